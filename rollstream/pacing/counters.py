"""The pacing's counters as read (rollstream/pacing/__init__.py tells the scheme): leases, published counts,
consumed bits, the run-wide counters in one snapshot (status, producers), the dispatch log (grants, top-ups,
leases, expiries). Nothing here writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from rollstream.bus.ids import count_or_none, parse_id, shown, split_sample_id, text
from rollstream.bus.streams import iter_stream
from rollstream.keys import DROPPED_STALE_FIELD, Keys
from schemas.text_entries import DispatchRecord, decode_dispatch


def is_consumed(r: redis.Redis, keys: Keys, sample_id: str) -> bool:
    """True when the prompt of a leased sample id was counted as consumed."""
    parsed = split_sample_id(sample_id)
    return parsed is not None and bool(r.getbit(keys.consumed_bits(parsed[0]), parsed[1]))


def leases(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """Producer -> prompts leased to it so far."""
    raw: Any = r.hgetall(keys.lease)
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def lease_of(r: redis.Redis, keys: Keys, producer: str) -> int:
    """Prompts leased to `producer` so far (0 before its first lease)."""
    return int(cast(Any, r.hget(keys.lease, producer)) or 0)


def published_count(r: redis.Redis, keys: Keys, producer: str) -> int:
    """Prompts `producer` has published so far (its next seq), as it says: 0 when its key holds anything
    but a canonical count (`published_report` says which)."""
    return published_report(r, keys, producer)[0]


def published_report(r: redis.Redis, keys: Keys, producer: str) -> tuple[int, str | None]:
    """(`published_count`, None), or (0, why) when the producer's own `published` key holds something that
    is not a canonical count (the value is its input: reported, never trusted)."""
    return read_count(cast(Any, r.get(keys.producer_published(producer))), keys.producer_published(producer))


def read_count(raw: Any, field: str) -> tuple[int, str | None]:
    """(value, None) of a count read from Redis (None: 0), or (0, why) when it is not a canonical count."""
    if raw is None:
        return 0, None
    n = count_or_none(raw)
    if n is None:
        return 0, f"{field}={shown(raw)} is not a canonical count: ignored"
    return n, None


def dispatch_entries(r: redis.Redis, keys: Keys) -> list[DispatchRecord]:
    """Every grant, top-up and lease (and an older run's producer takes and releases), in id order."""
    rc: Any = r
    streams = [
        keys.dispatch_log,
        *(text(k) for k in rc.scan_iter(match=keys.producer_pattern("dispatch_log"))),
    ]
    rows = sorted(((i, f) for s in streams for i, f in iter_stream(r, s)), key=lambda row: parse_id(row[0]))
    return [decode_dispatch(f) for _, f in rows]


@dataclass(frozen=True)
class RolloutCounts:
    """Run-wide pacing counters of all producers together, read in one snapshot."""

    dispatched: int  # prompts leased to producers
    consumed: int  # prompts the trainer finished with: trained, dropped as stale, evicted or dead-lettered
    in_flight: int  # leased, not yet published (generating, or a lease not used yet)
    dropped_stale: int  # consumed prompts the trainer dropped as too stale

    @property
    def published(self) -> int:
        """Leased prompts on the rollouts stream so far (leased minus in flight)."""
        return self.dispatched - self.in_flight

    @property
    def queued(self) -> int:
        """Samples published and not yet consumed: the trainer group's backlog (undelivered + buffered)."""
        return self.published - self.consumed


def rollout_counts(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> RolloutCounts:
    """One MULTI snapshot of the global counters, in flight summed over the named producers (their lease
    less what they published; GETs only: what the producer ACL allows)."""
    pipe = r.pipeline(transaction=True)
    pipe.get(keys.dispatched)
    pipe.get(keys.consumed)
    pipe.hget(keys.trainer, DROPPED_STALE_FIELD)
    for name in producers:
        pipe.hget(keys.lease, name)
        pipe.get(keys.producer_published(name))
    dispatched, consumed, dropped, *per = pipe.execute()
    return RolloutCounts(
        dispatched=int(dispatched or 0),
        consumed=int(consumed or 0),
        # a producer's own `published` is input: anything but a canonical count reads as 0, and more than
        # its lease as its lease (in flight is never negative)
        in_flight=sum(
            max(0, int(per[i] or 0) - (count_or_none(per[i + 1] or b"0") or 0)) for i in range(0, len(per), 2)
        ),
        dropped_stale=int(dropped or 0),
    )
