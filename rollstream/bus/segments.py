"""The archive's segment file format: stream entries exactly as Redis returned them, one framed record each.

A segment starts with the 8-byte magic `RSLOG1\\n\\0`, then records:

    u32 length (big endian) | u32 crc32 of the body | body = msgpack [entry id (str), [field, value, …]]

Field names and values keep their type (bytes stay bytes: msgpack bin). Only msgpack's plain types are
decoded (no ext types, no pickle), with sizes bounded by the record's own length. Up to the length the
archive index commits, a segment must hold whole, valid records; past it may lie a torn tail (a crash
mid-write), which readers never see and the writer truncates before it appends.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import msgpack

MAGIC = b"RSLOG1\n\0"
_HEAD = struct.Struct(">II")


class SegmentError(Exception):
    """A segment that is not ours, or a damaged record in the middle of one."""


def encode_record(entry_id: str, fields: Mapping[Any, Any]) -> bytes:
    """One framed record of an entry: its id and its fields in Redis' order."""
    flat: list[Any] = []
    for k, v in fields.items():
        flat += (k, v)
    body: bytes = msgpack.packb([entry_id, flat], use_bin_type=True)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def decode_body(body: bytes) -> tuple[str, dict[Any, Any]]:
    """(entry id, fields) of one record body; SegmentError when it is not one."""
    try:
        entry_id, flat = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise SegmentError(f"record does not decode: {e}") from None
    if not isinstance(entry_id, str) or not isinstance(flat, list) or len(flat) % 2:
        raise SegmentError("record is not [id, [field, value, ...]]")
    return entry_id, dict(zip(flat[::2], flat[1::2], strict=True))


def read_records(f: BinaryIO, limit: int | None = None) -> Iterator[tuple[int, str, dict[Any, Any]]]:
    """(end offset, id, fields) of each record of an open segment, in file order.

    With `limit` (the committed length the archive index records) every byte up to it must hold whole,
    valid records: anything else raises SegmentError (durable data damaged). Without it the file is read
    up to its first incomplete or damaged record, which is taken for a torn tail (a crash mid-write) and
    ignored; the last end offset yielded is where a writer may truncate the file to."""
    f.seek(0)
    if f.read(len(MAGIC)) != MAGIC:
        raise SegmentError("not an archive segment (bad magic)")
    pos = len(MAGIC)
    size = os.fstat(f.fileno()).st_size
    while limit is None or pos < limit:
        head = f.read(_HEAD.size)
        length, crc = _HEAD.unpack(head) if len(head) == _HEAD.size else (0, 0)
        whole = len(head) == _HEAD.size and pos + _HEAD.size + length <= size
        body = f.read(length) if whole else b""
        if not whole or zlib.crc32(body) != crc or (limit is not None and pos + _HEAD.size + length > limit):
            if limit is None:
                return  # torn tail
            raise SegmentError(f"damaged or missing record at byte {pos} of {limit} committed")
        pos += _HEAD.size + length
        entry_id, fields = decode_body(body)
        yield pos, entry_id, fields


def new_segment(f: BinaryIO) -> None:
    """Write the magic into a new, empty segment."""
    f.write(MAGIC)
