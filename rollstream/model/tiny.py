"""`TinyPolicy`: the tiny GPT with a tokenizer on a device, behind the shared policy interface."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollstream.model.base import BasePolicy, resolve_device
from rollstream.model.gpt import GPT, GPTConfig, KVCache, positions_from_mask
from rollstream.model.scoring import PromptGroups
from rollstream.model.tokenizer import CharTokenizer, Tokenizer


class TinyPolicy(BasePolicy):
    """The tiny-GPT policy (char tokenizer by default) used by the built-in tasks and tests."""

    def __init__(
        self, module: GPT, tokenizer: Tokenizer | None = None, device: str | torch.device = "auto"
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        if module.cfg.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"GPTConfig.vocab_size={module.cfg.vocab_size} < tokenizer "
                f"vocab_size={self.tokenizer.vocab_size}"
            )
        self.device = resolve_device(device)
        self.module: GPT = module.to(self.device)

    @classmethod
    def from_config(
        cls, cfg: GPTConfig, seed: int, device: str = "auto", tokenizer: Tokenizer | None = None
    ) -> TinyPolicy:
        """A freshly initialised policy; the same cfg and seed give the same weights on any device."""
        # the global RNG is left as it was: weights come only from the seeded generator below (built on the
        # CPU, not the meta device, whose init imports torch._dynamo: seconds at every worker start)
        with torch.random.fork_rng(devices=[]):
            module = GPT(cfg)
        module.init_weights(torch.Generator().manual_seed(seed))
        return cls(module, tokenizer, device)

    @property
    def config(self) -> GPTConfig:
        """The model's GPTConfig."""
        return self.module.cfg

    @property
    def max_seq_len(self) -> int:
        """Largest prompt + response length the learned positions allow."""
        return self.module.cfg.max_seq_len

    def _prefill(self, ids: Tensor, mask: Tensor, capacity: int) -> tuple[Tensor, Any]:
        """Full forward of a left-padded batch into a new cache; logits [B,V] of the next token."""
        cache = self.module.new_cache(ids.shape[0], capacity)
        logits = self.module(ids, 0, cache, positions_from_mask(mask), mask, logits_to_keep=1)
        return logits[:, -1], cache

    def _decode(self, tokens: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """One token per row after the cache; logits [B,V]."""
        assert isinstance(cache, KVCache)
        pos = (mask.sum(-1, keepdim=True) - 1).clamp_min(0)  # [B,1]
        return self.module(tokens, cache.length, cache, pos, mask)[:, -1]

    def _select_cache(self, cache: Any, rows: Tensor) -> Any:
        """Keep cache rows `rows`."""
        assert isinstance(cache, KVCache)
        cache.select(rows)
        return cache

    def _extend(self, cache: Any, ids: Tensor, mask: Tensor) -> Tensor:
        """ids [B,T] after the cache (mask [B, length+T]); logits [B,V] of the next token."""
        assert isinstance(cache, KVCache)
        pos = positions_from_mask(mask)[:, -ids.shape[1] :]
        return self.module(ids, cache.length, cache, pos, mask, logits_to_keep=1)[:, -1]

    def _cache_kv(self, cache: Any) -> list[tuple[Tensor, Tensor]]:
        """The filled positions of the cache, per layer."""
        assert isinstance(cache, KVCache)
        n = cache.length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(cache.k, cache.v, strict=True)]

    def _cache_of(self, kv: list[tuple[Tensor, Tensor]], room: int) -> Any:
        """A KVCache of these keys/values with `room` positions free after them."""
        batch, _, length, _ = kv[0][0].shape
        cache = self.module.new_cache(batch, length + room)
        for layer, (k, v) in enumerate(kv):
            cache.update(layer, k, v, 0)
        cache.length = length
        return cache

    def _response_logits(
        self, ids: Tensor, mask: Tensor, response_len: int, groups: PromptGroups | None = None
    ) -> Tensor:
        """Logits [B,R,V] predicting the last R tokens (only those positions go through the head; every row
        runs its whole prompt, `groups` or not)."""
        logits = self.module(ids, 0, None, positions_from_mask(mask), mask, logits_to_keep=response_len + 1)
        return logits[:, :-1]
