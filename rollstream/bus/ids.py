"""Entry ids and reply text: the one entry-id parser and the one text helper (redis-py replies are bytes; ids,
names and header values are wanted as str). Below both streams.py and archive.py, which use them."""

from __future__ import annotations

from typing import Any


def text(x: Any, errors: str = "replace") -> str:
    """A reply value as str: bytes decoded as UTF-8 (undecodable bytes handled per `errors`), else str(x)."""
    return x.decode(errors=errors) if isinstance(x, bytes) else str(x)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """(milliseconds, sequence) of a stream entry id `<ms>-<seq>` (a bare `<ms>` has sequence 0): its
    order key, and its parts for id arithmetic."""
    ms, _, seq = text(entry_id).partition("-")
    return int(ms), int(seq or 0)
