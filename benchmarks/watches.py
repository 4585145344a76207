"""What the trainer's two watches cost Redis: LeaseExpiry's snapshot (`finished_counts`: `lease_snapshot`'s
leases, consumed and revoked bit counts, trainer group and wants; every 0.25 s) and FloodFence's measurement
(`FloodFence.measure`: MEMORY USAGE SAMPLES 0, every 1 s), with P producers whose streams hold rollouts.

Run: `rollstream bench watches [--producers P] [--entries E] [--response-len L] [--samples N]
[--calls C] [--redis-url URL]`. Each producer's `rollouts:<p>` gets E rollouts (N samples of L response
tokens each: the entry size is printed), half of them read by the trainer group; then each watch runs C
times. Prints per call: wall ms (client round trip and decoding) and server µs (INFO commandstats, the
watch's commands only; on a Redis shared with other work the same commands of others count too); and the
per-second load at the watches' periods. The run namespace is throwaway and deleted afterwards.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from rollstream.bus import Publisher, connect, delete_run, setup_run
from rollstream.keys import TRAINER_GROUP, Keys, producer_names
from rollstream.pacing.expiry import LeaseExpiry, finished_counts
from rollstream.pacing.fence import FloodFence
from rollstream.testing.fakes import fake_rollout_sample
from schemas import encode

#: The commands the two watches send (INFO commandstats names).
WATCH_COMMANDS = ("hgetall", "bitcount", "xinfo|stream", "xinfo|groups", "get", "strlen", "memory|usage",
                  "multi", "exec")


def server_usec(r: redis.Redis) -> dict[str, int]:
    """Command -> total µs Redis spent in it so far (the watches' commands only)."""
    stats: Any = r.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in WATCH_COMMANDS}


def fill(
    r: redis.Redis, keys: Keys, producers: Sequence[str], entries: int, n: int, response_len: int
) -> int:
    """Publish `entries` rollouts per producer and have the trainer group read half; returns entry bytes."""
    pub = Publisher(r)
    sample = fake_rollout_sample("x-0", n=n, prompt_len=32, response_len=response_len, producer="x")
    size = sum(len(k) + len(v) for k, v in encode(sample).items())
    for p in producers:
        for seq in range(entries):
            sample = fake_rollout_sample(
                f"{p}-{seq}", n=n, prompt_len=32, response_len=response_len, producer=p
            )
            pub.publish(keys.rollouts_of(p), sample)
        r.xreadgroup(TRAINER_GROUP, "bench", {keys.rollouts_of(p): ">"}, count=entries // 2)
    return size


def measure(r: redis.Redis, call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(wall ms per call, server µs per call) of `call` over `calls` runs."""
    before = server_usec(r)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    wall = (time.perf_counter() - t0) / calls * 1e3
    after = server_usec(r)
    return wall, sum(after[c] - before[c] for c in WATCH_COMMANDS) / calls


def main(argv: Sequence[str] | None = None) -> int:
    """Measure both watches and print one line each plus the per-second load."""
    p = argparse.ArgumentParser(prog="rollstream bench watches", description=__doc__.splitlines()[0])
    p.add_argument("--producers", type=int, default=8, help="producers (streams watched)")
    p.add_argument("--entries", type=int, default=200, help="rollouts per producer's stream")
    p.add_argument("--samples", type=int, default=8, help="samples per rollout entry (n)")
    p.add_argument("--response-len", type=int, default=256, help="response tokens per sample")
    p.add_argument("--calls", type=int, default=200, help="runs of each watch")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to measure on")
    args = p.parse_args(argv)
    r = connect(args.redis_url)
    keys = Keys(f"bench-watches-{uuid.uuid4().hex[:8]}")
    names = producer_names(args.producers)
    try:
        setup_run(r, keys, names)
        size = fill(r, keys, names, args.entries, args.samples, args.response_len)
        print(f"{args.producers} producers, {args.entries} rollouts each of {size} bytes "
              f"({args.samples} samples x {args.response_len} tokens), {args.calls} calls per watch")
        fence, expiry = FloodFence(None, 1), LeaseExpiry(600.0, 1, 1)
        rows = {
            "LeaseExpiry finished_counts": (lambda: finished_counts(r, keys, names), expiry.every_s),
            "FloodFence measure": (lambda: fence.measure(r, keys, names), fence.every_s),
        }
        load = 0.0
        for label, (call, period) in rows.items():
            wall, usec = measure(r, call, args.calls)
            load += usec / period
            print(f"{label}: {wall:.3f} ms wall, {usec:.0f} us server per call (every {period:g} s)")
        print(f"together: {load:.0f} us of Redis time per second ({load / 1e4:.3f} % of one core)")
    finally:
        delete_run(r, keys)
    return 0
