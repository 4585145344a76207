"""Producers that flood Redis (rollstream/pacing/__init__.py tells the scheme): the trainer's `FloodFence`
measures each producer's own keys and streams and fences one past its bound (its unfinished lease taken back,
and the warden asked to switch its ACL user off and kill its connections: rollstream/ops/warden.py; the
trainer's own user may do neither), and `fenced` reads who was fenced and why."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from rollstream.keys import Keys
from rollstream.pacing.expiry import expire_lease

log = logging.getLogger(__name__)

#: Bytes a producer's four keys (cursor, published, want, version) may hold together: counts and a short
#: cursor take tens; past it the producer is fenced.
PRODUCER_KEYS_MAX_BYTES = 4096


class FloodFence:
    """The trainer's watch on each producer's memory (issue 41): every `every_s` it measures the producer's
    four keys (STRLEN) and its two streams (MEMORY USAGE, sampled); past PRODUCER_KEYS_MAX_BYTES or
    `bound_bytes` it fences the producer: the reason written to the `fenced` hash (status shows it, and the
    warden, reading it, switches the producer's ACL user off and kills its connections) and logged, its
    unfinished lease taken back (expire_lease) and no more leased to it. The run goes on with the others. A
    restarted trainer reads the hash and keeps leasing the fenced producers nothing."""

    def __init__(
        self, bound_bytes: int | None, max_outstanding: int, *, every_s: float = 5.0, clock: Any = None
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
        """Producer -> (bytes in its four keys, bytes of its two streams as MEMORY USAGE samples them)."""
        pipe = r.pipeline(transaction=False)
        for p in producers:
            for key in keys.producer_keys(p):
                pipe.strlen(key)
            pipe.memory_usage(keys.rollouts_of(p))
            pipe.memory_usage(keys.stats_of(p))
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
            out.append((p, why))
        return out

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
