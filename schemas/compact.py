"""The compact wire layout of a RolloutSample's batch (schema 2): what cannot be derived, nothing else.

A verl batch carries, per row, `input_ids` [n, P+R] = `prompts` [n, P] ++ `responses` [n, R], an
`attention_mask` [n, P+R] that is a left-padded prompt and a right-padded response, a `response_mask`
[n, R] and fp32 `rollout_log_probs` [n, R]; as int64 arrays that is 36 bytes per response token per row
and 24 per prompt token per row. The compact layout sends instead:

- `pad` (the one token id every unattended position holds), prompt lengths `plen` [n] and response
  lengths `rlen` [n] (the attention mask as lengths);
- the prompt's attended tokens once when every row has the same prompt (a GRPO group), else each row's;
- the attended response tokens of every row, concatenated (no padding), as int32 (uint32 when the ids
  need it, int64 only when neither holds them);
- `response_mask` as "the attention mask's response part" when it is, else one bit per attended token;
- `rollout_log_probs` as the attended positions' values, concatenated, in their own float dtype;
- the original dtype of every array it rebuilds.

`split` verifies that each known key is exactly rebuildable before choosing its compact form; a key
that is not (a mask with holes, a log-prob where no token is) stays in `rest` and travels as before,
and a batch whose `input_ids`/`attention_mask` are not in the layout above is not compact at all.
`rebuild` returns exactly the arrays `split` was given (same keys, dtypes, shapes, values), read-only
like every decoded array; with no padding the log-probs are zero-copy views of the wire bytes and the
all-ones masks a broadcast of one element (consumers that need contiguous memory copy, as the learner does). Every
inconsistency in a decoded layout is a DecodeError that names the field and value. No msgpack here.
"""

from __future__ import annotations

import functools
import math
from typing import Any, TypeGuard

import numpy as np

from schemas.errors import DecodeError

IDS, MASK, PROMPTS, RESPONSES = "input_ids", "attention_mask", "prompts", "responses"
RESPONSE_MASK, LOG_PROBS = "response_mask", "rollout_log_probs"
KNOWN_KEYS = (IDS, MASK, PROMPTS, RESPONSES, RESPONSE_MASK, LOG_PROBS)
_INT32, _UINT32 = np.iinfo(np.int32), np.iinfo(np.uint32)
_TOKEN_KINDS = "iub"
_MAX_PAD = 1 << 64


def _token_dtype(lo: int, hi: int) -> np.dtype:
    """Narrowest of int32 / uint32 / int64 that holds ids in [lo, hi]."""
    if lo >= _INT32.min and hi <= _INT32.max:
        return np.dtype("<i4")
    if lo >= 0 and hi <= _UINT32.max:
        return np.dtype("<u4")
    return np.dtype("<u8") if hi > np.iinfo(np.int64).max else np.dtype("<i8")


def _is_2d(arr: Any, shape: tuple[int, int], kinds: str) -> TypeGuard[np.ndarray]:
    """True for a numpy array of this shape whose dtype kind is one of kinds."""
    return isinstance(arr, np.ndarray) and arr.shape == shape and arr.dtype.kind in kinds


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape and equal values (np.array_equal without its generic overhead); a view of the very same
    memory (a producer slices prompts and responses out of input_ids) is equal without a comparison."""
    if a.shape != b.shape:
        return False
    if (
        a.dtype == b.dtype
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    ):
        return True
    return bool((a == b).all())


def _filled(n: int, value: int) -> np.ndarray:
    """[n] int32 array of value (np.full without its overhead)."""
    out = np.empty(n, np.int32)
    out.fill(value)
    return out


def _all_ones_guess(mask: np.ndarray) -> bool:
    """True when the first and last columns of a 2-d mask hold only 1 (a valid left/right-padded mask is then all
    ones): worth one full comparison. A guess only; the caller verifies."""
    return bool(mask.size and (mask[:, 0] == 1).all() and (mask[:, -1] == 1).all())


def _lengths(mask: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(plen, rlen, bits) when mask is 0/1, left-padded over the prompt and right-padded over the response;
    bits: the [n, P+R] bool array of attended positions (= mask), None when there is no padding; else None."""
    n, T = mask.shape
    if mask.dtype.kind == "b":
        if not mask.size or mask.all():
            return _filled(n, P), _filled(n, T - P), None
        plen, rlen = np.count_nonzero(mask[:, :P], axis=1), np.count_nonzero(mask[:, P:], axis=1)
    else:
        if _all_ones_guess(mask) and bool((mask == 1).all()):  # one pass where min() and max() take two
            return _filled(n, P), _filled(n, T - P), None
        lo, hi = (int(mask.min()), int(mask.max())) if mask.size else (1, 1)
        if lo < 0 or hi > 1:
            return None
        if lo == 1:
            return _filled(n, P), _filled(n, T - P), None
        plen, rlen = mask[:, :P].sum(axis=1), mask[:, P:].sum(axis=1)  # (0/1 values: counts)
    bits = np.zeros((n, T), bool)
    for i, (p, r) in enumerate(zip(plen.tolist(), rlen.tolist(), strict=True)):
        bits[i, P - p : P + r] = True  # the prompt's last p positions, the response's first r
    if not bool((mask == bits).all()):
        return None
    return plen, rlen, bits


def _zero_outside(arr: np.ndarray, outside: np.ndarray | None) -> bool:
    """True when every element of arr where `outside` is set (None: nowhere) is all-zero bytes (+0.0 for
    floats, never -0.0)."""
    if outside is None:
        return True
    values = arr[outside]
    if not values.size:
        return True
    return not np.any(values.view(f"u{arr.dtype.itemsize}") if arr.dtype.itemsize in (1, 2, 4, 8) else values)


def _range(*arrays: np.ndarray) -> tuple[int, int]:
    """(min, max) over the values of all arrays (0, 0 when they are empty)."""
    if len(arrays) == 1 and arrays[0].size:
        return int(arrays[0].min()), int(arrays[0].max())
    values = [a for a in arrays if a.size]
    if not values:
        return 0, 0
    return min(int(a.min()) for a in values), max(int(a.max()) for a in values)


def _ids_dtype(*arrays: np.ndarray) -> np.dtype:
    """The narrowest token dtype (see _token_dtype) for the values of all arrays. One pass per array in the usual
    case: viewed as unsigned, a max within int32 proves every value is in [0, int32 max] (a negative id views as
    a huge number); only otherwise are min and max taken."""
    values = [a for a in arrays if a.size]  # (split passes token arrays only: kinds i, u, b)
    # (the unsigned view keeps the array's byte order: a big-endian id read as little-endian could look small)
    most = max((int(a.view(f"{a.dtype.str[0]}u{a.dtype.itemsize}").max()) for a in values), default=0)
    if most <= _INT32.max:
        return np.dtype("<i4")
    return _token_dtype(*_range(*values))


def response_tokens(layout: dict[str, Any], tensors: dict[str, np.ndarray]) -> int | None:
    """The batch's response-token count (RolloutSample.num_tokens) when split's layout proves it: the lengths'
    sum when response_mask is the attention mask's response part (or absent); None when it must be counted."""
    spec = layout.get(RESPONSE_MASK)
    if spec is None and RESPONSE_MASK in tensors:
        return None  # response_mask travels as it is
    if spec is not None and spec[1] is not None:
        return None  # response_mask with holes: its bits, not the lengths
    return int(layout["rlen"].sum())


def split(tensors: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """(layout, rest): the compact layout of the known keys that fit it and the tensors that travel as they
    are; None when input_ids, attention_mask and responses are not in the layout (then nothing is compact)."""
    ids, mask, responses = tensors.get(IDS), tensors.get(MASK), tensors.get(RESPONSES)
    if not (
        isinstance(ids, np.ndarray)
        and isinstance(responses, np.ndarray)
        and ids.ndim == 2
        and responses.ndim == 2
    ):
        return None
    n, T = ids.shape
    R = responses.shape[1]
    P = T - R
    if (
        P < 0
        or responses.shape[0] != n
        or ids.dtype.kind not in _TOKEN_KINDS
        or not _is_2d(mask, (n, T), _TOKEN_KINDS)
    ):
        return None
    if responses.dtype.kind not in _TOKEN_KINDS or not _same(responses, ids[:, P:]):
        return None
    lengths = _lengths(mask, P)
    if lengths is None:
        return None
    plen, rlen, bits = lengths
    full = bits is None
    pbits = rbits = rout = None
    pad = 0
    if bits is not None:
        pbits, rbits = bits[:, :P], bits[:, P:]
        out = ~bits
        rout = out[:, P:]
        unattended = ids[out]
        pad = int(unattended[0])
        if np.any(unattended != unattended[0]):
            return None
    shared = bool(
        n > 0 and (full or np.all(plen == plen[0])) and (n == 1 or bool((ids[1:, :P] == ids[:1, :P]).all()))
    )
    if full:
        prompt, resp = (ids[0, :P] if shared else ids[:, :P]), ids[:, P:]
        tok = _ids_dtype(ids)
    else:
        assert pbits is not None and rbits is not None  # (set above when not full)
        prompt = ids[0, P - int(plen[0]) : P] if shared else ids[:, :P][pbits]
        resp = ids[:, P:][rbits]
        tok = _ids_dtype(prompt, resp)
    layout: dict[str, Any] = {
        "n": n, "P": P, "R": R, "pad": pad, IDS: ids.dtype.str, MASK: mask.dtype.str, "shared": shared,
        "plen": plen.astype("<i4"), "rlen": rlen.astype("<i4"),
        "prompt": np.ascontiguousarray(prompt, dtype=tok).reshape(-1),
        "resp": np.ascontiguousarray(resp, dtype=tok).reshape(-1),
    }  # fmt: skip
    rest = {k: v for k, v in tensors.items() if k not in (IDS, MASK, RESPONSES)}
    layout[RESPONSES] = responses.dtype.str
    prompts = rest.get(PROMPTS)
    if _is_2d(prompts, (n, P), _TOKEN_KINDS) and _same(prompts, ids[:, :P]):
        layout[PROMPTS] = rest.pop(PROMPTS).dtype.str
    rmask = rest.get(RESPONSE_MASK)
    if _is_2d(rmask, (n, R), _TOKEN_KINDS):
        # with no padding the mask's response part is all ones: comparing with 1 reads one array, not two
        if bool((rmask == 1).all()) if full else _same(rmask, mask[:, P:]):
            layout[RESPONSE_MASK] = [rmask.dtype.str, None]
        elif (
            rmask.dtype.kind == "b" or not rmask.size or (rmask.min() >= 0 and rmask.max() <= 1)
        ) and _zero_outside(rmask, rout):
            bits = rmask if rbits is None else rmask[rbits]
            layout[RESPONSE_MASK] = [rmask.dtype.str, np.packbits(bits.astype(bool, copy=False).reshape(-1))]
        if RESPONSE_MASK in layout:
            del rest[RESPONSE_MASK]
    lp = rest.get(LOG_PROBS)
    if _is_2d(lp, (n, R), "f") and lp.dtype.itemsize in (2, 4, 8) and _zero_outside(lp, rout):
        layout[LOG_PROBS] = np.ascontiguousarray(lp if rbits is None else lp[rbits]).reshape(-1)
        del rest[LOG_PROBS]
    return layout, rest


# --- decoding -------------------------------------------------------------------------------------


def _int(layout: dict[str, Any], name: str, lo: int, hi: int) -> int:
    """An int field of the layout within [lo, hi]."""
    value = layout.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise DecodeError(f"compact batch: {name}={value!r:.40} is not an int in [{lo}, {hi}]")
    return value


@functools.lru_cache(maxsize=256)
def _parse_dtype(text: str, kinds: str) -> np.dtype | None:
    """The numpy dtype a wire dtype string names when it is a plain one of the given kinds, else None."""
    try:
        dt = np.dtype(text)
    except (TypeError, ValueError):
        return None
    return dt if dt.kind in kinds and dt.str == text and dt.fields is None else None


def _dtype(layout: dict[str, Any], name: str, kinds: str, value: Any = None) -> np.dtype:
    """A dtype-string field of the layout, of one of the given kinds."""
    text = layout.get(name) if value is None else value
    dt = _parse_dtype(text, kinds) if type(text) is str and len(text) < 8 else None
    if dt is None:
        raise DecodeError(f"compact batch: {name} dtype {text!r:.40} is not one of kinds {kinds!r}")
    return dt


def _vector(layout: dict[str, Any], name: str, size: int, kinds: str) -> np.ndarray:
    """A 1-d array field of the layout with `size` elements of one of the given kinds."""
    arr = layout.get(name)
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds:
        raise DecodeError(
            f"compact batch: {name} is {type(arr).__name__}, not a 1-d array of kinds {kinds!r}"
        )
    if arr.size != size:
        raise DecodeError(f"compact batch: {name} has {arr.size} values, expected {size}")
    return arr


def _lens(layout: dict[str, Any], name: str, n: int, most: int) -> list[int]:
    """Per-row lengths, each in [0, most]."""
    values: list[int] = _vector(layout, name, n, "iu").tolist()
    for v in values:
        if not 0 <= v <= most:
            raise DecodeError(f"compact batch: {name} holds {v}, outside [0, {most}]")
    return values


@functools.lru_cache(maxsize=64)
def _can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """np.can_cast(src, dst, "safe"), remembered per pair of dtypes."""
    return bool(np.can_cast(src, dst, "safe"))


@functools.lru_cache(maxsize=64)
def _one(dt: np.dtype) -> np.ndarray:
    """A read-only one-element array holding 1 (the buffer all-ones masks broadcast; nothing can write it)."""
    one = np.ones(1, dt)
    one.flags.writeable = False
    return one


def _padded(shape: tuple[int, int], pad: int, dt: np.dtype) -> np.ndarray:
    """An array of shape filled with pad (zeros come pre-cleared from the allocator: no pass to fill)."""
    return np.zeros(shape, dt) if pad == 0 else np.full(shape, pad, dt)


def _frozen(arr: np.ndarray) -> np.ndarray:
    """arr made read-only (decoded arrays are views of wire bytes elsewhere; consumers copy to write)."""
    arr.flags.writeable = False
    return arr


def _spread(flat: np.ndarray, out: np.ndarray, lens: list[int], right: bool) -> None:
    """Copy consecutive runs of flat into the rows of out: run i (lens[i] long) left-aligned, or
    right-aligned when right; one slice per row."""
    width, pos = out.shape[1], 0
    for i, k in enumerate(lens):
        if k:
            if right:
                out[i, width - k :] = flat[pos : pos + k]
            else:
                out[i, :k] = flat[pos : pos + k]
            pos += k


def rebuild(layout: Any, rest: dict[str, Any], max_cells: int) -> dict[str, np.ndarray]:
    """The tensors `split` was given, from its layout and the rest; max_cells bounds n * (P + R)."""
    if type(layout) is not dict:
        raise DecodeError(f"compact batch: layout is {type(layout).__name__}, not a map")
    n = _int(layout, "n", 0, max_cells)
    P = _int(layout, "P", 0, max_cells)
    R = _int(layout, "R", 0, max_cells)
    if n * (P + R) > max_cells:
        raise DecodeError(f"compact batch: n={n} x (P={P} + R={R}) cells exceed max_batch_cells={max_cells}")
    plen, rlen = _lens(layout, "plen", n, P), _lens(layout, "rlen", n, R)
    shared = layout.get("shared")
    if type(shared) is not bool or (shared and n and plen.count(plen[0]) != n):
        raise DecodeError(f"compact batch: shared={shared!r:.40} with prompt lengths {plen[:8]}")
    n_prompt = (plen[0] if n else 0) if shared else sum(plen)
    n_resp = sum(rlen)
    prompt = _vector(layout, "prompt", n_prompt, "iu")
    resp = _vector(layout, "resp", n_resp, "iu")
    ids_dt, mask_dt = _dtype(layout, IDS, _TOKEN_KINDS), _dtype(layout, MASK, _TOKEN_KINDS)
    full = n_resp == n * R and (n_prompt == P if shared else n_prompt == n * P)
    pad = layout.get("pad")
    if type(pad) is not int or not -_MAX_PAD < pad < _MAX_PAD:
        raise DecodeError(f"compact batch: pad={pad!r:.40} is not an int token id")
    for key in KNOWN_KEYS:
        if key in rest and (key in (IDS, MASK, RESPONSES) or key in layout):
            raise DecodeError(f"compact batch: tensor {key!r} is both in the layout and in the rest")
    for name, tokens in (("prompt", prompt), ("resp", resp)):
        if tokens.size and not _can_cast(tokens.dtype, ids_dt):  # (int32 ids into int64: always fit)
            lo, hi = int(tokens.min()), int(tokens.max())
            info = np.iinfo(ids_dt) if ids_dt.kind != "b" else np.iinfo(np.uint8)
            if lo < info.min or hi > (1 if ids_dt.kind == "b" else info.max):
                raise DecodeError(
                    f"compact batch: {name} holds ids in [{lo}, {hi}], outside input_ids dtype {ids_dt.str}"
                )
    # input_ids [n, P+R]: pad everywhere, then the attended prompt and response tokens.
    try:
        ids = np.empty((n, P + R), ids_dt) if full else _padded((n, P + R), pad, ids_dt)
    except OverflowError as exc:
        raise DecodeError(f"compact batch: pad={pad} does not fit input_ids dtype {ids_dt.str}") from exc
    if shared:
        ids[:, P - n_prompt : P] = prompt
    elif full:
        ids[:, :P] = prompt.reshape(n, P)
    else:
        _spread(prompt, ids[:, :P], plen, right=True)
    if full:
        ids[:, P:] = resp.reshape(n, R)
        # no padding: the mask is all ones, a read-only broadcast of one element (no bytes to write)
        mask = np.ndarray((n, P + R), mask_dt, _one(mask_dt), strides=(0, 0))
    else:
        _spread(resp, ids[:, P:], rlen, right=False)
        mask = np.zeros((n, P + R), mask_dt)
        for i in range(n):  # attended: the row's prompt (right-aligned) then its response (left-aligned)
            mask[i, P - plen[i] : P + rlen[i]] = 1
    out = dict(rest)
    out[IDS], out[MASK] = _frozen(ids), _frozen(mask)
    resp_dt = _dtype(layout, RESPONSES, _TOKEN_KINDS)
    out[RESPONSES] = _frozen(ids[:, P:] if resp_dt == ids_dt else ids[:, P:].astype(resp_dt))
    if PROMPTS in layout:
        dt = _dtype(layout, PROMPTS, _TOKEN_KINDS)
        out[PROMPTS] = _frozen(ids[:, :P] if dt == ids_dt else ids[:, :P].astype(dt))
    if RESPONSE_MASK in layout:
        out[RESPONSE_MASK] = _response_mask(layout[RESPONSE_MASK], mask[:, P:], rlen, n_resp, full)
    if LOG_PROBS in layout:
        lp = layout[LOG_PROBS]
        if not isinstance(lp, np.ndarray) or lp.ndim != 1 or lp.dtype.kind != "f" or lp.size != n_resp:
            raise DecodeError(f"compact batch: {LOG_PROBS} must be a 1-d float array of {n_resp} values")
        if full:
            out[LOG_PROBS] = lp.reshape(n, R)  # a read-only view of the wire bytes
        else:
            dense = np.zeros((n, R), lp.dtype)
            _spread(lp, dense, rlen, right=False)
            out[LOG_PROBS] = _frozen(dense)
    return out


def _response_mask(spec: Any, mask_part: np.ndarray, rlen: list[int], n_resp: int, full: bool) -> np.ndarray:
    """response_mask from its layout entry [dtype, None (= the attention mask's response part) | bits]."""
    if type(spec) is not list or len(spec) != 2:
        raise DecodeError(f"compact batch: {RESPONSE_MASK} must be [dtype, bits or nil], got {spec!r:.40}")
    dt = _dtype({}, RESPONSE_MASK, _TOKEN_KINDS, spec[0])
    bits = spec[1]
    if bits is None:
        return _frozen(mask_part if dt == mask_part.dtype else mask_part.astype(dt))
    if (
        not isinstance(bits, np.ndarray)
        or bits.dtype != np.uint8
        or bits.ndim != 1
        or bits.size != math.ceil(n_resp / 8)
    ):
        raise DecodeError(f"compact batch: {RESPONSE_MASK} bits must be {math.ceil(n_resp / 8)} uint8 bytes")
    flat = np.unpackbits(bits, count=n_resp).astype(dt)
    n, R = mask_part.shape
    if full:
        return _frozen(flat.reshape(n, R))
    dense = np.zeros((n, R), dt)
    _spread(flat, dense, rlen, right=False)
    return _frozen(dense)
