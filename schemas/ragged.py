"""A RolloutSample's trajectories as ragged arrays: what the sampler produced, nothing padded.

One group of n trajectories (`RaggedBatch`):

- `prompt_ids` [sum(prompt_lens)] and `prompt_lens` [1] (the group's one prompt, shared by every row) or [n];
- `response_ids` [sum(response_lens)] and `response_lens` [n]: every row's response, concatenated;
- `tokens`: arrays with one value per response token, concatenated like `response_ids` (verl's names:
  `rollout_log_probs` float32 behaviour log-probs, `response_mask` 0/1 loss mask with tool tokens 0, absent
  when every token was generated, `token_level_scores` float32);
- `rows`: arrays with one entry per row (`rewards` [n]); `non_tensors`: per-row object arrays (verl's
  non_tensor_batch: `uid`, `raw_prompt`, ...); `meta_info`.

Token ids travel in the narrowest dtype that holds the vocabulary (`ids_dtype`). Wire schema 5 sends exactly
these arrays (schemas/ragged_wire.py); the trainer pads the rows an update trains once (consumers/trainer/
batch.py), its micro-batches views of them, and tells its forwards which rows share a prompt (the layouts of
schemas 1 to 3 are read into this form by schemas/legacy.py). Every check here costs at most one pass over an
array; failures are ValueError naming the field. No msgpack, no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

LOG_PROBS, RESPONSE_MASK, TOKEN_SCORES = "rollout_log_probs", "response_mask", "token_level_scores"
ID_KINDS = "iu"  # numpy kinds of token ids and lengths
_MAX_INT_ID = np.iinfo(np.int64).max


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype holding every id in [0, vocab_size): uint8, uint16, int32 or int64."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 31:
        return np.dtype("<i4")
    return np.dtype("<i8")


def id_range_ok(ids: np.ndarray, vocab_size: int) -> bool:
    """True when every id is in [0, vocab_size): no pass when the dtype cannot hold anything else, else one
    (viewed as unsigned, a negative id is a huge number)."""
    if not ids.size:
        return True
    if ids.dtype.kind == "u" and (1 << (8 * ids.dtype.itemsize)) <= vocab_size:
        return True
    unsigned = ids.view(f"{ids.dtype.str[0]}u{ids.dtype.itemsize}") if ids.dtype.kind == "i" else ids
    return int(unsigned.max()) < vocab_size


def check_lengths(arr: Any, name: str, size: int | None) -> list[int]:
    """The values of a 1-d integer array of non-negative lengths (of `size` entries when given), as a list
    (one row's length each: short, so Python's min and sum beat numpy's call overhead)."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in ID_KINDS:
        raise ValueError(f"{name} must be a 1-d integer array, got {describe(arr)}")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} entries, expected {size}")
    values: list[int] = arr.tolist()
    if values and min(values) < 0:
        raise ValueError(f"{name} holds a negative length {min(values)}")
    return values


def describe(arr: Any) -> str:
    """Short type/dtype/shape text of a value for an error message."""
    if isinstance(arr, np.ndarray):
        return f"{arr.dtype.str}{list(arr.shape)[:4]}"
    return type(arr).__name__


def _flat(rows: Sequence[Sequence[Any]], dtype: Any, total: int) -> np.ndarray:
    """The rows' values concatenated into one 1-d array of dtype (total values)."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=total)


def _offsets(lens: np.ndarray) -> list[int]:
    """[0, l0, l0+l1, ...]: where each run starts in the flat array, and the end."""
    out = [0]
    for k in lens.tolist():
        out.append(out[-1] + k)
    return out


class RaggedBatch:
    """One group's n trajectories, unpadded (see the module docstring for each field). A plain class, not a
    dataclass: pydantic then checks a RolloutSample's batch by its type alone, and `check` is the one pass."""

    __slots__ = (
        "prompt_ids",
        "prompt_lens",
        "response_ids",
        "response_lens",
        "tokens",
        "rows",
        "non_tensors",
        "meta_info",
    )

    def __init__(
        self,
        prompt_ids: np.ndarray,
        prompt_lens: np.ndarray,
        response_ids: np.ndarray,
        response_lens: np.ndarray,
        tokens: dict[str, np.ndarray] | None = None,
        rows: dict[str, np.ndarray] | None = None,
        non_tensors: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> None:
        """Keep the arrays (no copies) and check that their sizes agree with the lengths (ValueError naming
        the field)."""
        self.prompt_ids, self.prompt_lens = prompt_ids, prompt_lens
        self.response_ids, self.response_lens = response_ids, response_lens
        self.tokens: dict[str, np.ndarray] = {} if tokens is None else tokens
        self.rows: dict[str, np.ndarray] = {} if rows is None else rows
        self.non_tensors: dict[str, np.ndarray] = {} if non_tensors is None else non_tensors
        self.meta_info: dict[str, Any] = {} if meta_info is None else meta_info
        self.check()

    @classmethod
    def adopt(
        cls,
        prompt_ids: np.ndarray,
        prompt_lens: np.ndarray,
        response_ids: np.ndarray,
        response_lens: np.ndarray,
        tokens: dict[str, np.ndarray],
        rows: dict[str, np.ndarray],
        non_tensors: dict[str, np.ndarray],
        meta_info: dict[str, Any],
    ) -> RaggedBatch:
        """A batch of arrays the caller has checked as `check` does, each where it built it (the codec's
        schema-4/5 decode): no second pass."""
        self = cls.__new__(cls)
        self.prompt_ids, self.prompt_lens, self.response_ids, self.response_lens = (
            prompt_ids,
            prompt_lens,
            response_ids,
            response_lens,
        )
        self.tokens, self.rows, self.non_tensors, self.meta_info = tokens, rows, non_tensors, meta_info
        return self

    @classmethod
    def from_rows(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        masks: Sequence[Sequence[int]],
        log_probs: Sequence[Sequence[float]],
        vocab_size: int,
        token_scores: Sequence[np.ndarray] | None = None,
    ) -> RaggedBatch:
        """One group's rows (each row's prompt ids, response ids, 0/1 generated mask and behaviour log-probs)
        packed as the wire sends them: the prompt once when every row has the same one (a GRPO group), else
        each row's; responses, log-probs (float32, 0.0 where a tool wrote the token) and the loss mask (only
        when a tool wrote a token) concatenated; `token_level_scores` when given; ids in the narrowest dtype
        holding the vocabulary (ValueError naming the row when an id is outside it)."""
        dt = ids_dtype(vocab_size)
        first = prompts[0]
        shared = all(p == first for p in prompts[1:])
        kept = [first] if shared else list(prompts)
        plen = np.fromiter((len(p) for p in kept), np.int32, len(kept))
        rlen = np.fromiter((len(r) for r in responses), np.int32, len(responses))
        n_resp = int(rlen.sum())
        for name, rows in (("prompt_ids", kept), ("response_ids", responses)):
            for i, row in enumerate(rows):
                if row and (min(row) < 0 or max(row) >= vocab_size):
                    raise ValueError(f"trajectory {i}: {name} hold ids in [{min(row)}, {max(row)}], outside "
                                     f"the vocabulary [0, {vocab_size})")
        tokens: dict[str, np.ndarray] = {}
        mask = _flat(masks, np.uint8, n_resp)
        flat_log_probs = _flat(log_probs, np.float32, n_resp)
        if not all(all(m) for m in masks):
            tokens[RESPONSE_MASK] = mask
            flat_log_probs *= mask  # behaviour log-probs only where the model generated the token
        tokens[LOG_PROBS] = flat_log_probs
        if token_scores is not None:
            tokens[TOKEN_SCORES] = (np.concatenate(token_scores).astype(np.float32, copy=False)
                                    if n_resp else np.zeros(0, np.float32))
        return cls(
            prompt_ids=_flat(kept, dt, int(plen.sum())), prompt_lens=plen,
            response_ids=_flat(responses, dt, n_resp), response_lens=rlen, tokens=tokens,
        )

    def __len__(self) -> int:
        """Number of trajectories (rows)."""
        return int(self.response_lens.size)

    def __repr__(self) -> str:
        """Short description: rows, token counts and the keys of each part."""
        return (
            f"RaggedBatch(n={len(self)}, prompt_tokens={self.prompt_ids.size}, "
            f"response_tokens={self.response_ids.size}, tokens={list(self.tokens)}, rows={list(self.rows)}, "
            f"non_tensors={list(self.non_tensors)})"
        )

    def check(self) -> None:
        """Raise ValueError naming the first field whose type or size disagrees with the lengths."""
        rlen = check_lengths(self.response_lens, "response_lens", None)
        n = len(rlen)
        plen = check_lengths(self.prompt_lens, "prompt_lens", None)
        if len(plen) not in (1, n) or (n == 0 and plen):
            raise ValueError(f"prompt_lens has {len(plen)} entries, expected 1 (shared) or n={n}")
        n_resp = sum(rlen)
        for name, ids, want in (
            ("prompt_ids", self.prompt_ids, sum(plen)),
            ("response_ids", self.response_ids, n_resp),
        ):
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in ID_KINDS:
                raise ValueError(f"{name} must be a 1-d integer array, got {describe(ids)}")
            if ids.size != want:
                raise ValueError(f"{name} has {ids.size} ids, the lengths say {want}")
        for key, arr in self.tokens.items():
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.hasobject:
                raise ValueError(f"tokens[{key!r}] must be a 1-d numeric array, got {describe(arr)}")
            if arr.size != n_resp:
                raise ValueError(f"tokens[{key!r}] has {arr.size} values, response_lens say {n_resp}")
        for group, arrays in (("rows", self.rows), ("non_tensors", self.non_tensors)):
            for key, arr in arrays.items():
                if not isinstance(arr, np.ndarray) or not arr.ndim or arr.shape[0] != n:
                    raise ValueError(
                        f"{group}[{key!r}] must have first dimension n={n}, got {describe(arr)}"
                    )
                if group == "rows" and arr.dtype.hasobject:
                    raise ValueError(f"rows[{key!r}] has object dtype; put it in non_tensors")

    def row_prompt_lens(self) -> list[int]:
        """Each row's prompt length."""
        lens: list[int] = self.prompt_lens.tolist()
        return lens * len(self) if self.prompt_lens.size == 1 and len(self) != 1 else lens

    def prompt_offsets(self) -> list[int]:
        """Per row, where its prompt starts in prompt_ids (a shared prompt: 0 for every row), then the end."""
        if self.prompt_lens.size == 1 and len(self) != 1:
            return [0] * len(self) + [int(self.prompt_lens[0])]
        return _offsets(self.prompt_lens)

    def response_offsets(self) -> list[int]:
        """Per row, where its response starts in response_ids and in every tokens array, then the end."""
        return _offsets(self.response_lens)

    def num_tokens(self) -> int:
        """Response tokens that count for the loss: the response_mask's sum, else every response token."""
        mask = self.tokens.get(RESPONSE_MASK)
        if mask is not None:
            return int(np.count_nonzero(mask))
        return int(self.response_ids.size)
