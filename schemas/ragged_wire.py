"""A RaggedBatch on the wire (schemas 4 and 5): the list of its parts, [prompt_lens, response_lens,
prompt_ids, response_ids, tokens, rows, non_tensors, meta_info], written and read back.

Lengths are msgpack int lists; the ids, each tokens array and each 1-d rows array (their sizes given by the
lengths) are [dtype code, bin (inline) | int (index of field a<i>)], other rows arrays flat array headers; a
non_tensors value is the list of a 1-d object array's n values, a flat array header (numeric), or an object
array ext (any other shape). A RolloutSample's full_batch is this list right in the payload (schema 5); a
ragged batch anywhere else travels in the payload codec's EXT_RAGGED_BATCH (schemas/payload.py). Reading
makes every check of RaggedBatch.check where the part is read, and views the entry's bytes (no copy).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgpack
import numpy as np

from schemas.arrays import CODE_DTYPES, NUMPY_CODES, WIRE_KINDS, array_from_flat
from schemas.errors import DecodeError
from schemas.ragged import RaggedBatch

#: Arrays under this many bytes travel inline (in the payload), larger ones as their own raw field.
INLINE_MAX_BYTES = 1024


class Packing(Protocol):
    """What writing a ragged batch needs of the payload packer (schemas/payload.py `Packer`)."""

    out_of_band: bool
    buffers: list[memoryview]

    def array(self, obj: Any) -> bytes | msgpack.ExtType:
        """A numeric array as its flat header (+ inline data), or an ext for dtypes without a code."""
        ...

    def object_array(self, arr: np.ndarray) -> msgpack.ExtType:
        """An object array of any shape as an ext holding [shape, values]."""
        ...


class ReadLimits(Protocol):
    """The decode limit reading a ragged batch needs."""

    @property
    def max_bin_len(self) -> int:
        """Most bytes of one inline array."""
        ...


class Reading(Protocol):
    """What reading a ragged batch needs of the payload unpacker (schemas/payload.py `Unpacker`)."""

    @property
    def limits(self) -> ReadLimits:
        """The decode limits."""
        ...

    def field(self, ref: Any) -> Any:
        """The raw bytes of out-of-band field a<ref>, or inline bytes as given."""
        ...


# --- writing --------------------------------------------------------------------------------------------


def _pack_vector(p: Packing, arr: Any) -> list[Any] | None:
    """[dtype code, data] of a 1-d numeric array whose size the lengths give: its bytes inline, or the
    index of the field carrying them; None for anything else."""
    if type(arr) is not np.ndarray or arr.ndim != 1:
        return None
    code = NUMPY_CODES.get(arr.dtype)
    if code is None:
        return None
    if arr.nbytes < INLINE_MAX_BYTES:
        return [code, arr.tobytes()]  # (C order, whatever the strides)
    data = memoryview(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)).cast("B")  # type: ignore[arg-type]
    if not p.out_of_band:
        return [code, data]
    p.buffers.append(data)
    return [code, len(p.buffers) - 1]


def ragged_parts(p: Packing, obj: RaggedBatch) -> list[Any]:
    """A ragged batch as its lengths (int lists) and 1-d arrays, [prompt_lens, response_lens, prompt_ids,
    response_ids, tokens, rows, non_tensors, meta_info]: no layout to find, nothing padded."""
    vector = _pack_vector
    try:
        prompt, resp = vector(p, obj.prompt_ids), vector(p, obj.response_ids)
        tokens = {key: vector(p, arr) for key, arr in obj.tokens.items()}
        if prompt is None or resp is None or None in tokens.values():
            raise TypeError("ragged batch: ids and tokens arrays must be 1-d numeric numpy arrays")
        array = p.array
        return [
            obj.prompt_lens.tolist(),
            obj.response_lens.tolist(),
            prompt,
            resp,
            tokens,
            {key: vector(p, arr) or array(arr) for key, arr in obj.rows.items()},
            _pack_non_tensors(p, obj),
            obj.meta_info,
        ]
    except (TypeError, AttributeError):
        obj.check()  # a batch mutated after construction: names the bad field
        raise


def _pack_non_tensors(p: Packing, obj: RaggedBatch) -> dict[str, Any]:
    """Per-row arrays of a ragged batch: a 1-d object array as the list of its values, a numeric one as
    its flat header, any other object array as an EXT_OBJECT_ARRAY."""
    out: dict[str, Any] = {}
    for key, arr in obj.non_tensors.items():
        if type(arr) is not np.ndarray:
            obj.check()  # names the bad key
            raise TypeError(f"RaggedBatch non_tensors[{key!r}] is not a numpy array")
        if not arr.dtype.hasobject:
            out[key] = p.array(arr)
        elif arr.ndim == 1:
            out[key] = arr.tolist()
        else:
            out[key] = p.object_array(arr)
    return out


# --- reading --------------------------------------------------------------------------------------------


def _vector(u: Reading, spec: Any, count: int, name: str, kinds: str, key: str | None = None) -> np.ndarray:
    """A 1-d array of a ragged batch (schema 4 or 5) from its [dtype code, data], `count` values (the
    lengths' sum) of a numpy dtype of one of the kinds ("iu" or WIRE_KINDS); a view of the data, no copy.
    The part is named `name`, or `name[key]` in a map."""
    if type(spec) is list and len(spec) == 2:
        code, data = spec
        known = _VECTOR_DTYPES[kinds].get(code) if type(code) is int else None
        if known is not None:
            if type(data) is not bytes:
                data = u.field(data)
            if len(data) == count * known[1]:
                return np.frombuffer(data, known[0])
    return _bad_vector(u, spec, count, name if key is None else f"{name}[{key!r}]", kinds)

def _bad_vector(u: Reading, spec: Any, count: int, name: str, kinds: str) -> np.ndarray:
    """_vector's checks one by one, raising DecodeError naming the field and the value that failed."""
    if type(spec) is not list or len(spec) != 2:
        raise DecodeError(f"ragged batch: {name} must be [dtype code, data], got {type(spec).__name__}")
    code, data = spec
    dtype = CODE_DTYPES.get(code) if type(code) is int else None
    if dtype is None or dtype.kind not in kinds:
        raise DecodeError(
            f"ragged batch: {name} must be a 1-d {'integer' if kinds == 'iu' else 'numeric'} "
            f"array, got dtype code {code!r:.20}{f' ({dtype.str})' if dtype else ''}"
        )
    if type(data) is not bytes:
        data = u.field(data)
    if len(data) != count * dtype.itemsize:
        raise DecodeError(
            f"ragged batch: {name} has {len(data) / dtype.itemsize:g} values ({len(data)} bytes "
            f"of {dtype.str}), the lengths say {count}"
        )
    return np.frombuffer(data, dtype)  # (not reached: _vector took it)

def _rows(u: Reading, arrays: Any, n: int) -> dict[str, np.ndarray]:
    """A ragged batch's per-row numeric arrays: [dtype code, data] for a 1-d one (n values), a flat array
    header for any other shape (first dimension n)."""
    if type(arrays) is not dict:
        raise DecodeError("malformed ragged batch ext: rows must be a map")
    for key, value in arrays.items():
        if type(key) is not str:
            raise DecodeError(f"ragged batch: rows key {key!r:.40} is not a str")
        if type(value) is list:
            arrays[key] = _vector(u, value, n, "rows", WIRE_KINDS, key)
        else:
            arrays[key] = _row_array(u, value, n, "rows", key)
    return arrays

def _non_tensors(u: Reading, arrays: Any, n: int) -> dict[str, np.ndarray]:
    """A ragged batch's per-row object arrays: a list is a 1-d object array's n values (each kept as it
    is, never broadcast); a flat array header or an object array ext any other (first dimension n)."""
    if type(arrays) is not dict:
        raise DecodeError("malformed ragged batch ext: non_tensors must be a map")
    fromiter = np.fromiter
    for key, value in arrays.items():
        if type(key) is not str:
            raise DecodeError(f"ragged batch: non_tensors key {key!r:.40} is not a str")
        if type(value) is list and len(value) == n:
            arrays[key] = fromiter(value, object, n)
        else:
            arrays[key] = _row_array(u, value, n, "non_tensors", key)
    return arrays

def _row_array(u: Reading, value: Any, n: int, group: str, key: str) -> np.ndarray:
    """A per-row array of a ragged batch given as a flat array header (or an already decoded array ext):
    first dimension n, and a numeric dtype in rows; else DecodeError naming it and what it got."""
    rows = group == "rows"
    arr = array_from_flat(value, u.field, u.limits.max_bin_len) if type(value) is bytes else value
    if type(arr) is not np.ndarray or arr.shape[:1] != (n,) or (rows and arr.dtype.hasobject):
        what = (
            f"{arr.dtype.str}{list(arr.shape)[:4]}"
            if isinstance(arr, np.ndarray)
            else f"{len(arr)} values"
            if type(arr) is list
            else type(arr).__name__
        )
        raise DecodeError(
            f"ragged batch: {group}[{key!r:.40}] must have first dimension n={n}"
            f"{' and a numeric dtype' if rows else ''}, got {what}"
        )
    return arr

def ragged_batch(u: Reading, parts: list[Any]) -> RaggedBatch:
    """A RolloutSample's full_batch (schema 5) from its list of parts (as an EXT_RAGGED_BATCH holds)."""
    if len(parts) != 8:
        raise DecodeError(f"malformed ragged batch: full_batch has {len(parts)} parts, not 8")
    return ragged_from_parts(u, *parts)

def ragged_from_parts(
    u: Reading,
    plen: Any,
    rlen: Any,
    prompt: Any,
    resp: Any,
    tokens: Any,
    rows: Any,
    non_tensors: Any,
    meta_info: Any,
) -> RaggedBatch:
    """A RaggedBatch from its parts (schema 4 or 5). The checks of RaggedBatch.check, each made where the
    part is read: lengths are lists of non-negative int32s, one prompt length or n, every array's size
    agrees with the lengths, per-row arrays have first dimension n, rows are numeric."""
    if type(rlen) is list and type(plen) is list and _int32s(rlen + plen):
        response_lens, prompt_lens = rlen, plen
    else:
        response_lens, prompt_lens = _lengths(rlen, "response_lens"), _lengths(plen, "prompt_lens")
    n = len(response_lens)
    if len(prompt_lens) != 1 and len(prompt_lens) != n or (n == 0 and prompt_lens):
        raise DecodeError(
            f"ragged batch: prompt_lens has {len(prompt_lens)} entries, expected 1 (shared) or n={n}"
        )
    if type(tokens) is not dict or type(meta_info) is not dict:
        raise DecodeError("malformed ragged batch ext: tokens and meta_info must be maps")
    n_resp, vector = sum(response_lens), _vector
    batch = _new_batch(RaggedBatch)
    batch.prompt_ids = vector(u, prompt, sum(prompt_lens), "prompt_ids", "iu")
    batch.response_ids = vector(u, resp, n_resp, "response_ids", "iu")
    for key, spec in tokens.items():
        if type(key) is not str:
            raise DecodeError(f"ragged batch: tokens key {key!r:.40} is not a str")
        tokens[key] = vector(u, spec, n_resp, "tokens", WIRE_KINDS, key)
    batch.tokens, batch.meta_info = tokens, meta_info
    batch.rows = _rows(u, rows, n)
    batch.non_tensors = _non_tensors(u, non_tensors, n)
    # (RaggedBatch.adopt's contract: every check of RaggedBatch.check made above)
    batch.prompt_lens = np.array(prompt_lens, np.int32)
    batch.response_lens = np.array(response_lens, np.int32)
    return batch


INT32_MAX = (1 << 31) - 1
# per kinds a ragged batch's vector may have ("iu": ids, WIRE_KINDS: any numeric): code -> (dtype, itemsize)
_VECTOR_DTYPES: dict[str, dict[int, tuple[np.dtype, int]]] = {
    kinds: {code: (dt, dt.itemsize) for code, dt in CODE_DTYPES.items() if dt.kind in kinds}
    for kinds in ("iu", WIRE_KINDS)
}
_new_batch = object.__new__
_INT = {int}


def _int32s(values: list[Any]) -> bool:
    """Whether every value of a list is an int (exactly) in [0, 2**31)."""
    return not values or (set(map(type, values)) == _INT and min(values) >= 0 and max(values) <= INT32_MAX)


def _lengths(value: Any, name: str) -> list[int]:
    """A ragged batch's length list (schema 4 or 5): ints in [0, 2**31)."""
    if type(value) is not list or not _int32s(value):
        shown = value[:8] if type(value) is list else value
        raise DecodeError(f"ragged batch: {name} must be a list of ints in [0, 2**31), got {shown!r:.80}")
    return value
