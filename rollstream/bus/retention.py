"""Retention that never drops unread data: MINID below the slowest group's oldest unacked or undelivered
entry, plus a byte-budget cap as a safety net that logs loudly when it bites."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from rollstream.bus.streams import parse_id, text

log = logging.getLogger(__name__)


@dataclass
class TrimResult:
    """What one retention pass did to one stream."""

    stream: str
    minid: str | None
    trimmed_minid: int
    trimmed_cap: int
    bytes_before: int


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


def trim_stream(r: redis.Redis, stream: str, max_bytes: int | None = None) -> TrimResult:
    """Trim stream by MINID below what every group still needs; then, only if it is still over max_bytes,
    cap it by length and log an error naming how many entries (possibly unread) were dropped."""
    minid = safe_min_id(r, stream)
    trimmed = 0
    if minid is not None:
        trimmed = int(r.xtrim(stream, minid=minid, approximate=False))
    used = int(r.memory_usage(stream) or 0) if max_bytes else 0
    capped = 0
    if max_bytes and used > max_bytes:
        length = int(r.xlen(stream))
        keep = max(1, int(length * max_bytes / used * 0.9))
        capped = int(r.xtrim(stream, maxlen=keep, approximate=False))
        log.error(
            "RETENTION CAP BIT on %s: %d bytes > budget %d; dropped %d oldest entries (consumers are too far "
            "behind: unread data may be lost; raise bus.max_stream_bytes or add consumers)",
            stream, used, max_bytes, capped,
        )
    return TrimResult(stream, minid, trimmed, capped, used)


class Janitor:
    """Runs a retention pass over some streams at most every `every_s` seconds (call `maybe_run` often)."""

    def __init__(
        self,
        r: redis.Redis,
        streams: list[str],
        every_s: float,
        max_bytes: int | None,
        capped: dict[str, int] | None = None,
    ) -> None:
        """streams: trimmed below every group's unread entries; capped: stream -> newest entries to keep
        (audit streams nobody consumes, such as fates and params)."""
        self.r = r
        self.streams = streams
        self.capped = capped or {}
        self.every_s = every_s
        self.max_bytes = max_bytes
        self._next = 0.0

    def maybe_run(self, now: float | None = None) -> list[TrimResult]:
        """Trim every stream if the interval has passed; returns what was done ([] when not yet due)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return []
        self._next = now + self.every_s
        results = [trim_stream(self.r, s, self.max_bytes) for s in self.streams]
        for stream, keep in self.capped.items():
            n = int(self.r.xtrim(stream, maxlen=keep, approximate=True))
            results.append(TrimResult(stream, None, 0, n, 0))
        trimmed = sum(t.trimmed_minid + t.trimmed_cap for t in results)
        if trimmed:
            log.info("retention: trimmed %d entries from %s", trimmed, ", ".join(self.streams))
        return results
