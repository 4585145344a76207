"""`HFPolicy`: any local Hugging Face causal LM + tokenizer behind the shared policy interface.

`transformers` and `tokenizers` are imported inside functions only, so importing this module is cheap.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rollstream.model.base import BasePolicy, resolve_device
from rollstream.model.gpt import positions_from_mask
from rollstream.model.tokenizer import CHARS, SPECIAL_TOKENS


class HFTokenizer:
    """Adapts a transformers tokenizer to the `Tokenizer` protocol (pad falls back to eos)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        if self.hf.eos_token_id is None:
            raise ValueError("HF tokenizer has no eos token")

    @property
    def pad_id(self) -> int:
        """Padding id (the eos id when the tokenizer defines no pad token)."""
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None."""
        bos = self.hf.bos_token_id
        return int(bos) if bos is not None else None

    @property
    def eos_id(self) -> int:
        """End-of-sequence id."""
        return int(self.hf.eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens."""
        return len(self.hf)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of `text` without the tokenizer's own specials; bos first when `add_bos` and defined."""
        ids = list(self.hf(text, add_special_tokens=False)["input_ids"])
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`."""
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special))


class HFPolicy(BasePolicy):
    """A transformers causal LM (fp32 by default) with its tokenizer; generation uses past_key_values."""

    def __init__(self, model: nn.Module, tokenizer: Any, device: str | torch.device = "auto") -> None:
        self.tokenizer = tokenizer if isinstance(tokenizer, HFTokenizer) else HFTokenizer(tokenizer)
        self.device = resolve_device(device)
        self.module = model.to(self.device)
        params = inspect.signature(self.module.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
    ) -> HFPolicy:
        """Load model and tokenizer from a local directory (never downloads)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(model, tok, device)

    @property
    def max_seq_len(self) -> int | None:
        """The model's max_position_embeddings (None when the config has none)."""
        n = getattr(getattr(self.module, "config", None), "max_position_embeddings", None)
        return int(n) if n is not None else None

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache: Any, keep: int) -> Any:
        """One model call with an explicit attention mask and position ids."""
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        if cache is not None:
            kwargs[self._cache_arg] = cache
            kwargs["use_cache"] = True
        else:
            kwargs["use_cache"] = False
        if keep and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        return self.module(**kwargs)

    def _prefill(self, ids: Tensor, mask: Tensor, capacity: int) -> tuple[Tensor, Any]:
        """Full forward of a left-padded batch into a new DynamicCache; logits [B,V] of the next token."""
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=getattr(self.module, "config", None))
        except TypeError:  # older transformers
            cache = DynamicCache()
        out = self._forward(ids, mask, positions_from_mask(mask), cache, 1)
        return out.logits[:, -1], cache

    def _decode(self, tokens: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """One token per row after the cache; logits [B,V]."""
        pos = (mask.sum(-1, keepdim=True) - 1).clamp_min(0)  # [B,1]
        return self._forward(tokens, mask, pos, cache, 1).logits[:, -1]

    def _select_cache(self, cache: Any, rows: Tensor) -> Any:
        """Keep cache rows `rows`."""
        cache.batch_select_indices(rows)
        return cache

    def _response_logits(self, ids: Tensor, mask: Tensor, response_len: int) -> Tensor:
        """Logits [B,R,V] predicting the last R tokens."""
        logits = self._forward(ids, mask, positions_from_mask(mask), None, response_len + 1).logits
        return logits[:, -(response_len + 1) : -1]


def make_tiny_hf_model(directory: str | Path, seed: int = 0, hidden_size: int = 32) -> Path:
    """Save a tiny random Llama + char-level fast tokenizer (CharTokenizer's ids) to `directory`."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARS)})
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
    )
    tok.save_pretrained(str(directory))
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(directory))
    return directory
