"""LoRA versions on the vLLM engine (`rollout.name=vllm` with `model.lora_rank > 0`): merged weights, reloaded
in place.

A LoRA version publishes the factors alone (`<layer>.lora.A`, `<layer>.lora.B`). The producer keeps the
checkpoint's base tensors (in the engine's dtype, read once from `model.hf_path`) and, for each version, hands
vLLM's in-place reload (`VLLMPolicy.load_param_version`) every base tensor, the adapted layers' weights
replaced by

    W' = round(W + B A * lora_alpha / lora_rank)    (float32 product, rounded to W's dtype)

with the same operations, in the same order, as the trainer's `LoRALinear.merged_weight`
(rollstream/model/lora.py), so both compute with the same W' and the swap check reads what a full fine-tune's
does. The engine then samples with plain matrix products: a LoRA run samples at the plain model's cost (no
adapter kernels, no adapter slots). Why merged rather than vLLM's own adapters: docs/DESIGN.md, "The rollout
engine".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from producers.engines import EngineError, EngineStartError
from rollstream.model.lora import is_factor

#: Suffixes of a factor's name after its layer's prefix (`<layer>.lora.A` -> `<layer>.weight`).
FACTOR_SUFFIXES = (".lora.A", ".lora.B")


def read_checkpoint(path: str | Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor of the safetensors checkpoint in `path` (one file or shards), cast to `dtype` as
    transformers casts it on load (floating tensors only); EngineStartError when there is none."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineStartError(f"LoRA on vLLM: no *.safetensors checkpoint in model.hf_path={str(path)!r}")
    state: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                state[name] = t.to(dtype) if t.is_floating_point() else t
    return state


class LoRAMerger:
    """The base weights of a LoRA run and its scale; `merged` turns a version's factors into the tensors
    the engine reloads (every base tensor, adapted weights merged)."""

    def __init__(self, base: dict[str, Tensor], rank: int, alpha: float) -> None:
        """`base`: the checkpoint's tensors in the engine's dtype; `rank`, `alpha`: model.lora_rank and
        model.lora_alpha (the update is scaled by alpha / rank, as the trainer's factors)."""
        if rank < 1:
            raise ValueError(f"model.lora_rank={rank} must be >= 1 to merge LoRA factors")
        self.base = base
        self.scale = alpha / rank
        #: the adapted layers, from the first version merged: every later version must hold the same
        self.layers: set[str] | None = None

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype, rank: int, alpha: float) -> LoRAMerger:
        """A merger over the checkpoint in `path`, its tensors in `dtype` (the engine's)."""
        return cls(read_checkpoint(path, dtype), rank, alpha)

    def merged(self, tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) of every base tensor with each adapted `<layer>.weight` replaced by W' from the
        factors in `tensors` (a version's). EngineError, before anything is yielded, when the version holds
        a tensor that is not a factor, a factor without its pair, a layer the checkpoint lacks, or other
        layers than the first version's (a layer left out would fall back to its base weight)."""
        factors: dict[str, dict[str, Tensor]] = {}
        for name, t in tensors:
            if not is_factor(name):
                raise EngineError(
                    f"LoRA on vLLM: the version holds {name!r}, not a LoRA factor (model.lora_rank > 0 "
                    "publishes the factors alone; is the trainer's model.lora_rank the producer's?)"
                )
            layer, which = name[: -len(".lora.A")], name[-1]
            factors.setdefault(layer, {})[which] = t
        for layer, pair in factors.items():
            if set(pair) != {"A", "B"}:
                raise EngineError(f"LoRA on vLLM: layer {layer!r} has factor {sorted(pair)} without its pair")
            if f"{layer}.weight" not in self.base:
                raise EngineError(f"LoRA on vLLM: layer {layer!r} of the version is not in the checkpoint")
        if self.layers is not None and set(factors) != self.layers:
            missing, extra = sorted(self.layers - set(factors)), sorted(set(factors) - self.layers)
            raise EngineError(
                f"LoRA on vLLM: the version's layers differ from the first version's (missing {missing[:3]}, "
                f"new {extra[:3]})"
            )
        self.layers = set(factors)
        return self._merged(factors)

    def _merged(self, factors: dict[str, dict[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The tensors `merged` yields, one W' built at a time."""
        for name, w in self.base.items():
            pair = factors.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if pair is None:
                yield name, w
                continue
            # LoRALinear.merged_weight's operations: float32 B A, times the scale, plus W, rounded
            delta = (pair["B"].float() @ pair["A"].float()).mul_(self.scale)
            yield name, delta.add_(w.float()).to(w.dtype)
