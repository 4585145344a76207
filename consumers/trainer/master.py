"""Float32 master weights for a low-precision policy (actor.optim.master_weights).

The module holds bfloat16 (or float16) parameters, so forward and backward run at that precision without
torch.autocast's per-op casts (on CPU: SmolLM2's forward + backward about 2x faster than autocast over
float32 weights). An AdamW step of lr 2e-5 would round away in bfloat16 (8 mantissa bits), so the optimizer
updates float32 copies instead; after each step the module is refreshed from them. Checkpoints hold the
float32 copies; the published weights are the module's own (what producers sample with).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rollstream.weights.tensors import unique_state


class MasterWeights:
    """Float32 copies of a module's trainable parameters, which the optimizer owns."""

    def __init__(self, module: nn.Module) -> None:
        """Copy every trainable parameter of `module` to float32."""
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        # float32 gradient buffers, allocated once: the optimizer's zero_grad drops the copies' .grad each
        # update, and a fresh 4-byte-per-weight allocation every step would fault its pages in again
        self._grads = [torch.empty_like(m) for m in self.master]
        # the module's tensors (by storage) -> their copies, detached (what a state dict holds; no copy)
        self._by_ptr = {p.data_ptr(): m.detach() for p, m in zip(self.params, self.master, strict=True)}

    def parameters(self) -> list[nn.Parameter]:
        """The float32 copies (what the optimizer and gradient clipping see)."""
        return self.master

    def grads_to_master(self) -> None:
        """Move the module's gradients to the copies, in float32 (the module's are cleared)."""
        for p, m, buf in zip(self.params, self.master, self._grads, strict=True):
            m.grad = None if p.grad is None else buf.copy_(p.grad)
            p.grad = None

    @torch.no_grad()
    def to_module(self) -> None:
        """Refresh the module's parameters from the copies (rounded to the module's dtype)."""
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)

    def state(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """`weights` (the module's state dict, tied tensors once) with each parameter's float32 copy in its
        place: what a checkpoint keeps."""
        return {k: self._by_ptr.get(t.data_ptr(), t) for k, t in weights.items()}

    @torch.no_grad()
    def load(self, weights: dict[str, Tensor]) -> None:
        """Set the copies from checkpoint `weights` (float32, by name); the module itself is loaded by the
        caller."""
        for name, t in unique_state(self.module).items():
            m = self._by_ptr.get(t.data_ptr())
            if m is not None and name in weights:
                m.copy_(weights[name])
