"""Producers that flood Redis (rollstream/pacing/__init__.py tells the scheme): the trainer's `FloodFence`
measures each producer's own keys and streams by their full size and fences one past its bound (its unfinished
lease taken back, its unread excess dropped, and the warden asked to switch its ACL user off and kill its
connections: rollstream/ops/warden.py; the trainer's own user may do neither), and `fenced` reads who was
fenced and why.

Sizes are measured, not sampled: `MEMORY USAGE key SAMPLES 0` walks every node of a stream. Its default
sampling (5 nodes) read 14 MiB for a stream of 4,240 MiB whose small honest entries at the head hid 1 MiB
ones behind them. The full walk costs 0.58 ms on a stream of 200,000 small entries (27.6 MB) and 0.20 ms on
500 entries of 1 MiB (against 0.18 and 0.08 ms sampled; redis 7.0, this repository's test host), so every
producer is measured every second.

Dropping the excess: a fenced producer's entries that no group has been delivered yet (after each group's
last-delivered id) are copied to `dead` (bounded copies: header, sizes, digest; reason `fenced: …`) and
deleted, newest first, in MULTIs of a few entries; so its memory falls back under its bound at once and every
dropped entry is accounted for (the audit counts a `fenced:` dead letter as its entry held; a dropped rollout
ends its sample id, whose seq the fence took back). Entries already delivered stay with their reader (acked
ones are archived by retention). An own key over PRODUCER_KEYS_MAX_BYTES, which can hold no count, is
deleted."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

import redis

from rollstream.bus.ids import parse_id, text
from rollstream.keys import Keys
from rollstream.pacing.expiry import expire_lease
from schemas import DEAD_FIELD_KEEP_BYTES, DeadLetter, dead_letter_of, encode
from schemas.events import entry_digest

log = logging.getLogger(__name__)

#: Bytes a producer's four keys (cursor, published, want, version) may hold together: counts and a short
#: cursor take tens; past it the producer is fenced.
PRODUCER_KEYS_MAX_BYTES = 4096
#: Reason prefix of the dead copy of an entry the fence dropped (the audit counts such an entry as held).
FENCE_DROPPED = "fenced"
#: Entries dropped per MULTI (each read whole once: up to max_entry_bytes).
DROP_BATCH = 16


class FloodFence:
    """The trainer's watch on each producer's memory (issue 41): every `every_s` it measures the producer's
    four keys (STRLEN) and its two streams (MEMORY USAGE SAMPLES 0: whole); past PRODUCER_KEYS_MAX_BYTES or
    `bound_bytes` it fences the producer: the reason written to the `fenced` hash (status shows it, and the
    warden, reading it, switches the producer's ACL user off and kills its connections) and logged, its
    unfinished lease taken back (expire_lease) and no more leased to it, its unread excess dropped (`drop`).
    The run goes on with the others. A restarted trainer reads the hash and keeps leasing the fenced
    producers nothing."""

    def __init__(
        self, bound_bytes: int | None, max_outstanding: int, *, every_s: float = 1.0, clock: Any = None
    ) -> None:
        """Fence past `bound_bytes` (> 0; None: its keys only) of streams; leases go back into a budget of
        `max_outstanding`."""
        if bound_bytes is not None and bound_bytes <= 0:
            raise ValueError(f"bus.producer_max_bytes={bound_bytes!r} must be > 0 bytes")
        self.bound, self.max_outstanding, self.every_s = bound_bytes, max_outstanding, every_s
        self.clock = clock or time.monotonic
        self.fenced: dict[str, str] = {}  # producer -> why (applied by this process)
        self._next = 0.0

    def measure(self, r: redis.Redis, keys: Keys, producers: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Producer -> (bytes in its four keys, bytes of its two streams: MEMORY USAGE of every node)."""
        pipe = r.pipeline(transaction=False)
        for p in producers:
            for key in keys.producer_keys(p):
                pipe.strlen(key)
            pipe.memory_usage(keys.rollouts_of(p), samples=0)
            pipe.memory_usage(keys.stats_of(p), samples=0)
        raw = pipe.execute(raise_on_error=False)
        out, n = {}, len(keys.producer_keys("x")) + 2
        for i, p in enumerate(producers):
            row = [v if isinstance(v, int) else 0 for v in raw[i * n : (i + 1) * n]]
            out[p] = (sum(row[:-2]), sum(row[-2:]))
        return out

    def maybe_check(self, r: redis.Redis, keys: Keys, producers: Sequence[str]) -> list[tuple[str, str]]:
        """Check when due; returns (producer, why) for each producer fenced now."""
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.every_s
        recorded: Any = r.hgetall(keys.fenced)
        for name, why in recorded.items():  # fenced before (a restarted trainer or Redis): keep it fenced
            p = name.decode() if isinstance(name, bytes) else str(name)
            if p in producers and p not in self.fenced:
                self._apply(r, keys, p, why.decode() if isinstance(why, bytes) else str(why))
        out = []
        watched = [p for p in producers if p not in self.fenced]
        for p, (key_bytes, stream_bytes) in self.measure(r, keys, watched).items():
            if key_bytes > PRODUCER_KEYS_MAX_BYTES:
                why = f"its keys hold {key_bytes} bytes, over {PRODUCER_KEYS_MAX_BYTES=}"
            elif self.bound is not None and stream_bytes > self.bound:
                why = f"its streams use {stream_bytes} bytes, over bus.producer_max_bytes={self.bound}"
            else:
                continue
            r.hset(keys.fenced, p, why)
            self._apply(r, keys, p, why)
            dropped, freed = self.drop(r, keys, p, why)
            if dropped:
                why = f"{why}; {dropped} unread entries ({freed} bytes) dropped to dead"
                r.hset(keys.fenced, p, why)
                self.fenced[p] = why
            out.append((p, why))
        return out

    def drop(self, r: redis.Redis, keys: Keys, producer: str, why: str) -> tuple[int, int]:
        """Drop a fenced producer's excess (module docstring): its entries no group was delivered yet, copied
        to `dead` and deleted, and its own keys over PRODUCER_KEYS_MAX_BYTES; returns (entries, bytes)."""
        for key in keys.producer_keys(producer):
            if int(cast(Any, r.strlen(key))) > PRODUCER_KEYS_MAX_BYTES:
                r.delete(key)
        entries = size = 0
        for stream in (keys.rollouts_of(producer), keys.stats_of(producer)):
            try:
                groups: Any = r.xinfo_groups(stream)
            except redis.ResponseError:
                continue  # no such stream
            floor = min((parse_id(text(g["last-delivered-id"])) for g in groups), default=(0, 0))
            while True:
                batch = [(text(i), f) for i, f in cast(Any, r.xrevrange(stream, count=DROP_BATCH))
                         if parse_id(text(i)) > floor]
                if not batch:
                    break
                pipe = r.pipeline(transaction=True)
                reason = f"{FENCE_DROPPED}: {producer} was fenced ({why}); unread entry dropped"
                for entry_id, fields in batch:
                    size += sum(len(k) + len(v) for k, v in fields.items())
                    pipe.xadd(keys.dead, encode(_header_copy(stream, entry_id, reason, fields)))  # type: ignore[arg-type]
                    pipe.xdel(stream, entry_id)
                pipe.execute()
                entries += len(batch)
        if entries:
            log.error("FENCED producer %s: %d unread entries (%d bytes) dropped", producer, entries, size)
        return entries, size

    def _apply(self, r: redis.Redis, keys: Keys, producer: str, why: str) -> None:
        """Take the producer's lease back and lease it nothing more (the `fenced` hash, written before, is the
        warden's request to switch its user off); log what happened."""
        self.fenced[producer] = why
        taken, _ = expire_lease(r, keys, producer, self.max_outstanding)
        log.error(
            "FENCED producer %s: %s; %d leased prompts taken back, the warden asked to switch its user off "
            "and kill its connections", producer, why, taken,
        )


def fenced(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """Producer -> why the trainer fenced it (empty when none was)."""
    raw: Any = r.hgetall(keys.fenced)
    return {(k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
            for k, v in raw.items()}


def _header_copy(stream: str, entry_id: str, reason: str, raw: dict[Any, Any]) -> DeadLetter:
    """A dropped entry's dead copy: its fields up to DEAD_FIELD_KEEP_BYTES each (its header), the sizes of
    the others and the digest of the whole, so dropping frees what the entry held."""
    fields = {text(k, errors="backslashreplace"): bytes(v) for k, v in raw.items()}
    kept = {k: v for k, v in fields.items() if len(v) <= DEAD_FIELD_KEEP_BYTES}
    omitted = {k: len(v) for k, v in fields.items() if k not in kept}
    return dead_letter_of(stream, entry_id, reason, kept).model_copy(
        update={"omitted": omitted, "sha256": entry_digest(fields)}
    )
