"""Retention: Redis holds the hot window of a run's log, the archive (archive.py) holds the rest.

A pass of the `Janitor` (at most every bus.trim_every_s; the trainer runs it at the end of a global step):

1. Streams nobody consumes keep at most their newest `keep_newest[stream]` entries in Redis (fates, the
   trainer's dispatch_log and params: bus.audit_maxlen; records: bus.records_maxlen when > 0).
2. When the run's streams take more than the budget (bus.redis_max_bytes), the oldest entries below each
   stream's floor are moved, largest stream first, until the streams take LOW_WATER of the budget.
3. When one stream alone still takes more than bus.max_stream_bytes, its oldest entries are moved even
   above the floor (unread ones: a consumer group will never see them) and the pass logs RETENTION CAP BIT.

The floor of a stream with consumer groups is `safe_min_id` (the slowest group's oldest pending or first
undelivered entry); of one without groups, its newest entry (always kept, so `status`, `tail` and
producers polling `params` find the newest in Redis). "Moved" means: appended to the archive, fsynced,
committed in its index, and only then trimmed with XTRIM MINID. A crash in between leaves entries both
archived and in Redis (readers take each id once: streams.iter_stream) and the next pass trims them; a
crash before the commit leaves nothing a reader sees. When the unread data alone exceeds the budget the
pass reports `over_budget`, and the trainer caps its dispatch grants by it (pacing.grant_budget).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from rollstream.bus.archive import Archive, ArchiveError
from rollstream.bus.connection import CONNECTION_ERRORS
from rollstream.bus.ids import after, parse_id, text
from rollstream.bus.publish import run_producers
from rollstream.bus.streams import PAGE
from rollstream.keys import ARCHIVE_DIR_FIELD, Keys

if TYPE_CHECKING:
    from rollstream.config import PipelineConfig

log = logging.getLogger(__name__)

#: After a pass that found the streams over budget, they take at most this fraction of it.
LOW_WATER = 0.8
#: Most bytes of entries one XRANGE of a pass asks for (estimated from the stream's bytes per entry).
CHUNK_BYTES = 64 << 20
#: Tests only: SIGKILL this process at the Nth archive commit, after it is durable and before its XTRIM.
KILL_BEFORE_TRIM_ENV = "ROLLSTREAM_FAULT_KILL_BEFORE_TRIM"
CAP_BIT = "RETENTION CAP BIT"


def safe_min_id(r: redis.Redis, stream: str) -> str | None:
    """The smallest id any group still needs (oldest pending or first undelivered); None if no groups."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    if not groups:
        return None
    floors: list[tuple[int, int]] = []
    for g in groups:
        name = text(g["name"])
        ms, seq = parse_id(g["last-delivered-id"])
        floor = (ms, seq + 1)  # the first id after the last delivered one
        if int(g["pending"]) > 0:
            summary = r.xpending(stream, name)
            if summary and summary.get("min"):
                floor = min(floor, parse_id(summary["min"]))
        floors.append(floor)
    ms, seq = min(floors)
    return f"{ms}-{seq}"


def stream_floor(r: redis.Redis, stream: str) -> str | None:
    """The id below which entries may leave Redis: safe_min_id with groups, else the newest entry's id
    (None for an empty stream without groups)."""
    floor = safe_min_id(r, stream)
    if floor is not None:
        return floor
    rows: Any = r.xrevrange(stream, count=1)
    return text(rows[0][0]) if rows else None


@dataclass
class Moved:
    """What one move did to one stream."""

    stream: str
    archived: int = 0  # entries appended to the archive
    trimmed: int = 0  # entries XTRIM removed from Redis
    archived_bytes: int = 0  # raw bytes of the archived entries' fields


def move_to_archive(
    r: redis.Redis, archive: Archive, stream: str, below: str | None, max_count: int | None = None,
    after_commit: Callable[[str], None] | None = None,
) -> Moved:
    """Archive the oldest entries of `stream` with id < `below` (None: any; at most `max_count`), commit the
    archive, call `after_commit(stream)`, then XTRIM MINID just past the newest archived id (which also
    trims entries a crashed pass archived but did not trim)."""
    rc: Any = r
    out = Moved(stream)
    with archive.writer(stream) as w:
        start: str | None = after(w.index.last) if w.index.last else "-"
        end = "(" + below if below is not None else "+"
        size = max(1, int(rc.memory_usage(stream) or 0))
        per_entry = size / max(1, int(rc.xlen(stream) or 1))
        page = max(1, min(PAGE, int(CHUNK_BYTES / per_entry)))
        left = max_count
        while start is not None and (left is None or left > 0):
            count = page if left is None else min(page, left)
            rows = rc.xrange(stream, min=start, max=end, count=count)
            if not rows:
                break
            batch = [(text(i), f) for i, f in rows]
            out.archived += w.write(batch)
            out.archived_bytes += sum(len(k) + len(v) for _, f in rows for k, v in f.items())
            start = after(batch[-1][0])  # None past the largest id: nothing follows
            if left is not None:
                left -= len(rows)
            if len(rows) < count:
                break
        if out.archived:
            w.commit()
        last = w.index.last
    if last is None:
        return out
    if out.archived and after_commit is not None:
        after_commit(stream)
    ms, seq = parse_id(last)
    # just past the newest archived id (at the largest id, that id itself: it stays, a duplicate readers skip)
    minid = f"{ms}-{seq + 1}" if seq < 2**64 - 1 else f"{ms + 1}-0" if ms < 2**64 - 1 else last
    out.trimmed = int(rc.xtrim(stream, minid=minid, approximate=False))
    return out


def kill_hook_from_env() -> Callable[[str], None] | None:
    """The fault-injection hook of KILL_BEFORE_TRIM_ENV (None when unset)."""
    nth = int(os.environ.get(KILL_BEFORE_TRIM_ENV) or 0)
    if nth <= 0:
        return None
    count = [0]

    def hook(stream: str) -> None:
        count[0] += 1
        if count[0] >= nth:
            log.warning("fault injection: SIGKILL after archiving %s, before its XTRIM", stream)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


@dataclass
class PassResult:
    """What one retention pass did."""

    moved: list[Moved] = field(default_factory=list)
    used_before: int = 0  # bytes of the run's streams in Redis before the pass (MEMORY USAGE estimates)
    used_after: int = 0
    over_budget: bool = False  # still over budget: the unread data alone exceeds it
    capped: list[str] = field(default_factory=list)  # streams the safety cap had to cut
    seconds: float = 0.0
    error: str | None = None  # the archive could not be written: nothing more was trimmed

    @property
    def archived(self) -> int:
        """Entries moved to the archive in this pass."""
        return sum(m.archived for m in self.moved)


class Janitor:
    """Runs a retention pass over a run's streams at most every `every_s` seconds (call `maybe_run` often)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        archive: Archive,
        *,
        budget_bytes: int,
        every_s: float,
        max_stream_bytes: int | None = None,
        keep_newest: dict[str, int] | None = None,
        after_commit: Callable[[str], None] | None = None,
    ) -> None:
        """budget_bytes: what the run's streams may take in Redis; keep_newest: stream -> newest entries
        kept in Redis at most (streams without consumers); after_commit: test hook between a commit and
        its XTRIM (default: KILL_BEFORE_TRIM_ENV)."""
        self.r: Any = r
        self.keys = keys
        self.archive = archive
        self.budget_bytes = budget_bytes
        self.every_s = every_s
        self.max_stream_bytes = max_stream_bytes
        self.keep_newest = keep_newest or {}
        self.after_commit = after_commit if after_commit is not None else kill_hook_from_env()
        self.over_budget = False
        self.last: PassResult | None = None
        self._next = 0.0
        self._registered = False

    @classmethod
    def from_config(cls, cfg: PipelineConfig, r: redis.Redis, keys: Keys) -> Janitor:
        """The janitor of a run as pipeline.yaml's `bus` section describes it (archive in the run dir
        unless bus.archive_uri names one)."""
        bus = cfg.bus
        keep = {k: bus.audit_maxlen for k in (keys.fates, keys.dispatch_log, keys.params)}
        if bus.records_maxlen:
            keep[keys.records] = bus.records_maxlen
        return cls(
            r, keys, Archive(bus.archive_dir(cfg.run_dir())), budget_bytes=bus.redis_max_bytes,
            every_s=bus.trim_every_s, max_stream_bytes=bus.max_stream_bytes, keep_newest=keep,
        )

    def streams(self) -> list[str]:
        """Every stream of the run that exists: the fixed ones, each producer's rollouts and stats streams
        (each archived and trimmed under its own group floor) and each producer's dispatch log."""
        logs = self.r.scan_iter(match=self.keys.producer_pattern("dispatch_log"), count=1000)
        # an older run's producer:<name>:dispatch_log, where a producer may write: streams only (a string
        # there must not stop retention with WRONGTYPE)
        found = [text(k) for k in logs if text(self.r.type(k)) == "stream"]
        fixed = self.keys.all_streams(run_producers(self.r, self.keys))
        return [s for s in [*fixed, *sorted(found)] if self.r.exists(s)]

    def _register(self) -> None:
        """Record the archive folder in the run's `archive` hash (readers find it there). A run that
        already archived elsewhere keeps that folder: a log split over two folders would read with a gap."""
        if self._registered:
            return
        here = str(self.archive.root.resolve())
        recorded = self.r.hget(self.keys.archive, ARCHIVE_DIR_FIELD)
        if recorded is not None and text(recorded) != here:
            log.error(
                "the run already archives into %s; keeping it (bus.archive_uri says %s)", text(recorded), here
            )
            self.archive = Archive(Path(text(recorded))).create()
        else:
            self.archive.create()  # before readers are pointed to it
            self.r.hset(self.keys.archive, ARCHIVE_DIR_FIELD, here)
        self._registered = True

    def _move(self, stream: str, below: str | None, max_count: int | None = None) -> Moved:
        self._register()
        return move_to_archive(self.r, self.archive, stream, below, max_count, self.after_commit)

    def maybe_run(self, now: float | None = None) -> PassResult | None:
        """Run a pass if the interval has passed (None when not yet due). A pass the archive fails (disk
        full, folder gone) trims nothing more, is logged as an error and counts as over budget (producers
        are paced) instead of stopping the trainer; Redis errors propagate (the caller retries them)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        try:
            res = self.run_pass()
        except CONNECTION_ERRORS:
            raise  # not due yet rescheduled: the caller's retry (retry_on_connection) runs the pass again
        except (OSError, ArchiveError) as e:
            log.error("retention pass failed, nothing more leaves Redis until the archive works again: %s", e)
            self.over_budget = True
            res = self.last = PassResult(over_budget=True, error=str(e))
        self._next = now + self.every_s
        return res

    def run_pass(self) -> PassResult:
        """One pass: count caps, then the budget, then the per-stream safety cap (module docstring)."""
        t0 = time.perf_counter()
        res = PassResult()
        streams = self.streams()
        floors: dict[str, str | None] = {}

        def floor(stream: str) -> str | None:
            if stream not in floors:
                floors[stream] = stream_floor(self.r, stream)
            return floors[stream]

        for stream, keep in self.keep_newest.items():
            extra = int(self.r.xlen(stream)) - keep if stream in streams else 0
            if extra > 0:
                res.moved.append(self._move(stream, floor(stream), extra))
        sizes = {s: int(self.r.memory_usage(s) or 0) for s in streams}
        res.used_before = res.used_after = sum(sizes.values())
        if res.used_before > self.budget_bytes:
            need = res.used_before - LOW_WATER * self.budget_bytes
            for stream in sorted(streams, key=lambda s: -sizes[s]):
                if need <= 0:
                    break
                length = int(self.r.xlen(stream))
                if floor(stream) is None or not length:
                    continue
                per_entry = sizes[stream] / length
                moved = self._move(stream, floor(stream), math.ceil(need / per_entry))
                res.moved.append(moved)
                need -= moved.trimmed * per_entry
            sizes = {s: int(self.r.memory_usage(s) or 0) for s in streams}
            res.used_after = sum(sizes.values())
        res.over_budget = res.used_after > self.budget_bytes
        if self.max_stream_bytes:
            for stream, used in sizes.items():
                if used > self.max_stream_bytes:
                    res.moved.append(self._cap(stream, used))
                    res.capped.append(stream)
        res.seconds = time.perf_counter() - t0
        self.over_budget, self.last = res.over_budget, res
        self._log(res)
        return res

    def _cap(self, stream: str, used: int) -> Moved:
        """Move the oldest entries of a stream over max_stream_bytes, read or not, and say so loudly."""
        assert self.max_stream_bytes
        length = int(self.r.xlen(stream))
        keep = max(1, int(length * self.max_stream_bytes / used * 0.9))
        moved = self._move(stream, None, length - keep)
        log.error(
            "%s on %s: %d bytes > bus.max_stream_bytes %d; moved the %d oldest entries to the archive, "
            "unread ones included (a consumer group will not see those: consumers are too far behind)",
            CAP_BIT,
            stream,
            used,
            self.max_stream_bytes,
            moved.trimmed,
        )
        return moved

    def _log(self, res: PassResult) -> None:
        if res.archived or any(m.trimmed for m in res.moved):
            log.info(
                "retention: archived %d entries (%s), trimmed %d, in %.0f ms; streams %s -> %s of a %s "
                "budget",
                res.archived,
                _size(sum(m.archived_bytes for m in res.moved)),
                sum(m.trimmed for m in res.moved),
                res.seconds * 1000,
                _size(res.used_before),
                _size(res.used_after),
                _size(self.budget_bytes),
            )
        if res.over_budget:
            log.warning(
                "retention: unread data takes %s, over bus.redis_max_bytes %s: producers are paced to one "
                "global step per version until consumers catch up",
                _size(res.used_after),
                _size(self.budget_bytes),
            )


def _size(n: float) -> str:
    """Bytes as KiB below a MiB, else MiB, for log lines."""
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / 2**20:.1f} MiB"
