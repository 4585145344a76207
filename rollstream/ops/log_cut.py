"""The log's consistent cut: what the audit reads first, in one MULTI (each stream's `entries-added` and last
id, the trainer group's last delivered id and pending entries on each rollouts stream, the leases and each
producer's published count), so that everything it reads after is judged against one instant; and the
entries of a rollouts stream its trainer group has not acked now."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from rollstream.bus.ids import after, count_or_none, parse_id, text
from rollstream.bus.streams import PAGE, iter_stream
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.pacing.counters import read_count

#: Most pending entries of one rollouts stream the cut reads in its MULTI (the trainer's pending list is about
#: max_outstanding; beyond this the rest is paged after the cut, which can only make more entries open).
CUT_PENDING = 100_000


@dataclass
class Cut:
    """What the audit reads first, in one MULTI, so that everything read after it is judged against one
    instant: each stream's `entries-added` and last id, the trainer group's last delivered id and pending
    entries on each rollouts stream, the leases and each producer's published count."""

    added: dict[str, int] = field(default_factory=dict)  # stream -> entries-added (absent: no stream)
    last: dict[str, tuple[int, int]] = field(default_factory=dict)  # stream -> last-generated-id
    delivered: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # rollouts -> trainer group's
    pending: dict[str, set[str]] = field(default_factory=dict)  # rollouts stream -> pending entry ids
    leases: dict[str, int] = field(default_factory=dict)
    published: dict[str, int] = field(default_factory=dict)  # producer -> published count (canonical only)
    bad_inputs: list[str] = field(default_factory=list)  # producer-written values that are not counts

    def within(self, stream: str, entry_id: str) -> bool:
        """True when the entry existed at the cut (its id is at most the stream's last id then)."""
        last = self.last.get(stream)
        return last is not None and parse_id(entry_id) <= last

    def unacked(self, stream: str, entry_id: str) -> bool:
        """True when the trainer group had not acked this entry at the cut (pending or never delivered)."""
        if stream not in self.delivered:
            return True
        delivered = self.delivered[stream]
        if delivered is None or entry_id in self.pending.get(stream, set()):
            return True
        return parse_id(entry_id) > delivered


def read_cut(r: redis.Redis, keys: Keys, producers: list[str], streams: list[str]) -> Cut:
    """The audit's consistent cut (`Cut`), one MULTI; a stream, group or key that does not exist reads as
    absent, and a producer's `published` that is not a canonical count as 0 (reported in `bad_inputs`)."""
    rollouts = keys.rollouts_streams(producers)
    pipe = r.pipeline(transaction=True)
    for stream in streams:
        pipe.xinfo_stream(stream)
    for stream in rollouts:
        pipe.xinfo_groups(stream)
        pipe.xpending_range(stream, TRAINER_GROUP, "-", "+", CUT_PENDING)
    pipe.hgetall(keys.lease)
    for p in producers:
        pipe.get(keys.producer_published(p))
    res: list[Any] = pipe.execute(raise_on_error=False)
    cut = Cut()
    for stream, info in zip(streams, res, strict=False):
        if isinstance(info, dict):
            cut.added[stream] = int(info["entries-added"])
            cut.last[stream] = parse_id(info["last-generated-id"])
    res = res[len(streams):]
    for k, stream in enumerate(rollouts):
        groups, pending = res[2 * k], res[2 * k + 1]
        if isinstance(groups, Exception):
            continue  # no stream
        group = next((g for g in groups if text(g["name"]) == TRAINER_GROUP), None)
        cut.delivered[stream] = None if group is None else parse_id(group["last-delivered-id"])
        ids = set() if isinstance(pending, Exception) else {text(p["message_id"]) for p in pending}
        if group is not None and int(group.get("pending") or 0) > len(ids):
            ids |= _pending_after(r, stream, max(ids, key=parse_id, default=None))
        cut.pending[stream] = ids
    res = res[2 * len(rollouts):]
    raw_leases = res[0] if isinstance(res[0], dict) else {}
    cut.leases = {text(k): count_or_none(v) or 0 for k, v in raw_leases.items()}
    for p, raw in zip(producers, res[1:], strict=True):
        n, why = read_count(None if isinstance(raw, Exception) else raw, keys.producer_published(p))
        cut.published[p] = n
        if why is not None:
            cut.bad_inputs.append(f"{p}: {why}")
    return cut


def _pending_after(r: redis.Redis, stream: str, start: str | None) -> set[str]:
    """The trainer group's pending entries of `stream` after `start` (a pending list longer than
    CUT_PENDING, read in pages after the cut)."""
    rc: Any = r
    out: set[str] = set()
    lo = "-" if start is None else after(start)
    while lo is not None:
        rows = rc.xpending_range(stream, TRAINER_GROUP, lo, "+", PAGE)
        out |= {text(p["message_id"]) for p in rows}
        if len(rows) < PAGE:
            break
        lo = after(text(rows[-1]["message_id"]))
    return out


def unacked_entry_ids(r: redis.Redis, stream: str) -> set[str]:
    """Entries of a rollouts stream its trainer group has not acked now: its pending list plus those never
    delivered."""
    rc: Any = r
    if not rc.exists(stream):
        return set()
    groups = {text(g["name"]): g for g in rc.xinfo_groups(stream)}
    if TRAINER_GROUP not in groups:
        return {i for i, _ in iter_stream(r, stream)}
    last = text(groups[TRAINER_GROUP]["last-delivered-id"])
    pending = _pending_after(r, stream, None)
    start = after(last)  # None at the largest id: nothing can be undelivered
    undelivered = set() if start is None else {i for i, _ in iter_stream(r, stream, start)}
    return pending | undelivered
