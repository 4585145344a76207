"""Reading streams outside a consumer group: the one log iterator (the run's archive, then Redis, as one
sequence)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis

from rollstream.bus.ids import after as after_id
from rollstream.bus.ids import parse_id, text

if TYPE_CHECKING:
    from rollstream.bus.archive import Archive

#: Entries per XRANGE call of `iter_stream`.
PAGE = 1000


def run_archive(r: redis.Redis, key: str) -> Archive | None:
    """The archive of the run `key` belongs to, as recorded in the run's `archive` hash by the trainer;
    None when the key is no run's or nothing of the run was ever archived."""
    from rollstream.bus.archive import Archive
    from rollstream.keys import ARCHIVE_DIR_FIELD, split_key

    split = split_key(key)
    if split is None:
        return None
    where: Any = r.hget(split[0].archive, ARCHIVE_DIR_FIELD)
    return Archive(text(where)) if where else None


def _after(bound: str) -> str | None:
    """The id a lower bound of XRANGE (`-`, `id`, `ms`, `(id`) starts after, for the archive's filter."""
    if bound == "-":
        return None
    if bound.startswith("("):
        return bound[1:]
    ms, seq = parse_id(bound)
    return f"{ms}-{seq - 1}" if seq else (f"{ms - 1}-{2**64 - 1}" if ms else None)


def _upto(bound: str) -> str | None:
    """The last id an upper bound of XRANGE (`+`, `id`, `ms`, `(id`) includes, for the archive's filter."""
    if bound == "+":
        return None
    if bound.startswith("("):
        ms, seq = parse_id(bound[1:])
        return f"{ms}-{seq - 1}" if seq else (f"{ms - 1}-{2**64 - 1}" if ms else "0-0")
    return bound if "-" in bound else f"{bound}-{2**64 - 1}"


def iter_stream(
    r: redis.Redis, key: str, start: str = "-", end: str = "+", page: int = PAGE, reverse: bool = False,
    archive: Archive | bool = True,
) -> Iterator[tuple[str, Any]]:
    """(id, fields) of every entry of the log of `key` from start to end (both inclusive; `(id` excludes),
    in id order (newest first when `reverse`, which reads from `end` down to `start`), `page` entries per
    XRANGE call. The log is what the run archived (rollstream/bus/archive.py) followed by what Redis
    holds, each id once: `archive=True` finds the run's archive from Redis, an Archive reads that one,
    False reads Redis alone."""
    if reverse:  # the archive is looked up only if the reader goes below what Redis holds
        yield from _reverse(
            r, key, start, end, page, None if archive is True else (archive or None), lazy=archive is True
        )
        return
    arc = run_archive(r, key) if archive is True else (archive or None)
    if arc is None:
        yield from _redis(r, key, start, end, page)
    else:
        yield from _forward(r, key, start, end, page, arc)


def _pages(
    r: redis.Redis, key: str, lo: str, hi: str, page: int, reverse: bool = False
) -> Iterator[list[tuple[str, Any]]]:
    """Every XRANGE (XREVRANGE when reverse) page of `key` between the bounds lo and hi, as (id, fields)
    rows; the last page is shorter than `page`, possibly empty."""
    rc: Any = r  # redis-py's stubs type stream replies loosely
    while True:
        raw = (
            rc.xrevrange(key, max=hi, min=lo, count=page)
            if reverse
            else rc.xrange(key, min=lo, max=hi, count=page)
        )
        rows = [(text(i), f) for i, f in raw]
        yield rows
        if len(rows) < page:
            return
        if reverse:
            hi = "(" + rows[-1][0]
        elif (nxt := after_id(rows[-1][0])) is None:
            return  # the page ended at the largest id: nothing can follow it
        else:
            lo = nxt


def _redis(r: redis.Redis, key: str, start: str, end: str, page: int) -> Iterator[tuple[str, Any]]:
    for rows in _pages(r, key, start, end, page):
        yield from rows


def _forward(
    r: redis.Redis, key: str, start: str, end: str, page: int, arc: Archive
) -> Iterator[tuple[str, Any]]:
    """Archive then Redis. Retention archives (and commits the index) before it trims, so a Redis page read
    while the index is unchanged has no gap below it; when the index changed meanwhile, the page is
    dropped and the newly archived entries are read from the archive first."""
    last: str | None = None  # newest id yielded
    upto = _upto(end)
    while True:
        sig = arc.signature(key)
        index = arc.index(key)
        after = last if last is not None else _after(start)
        for entry_id, fields in arc.entries(key, index, after=after, upto=upto):
            last = entry_id
            yield entry_id, fields
        floor = max(
            (i for i in (last, index.last, _after(start)) if i is not None), key=parse_id, default=None
        )
        lo = start if floor is None else after_id(floor)
        if lo is None:
            return  # the archive ends at the largest id: nothing can follow it
        for rows in _pages(r, key, lo, end, page):
            if arc.signature(key) != sig:
                break  # archived (maybe trimmed) meanwhile: read the archive again from `last`
            for entry_id, fields in rows:
                last = entry_id
                yield entry_id, fields
        else:
            return


def _reverse(
    r: redis.Redis, key: str, start: str, end: str, page: int, arc: Archive | None, lazy: bool
) -> Iterator[tuple[str, Any]]:
    """Redis from `end` down, then the archive below the oldest entry Redis gave (found only when needed:
    a reader of the newest entries never looks for it). Entries trimmed while reading were archived before."""
    oldest = None
    for rows in _pages(r, key, start, end, page, reverse=True):
        for oldest, fields in rows:
            yield oldest, fields
    if lazy:
        arc = run_archive(r, key)
    if arc is None:
        return
    bounds = [b for b in (_upto(end), _upto("(" + oldest) if oldest is not None else None) if b is not None]
    upto = min(bounds, key=parse_id) if bounds else None
    yield from arc.entries(key, after=_after(start), upto=upto, reverse=True)
