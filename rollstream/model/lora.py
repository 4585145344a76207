"""LoRA (model.lora_rank > 0, verl's actor_rollout_ref.model.lora_rank): every targeted `nn.Linear` keeps its
weight, frozen, and gains two trainable factors, so that

    y = x W'^T + b,  W' = round(W + B A * lora_alpha / lora_rank),  A [rank, in], B [out, rank] (0 at first),

where round() is to the weights' own dtype (bfloat16 where the CPU multiplies it faster: model.dtype=fast).
Every process computes with the merged weight W', built once per change of the factors
(`LoRALinear.merged_weight`), so sampling costs what the plain model costs: a producer samples with plain
matrix products. In training the factors get LoRA's gradients (dA, dB from rank-r products; no gradient for
the base matrices, about a third of a linear layer's forward + backward) through a low-rank term that adds
exactly zero to the output; the input gradient goes through W' alone. Only A and B get optimizer state
(float32 masters with actor.optim.master_weights), so their sum B A accumulates exactly and W' follows it, as
a full fine-tune's bfloat16 weights follow their masters.

The factors live on the Linear itself (`<name>.lora.A`, `<name>.lora.B`, the Linear's class swapped for
`LoRALinear`), so every base tensor keeps its state-dict name. Every process of a run builds the same
structure on the same base (`build_policy`); a version publishes the factors alone
(`rollstream.weights.tensors.published_state`: SmolLM2 at rank 16, 10 MB instead of 269), and a producer
merges them the same way as the trainer, so both compute with the same W' (the swap check reads 0). A
checkpoint holds base and factors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

#: target_modules value that selects every Linear inside the network except the output head (peft's meaning).
ALL_LINEAR = "all-linear"
#: Names of output heads that "all-linear" leaves out (they map to the vocabulary; tied to the embedding).
OUTPUT_HEADS = ("lm_head", "head")


def _targets(module: nn.Module, target_modules: str | Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """(name, Linear) of the layers `target_modules` selects: "all-linear", or the last name components to
    match (e.g. ["q_proj", "v_proj"]). Never the output head: tied to the embedding, and the chunked log-prob
    path reads its weight directly, so naming it is a ValueError."""
    chosen = []
    for name, m in module.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        last = name.rsplit(".", 1)[-1]
        named = target_modules != ALL_LINEAR and last in target_modules
        if last in OUTPUT_HEADS and named:
            raise ValueError(
                f"target_modules={target_modules!r} selects the output head {name!r}, which LoRA cannot adapt"
            )
        if last not in OUTPUT_HEADS and (named or target_modules == ALL_LINEAR):
            chosen.append((name, m))
    return chosen


class LoRAFactors(nn.Module):
    """The trainable pair of one adapted Linear: A [rank, in] and B [out, rank], scaled by alpha / rank."""

    def __init__(self, layer: nn.Linear, rank: int, alpha: float) -> None:
        """Factors for `layer`, in its device and dtype: A Kaiming-uniform from torch's global RNG (as peft),
        B zero."""
        super().__init__()
        w = layer.weight
        a = torch.empty(rank, layer.in_features, device=w.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.A = nn.Parameter(a.to(w.dtype))
        self.B = nn.Parameter(torch.zeros(layer.out_features, rank, device=w.device, dtype=w.dtype))
        self.scale = alpha / rank


class FrozenLinear(nn.Linear):
    """A frozen Linear whose input is made contiguous first. torch's matmul does not fold a non-contiguous 3-D
    input that requires grad into one 2-D product when the weight does not: it expands the weight to the
    batch instead (SmolLM2's frozen output head on a [32, 13, 576] slice of the hidden states: a
    [32, 576, 49152] copy, 3.4 s against 0.14 s)."""

    def forward(self, x: Tensor) -> Tensor:
        """x W^T + b."""
        return F.linear(x.contiguous(), self.weight, self.bias)


class LoRALinear(nn.Linear):
    """An adapted Linear: x W'^T + b with W' = round(W + B A * scale), its factors in its `lora` child (a
    subclass, not a forward hook: on SmolLM2's 210 layers hooks cost ~8 % more per token)."""

    lora: LoRAFactors
    #: (storage, version) of W, A and B when `_merged` was built, and W' itself (not in the state dict)
    _merged_key: tuple[int, ...] | None = None
    _merged: Tensor | None = None

    def merged_weight(self) -> Tensor:
        """W' = W + B A * scale in float32, rounded to W's dtype; rebuilt when W, A or B changed (storage or
        version: a load, copy_, an optimizer step), so sampling and the micro-batches of one update build
        it once. Whatever writes into a parameter's memory behind autograd (a file read straight into it,
        torch's fused AdamW) bumps its version (`torch.autograd.graph.increment_version`)."""
        f = self.lora
        key = tuple(
            v for t in (self.weight, f.A, f.B) for v in (t.data_ptr(), t._version)
        )
        if self._merged is None or key != self._merged_key:
            # in float32 under any autocast of the caller; with B = 0 (version 0, a reference copy) W itself
            with torch.no_grad(), torch.autocast(self.weight.device.type, enabled=False):
                if f.B.any():
                    delta = (f.B.float() @ f.A.float()).mul_(f.scale)
                    self._merged = delta.add_(self.weight.float()).to(self.weight.dtype)
                else:
                    self._merged = self.weight.detach()
            self._merged_key = key
        return self._merged

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        """A move or cast (`.to`, `.cuda`, `.half`) drops W': new tensors may reuse freed addresses."""
        self._merged = None
        return super()._apply(fn, recurse)

    def forward(self, x: Tensor) -> Tensor:
        """x W'^T + b. When the factors train, plus (t - t) for the low-rank term t = (x A^T * scale) B^T of
        the detached input: exactly zero in value, it gives A and B LoRA's gradients, while the input's
        gradient flows through W' alone (which already holds B A)."""
        x = x.contiguous()
        out = F.linear(x, self.merged_weight(), self.bias)
        f = self.lora
        if torch.is_grad_enabled() and (f.A.requires_grad or f.B.requires_grad):
            low = F.linear(F.linear(x.detach(), f.A) * f.scale, f.B)
            out = out + (low - low.detach())
        return out


def apply_lora(module: nn.Module, rank: int, alpha: float, target_modules: str | Sequence[str]) -> int:
    """Freeze every parameter of `module` and add trainable LoRA factors of `rank` (`<layer>.lora.A`,
    `<layer>.lora.B`) to the Linear layers `target_modules` selects (they become `LoRALinear`, the other
    Linear layers `FrozenLinear`, their state-dict names unchanged); B = 0, so the function is unchanged.
    Returns how many layers got them; ValueError when nothing matches (naming the value)."""
    if rank < 1:
        raise ValueError(f"lora_rank={rank} must be >= 1 to apply LoRA")
    layers = _targets(module, target_modules)
    if not layers:
        raise ValueError(f"target_modules={target_modules!r} matches no Linear layer of the model")
    module.requires_grad_(False)
    adapted = {id(layer) for _, layer in layers}
    for m in module.modules():
        if type(m) is nn.Linear and id(m) not in adapted:
            m.__class__ = FrozenLinear
    for _, layer in layers:
        layer.add_module("lora", LoRAFactors(layer, rank, alpha))
        layer.__class__ = LoRALinear
    return len(layers)


def is_factor(name: str) -> bool:
    """Whether a state-dict name is a LoRA factor's (what a LoRA version publishes, alone)."""
    return name.endswith((".lora.A", ".lora.B")) or name in ("lora.A", "lora.B")
