"""CPU µs per sample of the codec alone, in this process (`time.process_time`, best of `--rounds` loops of
`--calls` calls): `schemas.encode`, `schemas.decode` of the fields as Redis returns them (bytes names and
values, read back with XRANGE), and pickle protocol 5 (dumps, loads) of the same RolloutSample, at each size
of `benchmarks.bus_trials.make_sample`. Built on the public API only, so one copy of this file can time
another tree's codec: `PYTHONPATH=<tree> python benchmarks/codec_cpu.py --sizes 16K,256K,4M` (BENCHMARKS.md,
issue 23's third pass, alternates two trees that way). Prints one JSON object."""

from __future__ import annotations

import argparse
import importlib
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from benchmarks.bus_trials import DEFAULT_URL, make_sample, parse_size
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


def measure(r: redis.Redis, size: int, calls: int, rounds: int) -> dict[str, float]:
    """encode, decode, encode + decode, pickle dumps / loads µs and entry facts of one size."""
    pickle = importlib.import_module("pickle")  # the baseline being timed, never a read path
    sample = make_sample(size)
    key = f"codec-cpu-{uuid.uuid4().hex}"
    try:
        r.xadd(key, encode(sample))  # type: ignore[arg-type]
        entries: Any = r.xrange(key, count=1)
        fields: dict[bytes, bytes] = entries[0][1]  # as every reader gets them
    finally:
        r.delete(key)
    blob = pickle.dumps(sample, protocol=5)
    scale = max(1, size // (256 << 10))  # fewer calls for big samples
    n = max(20, calls // scale)
    enc = best_us(lambda: encode(sample), n, rounds)
    dec = best_us(lambda: decode(fields), n, rounds)
    return {
        "encode_us": enc,
        "decode_us": dec,
        "encode_decode_us": enc + dec,
        "pickle_dumps_us": best_us(lambda: pickle.dumps(sample, protocol=5), n, rounds),
        "pickle_loads_us": (loads := best_us(lambda: pickle.loads(blob), n, rounds)),
        "decode_pickle_over_ours": loads / dec,
        "entry_fields": len(fields),
        "entry_bytes": sum(len(k) + len(v) for k, v in fields.items()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Time the codec at each size and print the JSON report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default="16K,256K,4M", help="comma-separated sample sizes on the wire")
    p.add_argument("--calls", type=int, default=1000, help="calls per timed loop (fewer above 256 KB)")
    p.add_argument("--rounds", type=int, default=15, help="timed loops per measure; the best is kept")
    p.add_argument("--redis-url", default=DEFAULT_URL, help="Redis the sample goes through once")
    args = p.parse_args(argv)
    r = redis.Redis.from_url(args.redis_url)
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
        report = {str(size): measure(r, size, args.calls, args.rounds) for size in sizes}
    finally:
        r.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
