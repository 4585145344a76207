"""CPU µs per sample of the codec alone, in this process (`time.process_time`, best of `--rounds` loops of
`--calls` calls): `schemas.encode`, `schemas.decode` of the fields as Redis returns them (bytes names and
values, read back with XRANGE), and pickle protocol 5 (dumps, loads) of the same RolloutSample, at each size
of `benchmarks.bus_trials.make_sample`; and both decodes as a trainer meets them ("held"): each entry its own
buffers (--held-mb of distinct entries read back from Redis, distinct pickle blobs), decoded a read batch
(`default_batch`) at a time with the previous batch's results still held, so neither reuses a hot buffer or
the allocation it just freed. Built on the public API only, so one copy of this file can time
another tree's codec: `PYTHONPATH=<tree> python benchmarks/codec_cpu.py --sizes 16K,256K,4M`
(docs/history/BENCHMARKS-codec.md, issue 23, alternates two trees that way). Prints one JSON object."""

from __future__ import annotations

import argparse
import importlib
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from benchmarks.bus_trials import DEFAULT_URL, default_batch, make_sample, parse_size, wire_size
from schemas import decode, encode


def best_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """The least process-time µs per call over `rounds` loops of `calls` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    return best


def held_us(fn: Callable[[Any], object], items: Sequence[Any], batch: int, rounds: int) -> float:
    """The least process-time µs per item over `rounds` passes of fn over items, `batch` at a time, each
    batch's results held until the next batch's replace them (a trainer holds what it read)."""
    best = float("inf")
    for _ in range(rounds):
        held: list[object] = []
        t0 = time.process_time()
        for start in range(0, len(items), batch):
            held = [fn(x) for x in items[start : start + batch]]
        best = min(best, (time.process_time() - t0) / len(items) * 1e6)
        del held
    return best


def measure(r: redis.Redis, size: int, calls: int, rounds: int, held_mb: float = 64.0) -> dict[str, float]:
    """encode, decode, encode + decode, pickle dumps / loads µs (hot and held) and entry facts of one size."""
    pickle = importlib.import_module("pickle")  # the baseline being timed, never a read path
    sample = make_sample(size)
    key = f"codec-cpu-{uuid.uuid4().hex}"
    batch = default_batch(wire_size(encode(sample)))  # what one XREADGROUP of the bus benchmark reads
    copies = max(4 * batch, round(held_mb * (1 << 20) / size) // batch * batch) if held_mb > 0 else 0
    try:
        pipe = r.pipeline(transaction=False)
        for _ in range(max(1, copies)):
            pipe.xadd(key, encode(sample))  # type: ignore[arg-type]
        pipe.execute()
        entries: Any = r.xrange(key)  # each entry its own bytes, as every reader gets them
        fields: dict[bytes, bytes] = entries[0][1]
    finally:
        r.delete(key)
    blob = pickle.dumps(sample, protocol=5)
    scale = max(1, size // (256 << 10))  # fewer calls for big samples
    n = max(20, calls // scale)
    enc = best_us(lambda: encode(sample), n, rounds)
    dec = best_us(lambda: decode(fields), n, rounds)
    out = {
        "encode_us": enc,
        "decode_us": dec,
        "encode_decode_us": enc + dec,
        "pickle_dumps_us": best_us(lambda: pickle.dumps(sample, protocol=5), n, rounds),
        "pickle_loads_us": (loads := best_us(lambda: pickle.loads(blob), n, rounds)),
        "decode_pickle_over_ours": loads / dec,
        "entry_fields": len(fields),
        "entry_bytes": sum(len(k) + len(v) for k, v in fields.items()),
    }
    if copies:
        held = [f for _, f in entries]
        blobs = [pickle.dumps(sample, protocol=5) for _ in range(copies)]
        dec_held = held_us(decode, held, batch, 3)
        loads_held = held_us(pickle.loads, blobs, batch, 3)
        out |= {
            "held_batch": batch,
            "held_entries": copies,
            "decode_held_us": dec_held,
            "pickle_loads_held_us": loads_held,
            "decode_pickle_over_ours_held": loads_held / dec_held,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Time the codec at each size and print the JSON report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default="16K,256K,4M", help="comma-separated sample sizes on the wire")
    p.add_argument("--calls", type=int, default=1000, help="calls per timed loop (fewer above 256 KB)")
    p.add_argument("--rounds", type=int, default=15, help="timed loops per measure; the best is kept")
    p.add_argument("--redis-url", default=DEFAULT_URL, help="Redis the samples go through (keys deleted)")
    p.add_argument("--held-mb", type=float, default=64.0, help="MB of entries to decode held (0: none)")
    args = p.parse_args(argv)
    r = redis.Redis.from_url(args.redis_url)
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
        report = {str(size): measure(r, size, args.calls, args.rounds, args.held_mb) for size in sizes}
    finally:
        r.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
