"""The policy: tokenizers, the tiny GPT, the HF wrapper, and `load_policy`."""

from __future__ import annotations

from typing import Any

from rollstream.model.base import BasePolicy, Completion, build_batch, left_pad
from rollstream.model.gpt import GPT, GPTConfig, KVCache
from rollstream.model.tiny import TinyPolicy
from rollstream.model.tokenizer import CharTokenizer, Tokenizer

__all__ = [
    "GPT",
    "BasePolicy",
    "CharTokenizer",
    "GPTConfig",
    "KVCache",
    "TinyPolicy",
    "Tokenizer",
    "Completion",
    "build_batch",
    "left_pad",
    "load_policy",
]


def load_policy(backend: str, **kwargs: Any) -> BasePolicy:
    """Build a policy: "tiny" -> TinyPolicy.from_config(**kwargs), "hf" ->
    HFPolicy.from_pretrained(**kwargs)."""
    if backend == "tiny":
        return TinyPolicy.from_config(**kwargs)
    if backend == "hf":
        from rollstream.model.hf import HFPolicy

        return HFPolicy.from_pretrained(**kwargs)
    raise ValueError(f"unknown policy backend {backend!r} (expected 'tiny' or 'hf')")
