"""Continuous batching on the built-in policy (`RowBatch`): rows enter a running decode batch as others
finish, one token per row per `step`, so a producer keeps its engine full instead of running a batch down to
its longest row (producers/continuous.py drives it, as it drives the vLLM engine).

The batch is one KV cache of b rows x L columns, left-padded: every row's tokens end at the last column, and a
row's own columns are marked in the attention mask (positions come from the mask, so holes cost nothing but
the attention over them). A step:

1. **Admit.** Rows submitted since the last step (new rows, and rows a weight swap sent back) are prefilled
   together, each distinct history once (a group's n rows share their prompt; rows sharing a chat template's
   system turn share its prefix: `BasePolicy._prefill_prompts`). The batch is rebuilt once: the finished rows
   dropped, the leading columns no row uses trimmed, the new rows' keys and values written right-aligned
   beside the others.
2. **Sample** one token for every row in flight from its next-token logits (rows grouped by their sampling
   settings: `sample_tokens`); a row that produced eos or used its token budget leaves (`step` returns it).
3. **Decode** the sampled tokens: one forward over the batch (finished rows ride along until the next
   rebuild, masked out; a rebuild happens once they are COMPACT_DEAD_FRACTION of the batch, as in
   `BasePolicy.generate`).

A new version of the weights is loaded into the policy by its owner; `resume(True)` then records a swap point
on every row in flight and sends them back to be prefilled again (prompt + tokens so far) under the new
weights, as the built-in sampler's re-prefill does. Greedy rows decode the tokens per-row generation does
(`tests/test_rows.py`); `busy_s` / `row_s` measure time in steps and rows in flight over it (occupancy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rollstream.model.base import COMPACT_DEAD_FRACTION, BasePolicy, Completion
from rollstream.model.sampling import check_generate_args, sample_tokens
from rollstream.model.tokenizer import Tokenizer


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
    `generator` draws the samples (None: torch's global RNG)."""

    def __init__(self, policy: BasePolicy, generator: torch.Generator | None = None) -> None:
        self.policy = policy
        self.tokenizer: Tokenizer = policy.tokenizer
        self.generator = generator
        self._rows: list[_Row | None] = []  # batch row -> its row, None once finished (until the rebuild)
        self._waiting: list[_Row] = []  # submitted or resumed, prefilled at the next step
        self._cache: Any = None
        self._mask: Tensor | None = None  # [b, L]: 1 where a row has a token
        self._logits: Tensor | None = None  # [b, V]: each row's next-token logits
        self.busy_s = 0.0  #: seconds spent in steps
        self.row_s = 0.0  #: rows in flight x seconds, summed over steps (busy_s x mean rows in flight)

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
        rows, t0 = self.in_flight, time.perf_counter()
        module = self.policy.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.policy.compute():
                if self._waiting:
                    self._admit()
                done = self._sample() if self._rows else []
        finally:
            module.train(was_training)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.row_s += rows * dt
        return done

    def resume(self, swapped: bool) -> None:
        """After the policy's weights may have changed: with `swapped` (they did), every row in flight records
        where the new weights take over (`swap_points`) and is prefilled again under them at the next step."""
        if not swapped:
            return
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
        """Prefill the waiting rows (each distinct history once) and rebuild the batch with them."""
        new, self._waiting = self._waiting, []
        histories: dict[tuple[int, ...], int] = {}
        of_row = [histories.setdefault(tuple(r.row.prompt_ids + r.row.response_ids), len(histories))
                  for r in new]
        prompts = [list(h) for h in histories]
        _, mask, logits, cache = self.policy._prefill_prompts(prompts, max(r.left for r in new))
        kv = self.policy._cache_kv(cache)
        rows = torch.tensor(of_row, device=mask.device)
        self._rebuild([(k[rows], v[rows]) for k, v in kv], mask[rows], logits[rows], new)

    def _rebuild(
        self, kv: list[tuple[Tensor, Tensor]] | None, mask: Tensor | None, logits: Tensor | None,
        new: list[_Row],
    ) -> None:
        """The batch again: its unfinished rows, without the leading columns none of them uses, and `new`
        rows (their keys/values per layer `kv` [w,H,Lw,D], mask [w,Lw], next-token logits [w,V]) after them,
        right-aligned in one cache with room for every row's tokens left."""
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
        for layer in range(len(parts[0][0])):
            ks = [F.pad(p[0][layer][0], (0, 0, width - p[0][layer][0].shape[2], 0)) for p in parts]
            vs = [F.pad(p[0][layer][1], (0, 0, width - p[0][layer][1].shape[2], 0)) for p in parts]
            layers.append((torch.cat(ks), torch.cat(vs)))
        room = max(r.left for r in rows if r is not None)
        self._cache = self.policy._cache_of(layers, room)
        self._rows = rows

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
        if b - live >= COMPACT_DEAD_FRACTION * b:  # drop the finished rows (a copy of the cache)
            keep = alive.nonzero().squeeze(-1)
            tokens, alive = tokens[keep], alive[keep]
            self._rebuild(None, None, None, [])
        # finished rows decode on (their token ignored) with a 0 in the mask: their positions stay put
        self._mask = torch.cat([self._mask, alive[:, None]], 1)
        self._logits = self.policy._decode(tokens[:, None], self._mask, self._cache)
        return done
