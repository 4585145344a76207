"""`HFPolicy`: any local Hugging Face causal LM + tokenizer behind the shared policy interface.

`transformers` and `tokenizers` are imported inside functions only, so importing this module is cheap.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollstream.model import attention
from rollstream.model.base import SHARED_PREFIX_MIN, BasePolicy, resolve_device
from rollstream.model.chat import check_system_prompt
from rollstream.model.gpt import positions_from_mask
from rollstream.model.scoring import PromptGroups

__all__ = ["HFPolicy", "HFTokenizer"]


class HFTokenizer:
    """Adapts a transformers tokenizer to the `Tokenizer` protocol (pad falls back to eos).

    `use_chat_template` (when asked for and the tokenizer has a template): prompts and tool results are
    rendered with the chat template (see rollstream.model.chat), a prompt after `system_prompt` as its system
    turn when one is given (else the template's default)."""

    def __init__(
        self, hf_tokenizer: Any, chat_template: bool = True, system_prompt: str | None = None
    ) -> None:
        self.hf = hf_tokenizer
        if self.hf.eos_token_id is None:
            raise ValueError("HF tokenizer has no eos token")
        self.use_chat_template = bool(chat_template and getattr(self.hf, "chat_template", None))
        if system_prompt is not None:
            if not self.use_chat_template:
                raise ValueError(f"model.system_prompt={system_prompt!r} needs a tokenizer with a chat "
                                 "template and model.chat_template: true")
            check_system_prompt(self.hf, system_prompt)
        self.system_prompt = system_prompt

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

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        device: str | torch.device = "auto",
        chat_template: bool = True,
        system_prompt: str | None = None,
    ) -> None:
        self.tokenizer = (
            tokenizer
            if isinstance(tokenizer, HFTokenizer)
            else HFTokenizer(tokenizer, chat_template, system_prompt)
        )
        self.device = resolve_device(device)
        self.module = model.to(self.device)
        params = inspect.signature(self.module.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._head_checked: bool | None = None  # hidden @ head == the model's logits (checked on first use)
        self._checkpointing = False  # gradient checkpointing on (it disables the KV cache in training)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
        chat_template: bool = True,
        system_prompt: str | None = None,
    ) -> HFPolicy:
        """Load model (weights in `dtype`) and tokenizer from a local directory (never downloads);
        `chat_template` renders prompts with the tokenizer's chat template when it has one, after
        `system_prompt` as the system turn when given."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
        if attn_implementation is not None:
            if attn_implementation == attention.EAGER_GQA:
                attention.register()
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(model, tok, device, chat_template, system_prompt)

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
        cache = self._new_cache()
        out = self._forward(ids, mask, positions_from_mask(mask), cache, 1)
        return out.logits[:, -1], cache

    def _prefill_after(self, prefix: Tensor, ids: Tensor, mask: Tensor) -> tuple[Tensor, Any] | None:
        """The prefix once (batch 1), its DynamicCache repeated to the rows, then ids/mask after it."""
        cache = self._new_cache()
        P = prefix.shape[0]
        common: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if self._has_logits_to_keep:
            common["logits_to_keep"] = 1
        self._prefix_into(self.module, common, prefix, ids.shape[0])
        full = torch.cat([mask.new_ones((ids.shape[0], P)), mask], 1)
        out = self._forward(ids, full, positions_from_mask(full)[:, P:], cache, 1)
        return out.logits[:, -1], cache

    def _decode(self, tokens: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """One token per row after the cache; logits [B,V]."""
        pos = (mask.sum(-1, keepdim=True) - 1).clamp_min(0)  # [B,1]
        return self._forward(tokens, mask, pos, cache, 1).logits[:, -1]

    def _select_cache(self, cache: Any, rows: Tensor) -> Any:
        """Keep cache rows `rows`."""
        cache.batch_select_indices(rows)
        return cache

    def _extend(self, cache: Any, ids: Tensor, mask: Tensor) -> Tensor:
        """ids [B,T] after the cache (mask [B, cached+T]); logits [B,V] of the next token."""
        pos = positions_from_mask(mask)[:, -ids.shape[1] :]
        return self._forward(ids, mask, pos, cache, 1).logits[:, -1]

    def _cache_kv(self, cache: Any) -> list[tuple[Tensor, Tensor]]:
        """The DynamicCache's keys and values per layer (ValueError for a cache whose layers do not hold every
        position, as sliding-window ones do: continuous batching moves whole rows of columns)."""
        layers = getattr(cache, "layers", None)
        if layers is None:  # transformers before 4.56
            return list(zip(cache.key_cache, cache.value_cache, strict=True))
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError("continuous generation needs a model whose every layer caches all positions "
                             f"({type(self.module).__name__} has sliding-window layers)")
        return [(layer.keys, layer.values) for layer in layers]

    def _cache_of(self, kv: list[tuple[Tensor, Tensor]], room: int) -> Any:
        """A DynamicCache holding these very tensors (no copy; it grows as it decodes: no `room` needed)."""
        cache = self._new_cache()
        layers = getattr(cache, "layers", None)
        for layer, (k, v) in enumerate(kv):
            if layers is None or len(layers) <= layer:  # transformers before 4.56, or a cache without config
                cache.update(k, v, layer)
                continue
            layers[layer].lazy_initialization(k, v)
            layers[layer].keys, layers[layer].values = k, v
        return cache

    def _response_logits(
        self, ids: Tensor, mask: Tensor, response_len: int, groups: PromptGroups | None = None
    ) -> Tensor:
        """Logits [B,R,V] predicting the last R tokens (a shared prompt runs once: `_shared_forward`)."""
        shared = self._shared_forward(ids, mask, response_len, False, groups)
        if shared is not None:
            return shared
        logits = self._forward(ids, mask, positions_from_mask(mask), None, response_len + 1).logits
        return logits[:, -(response_len + 1) : -1]

    def _new_cache(self) -> Any:
        """An empty DynamicCache for this model."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=getattr(self.module, "config", None))
        except TypeError:  # older transformers
            return DynamicCache()

    def _shared_forward(
        self, ids: Tensor, mask: Tensor, response_len: int, hidden: bool, groups: PromptGroups | None
    ) -> Tensor | None:
        """Logits [B,R,V] (or the body's final hidden states [B,R,H] when `hidden`) predicting the last R
        tokens, each distinct prompt run once: when `groups` says rows share prompts (GRPO's n samples, as
        the ragged form carries them), the prompts go into a KV cache, the cache is repeated to their rows,
        and only the R response tokens of each row run on it. Same numbers and gradient as the full forward
        (the repeated cache sums its rows' gradients) on fewer tokens: 16 prompts x 8 samples of 45 + 12
        tokens run 2,256 instead of 7,296. None when no prompt is shared (or no groups are given), or under
        gradient checkpointing in training (it turns the cache off)."""
        P = ids.shape[1] - response_len
        if groups is None or not groups.shares or P < 1 or (self._checkpointing and torch.is_grad_enabled()):
            return None
        rows = groups.of_row
        p_ids, p_mask = ids[groups.first, :P], mask[groups.first, :P]  # [U, P]: each distinct prompt once
        model: Any = self.module
        net = model.base_model if hidden else model
        cache = self._new_cache()
        common: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if not hidden and self._has_logits_to_keep:
            common["logits_to_keep"] = 1
        p_ids, p_mask = self._common_prefix_into(net, common, p_ids, p_mask, groups.prefix_len)
        L = p_mask.shape[1]  # the cache's columns: a common prefix (when run apart) and the prompts' own
        p_pos = positions_from_mask(p_mask)[:, L - p_ids.shape[1] :]
        first = net(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, **common)
        cache.batch_select_indices(rows)
        common.pop("logits_to_keep", None)
        full = torch.cat([p_mask[rows], mask[:, P:]], 1)
        r_pos = positions_from_mask(full)[:, L:]
        rest = net(input_ids=ids[:, P:], attention_mask=full, position_ids=r_pos, **common)
        if hidden:
            return torch.cat([first.last_hidden_state[:, -1:][rows], rest.last_hidden_state[:, :-1]], 1)
        return torch.cat([first.logits[:, -1:][rows], rest.logits[:, :-1]], 1)

    def _prefix_into(self, net: Any, common: dict[str, Any], prefix: Tensor, rows: int) -> None:
        """Run `prefix` [C] once (batch 1) into the cache in `common` and repeat it to `rows` rows (in
        training their gradients sum back into the one prefix run)."""
        positions = torch.arange(prefix.shape[0], device=prefix.device)[None]
        mask = torch.ones_like(prefix)[None]
        net(input_ids=prefix[None], attention_mask=mask, position_ids=positions, **common)
        to_rows = torch.zeros(rows, dtype=torch.long, device=prefix.device)
        common[self._cache_arg].batch_select_indices(to_rows)

    def _common_prefix_into(
        self, net: Any, common: dict[str, Any], p_ids: Tensor, p_mask: Tensor, prefix_len: int
    ) -> tuple[Tensor, Tensor]:
        """The distinct prompts [U,P] (left-padded) of a shared forward: when they all start with the same
        `prefix_len` >= SHARED_PREFIX_MIN tokens (a chat template's system turn), run that prefix once into
        the cache (its rows repeated to the U prompts; their gradients sum) and return the prompts' own
        tokens [U,S] (columns of p_ids: the S after the prefix of the longest prompt) with the cache's mask
        [U,C+S] (the prefix, then each prompt's own tokens: what the columns hold of a shorter prompt's prefix
        is masked, a hole attention and positions skip); else as given."""
        U, P = p_ids.shape
        C = prefix_len
        if C < SHARED_PREFIX_MIN or U < 2:
            return p_ids, p_mask
        lens = p_mask.sum(-1)  # [U] each prompt's length
        start = P - int(lens[0])
        self._prefix_into(net, common, p_ids[0, start : start + C], U)
        S = int(lens.max()) - C  # the widest prompt's own tokens
        cols = torch.arange(P - S, P, device=p_ids.device)
        own = cols[None, :] >= (P - (lens - C))[:, None]  # [U, S]: a prompt's tokens after the prefix
        s_mask = p_mask[:, P - S :] * own
        return p_ids[:, P - S :], torch.cat([s_mask.new_ones((U, C)), s_mask], 1)

    def _response_hidden(
        self, ids: Tensor, mask: Tensor, response_len: int, groups: PromptGroups | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Final hidden states [B,R,H] before the output head, with the head's weight [V,H] and bias; None
        when this model's logits are not plain `lm_head(hidden)` (soft-capping, scaling: checked once)."""
        model: Any = self.module
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        base = getattr(model, "base_model", None)
        if self._head_checked is False or not isinstance(head, nn.Linear) or base is None or base is model:
            return None
        hidden = self._shared_forward(ids, mask, response_len, True, groups)
        if hidden is None:
            out = base(
                input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False
            )
            hidden = out.last_hidden_state[:, -(response_len + 1) : -1]  # [B,R,H]
        if self._head_checked is None:
            with torch.no_grad():
                want = self._response_logits(ids[:1], mask[:1], response_len).float()
                got = F.linear(hidden[:1].detach(), head.weight, head.bias).float()
            self._head_checked = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))
            if not self._head_checked:
                return None
        return hidden, head.weight, head.bias

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in backward instead of keeping them (training only)."""
        model: Any = self.module
        self._checkpointing = True
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
