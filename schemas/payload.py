"""The payload codec: plain values <-> msgpack bytes, with numpy arrays, torch tensors, DataProto and
RaggedBatch as msgpack ext types (the stream entry around a payload is schemas/codec.py).

An array is described by a flat fixed-size header (`schemas.arrays.pack_head`: dtype code, ndim, dims)
followed by its bytes inline (< INLINE_MAX_BYTES) or, inside a stream entry, by the index of the raw field
`a<i>` carrying them. In a DataProto's tensors map the header is the value itself (a bin); a ragged batch
sends its parts as schemas/ragged_wire.py writes them; anywhere else the header is the body of an
EXT_FLAT_ARRAY ExtType. Object arrays are [shape, values] lists in a DataProto's non_tensors map. Dtypes
without a code use the msgpack-bodied EXT_ARRAY; that and EXT_OBJECT_ARRAY stay decodable everywhere.
Unpacking views the bytes (no copy) and unpacks with explicit size limits; the ext types only older encoders
wrote are read by schemas/legacy.py, which the unpacker asks only for a code it does not write. Every
failure is a `DecodeError` with a short reason. No pickle, ever.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from schemas.arrays import (
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
from schemas.legacy import LEGACY_EXTS
from schemas.ragged import RaggedBatch
from schemas.ragged_wire import INLINE_MAX_BYTES, ragged_from_parts, ragged_parts

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
# the parts list of a RaggedBatch (schemas/ragged_wire.py): schema 4's full_batch; from schema 5 on that list
# is the full_batch value itself, unpacked with the payload, and the ext only carries a RaggedBatch found
# anywhere else
EXT_RAGGED_BATCH = 8

PAYLOAD_FIELD = "payload"
ARRAY_FIELD_PREFIX = "a"

MiB = 1 << 20
# (bytes, str) names of the first raw array fields, as redis-py returns them and as encode() builds them.
FIELD_NAMES = tuple((f"{ARRAY_FIELD_PREFIX}{i}".encode(), f"{ARRAY_FIELD_PREFIX}{i}") for i in range(256))

# Values an object array holds as they are when assigned as a whole (none is a sequence).
_SCALARS = frozenset({str, int, float, bool, type(None)})

# Entry fields as redis-py returns them (bytes keys) or as encode() builds them (str keys).
Fields = Mapping[bytes, Any] | Mapping[str, Any]


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


class OutOfBand:
    """Marks a bytes value to travel as its own raw field when large (dead-letter originals)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        """Wrap the bytes."""
        self.data = data


def _ext_type(code: int, data: bytes) -> msgpack.ExtType:
    """msgpack.ExtType(code, data) without its argument checks (code and data come from this module)."""
    return tuple.__new__(msgpack.ExtType, (code, data))


class Packer:
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

    def array(self, obj: Any) -> bytes | msgpack.ExtType:
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

    def _ragged(self, obj: RaggedBatch) -> msgpack.ExtType:
        """A ragged batch anywhere but a RolloutSample's full_batch: its parts in an EXT_RAGGED_BATCH."""
        return _ext_type(EXT_RAGGED_BATCH, self.pack(ragged_parts(self, obj)))

    def object_array(self, arr: np.ndarray) -> msgpack.ExtType:
        """An object array of any shape as an EXT_OBJECT_ARRAY holding [shape, flat values]."""
        return _ext_type(EXT_OBJECT_ARRAY, self.pack([list(arr.shape), arr.reshape(-1).tolist()]))

    def _parts(self, obj: DataProto, tensors_in: Mapping[str, Any]) -> list[Any]:
        """[tensors, non_tensors, meta_info] of a batch, tensors taken from tensors_in."""
        tensors: dict[str, Any] = {}
        array = self.array
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
            flat = self.array(obj)
            return _ext_type(EXT_FLAT_ARRAY, flat) if isinstance(flat, bytes) else flat
        if isinstance(obj, RaggedBatch):
            return self._ragged(obj)
        if isinstance(obj, DataProto):
            return self._dataproto(obj)
        if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
            return _ext_type(EXT_OBJECT_ARRAY, self.pack([list(obj.shape), obj.reshape(-1).tolist()]))
        if isinstance(obj, np.ndarray) or is_torch_tensor(obj):
            flat = self.array(obj)
            return _ext_type(EXT_FLAT_ARRAY, flat) if isinstance(flat, bytes) else flat
        if isinstance(obj, OutOfBand):
            ref = self._ref(memoryview(obj.data).cast("B"))
            return _ext_type(EXT_BYTES, self.pack(ref)) if isinstance(ref, int) else ref
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(
            f"cannot encode {type(obj).__name__} (allowed: msgpack values, numpy, torch, DataProto, "
            "RaggedBatch)"
        )


# --- unpacking ----------------------------------------------------------------------------------


class Unpacker:
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
        if 0 <= ref < len(FIELD_NAMES):
            bname, name = FIELD_NAMES[ref]
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
            return ragged_from_parts(self, *self.unpack_list(data, 8, "ragged batch"))
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


def encode_payload(obj: Any) -> bytes:
    """msgpack bytes of a plain value that may hold numpy arrays, torch tensors and DataProto (all inline)."""
    return Packer(out_of_band=False).pack(obj)


def decode_payload(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Inverse of encode_payload; arrays are read-only views of the decoded bytes; failures raise
    DecodeError."""
    try:
        if len(data) > limits.max_payload_bytes:
            raise DecodeError(f"payload is {len(data)} bytes, over the {limits.max_payload_bytes} limit")
        return Unpacker(None, limits).unpack(data)
    except Exception as exc:
        raise as_decode_error(exc) from exc
