"""The one codec: events <-> Redis stream entry fields, and plain values <-> msgpack bytes.

Entry layout (XADD field order): human-readable header fields (`type`, `schema`, then per-event ones),
`payload` (msgpack map of the model's fields), then raw array fields `a0`, `a1`, ... Arrays inside the
payload are msgpack ExtTypes holding dtype + shape + either the inline bytes (< INLINE_MAX_BYTES) or the
index of the out-of-band field carrying them. Decoding views those bytes (no copy), unpacks with
explicit size limits, upgrades old schema versions, and validates with pydantic. Every failure
is a `DecodeError` with a short reason. No pickle, ever.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from schemas.arrays import array_from_wire, array_to_wire, check_shape, is_torch_tensor
from schemas.batch import DataProto
from schemas.errors import DecodeError, as_decode_error
from schemas.events import EVENT_MODELS, DeadLetter, Event, EventBase
from schemas.upgrades import upgrade

# Ext type codes inside the payload.
EXT_ARRAY = 1  # packed [dtype str, shape, bin (inline) | int (index of field a<i>)]
EXT_OBJECT_ARRAY = 2  # packed [shape, flat list of msgpack values] -> numpy object array
EXT_DATAPROTO = 3  # packed [tensors map, non_tensors map, meta_info map]
EXT_BYTES = 4  # packed int: index of the raw field a<i> holding a bytes value

INLINE_MAX_BYTES = 1024
PAYLOAD_FIELD = "payload"
ARRAY_FIELD_PREFIX = "a"

MiB = 1 << 20

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
    max_depth: int = 8


DEFAULT_LIMITS = Limits()


# --- packing ------------------------------------------------------------------------------------


class _OutOfBand:
    """Marks a bytes value to travel as its own raw field when large (dead-letter originals)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        """Wrap the bytes."""
        self.data = data


class _Packer:
    """msgpack packer that turns arrays/DataProto into ExtTypes, collecting out-of-band buffers."""

    def __init__(self, out_of_band: bool) -> None:
        """out_of_band=False inlines every array (for standalone payload bytes)."""
        self.out_of_band = out_of_band
        self.buffers: list[memoryview] = []

    def pack(self, obj: Any) -> bytes:
        """Pack one value."""
        return msgpack.packb(obj, default=self._default, use_bin_type=True)

    def _ref(self, data: memoryview) -> memoryview | int:
        """Inline small buffers; give large ones a field index."""
        if not self.out_of_band or data.nbytes < INLINE_MAX_BYTES:
            return data
        self.buffers.append(data)
        return len(self.buffers) - 1

    def _default(self, obj: Any) -> Any:
        """Encode what msgpack does not know natively."""
        if isinstance(obj, DataProto):
            return msgpack.ExtType(EXT_DATAPROTO, self.pack([obj.tensors, obj.non_tensors, obj.meta_info]))
        if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
            return msgpack.ExtType(EXT_OBJECT_ARRAY, self.pack([list(obj.shape), obj.reshape(-1).tolist()]))
        if isinstance(obj, np.ndarray) or is_torch_tensor(obj):
            dtype, shape, data = array_to_wire(obj)
            return msgpack.ExtType(EXT_ARRAY, self.pack([dtype, shape, self._ref(data)]))
        if isinstance(obj, _OutOfBand):
            ref = self._ref(memoryview(obj.data).cast("B"))
            return msgpack.ExtType(EXT_BYTES, self.pack(ref)) if isinstance(ref, int) else ref
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(
            f"cannot encode {type(obj).__name__} (allowed: msgpack values, numpy, torch, DataProto)"
        )


# --- unpacking ----------------------------------------------------------------------------------


class _Unpacker:
    """msgpack unpacker with limits that resolves ExtTypes, viewing out-of-band fields without copying."""

    def __init__(self, fields: Mapping[str, Any] | None, limits: Limits) -> None:
        """fields: the entry's fields by str name (None outside an entry)."""
        self.fields = fields
        self.limits = limits
        self.depth = 0

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

    def _field(self, ref: Any) -> Any:
        """The raw bytes of out-of-band field a<ref>, or inline bytes as given."""
        if isinstance(ref, bytes):
            return ref
        if type(ref) is not int:
            raise DecodeError(f"array data must be bytes or a field index, got {type(ref).__name__}")
        if self.fields is None:
            raise DecodeError("out-of-band array reference outside a stream entry")
        name = f"{ARRAY_FIELD_PREFIX}{ref}"
        if name not in self.fields:
            raise DecodeError(f"missing array field {name!r}")
        data = self.fields[name]
        if len(data) > self.limits.max_field_bytes:
            raise DecodeError(
                f"field {name!r} is {len(data)} bytes, over the {self.limits.max_field_bytes} limit"
            )
        return data

    def _list(self, data: bytes, size: int, what: str) -> list[Any]:
        """Unpack an ext body that must be a list of `size` items."""
        value = self.unpack(data)
        if not isinstance(value, list) or len(value) != size:
            raise DecodeError(f"malformed {what} ext")
        return value

    def _ext(self, code: int, data: bytes) -> Any:
        """Resolve one ExtType."""
        if code == EXT_ARRAY:
            dtype, shape, ref = self._list(data, 3, "array")
            return array_from_wire(dtype, shape, self._field(ref))
        if code == EXT_OBJECT_ARRAY:
            shape_in, values = self._list(data, 2, "object array")
            shape = check_shape(shape_in)
            if not isinstance(values, list) or int(np.prod(shape, dtype=object)) != len(values):
                raise DecodeError(f"object array of shape {list(shape)[:8]} has {len(values)} values")
            out = np.empty(len(values), dtype=object)
            for i, v in enumerate(values):
                out[i] = v
            return out.reshape(shape)
        if code == EXT_DATAPROTO:
            tensors, non_tensors, meta_info = self._list(data, 3, "DataProto")
            if not all(isinstance(m, dict) for m in (tensors, non_tensors, meta_info)):
                raise DecodeError("malformed DataProto ext: parts must be maps")
            return DataProto(tensors, non_tensors, meta_info)
        if code == EXT_BYTES:
            raw = self._field(self.unpack(data))
            return raw if isinstance(raw, bytes) else bytes(raw)
        raise DecodeError(f"unknown msgpack ext type {code}")


# --- public API ---------------------------------------------------------------------------------


def _header_bytes(value: Any) -> bytes:
    """Render a header value as readable bytes."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return b"1" if value else b"0"
    return str(value).encode()


def encode(event: EventBase) -> dict[str, bytes | memoryview]:
    """XADD fields for an event: header fields, then `payload`, then raw array fields a0, a1, …"""
    packer = _Packer(out_of_band=True)
    body = {name: getattr(event, name) for name in type(event).model_fields}
    if isinstance(event, DeadLetter):
        body["fields"] = {k: _OutOfBand(v) for k, v in event.fields.items()}
    payload = packer.pack(body)
    out: dict[str, bytes | memoryview] = {
        "type": event.type.encode(),
        "schema": str(event.schema_version).encode(),
    }
    for key, value in event.header().items():
        out[key] = _header_bytes(value)
    out[PAYLOAD_FIELD] = payload
    for i, buf in enumerate(packer.buffers):
        out[f"{ARRAY_FIELD_PREFIX}{i}"] = buf
    return out


def _text(value: Any) -> str:
    """A header value as str."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode()
    return str(value)


def _decode(fields: Fields, limits: Limits) -> Event:
    """decode() without the exception mapping."""
    if not isinstance(fields, Mapping):
        raise DecodeError(f"entry fields must be a mapping, got {type(fields).__name__}")
    named = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    payload = named.get(PAYLOAD_FIELD)
    if payload is None:
        raise DecodeError("missing 'payload' field")
    if len(payload) > limits.max_payload_bytes:
        raise DecodeError(f"payload is {len(payload)} bytes, over the {limits.max_payload_bytes} limit")
    data = _Unpacker(named, limits).unpack(payload)
    if not isinstance(data, dict):
        raise DecodeError(f"payload is a {type(data).__name__}, not a map")
    event_type = data.get("type")
    if not isinstance(event_type, str):
        raise DecodeError("payload has no 'type'")
    header_type = named.get("type")
    if header_type is not None and _text(header_type) != event_type:
        raise DecodeError(f"header type {_text(header_type)[:40]!r} != payload type {event_type[:40]!r}")
    model = EVENT_MODELS.get(event_type)
    if model is None:
        raise DecodeError(f"unknown event type {event_type[:40]!r}")
    data = upgrade(event_type, data, model.SCHEMA)
    return model.model_validate(data)  # type: ignore[return-value]


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
    """Inverse of encode_payload; arrays are read-only views of the decoded bytes; failures raise DecodeError."""
    try:
        if len(data) > limits.max_payload_bytes:
            raise DecodeError(f"payload is {len(data)} bytes, over the {limits.max_payload_bytes} limit")
        return _Unpacker(None, limits).unpack(data)
    except Exception as exc:
        raise as_decode_error(exc) from exc
