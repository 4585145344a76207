"""The policy: tokenizers, the tiny GPT, the HF wrapper, `load_policy`, and the policy a config describes
(`build_policy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rollstream.model.base import BasePolicy, Completion, left_pad, resolve_device, resolve_dtype
from rollstream.model.gpt import GPT, GPTConfig, KVCache
from rollstream.model.lora import apply_lora
from rollstream.model.scoring import PromptGroups, build_batch, pad_right
from rollstream.model.tiny import TinyPolicy
from rollstream.model.tokenizer import CharTokenizer, Tokenizer

if TYPE_CHECKING:
    from rollstream.config import PipelineConfig

__all__ = [
    "GPT",
    "BasePolicy",
    "CharTokenizer",
    "GPTConfig",
    "KVCache",
    "PromptGroups",
    "TinyPolicy",
    "Tokenizer",
    "Completion",
    "build_batch",
    "build_policy",
    "left_pad",
    "load_policy",
    "pad_right",
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


def build_policy(cfg: PipelineConfig, device: str | None = None, dtype: str | None = None) -> BasePolicy:
    """The policy with initial weights from run.seed (identical on every process for the same seed), its
    weights in model.dtype, its forward passes under model.autocast; with `dtype` (a producer's
    rollout.dtype) its weights in that dtype, computing in it. With model.lora_rank > 0 its weights are
    frozen and it carries LoRA factors (rollstream.model.lora): the trainer's to train, a producer's to
    load."""
    m = cfg.model
    dev = resolve_device(device or cfg.run.device)
    policy = _load(cfg, dev, resolve_dtype(dtype or m.dtype, dev))
    if m.lora_rank:  # every process holds the same structure: producers load the trainer's factors
        apply_lora(policy.module, m.lora_rank, m.lora_alpha, m.target_modules)
    autocast = None if dtype else m.autocast
    policy.autocast_dtype = resolve_dtype(autocast, dev) if autocast else None
    return policy


def _load(cfg: PipelineConfig, dev: torch.device, dtype: torch.dtype) -> BasePolicy:
    """The policy of model.backend on `dev` with weights in `dtype` (tiny: seeded from run.seed)."""
    m = cfg.model
    if m.backend == "hf":
        return load_policy("hf", path=m.hf_path, device=str(dev), dtype=dtype, chat_template=m.chat_template,
                           system_prompt=m.system_prompt, attn_implementation=m.attn_implementation)
    gcfg = GPTConfig(
        vocab_size=CharTokenizer().vocab_size,
        d_model=m.d_model,
        n_layer=m.n_layer,
        n_head=m.n_head,
        max_seq_len=m.max_seq_len,
        position=m.position,
    )
    policy = load_policy("tiny", cfg=gcfg, seed=cfg.run.seed, device=str(dev))
    if dtype != torch.float32:
        policy.module.to(dtype)
    return policy
