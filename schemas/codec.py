"""The one codec: events <-> Redis stream entry fields (the bytes of each field's value: schemas/payload.py).

Entry layout (XADD field order): human-readable header fields (`type`, `schema`, then per-event ones),
`payload` (msgpack map of the model's fields, schemas/payload.py), then raw array fields `a0`, `a1`, ...
(one large array or bytes value each). A RolloutSample's full_batch is the list of its parts right in the
payload (schema 5, schemas/ragged_wire.py). Decoding views the entry's bytes (no copy), unpacks with
explicit size limits, validates with pydantic, and upgrades an older schema's payload (schemas/legacy.py).
An entry is refused as a whole when it is over `Limits.max_entry_bytes`, holds a field the encoder would
not write (unknown names, array fields the payload never references), or has a readable header field
that disagrees with the payload (the header is what `redis-cli` and the audit read, so it must not lie).
Every failure is a `DecodeError` with a short reason. No pickle, ever.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, TypeVar

from schemas.errors import DecodeError, as_decode_error
from schemas.events import EVENT_MODELS, DeadLetter, Event, EventBase, RolloutSample
from schemas.legacy import upgrade
from schemas.payload import (
    ARRAY_FIELD_PREFIX,
    DEFAULT_LIMITS,
    FIELD_NAMES,
    PAYLOAD_FIELD,
    Fields,
    Limits,
    OutOfBand,
    Packer,
    Unpacker,
    decode_payload,
    encode_payload,
)
from schemas.ragged_wire import INLINE_MAX_BYTES, ragged_batch, ragged_parts

__all__ = [
    "DEFAULT_LIMITS", "INLINE_MAX_BYTES", "Fields", "Limits", "decode", "decode_as", "decode_payload",
    "encode", "encode_payload",
]

E = TypeVar("E", bound=EventBase)


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
    packer = Packer(out_of_band=True)
    body = dict(event.__dict__)  # a model's fields, in order (extra="forbid": nothing else is in there)
    if type(event) is RolloutSample:
        body["full_batch"] = ragged_parts(packer, event.full_batch)  # (schema 5: in the payload, no ext)
    if isinstance(event, DeadLetter):
        body["fields"] = {k: OutOfBand(v) for k, v in event.fields.items()}
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
        out[FIELD_NAMES[i][1] if i < len(FIELD_NAMES) else f"{ARRAY_FIELD_PREFIX}{i}"] = buf
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
    unpacker = Unpacker(fields, limits)
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
        data["full_batch"] = ragged_batch(unpacker, parts)
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
