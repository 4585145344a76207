"""Reading streams outside a consumer group: the one paged XRANGE iterator, the one entry-id parser and the
one text helper (redis-py replies are bytes; ids, names and header values are wanted as str)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis

#: Entries per XRANGE call of `iter_stream`.
PAGE = 1000


def text(x: Any, errors: str = "replace") -> str:
    """A reply value as str: bytes decoded as UTF-8 (undecodable bytes handled per `errors`), else str(x)."""
    return x.decode(errors=errors) if isinstance(x, bytes) else str(x)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """(milliseconds, sequence) of a stream entry id `<ms>-<seq>` (a bare `<ms>` has sequence 0): its
    order key, and its parts for id arithmetic."""
    ms, _, seq = text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def iter_stream(
    r: redis.Redis, key: str, start: str = "-", end: str = "+", page: int = PAGE, reverse: bool = False
) -> Iterator[tuple[str, Any]]:
    """(id, fields) of every entry of `key` from start to end (both inclusive; `(id` excludes), in id order
    (newest first when `reverse`, which reads from `end` down to `start`), `page` entries per call."""
    rc: Any = r  # redis-py's stubs type stream replies loosely
    lo, hi = start, end
    while True:
        rows = rc.xrevrange(key, max=hi, min=lo, count=page) if reverse else rc.xrange(key, min=lo, max=hi, count=page)
        entry_id = ""
        for raw_id, fields in rows:
            entry_id = text(raw_id)
            yield entry_id, fields
        if len(rows) < page:
            return
        if reverse:
            hi = "(" + entry_id
        else:
            lo = "(" + entry_id
