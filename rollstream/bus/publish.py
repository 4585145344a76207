"""Publishing events: XADD with readable header fields then the payload; pipelined batches."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from rollstream.bus.ids import text
from rollstream.keys import AGGREGATOR_GROUP, TRAINER_GROUP, Keys
from schemas import Event, encode


class RunNotSetUpError(RuntimeError):
    """XADD NOMKSTREAM found no stream: the run was never set up (or was deleted)."""

    @classmethod
    def for_stream(cls, stream: str) -> RunNotSetUpError:
        """The error for a write that found no `stream`, saying how to set the run up."""
        return cls(f"stream {stream} does not exist: run `rollstream run` or setup_run first")


def setup_run(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> None:
    """Create the run's consumed streams and their groups (idempotent): `metrics`, and each producer's
    `rollouts:<p>` (trainer group) and `stats:<p>` (aggregator group); record the producers in the
    `producers` set, then mark the run set up."""
    pairs = [(keys.metrics, AGGREGATOR_GROUP)]
    pairs += [(s, TRAINER_GROUP) for s in keys.rollouts_streams(producers)]
    pairs += [(s, AGGREGATOR_GROUP) for s in keys.stats_streams(producers)]
    for stream, group in pairs:
        ensure_group(r, stream, group)
    if producers:
        r.sadd(keys.producers, *producers)
    r.set(keys.setup, b"1")


def run_producers(r: redis.Redis, keys: Keys) -> list[str]:
    """The run's producer names as setup_run recorded them (sorted; [] for a run never set up)."""
    return sorted(text(p) for p in r.smembers(keys.producers))


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """XGROUP CREATE … MKSTREAM, ignoring BUSYGROUP (the group already exists)."""
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def delete_run(r: redis.Redis, keys: Keys) -> int:
    """Delete every key of a run namespace (tests, benchmarks, throwaway replays); returns how many."""
    batch = list(r.scan_iter(match=keys.pattern(), count=1000))
    for i in range(0, len(batch), 500):
        r.delete(*batch[i : i + 500])
    return len(batch)


class Publisher:
    """Appends encoded events to streams; with nomkstream=True a missing stream is an error, not created."""

    def __init__(self, r: redis.Redis, *, nomkstream: bool = True) -> None:
        self.r = r
        self.nomkstream = nomkstream

    def publish(self, stream: str, event: Event, entry_id: str = "*") -> str:
        """XADD one event; returns its entry id."""
        new_id = self.r.xadd(stream, encode(event), id=entry_id, nomkstream=self.nomkstream)  # type: ignore[arg-type]
        if new_id is None:
            raise RunNotSetUpError.for_stream(stream)
        return text(new_id)

    def publish_many(self, stream: str, events: Sequence[Event]) -> list[str]:
        """XADD several events in one pipelined round trip; returns their ids in order."""
        pipe = self.r.pipeline(transaction=False)
        for ev in events:
            pipe.xadd(stream, encode(ev), nomkstream=self.nomkstream)  # type: ignore[arg-type]
        ids = pipe.execute()
        if any(i is None for i in ids):
            raise RunNotSetUpError.for_stream(stream)
        return [text(i) for i in ids]
