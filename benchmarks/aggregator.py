"""Aggregator fold throughput: the pure Fold (decoded events, decode + fold) and the worker through Redis.

Run: `rollstream bench aggregator [--steps N] [--local-updates K] [--producers P]
[--metrics M] [--redis-url URL]`. The Redis part uses a throwaway run namespace and deletes it afterwards.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

from consumers.aggregator.fold import Fold
from consumers.aggregator.worker import AggregatorWorker
from rollstream.bus import connect, delete_run
from rollstream.bus.reader import BURST_BLOCK_MS
from rollstream.config import load_config
from rollstream.keys import Keys
from rollstream.testing.fakes import fake_metrics_log, publish_log
from schemas import ProducerStats, decode, encode


def bench_pure(events: list[Any], repeats: int = 3) -> tuple[float, float]:
    """Best-of-`repeats` events/s of Fold.feed on decoded events, and of decode + Fold.feed."""
    ids = [f"{i + 1}-0" for i in range(len(events))]
    wire = [{k.encode(): bytes(v) for k, v in encode(ev).items()} for ev in events]
    fold_s = decode_s = float("inf")
    for _ in range(repeats):
        fold = Fold()
        t0 = time.perf_counter()
        for entry_id, ev in zip(ids, events, strict=True):
            fold.feed(entry_id, ev)
        fold_s = min(fold_s, time.perf_counter() - t0)
        fold = Fold()
        t0 = time.perf_counter()
        for entry_id, fields in zip(ids, wire, strict=True):
            fold.feed(entry_id, decode(fields))
        decode_s = min(decode_s, time.perf_counter() - t0)
    return len(events) / fold_s, len(events) / decode_s


def bench_worker(events: list[Any], redis_url: str) -> dict[str, float]:
    """Publish the log to a fresh namespace, drain it with the worker in burst mode; events/s and records."""
    r = connect(redis_url)
    keys = Keys(f"bench-agg-{uuid.uuid4().hex[:8]}")
    try:
        # stats to `stats`, trainer events to `metrics`, vouched for by the trainer hash
        publish_log(r, keys, events)
        with tempfile.TemporaryDirectory() as tmp:
            producers = max(
                1, len({e.producer for e in events if isinstance(e, ProducerStats)})
            )  # whose stats fold
            cfg = load_config(
                None,
                [
                    f"run.name={keys.run}",
                    f"run.dir={tmp}",
                    f"run.redis_url={redis_url}",
                    f"rollout.num_producers={producers}",
                ],
            )
            worker = AggregatorWorker(cfg, r, keys)
            t0 = time.perf_counter()
            worker.run(burst=True)
            # burst ends with one empty blocking poll
            elapsed = time.perf_counter() - t0 - BURST_BLOCK_MS / 1000
        return {"events_per_s": len(events) / elapsed, "records": worker.records_written, "seconds": elapsed}
    finally:
        delete_run(r, keys)


def main(argv: Sequence[str] | None = None) -> int:
    """Print one line per measurement."""
    p = argparse.ArgumentParser(prog="rollstream bench aggregator", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500, help="global steps in the synthetic log")
    p.add_argument("--local-updates", type=int, default=4, help="local updates per global step")
    p.add_argument("--producers", type=int, default=4, help="producers (one stats event each per step)")
    p.add_argument("--metrics", type=int, default=50, help="metrics per local update")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis for the worker benchmark")
    args = p.parse_args(argv)
    events = fake_metrics_log(
        args.steps,
        local_updates=args.local_updates,
        producers=args.producers,
        metrics_per_update=args.metrics,
    )
    print(
        f"log: {len(events)} events ({args.steps} steps x ({args.local_updates} local updates + step_end "
        f"+ {args.producers} producer stats), validation every 5, {args.metrics} metrics per update)"
    )
    fold_eps, decode_eps = bench_pure(events)
    print(f"pure fold (decoded events):  {fold_eps:10.0f} events/s")
    print(f"decode + fold:               {decode_eps:10.0f} events/s")
    w = bench_worker(events, args.redis_url)
    print(
        f"worker through Redis:        {w['events_per_s']:10.0f} events/s ({w['records']:.0f} records, "
        f"{w['seconds']:.2f} s)"
    )
    return 0
