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
these arrays (schemas/codec.py); the trainer's assembly pads them once, per micro-batch. `from_padded` and
`from_compact` read the layouts of schemas 1 and 2 (a padded verl DataProto; the compact layout) into this
form. Every check here costs at most one pass over an array; failures are ValueError naming the field.
No msgpack, no torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from schemas.batch import DataProto

LOG_PROBS, RESPONSE_MASK, TOKEN_SCORES = "rollout_log_probs", "response_mask", "token_level_scores"
_ID_KINDS = "iu"
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


def _total(lens: np.ndarray) -> int:
    """Sum of lengths as a Python int (no wrap-around)."""
    return sum(lens.tolist())


def _lengths(arr: Any, name: str, size: int | None) -> list[int]:
    """The values of a 1-d integer array of non-negative lengths (of `size` entries when given), as a list
    (one row's length each: short, so Python's min and sum beat numpy's call overhead)."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in _ID_KINDS:
        raise ValueError(f"{name} must be a 1-d integer array, got {_describe(arr)}")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} entries, expected {size}")
    values: list[int] = arr.tolist()
    if values and min(values) < 0:
        raise ValueError(f"{name} holds a negative length {min(values)}")
    return values


def _describe(arr: Any) -> str:
    """Short type/dtype/shape text of a value for an error message."""
    if isinstance(arr, np.ndarray):
        return f"{arr.dtype.str}{list(arr.shape)[:4]}"
    return type(arr).__name__


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
        rlen = _lengths(self.response_lens, "response_lens", None)
        n = len(rlen)
        plen = _lengths(self.prompt_lens, "prompt_lens", None)
        if len(plen) not in (1, n) or (n == 0 and plen):
            raise ValueError(f"prompt_lens has {len(plen)} entries, expected 1 (shared) or n={n}")
        n_resp = sum(rlen)
        for name, ids, want in (
            ("prompt_ids", self.prompt_ids, sum(plen)),
            ("response_ids", self.response_ids, n_resp),
        ):
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in _ID_KINDS:
                raise ValueError(f"{name} must be a 1-d integer array, got {_describe(ids)}")
            if ids.size != want:
                raise ValueError(f"{name} has {ids.size} ids, the lengths say {want}")
        for key, arr in self.tokens.items():
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.hasobject:
                raise ValueError(f"tokens[{key!r}] must be a 1-d numeric array, got {_describe(arr)}")
            if arr.size != n_resp:
                raise ValueError(f"tokens[{key!r}] has {arr.size} values, response_lens say {n_resp}")
        for group, arrays in (("rows", self.rows), ("non_tensors", self.non_tensors)):
            for key, arr in arrays.items():
                if not isinstance(arr, np.ndarray) or not arr.ndim or arr.shape[0] != n:
                    raise ValueError(
                        f"{group}[{key!r}] must have first dimension n={n}, got {_describe(arr)}"
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


# --- the layouts of schemas 1 and 2, read into the ragged form --------------------------------------


def from_padded(batch: DataProto) -> RaggedBatch:
    """The ragged form of a padded verl batch (schema 1): `responses` [n, R] with `input_ids` /
    `attention_mask` [n, P+R] (a left-padded prompt, a right-padded response; `prompts` when input_ids is
    absent; no attention mask = nothing padded); [n, R] arrays become per-token arrays (their attended
    values), 1-d ones per-row arrays; [n, P+R] arrays other than ids and mask (position_ids) are dropped."""
    t = batch.tensors
    responses = t.get("responses")
    if not isinstance(responses, np.ndarray) or responses.ndim != 2:
        raise ValueError(f"a padded batch needs 2-d responses, got {_describe(responses)}")
    n, R = responses.shape
    ids = t.get("input_ids")
    prompts = (
        ids[:, : ids.shape[1] - R] if isinstance(ids, np.ndarray) and ids.ndim == 2 else t.get("prompts")
    )
    if not isinstance(prompts, np.ndarray) or prompts.ndim != 2 or prompts.shape[0] != n:
        raise ValueError(
            f"a padded batch needs input_ids or prompts with n={n} rows, got {_describe(prompts)}"
        )
    P = prompts.shape[1]
    plen, rlen = _padded_lengths(t.get("attention_mask"), n, P, R)
    pbits = np.arange(P)[None, :] >= (P - plen)[:, None]  # [n, P]
    rbits = np.arange(R)[None, :] < rlen[:, None]  # [n, R]
    id_dt = ids.dtype if isinstance(ids, np.ndarray) else prompts.dtype
    tokens, rows = _padded_tensors(t, rbits, P, R)
    if RESPONSE_MASK in tokens and bool((tokens[RESPONSE_MASK] == 1).all()):
        del tokens[RESPONSE_MASK]  # every attended token generated: the lengths say it
    prompt_rows = prompts[pbits]
    if (
        n > 1
        and bool((plen == plen[0]).all())
        and bool((prompt_rows.reshape(n, -1) == prompt_rows[: plen[0]]).all())
    ):
        prompt_ids, prompt_lens = prompt_rows[: int(plen[0])], plen[:1]
    else:
        prompt_ids, prompt_lens = prompt_rows, plen
    return RaggedBatch(
        prompt_ids=np.ascontiguousarray(prompt_ids, dtype=id_dt),
        prompt_lens=np.ascontiguousarray(prompt_lens, dtype=np.int32),
        response_ids=np.ascontiguousarray(responses[rbits], dtype=id_dt),
        response_lens=rlen,
        tokens=tokens,
        rows=rows,
        non_tensors=dict(batch.non_tensors),
        meta_info=dict(batch.meta_info),
    )


def _padded_lengths(mask: Any, n: int, P: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, response lengths) [n] int32 of a padded batch from its attention mask [n, P+R] (None:
    nothing padded), which must be a left-padded prompt and a right-padded response on every row."""
    if mask is None:
        return np.full(n, P, np.int32), np.full(n, R, np.int32)
    if not isinstance(mask, np.ndarray) or mask.shape != (n, P + R):
        raise ValueError(f"attention_mask is {_describe(mask)}, expected [{n}, {P + R}]")
    plen = np.count_nonzero(mask[:, :P], axis=1).astype(np.int32)
    rlen = np.count_nonzero(mask[:, P:], axis=1).astype(np.int32)
    bits = np.zeros((n, P + R), bool)
    for i, (p, r) in enumerate(zip(plen.tolist(), rlen.tolist(), strict=True)):
        bits[i, P - p : P + r] = True
    if not bool((mask == bits).all()):
        raise ValueError(
            "attention_mask is not a left-padded prompt and a right-padded response on every row"
        )
    return plen, rlen


def _padded_tensors(
    t: dict[str, np.ndarray], rbits: np.ndarray, P: int, R: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(per-token arrays: the attended values of [n, R] tensors, per-row arrays: 1-d and other-width ones) of
    a padded batch's tensors other than ids, mask, prompts and responses; [n, P+R] ones are dropped."""
    tokens: dict[str, np.ndarray] = {}
    rows: dict[str, np.ndarray] = {}
    for key, arr in t.items():
        if key in ("input_ids", "attention_mask", "prompts", "responses"):
            continue
        if arr.ndim == 2 and arr.shape[1] == R and key != "position_ids":
            tokens[key] = np.ascontiguousarray(arr[rbits])
        elif arr.ndim == 2 and arr.shape[1] == P + R:
            continue
        elif arr.ndim == 1 or (arr.ndim >= 2 and arr.shape[1] not in (R, P + R)):
            rows[key] = arr
        else:
            raise ValueError(f"tensor {key!r} of shape {list(arr.shape)} fits neither P={P} nor R={R}")
    return tokens, rows


def _layout_int(layout: dict[str, Any], name: str, most: int) -> int:
    """An int field of a schema-2 layout within [0, most]."""
    value = layout.get(name)
    if type(value) is not int or not 0 <= value <= most:
        raise ValueError(f"compact batch: {name}={value!r:.40} is not an int in [0, {most}]")
    return value


def _layout_vector(layout: dict[str, Any], name: str, size: int | None, kinds: str) -> np.ndarray:
    """A 1-d array field of a schema-2 layout (of `size` values when given) of one of the kinds."""
    arr = layout.get(name)
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds:
        raise ValueError(f"compact batch: {name} is {_describe(arr)}, not a 1-d array of kinds {kinds!r}")
    if size is not None and arr.size != size:
        raise ValueError(f"compact batch: {name} has {arr.size} values, expected {size}")
    return arr


def _compact_mask(spec: Any, n_resp: int) -> np.ndarray | None:
    """A schema-2 layout's response mask, [dtype, bits or nil], as one 0/1 value per response token (None:
    absent, or nil bits = every token generated)."""
    if spec is None:
        return None
    if type(spec) is not list or len(spec) != 2:
        raise ValueError(f"compact batch: {RESPONSE_MASK} must be [dtype, bits or nil], got {spec!r:.40}")
    bits = spec[1]
    if bits is None:
        return None
    size = math.ceil(n_resp / 8)
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint8 or bits.ndim != 1 or bits.size != size:
        raise ValueError(f"compact batch: {RESPONSE_MASK} bits must be {size} uint8 bytes")
    return np.unpackbits(bits, count=n_resp)


def from_compact(
    layout: Any, rest: dict[str, np.ndarray], non_tensors: dict[str, np.ndarray], meta_info: dict[str, Any]
) -> RaggedBatch:
    """The ragged form of a schema-2 compact batch: its layout (lengths, the prompt once or per row, the
    attended response tokens, log-probs and mask bits) is ragged already; [n, R] rest tensors
    (token_level_scores) keep their attended values, 1-d ones are per-row arrays."""
    if type(layout) is not dict:
        raise ValueError(f"compact batch: layout is {type(layout).__name__}, not a map")
    n = _layout_int(layout, "n", 1 << 31)
    P = _layout_int(layout, "P", 1 << 40)
    R = _layout_int(layout, "R", 1 << 40)
    plen = _layout_vector(layout, "plen", n, _ID_KINDS)
    rlen = _layout_vector(layout, "rlen", n, _ID_KINDS)
    _lengths(plen, "compact batch: plen", n)
    _lengths(rlen, "compact batch: rlen", n)
    if rlen.size and int(rlen.max()) > R:
        raise ValueError(f"compact batch: rlen holds {int(rlen.max())}, over R={R}")
    shared = layout.get("shared")
    if type(shared) is not bool or (shared and n and not bool((plen == plen[0]).all())):
        raise ValueError(f"compact batch: shared={shared!r:.40} with prompt lengths {plen[:8].tolist()}")
    n_resp = _total(rlen)
    prompt_lens = plen[:1] if shared and n else plen
    prompt = _layout_vector(layout, "prompt", _total(prompt_lens), _ID_KINDS)
    resp = _layout_vector(layout, "resp", n_resp, _ID_KINDS)
    tokens: dict[str, np.ndarray] = {}
    mask = _compact_mask(layout.get(RESPONSE_MASK), n_resp)
    if mask is not None:
        tokens[RESPONSE_MASK] = mask
    if LOG_PROBS in layout:
        tokens[LOG_PROBS] = _layout_vector(layout, LOG_PROBS, n_resp, "f")
    rbits: np.ndarray | None = None
    rows: dict[str, np.ndarray] = {}
    for key, arr in rest.items():
        if not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
            raise ValueError(f"compact batch: tensor {key!r} is {_describe(arr)}")
        if key in ("input_ids", "attention_mask", "responses", "prompts") or key in tokens:
            raise ValueError(f"compact batch: tensor {key!r} is both in the layout and in the rest")
        if arr.ndim == 2 and arr.shape == (n, R):
            if rbits is None:
                rbits = np.arange(R)[None, :] < rlen[:, None]
            tokens[key] = np.ascontiguousarray(arr[rbits])
        elif arr.ndim == 2 and arr.shape == (n, P + R):
            continue  # (position_ids: derived from the lengths)
        elif arr.ndim >= 1 and arr.shape[0] == n:
            rows[key] = arr
        else:
            raise ValueError(f"compact batch: tensor {key!r} of shape {list(arr.shape)} fits no row layout")
    return RaggedBatch(
        prompt_ids=prompt,
        prompt_lens=prompt_lens,
        response_ids=resp,
        response_lens=rlen,
        tokens=tokens,
        rows=rows,
        non_tensors=non_tensors,
        meta_info=meta_info,
    )
