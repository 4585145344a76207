"""Continuous batching on the built-in policy (`RowBatch`): rows enter a running decode batch as others
finish, one token per row per `step`, so a producer keeps its engine full instead of running a batch down to
its longest row (producers/continuous.py drives it, as it drives the vLLM engine).

The batch is one KV cache of b rows (slots) x L columns, left-padded: every row's tokens end at the last
column, and a row's own columns are marked in the attention mask (positions come from the mask, so holes cost
nothing but the attention over them). A step:

1. **Admit.** Rows submitted since the last step (new rows, and rows a weight swap sent back) are prefilled
   together, each distinct history once (a group's n rows share their prompt). The tokens every prompt starts
   with (a chat template's system turn: ~27 of SmolLM2's ~45) are computed once and kept: later rows prefill
   only what follows them. The new rows' keys and values go right-aligned into the slots finished rows left,
   in place; only when they do not fit (too few free slots, a longer prompt than L, or the cache's room used
   up) is the batch rebuilt: finished rows dropped, the leading columns no row uses trimmed, one copy.
   Leading columns no row uses are also trimmed between rebuilds (TRIM_MIN).
2. **Sample** one token for every row in flight from its next-token logits (rows grouped by their sampling
   settings: `sample_tokens`); a row that produced eos or used its token budget leaves (`step` returns it).
3. **Decode** the sampled tokens: one forward over the batch (finished rows ride along, masked out, until a
   new row takes their slot or they are COMPACT_DEAD_FRACTION of the batch, as `BasePolicy.generate` drops
   them).

The owner loads new weights into the policy and then calls `resume(True)` (the continuous loop does, after
every load): every row in flight records a swap point and is prefilled again (prompt + tokens so far) under
the new weights, as the built-in sampler's re-prefill does, and the kept prefix is dropped. Greedy rows
decode the tokens per-row generation does (`tests/test_rows.py`); `clock` measures time in steps and rows in
flight over it (occupancy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rollstream.model.base import (
    COMPACT_DEAD_FRACTION,
    SHARED_PREFIX_MIN,
    BasePolicy,
    Completion,
    EngineClock,
    common_prefix_len,
    left_pad,
)
from rollstream.model.sampling import check_generate_args, sample_tokens
from rollstream.model.tokenizer import Tokenizer

#: Columns a rebuilt or trimmed cache takes beyond its rows' tokens left, so rows admitted later fit in place.
ROOM_SLACK = 32
#: Leading columns no row uses that are dropped before the next decode.
TRIM_MIN = 8
#: Keys/values per layer, [rows, heads, columns, head_dim] each.
KV = list[tuple[Tensor, Tensor]]


@dataclass
class _Row:
    """One row in the batch: its completion (filled as it decodes), token budget and sampling settings."""

    row: Completion
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    top_k: int

    @property
    def left(self) -> int:
        """Tokens it may still generate."""
        return self.max_new_tokens - len(self.row.response_ids)


class RowBatch:
    """A running decode batch over a built-in policy that rows enter and leave one at a time (the module
    docstring): `submit` a row, `step` (the rows that finished), `resume` rows after a weight swap, `abort`.
    `generator` draws the samples (None: torch's global RNG); finished rows are dropped (a copy of the cache)
    once they are `compact_at` of the batch, unless new rows took their slots first. Submitted rows wait to be
    prefilled together until `admit_rows` of them wait (or as many as the rows decoding): prefilling one
    group's prompt alone costs a CPU several times what it costs in a batch of prompts."""

    def __init__(
        self, policy: BasePolicy, generator: torch.Generator | None = None,
        compact_at: float = COMPACT_DEAD_FRACTION, admit_rows: int = 1,
    ) -> None:
        self.policy = policy
        self.tokenizer: Tokenizer = policy.tokenizer
        self.generator = generator
        self.compact_at = compact_at
        self.admit_rows = admit_rows
        self._rows: list[_Row | None] = []  # batch row -> its row, None once finished (until the rebuild)
        self._waiting: list[_Row] = []  # submitted or resumed, prefilled at the next step
        self._cache: Any = None
        self._mask: Tensor | None = None  # [b, L]: 1 where a row has a token
        self._logits: Tensor | None = None  # [b, V]: each row's next-token logits
        self._room = 0  # columns the cache takes before it must be rebuilt
        self._prefix: list[int] = []  # tokens every prompt so far started with, and their keys/values [1,...]
        self._prefix_kv: KV | None = None
        self.clock = EngineClock()  #: what the steps took (rows decoding, and batch rows: finished ones too)

    @property
    def max_seq_len(self) -> int | None:
        """Longest prompt + response the policy allows (None: unbounded)."""
        return self.policy.max_seq_len

    @property
    def in_flight(self) -> int:
        """Rows submitted and not finished."""
        return len(self._waiting) + sum(1 for r in self._rows if r is not None)

    def submit(
        self, row: Completion, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = -1
    ) -> None:
        """Add a row: its prompt + what it generated so far, for the tokens it has left of `max_new_tokens`
        (temperature 0: greedy); its tokens and log-probs are appended to `row` as the batch steps."""
        history = row.prompt_ids + row.response_ids
        left = max_new_tokens - len(row.response_ids)
        if left < 1:
            raise ValueError(f"a row needs a token left to generate: {max_new_tokens=}, "
                             f"{len(row.response_ids)} generated")
        check_generate_args([history], 1, left, temperature, top_p, self.max_seq_len, top_k)
        self._waiting.append(_Row(row, max_new_tokens, temperature, top_p, top_k))

    def step(self) -> list[Completion]:
        """One token for every row in flight (new rows prefilled first); returns the rows that finished in it
        (eos, or their token budget)."""
        t0 = time.perf_counter()
        module = self.policy.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.policy.compute():
                live = self.decoding
                if self._waiting and (len(self._waiting) >= min(self.admit_rows, max(1, live))):
                    self._admit()
                rows, batch = self.decoding, len(self._rows)
                done = self._sample() if self._rows else []
        finally:
            module.train(was_training)
        self.clock.add(time.perf_counter() - t0, rows, batch)
        return done

    @property
    def columns(self) -> int:
        """Columns the batch's cache holds (what each row's attention reads)."""
        return 0 if self._mask is None else self._mask.shape[1]

    @property
    def decoding(self) -> int:
        """Rows in the batch that decode (in flight, not waiting to be prefilled)."""
        return sum(1 for r in self._rows if r is not None)

    def resume(self, swapped: bool) -> None:
        """After the policy's weights may have changed: with `swapped` (they did), every row in flight records
        where the new weights take over (`swap_points`) and is prefilled again under them at the next step."""
        if not swapped:
            return
        self._prefix, self._prefix_kv = [], None  # computed by the old weights
        live = [r for r in self._rows if r is not None]
        for r in live + self._waiting:
            r.row.swap_points.append(len(r.row.response_ids))
        self._waiting = live + self._waiting
        self._clear()

    def abort(self) -> None:
        """Drop every row (their completions keep what they generated)."""
        self._waiting = []
        self._clear()

    # ---- the steps --------------------------------------------------------------------------------
    def _clear(self) -> None:
        """Empty the batch (its cache freed)."""
        self._rows, self._cache, self._mask, self._logits = [], None, None, None

    def _admit(self) -> None:
        """Prefill the waiting rows (each distinct history once) and put them into free slots, or rebuild the
        batch with them."""
        new, self._waiting = self._waiting, []
        histories: dict[tuple[int, ...], int] = {}
        of_row = [histories.setdefault(tuple(r.row.prompt_ids + r.row.response_ids), len(histories))
                  for r in new]
        kv, mask, logits = self._prefill([list(h) for h in histories], max(r.left for r in new))
        rows = torch.tensor(of_row, device=mask.device)
        kv, mask, logits = [(k[rows], v[rows]) for k, v in kv], mask[rows], logits[rows]
        if not self._place(kv, mask, logits, new):
            self._rebuild(kv, mask, logits, new)

    def _prefill(self, prompts: list[list[int]], left: int) -> tuple[KV, Tensor, Tensor]:
        """Prompts [u] -> (their keys/values per layer, mask [u,w], next-token logits [u,V]): after the kept
        prefix when they all start with it, else whole (`BasePolicy._prefill_prompts`)."""
        policy = self.policy
        shared = self._shared_prefix(prompts)
        if not shared:
            _, mask, logits, cache = policy._prefill_prompts(prompts, left)
            return policy._cache_kv(cache), mask, logits
        assert self._prefix_kv is not None
        u = len(prompts)
        suffixes = [p[shared:] for p in prompts]
        ids, mask = (t.to(policy.device) for t in left_pad(suffixes, self.tokenizer.pad_id))
        prefix = [(k.expand(u, -1, -1, -1), v.expand(u, -1, -1, -1)) for k, v in self._prefix_kv]
        cache = policy._cache_of(prefix, ids.shape[1] + left)
        full = torch.cat([mask.new_ones((u, shared)), mask], 1)
        logits = policy._extend(cache, ids, full)
        return policy._cache_kv(cache), full, logits

    def _shared_prefix(self, prompts: list[list[int]]) -> int:
        """How many leading tokens of every prompt the kept prefix covers (0: too few to use). The first
        prompts set it (all but their last token when alone: the next ones cut it to what they share); it only
        shrinks while SHARED_PREFIX_MIN tokens or more are left."""
        if self._prefix_kv is None:
            prefix = prompts[0][:-1] if len(prompts) == 1 else prompts[0][: common_prefix_len(prompts)]
            if len(prefix) < SHARED_PREFIX_MIN:
                return 0
            ids = torch.tensor([prefix], device=self.policy.device)
            _, cache = self.policy._prefill(ids, torch.ones_like(ids), len(prefix))
            self._prefix, self._prefix_kv = prefix, self.policy._cache_kv(cache)
        shared = common_prefix_len([self._prefix + [-1], *prompts])
        if shared < SHARED_PREFIX_MIN:
            return 0
        if shared < len(self._prefix):
            assert self._prefix_kv is not None
            self._prefix = self._prefix[:shared]
            self._prefix_kv = [(k[:, :, :shared], v[:, :, :shared]) for k, v in self._prefix_kv]
        return shared

    def _place(self, kv: KV, mask: Tensor, logits: Tensor, new: list[_Row]) -> bool:
        """Write new rows (keys/values per layer [w,H,Lw,D], mask [w,Lw], logits [w,V]) into the slots of
        finished rows, right-aligned, in place; False (nothing written) when they do not fit."""
        free = [j for j, r in enumerate(self._rows) if r is None]
        if self._mask is None or self._logits is None or len(free) < len(new):
            return False
        width, columns = mask.shape[1], self._mask.shape[1]
        if width > columns or max(r.left for r in new) > self._room:
            return False
        slots = torch.tensor(free[: len(new)], device=mask.device)
        for (k, v), (nk, nv) in zip(self.policy._cache_kv(self._cache), kv, strict=True):
            k[slots, :, columns - width :] = nk
            v[slots, :, columns - width :] = nv
        self._mask[slots] = 0
        self._mask[slots, columns - width :] = mask
        self._logits[slots] = logits
        for j, r in zip(free, new, strict=False):
            self._rows[j] = r
        return True

    def _rebuild(self, kv: KV | None, mask: Tensor | None, logits: Tensor | None, new: list[_Row]) -> None:
        """The batch again: its unfinished rows, without the leading columns none of them uses, and `new`
        rows (their keys/values per layer `kv` [w,H,Lw,D], mask [w,Lw], next-token logits [w,V]) after them,
        right-aligned in one cache with ROOM_SLACK columns of room beyond every row's tokens left."""
        keep = [j for j, r in enumerate(self._rows) if r is not None]
        parts = []  # (keys/values per layer, mask, logits) of the old rows kept, then of the new ones
        if keep:
            assert self._mask is not None and self._logits is not None
            idx = torch.tensor(keep, device=self._mask.device)
            old_mask = self._mask[idx]
            first = int(old_mask.any(0).nonzero()[0])  # the leading columns no kept row uses go
            old_kv = [(k[idx, :, first:], v[idx, :, first:]) for k, v in self.policy._cache_kv(self._cache)]
            parts.append((old_kv, old_mask[:, first:], self._logits[idx]))
        if kv is not None and mask is not None and logits is not None:
            parts.append((kv, mask, logits))
        rows = [self._rows[j] for j in keep] + list(new)
        if not rows:
            self._clear()
            return
        width = max(m.shape[1] for _, m, _ in parts)
        self._mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, m, _ in parts])
        self._logits = torch.cat([lg for _, _, lg in parts])
        layers = []
        for layer, (k0, v0) in enumerate(parts[0][0]):
            shape = (len(rows), k0.shape[1], width, k0.shape[3])
            k_out, v_out = k0.new_zeros(shape), v0.new_zeros(shape)
            at = 0
            for part_kv, m, _ in parts:  # one copy: each part written right-aligned into its rows
                k, v = part_kv[layer]
                k_out[at : at + k.shape[0], :, width - k.shape[2] :] = k
                v_out[at : at + k.shape[0], :, width - k.shape[2] :] = v
                at += m.shape[0]
            layers.append((k_out, v_out))
        self._room = max(r.left for r in rows if r is not None) + ROOM_SLACK
        self._cache = self.policy._cache_of(layers, self._room)
        self._rows = rows

    def _trim(self) -> None:
        """Drop the leading columns no row uses once there are TRIM_MIN of them (slices of the cache: no copy
        where the backend's cache can hold them, as a DynamicCache can)."""
        assert self._mask is not None
        first = int(self._mask.any(0).nonzero()[0])
        if first < TRIM_MIN:
            return
        kv = [(k[:, :, first:], v[:, :, first:]) for k, v in self.policy._cache_kv(self._cache)]
        self._room = max(r.left for r in self._rows if r is not None) + ROOM_SLACK
        self._cache = self.policy._cache_of(kv, self._room)
        self._mask = self._mask[:, first:]

    def _sample(self) -> list[Completion]:
        """Sample each row's next token, finish the rows it ends, and decode the others' (the module
        docstring, steps 2 and 3)."""
        assert self._logits is not None and self._mask is not None
        b = len(self._rows)
        eos = self.tokenizer.eos_id
        tokens = torch.full((b,), eos, dtype=torch.long, device=self._logits.device)
        alive = torch.zeros(b, dtype=torch.long, device=self._logits.device)
        done: list[Completion] = []
        by_settings: dict[tuple[float, float, int], list[int]] = {}
        for j, r in enumerate(self._rows):
            if r is not None:
                by_settings.setdefault((r.temperature, r.top_p, r.top_k), []).append(j)
        for (temperature, top_p, top_k), idx in by_settings.items():
            sel = torch.tensor(idx, device=self._logits.device)
            logits = self._logits if len(idx) == b else self._logits[sel]
            tok, logp = sample_tokens(logits, temperature, top_p, self.generator, temperature == 0.0, top_k)
            tokens[sel] = tok
            for j, t, lp in zip(idx, tok.tolist(), logp.tolist(), strict=True):
                r = self._rows[j]
                assert r is not None
                r.row.response_ids.append(t)
                r.row.log_probs.append(lp)
                if t == eos or r.left == 0:
                    r.row.finished = t == eos
                    self._rows[j] = None
                    done.append(r.row)
                else:
                    alive[j] = 1
        live = int(alive.sum())
        if not live:
            if not self._waiting:
                self._clear()
            return done
        if b - live >= self.compact_at * b:  # drop the finished rows (a copy of the cache): decoding them on
            # until waiting rows take their slots cost more (SmolLM2 on a CPU)
            keep = alive.nonzero().squeeze(-1)
            tokens, alive = tokens[keep], alive[keep]
            self._rebuild(None, None, None, [])
        else:
            self._trim()
        # finished rows decode on (their token ignored) with a 0 in the mask: their positions stay put
        self._mask = torch.cat([self._mask, alive[:, None]], 1)
        self._logits = self.policy._decode(tokens[:, None], self._mask, self._cache)
        self._room -= 1
        return done
