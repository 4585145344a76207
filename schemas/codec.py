# Over 400 lines on purpose: the one bytes boundary; the packer and the unpacker mirror each other ext by ext.
"""The one codec: events <-> Redis stream entry fields, and plain values <-> msgpack bytes.

Entry layout (XADD field order): human-readable header fields (`type`, `schema`, then per-event ones),
`payload` (msgpack map of the model's fields), then raw array fields `a0`, `a1`, ... (one array each).
An array is described by a flat fixed-size header (`schemas.arrays.pack_head`: dtype code, ndim, dims)
followed by its bytes inline (< INLINE_MAX_BYTES) or by the index of the field carrying them. In a DataProto's
tensors map the header is the value itself (a bin); a ragged batch sends its 1-d arrays as [dtype code, data],
their sizes given by its lengths (msgpack int lists): a RolloutSample's full_batch as a list of its parts
right in the payload (schema 5, no ext to unpack twice), a ragged batch anywhere else (and schema 4's
full_batch) as an EXT_RAGGED_BATCH holding that list; anywhere else the header is the body of an
EXT_FLAT_ARRAY ExtType. Object arrays are [shape, values] lists in a DataProto's non_tensors map (a ragged
batch's 1-d ones: their values). Dtypes without a code use the msgpack-bodied EXT_ARRAY; that and
EXT_OBJECT_ARRAY stay decodable everywhere. Decoding views the entry's bytes (no copy), unpacks with explicit
size limits, and validates with pydantic; what only older encoders wrote (the ext types of schemas 2 and 3,
and every old payload's upgrade) is read by schemas/legacy.py, which this module asks only for a code or a
schema version it does not write.
An entry is refused as a whole when it is over `Limits.max_entry_bytes`, holds a field the encoder would
not write (unknown names, array fields the payload never references), or has a readable header field
that disagrees with the payload (the header is what `redis-cli` and the audit read, so it must not lie).
Every failure is a `DecodeError` with a short reason. No pickle, ever.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from schemas.arrays import (
    CODE_DTYPES,
    NUMPY_CODES,
    WIRE_KINDS,
    array_from_flat,
    array_from_wire,
    array_to_wire,
    check_shape,
    flat_array,
    is_torch_tensor,
    pack_head,
)
from schemas.batch import DataProto
from schemas.errors import DecodeError, as_decode_error
from schemas.events import EVENT_MODELS, DeadLetter, Event, EventBase, RolloutSample
from schemas.legacy import LEGACY_EXTS, upgrade
from schemas.ragged import RaggedBatch

# Ext type codes inside the payload.
EXT_ARRAY = 1  # packed [dtype str, shape, bin (inline) | int (index of field a<i>)]
EXT_OBJECT_ARRAY = 2  # packed [shape, flat list of msgpack values] -> numpy object array
# packed [tensors, non_tensors, meta_info] maps; a tensors value may be a bin holding a flat array header
# (schemas.arrays.pack_head, + inline data), a non_tensors value a list [shape, flat values] of an object
# array.
EXT_DATAPROTO = 3
EXT_BYTES = 4  # packed int: index of the raw field a<i> holding a bytes value
EXT_FLAT_ARRAY = 5  # flat header (schemas.arrays.pack_head) + inline bytes, or + uint32 index of field a<i>
# (codes 6 and 7: schemas 2 and 3's rollout batches, read only by schemas/legacy.py)
# packed [prompt_lens, response_lens, prompt_ids, response_ids, tokens, rows, non_tensors, meta_info]: a
# RaggedBatch (schema 4's full_batch; from schema 5 on that list is the full_batch value itself, unpacked with
# the payload, and the ext only carries a RaggedBatch found anywhere else). Lengths are msgpack int lists; the
# ids, each tokens array and each 1-d rows array (their sizes given by the lengths) are [dtype code, bin
# (inline) | int (index of field a<i>)], other rows arrays flat array headers; a non_tensors value is the list
# of a 1-d object array's n values, a flat array header (numeric), or an EXT_OBJECT_ARRAY (any other shape).
EXT_RAGGED_BATCH = 8

INLINE_MAX_BYTES = 1024
PAYLOAD_FIELD = "payload"
ARRAY_FIELD_PREFIX = "a"

MiB = 1 << 20
# (bytes, str) names of the first raw array fields, as redis-py returns them and as encode() builds them.
_FIELD_NAMES = tuple((f"{ARRAY_FIELD_PREFIX}{i}".encode(), f"{ARRAY_FIELD_PREFIX}{i}") for i in range(256))

# Values an object array holds as they are when assigned as a whole (none is a sequence).
_SCALARS = frozenset({str, int, float, bool, type(None)})

# Entry fields as redis-py returns them (bytes keys) or as encode() builds them (str keys).
Fields = Mapping[bytes, Any] | Mapping[str, Any]
E = TypeVar("E", bound=EventBase)


@dataclass(frozen=True)
class Limits:
    """Decode limits: sizes msgpack may allocate for, and how deep ext types may nest."""

    max_bin_len: int = 64 * MiB
    max_str_len: int = 16 * MiB
    max_array_len: int = 1 << 20
    max_map_len: int = 1 << 16
    max_ext_len: int = 64 * MiB
    max_payload_bytes: int = 256 * MiB
    max_field_bytes: int = 4096 * MiB
    max_entry_bytes: int = 4096 * MiB  # all field names and values of one entry together
    max_depth: int = 8


DEFAULT_LIMITS = Limits()


# --- packing ------------------------------------------------------------------------------------


class _OutOfBand:
    """Marks a bytes value to travel as its own raw field when large (dead-letter originals)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        """Wrap the bytes."""
        self.data = data


def _ext_type(code: int, data: bytes) -> msgpack.ExtType:
    """msgpack.ExtType(code, data) without its argument checks (code and data come from this module)."""
    return tuple.__new__(msgpack.ExtType, (code, data))


class _Packer:
    """msgpack packer that turns arrays, DataProto and RaggedBatch into ExtTypes, collecting out-of-band
    buffers."""

    def __init__(self, out_of_band: bool) -> None:
        """out_of_band=False inlines every array (for standalone payload bytes)."""
        self.out_of_band = out_of_band
        self.buffers: list[memoryview] = []

    def pack(self, obj: Any) -> bytes:
        """Pack one value."""
        packed: bytes = msgpack.packb(obj, default=self._default, use_bin_type=True)
        return packed

    def _ref(self, data: memoryview) -> memoryview | int:
        """Inline small buffers; give large ones a field index."""
        if not self.out_of_band or data.nbytes < INLINE_MAX_BYTES:
            return data
        self.buffers.append(data)
        return len(self.buffers) - 1

    def _array(self, obj: Any) -> bytes | msgpack.ExtType:
        """A numeric array or tensor as its flat header (+ inline data), or an EXT_ARRAY for dtypes without a
        code."""
        # the usual case, without building strings
        if type(obj) is np.ndarray and obj.dtype.kind in WIRE_KINDS:
            big = self.out_of_band and obj.nbytes >= INLINE_MAX_BYTES
            flat = flat_array(obj, len(self.buffers) if big else None)
            if flat is not None:
                if big:
                    self.buffers.append(flat[1])
                    return flat[0]
                return flat[0] + flat[1]
        dtype, shape, data = array_to_wire(obj)
        if self.out_of_band and data.nbytes >= INLINE_MAX_BYTES:
            head = pack_head(dtype, shape, len(self.buffers))
            self.buffers.append(data)
            if head is not None:
                return head
            return _ext_type(EXT_ARRAY, self.pack([dtype, shape, len(self.buffers) - 1]))
        head = pack_head(dtype, shape, None)
        if head is not None:
            return head + data
        return _ext_type(EXT_ARRAY, self.pack([dtype, shape, data]))

    def _dataproto(self, obj: DataProto) -> msgpack.ExtType:
        """DataProto as [tensors: {name: flat header bin}, non_tensors: {name: [shape, values] | array},
        meta]."""
        return _ext_type(EXT_DATAPROTO, self.pack(self._parts(obj, obj.tensors)))

    def _vector(self, arr: Any) -> list[Any] | None:
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
        if not self.out_of_band:
            return [code, data]
        self.buffers.append(data)
        return [code, len(self.buffers) - 1]

    def ragged_parts(self, obj: RaggedBatch) -> list[Any]:
        """A ragged batch as its lengths (int lists) and 1-d arrays, [prompt_lens, response_lens, prompt_ids,
        response_ids, tokens, rows, non_tensors, meta_info]: no layout to find, nothing padded."""
        vector = self._vector
        try:
            prompt, resp = vector(obj.prompt_ids), vector(obj.response_ids)
            tokens = {key: vector(arr) for key, arr in obj.tokens.items()}
            if prompt is None or resp is None or None in tokens.values():
                raise TypeError("ragged batch: ids and tokens arrays must be 1-d numeric numpy arrays")
            array = self._array
            return [
                obj.prompt_lens.tolist(),
                obj.response_lens.tolist(),
                prompt,
                resp,
                tokens,
                {key: vector(arr) or array(arr) for key, arr in obj.rows.items()},
                self._ragged_non_tensors(obj),
                obj.meta_info,
            ]
        except (TypeError, AttributeError):
            obj.check()  # a batch mutated after construction: names the bad field
            raise

    def _ragged(self, obj: RaggedBatch) -> msgpack.ExtType:
        """A ragged batch anywhere but a RolloutSample's full_batch: its parts in an EXT_RAGGED_BATCH."""
        return _ext_type(EXT_RAGGED_BATCH, self.pack(self.ragged_parts(obj)))

    def _ragged_non_tensors(self, obj: RaggedBatch) -> dict[str, Any]:
        """Per-row arrays of a ragged batch: a 1-d object array as the list of its values, a numeric one as
        its flat header, any other object array as an EXT_OBJECT_ARRAY."""
        out: dict[str, Any] = {}
        for key, arr in obj.non_tensors.items():
            if type(arr) is not np.ndarray:
                obj.check()  # names the bad key
                raise TypeError(f"RaggedBatch non_tensors[{key!r}] is not a numpy array")
            if not arr.dtype.hasobject:
                out[key] = self._array(arr)
            elif arr.ndim == 1:
                out[key] = arr.tolist()
            else:
                out[key] = _ext_type(EXT_OBJECT_ARRAY, self.pack([list(arr.shape), arr.reshape(-1).tolist()]))
        return out

    def _parts(self, obj: DataProto, tensors_in: Mapping[str, Any]) -> list[Any]:
        """[tensors, non_tensors, meta_info] of a batch, tensors taken from tensors_in."""
        tensors: dict[str, Any] = {}
        array = self._array
        for key, arr in tensors_in.items():
            if not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
                obj._check()  # names the bad key; a batch mutated after construction must not reach the wire
                raise TypeError(f"DataProto tensors[{key!r}] is not a numeric numpy array")
            tensors[key] = array(arr)
        return [tensors, self._non_tensors(obj.non_tensors, obj), obj.meta_info]

    @staticmethod
    def _non_tensors(arrays: Mapping[str, Any], obj: DataProto | RaggedBatch) -> dict[str, Any]:
        """Per-row object arrays as [shape, values] lists (numeric ones as arrays)."""
        out: dict[str, Any] = {}
        for key, arr in arrays.items():
            if not isinstance(arr, np.ndarray):
                if isinstance(obj, RaggedBatch):
                    obj.check()  # names the bad key
                else:
                    obj._check()
                raise TypeError(f"{type(obj).__name__} non_tensors[{key!r}] is not a numpy array")
            out[key] = [list(arr.shape), arr.reshape(-1).tolist()] if arr.dtype.hasobject else arr
        return out

    def _default(self, obj: Any) -> Any:
        """Encode what msgpack does not know natively."""
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            flat = self._array(obj)
            return _ext_type(EXT_FLAT_ARRAY, flat) if isinstance(flat, bytes) else flat
        if isinstance(obj, RaggedBatch):
            return self._ragged(obj)
        if isinstance(obj, DataProto):
            return self._dataproto(obj)
        if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
            return _ext_type(EXT_OBJECT_ARRAY, self.pack([list(obj.shape), obj.reshape(-1).tolist()]))
        if isinstance(obj, np.ndarray) or is_torch_tensor(obj):
            flat = self._array(obj)
            return _ext_type(EXT_FLAT_ARRAY, flat) if isinstance(flat, bytes) else flat
        if isinstance(obj, _OutOfBand):
            ref = self._ref(memoryview(obj.data).cast("B"))
            return _ext_type(EXT_BYTES, self.pack(ref)) if isinstance(ref, int) else ref
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(
            f"cannot encode {type(obj).__name__} (allowed: msgpack values, numpy, torch, DataProto, "
            "RaggedBatch)"
        )


# --- unpacking ----------------------------------------------------------------------------------


class _Unpacker:
    """msgpack unpacker with limits that resolves ExtTypes, viewing out-of-band fields without copying."""

    __slots__ = ("fields", "limits", "depth", "used")

    def __init__(self, fields: Fields | None, limits: Limits) -> None:
        """fields: the entry's fields by bytes or str name (None outside an entry)."""
        self.fields = fields
        self.limits = limits
        self.depth = 0
        # names (str and bytes) of the out-of-band fields the payload referenced
        self.used: set[str | bytes] = set()

    def unpack(self, data: bytes) -> Any:
        """Unpack one value with the configured limits."""
        lim = self.limits
        if self.depth >= lim.max_depth:
            raise DecodeError(f"payload nests deeper than {lim.max_depth} ext levels")
        self.depth += 1
        try:
            return msgpack.unpackb(
                data,
                ext_hook=self._ext,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_bin_len=lim.max_bin_len,
                max_str_len=lim.max_str_len,
                max_array_len=lim.max_array_len,
                max_map_len=lim.max_map_len,
                max_ext_len=lim.max_ext_len,
            )
        finally:
            self.depth -= 1

    def field(self, ref: Any) -> Any:
        """The raw bytes of out-of-band field a<ref> (bytes or a byte memoryview), or inline bytes as
        given."""
        if type(ref) is not int:
            if isinstance(ref, bytes):
                return ref
            raise DecodeError(f"array data must be bytes or a field index, got {type(ref).__name__}")
        fields = self.fields
        if fields is None:
            raise DecodeError("out-of-band array reference outside a stream entry")
        if 0 <= ref < len(_FIELD_NAMES):
            bname, name = _FIELD_NAMES[ref]
        else:
            name = f"{ARRAY_FIELD_PREFIX}{ref}"
            bname = name.encode()
        data = fields.get(bname)  # type: ignore[call-overload]
        if data is None:
            data = fields.get(name)  # type: ignore[call-overload]
            if data is None:
                raise DecodeError(f"missing array field {name!r}")
        self.used.add(name)
        self.used.add(bname)
        if type(data) is not bytes:
            try:
                data = memoryview(data).cast("B")
            except TypeError as exc:
                raise DecodeError(f"field {name!r} is {type(data).__name__}, not bytes") from exc
        if len(data) > self.limits.max_field_bytes:
            raise DecodeError(
                f"field {name!r} is {len(data)} bytes, over the {self.limits.max_field_bytes} limit"
            )
        return data

    def unpack_list(self, data: bytes, size: int, what: str) -> list[Any]:
        """Unpack an ext body that must be a list of `size` items."""
        value = self.unpack(data)
        if type(value) is not list or len(value) != size:
            raise DecodeError(f"malformed {what} ext")
        return value

    def _object_array(self, value: Any) -> np.ndarray:
        """Object array from its unpacked [shape, flat values]."""
        if type(value) is not list or len(value) != 2:
            raise DecodeError("malformed object array ext")
        shape_in, values = value
        shape = check_shape(shape_in)
        if type(values) is not list or math.prod(shape) != len(values):
            raise DecodeError(f"object array of shape {list(shape)[:8]} has {len(values)} values")
        out = np.empty(len(values), dtype=object)
        if set(map(type, values)) <= _SCALARS:
            out[:] = values  # (no value is a sequence numpy would broadcast)
        else:
            for i, v in enumerate(values):
                out[i] = v
        return out if len(shape) == 1 else out.reshape(shape)

    def _ext(self, code: int, data: bytes) -> Any:
        """Resolve one ExtType."""
        if code == EXT_RAGGED_BATCH:
            return self._ragged(*self.unpack_list(data, 8, "ragged batch"))
        if code == EXT_FLAT_ARRAY:
            # Inline array data is bin data, so max_bin_len bounds it as it bounds a msgpack bin.
            return array_from_flat(data, self.field, self.limits.max_bin_len)
        if code == EXT_ARRAY:
            dtype, shape, ref = self.unpack_list(data, 3, "array")
            return array_from_wire(dtype, shape, self.field(ref))
        if code == EXT_OBJECT_ARRAY:
            return self._object_array(self.unpack(data))
        if code == EXT_DATAPROTO:
            return self._dataproto(*self.unpack_list(data, 3, "DataProto"))
        if code == EXT_BYTES:
            raw = self.field(self.unpack(data))
            return raw if isinstance(raw, bytes) else bytes(raw)
        legacy = LEGACY_EXTS.get(code)  # an ext only older encoders wrote (schemas/legacy.py)
        if legacy is None:
            raise DecodeError(f"unknown msgpack ext type {code}")
        return legacy(self, data)

    def parts(self, tensors: Any, non_tensors: Any, meta_info: Any, what: str) -> tuple[dict[str, Any], ...]:
        """(tensors, non_tensors, meta_info) maps with their arrays decoded (tensors: flat array headers, or
        older writers' array ExtTypes; non_tensors: an object array's [shape, values])."""
        if not (type(tensors) is dict and type(non_tensors) is dict and type(meta_info) is dict):
            raise DecodeError(f"malformed {what} ext: parts must be maps")
        field, max_inline = self.field, self.limits.max_bin_len
        for key, value in tensors.items():
            if type(value) is bytes:
                tensors[key] = array_from_flat(value, field, max_inline)
        for key, value in non_tensors.items():
            if type(value) is list:
                non_tensors[key] = self._object_array(value)
        return tensors, non_tensors, meta_info

    def _dataproto(self, tensors: Any, non_tensors: Any, meta_info: Any) -> DataProto:
        """A DataProto from its unpacked parts."""
        return DataProto.adopt(*self.parts(tensors, non_tensors, meta_info, "DataProto"))

    def _vector(self, spec: Any, count: int, name: str, kinds: str, key: str | None = None) -> np.ndarray:
        """A 1-d array of a ragged batch (schema 4 or 5) from its [dtype code, data], `count` values (the
        lengths' sum) of a numpy dtype of one of the kinds ("iu" or WIRE_KINDS); a view of the data, no copy.
        The part is named `name`, or `name[key]` in a map."""
        if type(spec) is list and len(spec) == 2:
            code, data = spec
            known = _VECTOR_DTYPES[kinds].get(code) if type(code) is int else None
            if known is not None:
                if type(data) is not bytes:
                    data = self.field(data)
                if len(data) == count * known[1]:
                    return np.frombuffer(data, known[0])
        return self._bad_vector(spec, count, name if key is None else f"{name}[{key!r}]", kinds)

    def _bad_vector(self, spec: Any, count: int, name: str, kinds: str) -> np.ndarray:
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
            data = self.field(data)
        if len(data) != count * dtype.itemsize:
            raise DecodeError(
                f"ragged batch: {name} has {len(data) / dtype.itemsize:g} values ({len(data)} bytes "
                f"of {dtype.str}), the lengths say {count}"
            )
        return np.frombuffer(data, dtype)  # (not reached: _vector took it)

    def _rows(self, arrays: Any, n: int) -> dict[str, np.ndarray]:
        """A ragged batch's per-row numeric arrays: [dtype code, data] for a 1-d one (n values), a flat array
        header for any other shape (first dimension n)."""
        if type(arrays) is not dict:
            raise DecodeError("malformed ragged batch ext: rows must be a map")
        for key, value in arrays.items():
            if type(key) is not str:
                raise DecodeError(f"ragged batch: rows key {key!r:.40} is not a str")
            if type(value) is list:
                arrays[key] = self._vector(value, n, "rows", WIRE_KINDS, key)
            else:
                arrays[key] = self._row_array(value, n, "rows", key)
        return arrays

    def _non_tensors(self, arrays: Any, n: int) -> dict[str, np.ndarray]:
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
                arrays[key] = self._row_array(value, n, "non_tensors", key)
        return arrays

    def _row_array(self, value: Any, n: int, group: str, key: str) -> np.ndarray:
        """A per-row array of a ragged batch given as a flat array header (or an already decoded array ext):
        first dimension n, and a numeric dtype in rows; else DecodeError naming it and what it got."""
        rows = group == "rows"
        arr = array_from_flat(value, self.field, self.limits.max_bin_len) if type(value) is bytes else value
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

    def ragged_batch(self, parts: list[Any]) -> RaggedBatch:
        """A RolloutSample's full_batch (schema 5) from its list of parts (as an EXT_RAGGED_BATCH holds)."""
        if len(parts) != 8:
            raise DecodeError(f"malformed ragged batch: full_batch has {len(parts)} parts, not 8")
        return self._ragged(*parts)

    def _ragged(
        self,
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
        n_resp, vector = sum(response_lens), self._vector
        batch = _new_batch(RaggedBatch)
        batch.prompt_ids = vector(prompt, sum(prompt_lens), "prompt_ids", "iu")
        batch.response_ids = vector(resp, n_resp, "response_ids", "iu")
        for key, spec in tokens.items():
            if type(key) is not str:
                raise DecodeError(f"ragged batch: tokens key {key!r:.40} is not a str")
            tokens[key] = vector(spec, n_resp, "tokens", WIRE_KINDS, key)
        batch.tokens, batch.meta_info = tokens, meta_info
        batch.rows = self._rows(rows, n)
        batch.non_tensors = self._non_tensors(non_tensors, n)
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


# --- public API ---------------------------------------------------------------------------------


def _header_bytes(value: Any) -> bytes:
    """Render a header value as readable bytes."""
    if type(value) is int:
        return str(value).encode()
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return b"1" if value else b"0"
    return str(value).encode()


def encode(event: EventBase) -> dict[str, bytes | memoryview]:
    """XADD fields for an event: header fields, then `payload`, then raw array fields a0, a1, …"""
    packer = _Packer(out_of_band=True)
    body = dict(event.__dict__)  # a model's fields, in order (extra="forbid": nothing else is in there)
    if type(event) is RolloutSample:
        body["full_batch"] = packer.ragged_parts(event.full_batch)  # (schema 5: in the payload, no ext)
    if isinstance(event, DeadLetter):
        body["fields"] = {k: _OutOfBand(v) for k, v in event.fields.items()}
    payload = packer.pack(body)
    out: dict[str, bytes | memoryview] = {
        "type": event.type.encode(),
        "schema": str(body["schema_version"]).encode(),
    }
    for name, attr in _header_names(type(event)):  # event.header(), rendered
        value = getattr(event, attr)
        out[name] = value.encode() if type(value) is str else _header_bytes(value)
    out[PAYLOAD_FIELD] = payload
    for i, buf in enumerate(packer.buffers):
        out[_FIELD_NAMES[i][1] if i < len(_FIELD_NAMES) else f"{ARRAY_FIELD_PREFIX}{i}"] = buf
    return out


def _get(fields: Fields, bname: bytes, name: str) -> Any:
    """A field's value by its bytes name (as redis-py returns it) or str name (as encode() builds it)."""
    value = fields.get(bname)  # type: ignore[call-overload]
    return fields.get(name) if value is None else value  # type: ignore[call-overload]


def _text(value: Any) -> str:
    """A header value as str."""
    if type(value) is bytes:
        return value.decode()
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode()
    return str(value)


def _field_name(name: Any) -> str:
    """An entry field name as text (undecodable bytes as escapes, so a reason can show them)."""
    return name.decode(errors="backslashreplace") if isinstance(name, bytes) else str(name)


def _check_entry_size(fields: Fields, limits: Limits) -> None:
    """Refuse an entry whose names and values together exceed limits.max_entry_bytes (bytes, bytearray,
    memoryview and str values count their len(), any other 0). The usual entry is summed in one pass of
    len() over names and values: never less than that count, so at or under the limit it passes at once;
    otherwise (over it, or a value without len()) each value is counted by its type."""
    try:
        if sum(map(len, fields)) + sum(map(len, fields.values())) <= limits.max_entry_bytes:
            return
    except (TypeError, ValueError, OverflowError):  # a value len() refuses: counted by type below
        pass
    total = 0
    for name, value in fields.items():
        total += len(name) + (len(value) if isinstance(value, bytes | bytearray | memoryview | str) else 0)
    if total > limits.max_entry_bytes:
        raise DecodeError(f"entry is {total} bytes, over the max_entry_bytes={limits.max_entry_bytes} limit")


def _header_name(attr: str) -> str:
    """The entry field a header attribute is written as (RolloutSample's num_tokens was `tokens`)."""
    return "tokens" if attr == "num_tokens" else attr


@functools.lru_cache(maxsize=64)
def _header_names(model: type[EventBase]) -> tuple[tuple[str, str], ...]:
    """(entry header field name, the attribute whose value it renders) per header field a model's entries
    are written with, in order; computed once per model."""
    return tuple((_header_name(a), a) for a in model.HEADER)


_SCHEMA_FIELD = ("schema", "schema_version")


@functools.lru_cache(maxsize=64)
def _entry_names(model: type[EventBase]) -> dict[str | bytes, tuple[str, str] | None]:
    """Every field name a model's entries may carry besides array fields, as str and as bytes: its header
    fields (those it writes and those older encoders wrote) -> (name, the attribute they render); `schema`
    -> _SCHEMA_FIELD; `type` and `payload` (checked before validation) -> None."""
    out: dict[str | bytes, tuple[str, str] | None] = {}
    for attr in (*model.HEADER, *model.OLD_HEADER):
        out[_header_name(attr)] = (_header_name(attr), attr)
    out["schema"] = _SCHEMA_FIELD
    out["type"] = out[PAYLOAD_FIELD] = None
    out.update({name.encode(): spec for name, spec in out.items() if isinstance(name, str)})
    return out


_UNKNOWN = ("", "")


def _check_entry_fields(
    fields: Fields, model: type[EventBase], used: set[str | bytes], event: EventBase, raw_schema: Any
) -> None:
    """Every field is one the encoder writes (or an older one wrote), and every readable header field the
    entry has equals the payload's value: one pass over the entry's fields."""
    names = _entry_names(model)
    for raw_name, got in fields.items():
        spec = names.get(raw_name, _UNKNOWN)
        if spec is None:
            continue
        if spec is _UNKNOWN:
            if raw_name not in used:
                name = _field_name(raw_name)
                if name not in used:
                    raise DecodeError(f"unknown field {name[:40]!r} in a {event.type!r} entry")
            continue
        if spec is _SCHEMA_FIELD:
            if type(raw_schema) is int and _text(got) != str(raw_schema):
                raise DecodeError(f"header schema={_text(got)[:40]!r} != payload schema_version={raw_schema}")
            continue
        name, attr = spec
        value = getattr(event, attr)
        kind = type(value)
        want = value.encode() if kind is str else str(value).encode() if kind is int else _header_bytes(value)
        if got != want and bytes(got) != want:
            raise DecodeError(f"header {name}={bytes(got)[:40]!r} != payload {attr}={want[:40]!r}")


def _decode(fields: Fields, limits: Limits) -> Event:
    """decode() without the exception mapping."""
    if type(fields) is not dict and not isinstance(fields, Mapping):
        raise DecodeError(f"entry fields must be a mapping, got {type(fields).__name__}")
    _check_entry_size(fields, limits)
    payload = fields.get(b"payload")  # type: ignore[call-overload]
    if payload is None:
        payload = fields.get(PAYLOAD_FIELD)  # type: ignore[call-overload]
        if payload is None:
            raise DecodeError("missing 'payload' field")
    if len(payload) > limits.max_payload_bytes:
        raise DecodeError(f"payload is {len(payload)} bytes, over the {limits.max_payload_bytes} limit")
    unpacker = _Unpacker(fields, limits)
    data = unpacker.unpack(payload)
    if type(data) is not dict:
        raise DecodeError(f"payload is a {type(data).__name__}, not a map")
    event_type = data.get("type")
    if type(event_type) is not str:
        raise DecodeError("payload has no 'type'")
    header_type = _get(fields, b"type", "type")
    if header_type is not None and header_type != event_type.encode() and _text(header_type) != event_type:
        raise DecodeError(f"header type {_text(header_type)[:40]!r} != payload type {event_type[:40]!r}")
    model = EVENT_MODELS.get(event_type)
    if model is None:
        raise DecodeError(f"unknown event type {event_type[:40]!r}")
    version = data.get("schema_version")
    if type(version) is not int or version != model.SCHEMA:
        data = upgrade(event_type, data, model.SCHEMA)
    elif model is RolloutSample and type(parts := data.get("full_batch")) is list:
        data["full_batch"] = unpacker.ragged_batch(parts)
    event = model.__pydantic_validator__.validate_python(data)  # = model_validate
    _check_entry_fields(fields, model, unpacker.used, event, version)
    return event  # type: ignore[no-any-return]


def decode(fields: Fields, limits: Limits = DEFAULT_LIMITS) -> Event:
    """Event from stream entry fields as redis-py returns them; any failure raises DecodeError."""
    try:
        return _decode(fields, limits)
    except Exception as exc:
        raise as_decode_error(exc) from exc


def decode_as(fields: Fields, model: type[E], limits: Limits = DEFAULT_LIMITS) -> E:
    """decode() that also requires the event to be a `model` instance (else DecodeError)."""
    event = decode(fields, limits)
    if not isinstance(event, model):
        raise DecodeError(f"expected {model.__name__}, got {type(event).__name__} ({event.type!r})")
    return event


def encode_payload(obj: Any) -> bytes:
    """msgpack bytes of a plain value that may hold numpy arrays, torch tensors and DataProto (all inline)."""
    return _Packer(out_of_band=False).pack(obj)


def decode_payload(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Inverse of encode_payload; arrays are read-only views of the decoded bytes; failures raise
    DecodeError."""
    try:
        if len(data) > limits.max_payload_bytes:
            raise DecodeError(f"payload is {len(data)} bytes, over the {limits.max_payload_bytes} limit")
        return _Unpacker(None, limits).unpack(data)
    except Exception as exc:
        raise as_decode_error(exc) from exc
