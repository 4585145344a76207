"""What every policy backend shares: completions, the batched sampling loop (each step's token choice:
rollstream/model/sampling.py), log-probs, weight bytes.

A backend (tiny GPT or HF causal LM) supplies four small methods: prefill a left-padded batch into a
fresh KV cache, decode one token per row, drop rows from the cache, and compute the logits that
predict the last `response_len` tokens of a full batch. Both generation and `log_probs` use position
ids computed from the attention mask, so a left-padded batch gives the same numbers either way.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rollstream.model.fast_dtype import fast_cpu_dtype
from rollstream.model.logprobs import chunked_logprobs_entropy, logprobs_entropy
from rollstream.model.sampling import check_generate_args, sample_tokens
from rollstream.model.scoring import PromptGroups
from rollstream.model.tokenizer import Tokenizer
from rollstream.weights.tensors import load_bytes_into, module_bytes


@dataclass
class Completion:
    """One sampled response to one prompt: what one `generate` call returns per row (an agent loop strings
    the completions of its turns together into a producers.rollout.Trajectory).

    `log_probs[i]` is the behaviour log-prob of `response_ids[i]`: log_softmax(logits / temperature)
    of the weights that sampled it (no top-p renormalisation); this is what `BasePolicy.log_probs` with the
    same temperature recomputes. `swap_points` lists response indices i at which new weights took effect
    (tokens
    from i on were sampled, with a re-prefilled cache, under the newer weights).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False  # eos was produced (it is the last response id)
    swap_points: list[int] = field(default_factory=list)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Resolve "auto" to cuda when available, else cpu; anything else as given."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Parameter dtype from its config name: "auto" is bfloat16 on CUDA and float32 elsewhere; "fast" is
    bfloat16 on a CUDA GPU that supports it and, on a CPU, the dtype it multiplies faster (measured once per
    machine: rollstream.model.fast_dtype)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fast":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return fast_cpu_dtype() if device.type == "cpu" else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: expected auto, fast, {', '.join(names)}")
    return names[dtype]


#: Fewest leading tokens all prompts of a generate call must share before they are computed once
#: (`BasePolicy._prefill_prompts`); shorter common prefixes are not worth the extra forward call.
SHARED_PREFIX_MIN = 4

#: Finished rows stay in a generate call's batch (decoded, their tokens ignored) until they are this share of
#: it; then they are dropped together. Dropping rows copies the whole KV cache, which per finished row cost
#: more than decoding it on (SmolLM2, 16 x 8 rows on one core: a fifth of a generation went to compaction).
COMPACT_DEAD_FRACTION = 0.125


@dataclass
class EngineClock:
    """What a generation engine's steps took, for the generation benchmark's busy share, occupancy and live
    share: seconds in steps, and rows x seconds over them (one clock per engine: `engine.clock`)."""

    busy_s: float = 0.0  #: seconds spent in steps
    row_s: float = 0.0  #: rows still generating x seconds (busy_s x mean rows in flight)
    batch_row_s: float = 0.0  #: rows the batch computes x seconds (finished rows too, decoded until dropped)

    def add(self, seconds: float, rows: int, batch: int | None = None) -> None:
        """Count one step of `seconds` over `rows` generating in a batch of `batch` rows (None: `rows`)."""
        self.busy_s += seconds
        self.row_s += seconds * rows
        self.batch_row_s += seconds * (rows if batch is None else batch)


def common_prefix_len(rows: Sequence[Sequence[int]] | Sequence[np.ndarray]) -> int:
    """Length of the longest prefix every row starts with, leaving every row at least one token of its own."""
    if not rows:
        return 0
    n = max(min(len(r) for r in rows) - 1, 0)
    first = np.asarray(rows[0][:n])
    for r in rows[1:]:
        differs = np.flatnonzero(np.asarray(r[:n]) != first)
        if differs.size:
            n = int(differs[0])
            first = first[:n]
    return n


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token rows to one length: (ids [B,L] long, attention_mask [B,L] long)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


class BasePolicy(ABC):
    """The policy interface the producer and trainer use: generate, log_probs, weights as bytes."""

    module: nn.Module
    tokenizer: Tokenizer
    device: torch.device
    #: Tokens per output-head chunk in forward_logprobs_entropy (0 = the whole batch's logits at once);
    #: used where the backend gives hidden states (`_response_hidden`).
    logprob_chunk_size: int = 0
    #: Compute dtype of every forward pass (torch.autocast over the weights' own dtype); None computes in the
    #: weights' dtype. bfloat16 over float32 weights keeps float32 master weights at bfloat16 matmul speed.
    autocast_dtype: torch.dtype | None = None

    @property
    def clock(self) -> EngineClock:
        """What `generate`'s steps took (EngineClock), this policy's own, made at first use."""
        clock = self.__dict__.get("_clock")
        if clock is None:
            clock = self.__dict__["_clock"] = EngineClock()
        return clock

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """The context forward passes run in: torch.autocast to `autocast_dtype` on the policy's device, or
        nothing when it is None."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ---- backend hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _prefill(self, ids: Tensor, mask: Tensor, capacity: int) -> tuple[Tensor, Any]:
        """ids, mask [B,T] (left-padded) -> (logits [B,V] of the next token, new cache of `capacity`)."""

    @abstractmethod
    def _decode(self, tokens: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """tokens [B,1] appended after the cache, mask [B,Tcache+1] -> logits [B,V] of the next token."""

    @abstractmethod
    def _select_cache(self, cache: Any, rows: Tensor) -> Any:
        """Cache restricted to batch rows `rows`."""

    def _prefill_after(self, prefix: Tensor, ids: Tensor, mask: Tensor) -> tuple[Tensor, Any] | None:
        """ids, mask [B,T] (left-padded) after one prefix [P] every row shares: the prefix computed once and
        its cache repeated to the B rows -> (logits [B,V] of the next token, cache of prefix + ids); None
        when the backend cannot (generate then prefills whole prompts)."""
        return None

    def _extend(self, cache: Any, ids: Tensor, mask: Tensor) -> Tensor:
        """ids [B,T] after the cache's columns (mask [B, cached+T]) -> logits [B,V] of the next token."""
        raise ValueError(f"continuous generation is not supported by {type(self).__name__}")

    def _cache_kv(self, cache: Any) -> list[tuple[Tensor, Tensor]]:
        """The cache's keys and values per layer, [B, heads, T, head_dim] each (rollstream/model/rows.py)."""
        raise ValueError(f"continuous generation is not supported by {type(self).__name__}")

    def _cache_of(self, kv: list[tuple[Tensor, Tensor]], room: int) -> Any:
        """A cache holding `kv` (as `_cache_kv` gives it) with room for `room` more positions."""
        raise ValueError(f"continuous generation is not supported by {type(self).__name__}")

    @abstractmethod
    def _response_logits(
        self, ids: Tensor, mask: Tensor, response_len: int, groups: PromptGroups | None = None
    ) -> Tensor:
        """Forward of ids/mask [B,T] -> logits [B,R,V] predicting ids[:, -R:]; `groups`: the rows that share
        a prompt (a backend may run each prompt once)."""

    def _response_hidden(
        self, ids: Tensor, mask: Tensor, response_len: int, groups: PromptGroups | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Final hidden states [B,R,H] predicting ids[:, -R:] with the output head's weight [V,H] and bias
        [V] (or None); None when the backend only gives logits (then log-probs are not chunked)."""
        return None

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in backward instead of storing them; backends without it refuse."""
        raise ValueError(
            f"gradient checkpointing is not supported by {type(self).__name__} (use model.backend=hf)"
        )

    @property
    def max_seq_len(self) -> int | None:
        """Longest prompt + response the model's positions allow, or None when unbounded/unknown."""
        return None

    # ---- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        sync_every_tokens: int = 0,
        on_chunk: Callable[[], bool] | None = None,
        top_k: int = -1,
    ) -> list[Completion]:
        """Sample n responses per prompt in one left-padded KV-cached batch; prompt-major order. Each distinct
        prompt is prefilled once and its cache shared by its rows (its n samples, and equal prompts).

        Sampling uses softmax(logits / temperature) with top-k (-1: all tokens) and top-p (argmax when
        `greedy` or temperature == 0); stored log-probs are those of softmax(logits / temperature) (see
        Completion). A row stops after eos. Every `sync_every_tokens` decoded tokens (while rows remain),
        `on_chunk()` is called; True means new weights were loaded, and the cache of the unfinished rows
        is re-prefilled under them. `generator` None uses torch's global RNG.
        """
        check_generate_args(prompts, n, max_new_tokens, temperature, top_p, self.max_seq_len, top_k)
        trajs = [Completion(prompt_ids=list(p)) for p in prompts for _ in range(n)]
        if not trajs or max_new_tokens == 0:
            return trajs
        eos = self.tokenizer.eos_id
        # trajectory index of each batch row; -1 once the row finished (it stays in the batch, decoded and
        # ignored, until COMPACT_DEAD_FRACTION of the rows have finished: dropping rows copies the KV cache)
        alive = list(range(len(trajs)))
        was_training = self.module.training
        self.module.eval()
        since = (time.perf_counter(), len(trajs), len(trajs))  # a step began: when, unfinished and batch rows
        try:
            with torch.no_grad(), self.compute():
                # each distinct prompt is prefilled once: the agent loops pass a group's n rows as n equal
                # prompts (n=1), and the n samples of a prompt share its prefill: rows [U] -> [P*n]
                distinct: dict[tuple[int, ...], int] = {}
                of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
                firsts = [list(p) for p in distinct]
                seq, seq_mask, logits, cache = self._prefill_prompts(firsts, max_new_tokens)
                if n > 1 or len(distinct) < len(prompts):
                    rows = torch.tensor(of, device=self.device).repeat_interleave(n)
                    seq, seq_mask, logits = seq[rows], seq_mask[rows], logits[rows]
                    cache = self._select_cache(cache, rows)
                for step in range(max_new_tokens):
                    since = self._timed(since, sum(1 for j in alive if j >= 0), len(alive))
                    tok, logp = sample_tokens(logits, temperature, top_p, generator, greedy, top_k)  # [b]
                    keep: list[int] = []
                    for j, (t, lp) in enumerate(zip(tok.tolist(), logp.tolist(), strict=True)):
                        if alive[j] < 0:
                            continue
                        traj = trajs[alive[j]]
                        traj.response_ids.append(t)
                        traj.log_probs.append(lp)
                        if t == eos:
                            traj.finished = True
                            alive[j] = -1
                        else:
                            keep.append(j)
                    if step + 1 == max_new_tokens or not keep:
                        break
                    seq = torch.cat([seq, tok[:, None]], 1)
                    seq_mask = torch.cat([seq_mask, torch.ones_like(tok)[:, None]], 1)
                    left = max_new_tokens - step - 1
                    chunk_end = (
                        on_chunk is not None and sync_every_tokens > 0 and (step + 1) % sync_every_tokens == 0
                    )
                    dead = len(alive) - len(keep)
                    if dead and (dead >= COMPACT_DEAD_FRACTION * len(alive) or chunk_end):
                        rows = torch.tensor(keep, device=self.device)  # drop finished rows (batch and cache)
                        seq, seq_mask, tok = seq[rows], seq_mask[rows], tok[rows]
                        cache = self._select_cache(cache, rows)
                        alive = [alive[j] for j in keep]
                    if chunk_end and on_chunk is not None:  # (mypy: chunk_end implies it)
                        if on_chunk():
                            for j in alive:
                                trajs[j].swap_points.append(step + 1)
                            first = int(seq_mask.any(0).nonzero()[0])  # drop all-pad leading columns
                            seq, seq_mask = seq[:, first:], seq_mask[:, first:]
                            logits, cache = self._prefill(seq, seq_mask, seq.shape[1] + left)
                            continue
                    logits = self._decode(tok[:, None], seq_mask, cache)
        finally:
            self._timed(since, 0, 0)
            self.module.train(was_training)
        return trajs

    def _timed(self, since: tuple[float, int, int], rows: int, batch: int) -> tuple[float, int, int]:
        """Count the step begun at `since` (time, unfinished, batch rows); the next begins now with these."""
        now = time.perf_counter()
        self.clock.add(now - since[0], since[1], since[2])
        return now, rows, batch

    def _prefill_prompts(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> tuple[Tensor, Tensor, Tensor, Any]:
        """Each prompt once, left-padded -> (ids [U,T], mask [U,T], next-token logits [U,V], cache). The
        tokens every prompt starts with (a chat template's system turn: ~27 of SmolLM2's ~45) are computed
        once when the backend can (`_prefill_after`) and at least SHARED_PREFIX_MIN long; the mask then has
        the suffixes' left padding between prefix and suffix, which attention and positions skip."""
        shared = common_prefix_len(prompts) if len(prompts) > 1 else 0
        if shared >= SHARED_PREFIX_MIN:
            prefix = torch.tensor(prompts[0][:shared], dtype=torch.long, device=self.device)
            suffixes = [p[shared:] for p in prompts]
            ids, mask = (t.to(self.device) for t in left_pad(suffixes, self.tokenizer.pad_id))
            out = self._prefill_after(prefix, ids, mask)
            if out is not None:
                rows = len(prompts)
                seq = torch.cat([prefix.expand(rows, shared), ids], 1)
                seq_mask = torch.cat([torch.ones_like(seq[:, :shared]), mask], 1)
                return seq, seq_mask, out[0], out[1]
        ids, mask = (t.to(self.device) for t in left_pad(prompts, self.tokenizer.pad_id))
        logits, cache = self._prefill(ids, mask, ids.shape[1] + max_new_tokens)
        return ids, mask, logits, cache

    # ---- scoring ---------------------------------------------------------------------------------
    def forward_logprobs_entropy(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_len: int,
        temperature: float = 1.0,
        groups: PromptGroups | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Per-token log-prob and entropy [B,R] of the last R tokens under softmax(logits / temperature)
        (the sampling distribution, as verl's actor computes it); grad follows torch grad mode. With
        `logprob_chunk_size` > 0 and a backend giving hidden states, the output head runs chunk by chunk
        (rollstream.model.logprobs): same numbers, peak memory O(chunk x vocab). `groups` (the rows that
        share a prompt, on the batch's device): the HF backend runs each shared prompt once."""
        if response_len < 1 or response_len >= input_ids.shape[1]:
            raise ValueError(f"response_len {response_len} must be in [1, {input_ids.shape[1] - 1}]")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        with self.compute():
            if self.logprob_chunk_size > 0:
                head = self._response_hidden(ids, mask, response_len, groups)
                if head is not None:
                    hidden, weight, bias = head
                    labels = ids[:, -response_len:]
                    return chunked_logprobs_entropy(
                        hidden, weight, bias, labels, temperature, self.logprob_chunk_size
                    )
            logits = self._response_logits(ids, mask, response_len, groups)  # [B,R,V]
        return logprobs_entropy(logits, ids[:, -response_len:], temperature)  # [B,R], [B,R] in float32

    def log_probs(self, input_ids: Tensor, attention_mask: Tensor, response_len: int,
                  temperature: float = 1.0, groups: PromptGroups | None = None) -> Tensor:
        """Per-token log-probs [B,R] of the last R tokens of a left-padded batch under logits /
        temperature (`groups`: as forward_logprobs_entropy)."""
        return self.forward_logprobs_entropy(input_ids, attention_mask, response_len, temperature, groups)[0]

    # ---- weights and modes -----------------------------------------------------------------------
    def state_dict_bytes(self) -> bytes:
        """The weights as safetensors bytes."""
        return module_bytes(self.module)

    def load_state_dict_bytes(self, data: bytes) -> None:
        """Load safetensors bytes (from `state_dict_bytes`) into the weights in place."""
        load_bytes_into(self.module, data)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The trainable parameters (for the optimizer)."""
        return self.module.parameters()

    def train(self, mode: bool = True) -> BasePolicy:
        """Put the module in train mode; returns self."""
        self.module.train(mode)
        return self

    def eval(self) -> BasePolicy:
        """Put the module in eval mode; returns self."""
        self.module.eval()
        return self

    def train_is_eval(self) -> bool:
        """Whether a train-mode forward computes what an eval-mode one does: no dropout module with p > 0
        and, for a Hugging Face model, no `*dropout` / `*pdrop` probability > 0 in its config."""
        for m in self.module.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
                return False
        config = getattr(self.module, "config", None)
        to_dict = getattr(config, "to_dict", None)
        settings: dict[str, Any] = to_dict() if callable(to_dict) else {}
        return not any(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in settings.items()
            if k.endswith("dropout") or k.endswith("pdrop")
        )
