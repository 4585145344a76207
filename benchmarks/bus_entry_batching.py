"""What several samples per stream entry could buy (issue 23's open ours/raw targets): the raw baseline's
cycle (pipelined XADD, XREADGROUP, XACK of opaque fields) with K samples' bytes per entry against one sample
per entry, alternated, µs per sample, beside our codec's CPU per sample, and the best ours/raw each layout
allows.

The raw cycle is benchmarks/bus_trials.py's trial_raw; the codec's CPU is benchmarks/codec_cpu.py's. ours/raw
with K samples per entry can be at best

    raw(K=1) / (raw(K) + encode + decode)

even if every per-entry cost of our codec vanished; the printed `bound` is that. Run:
`rollstream bench bus_entry_batching [--sizes 16K,256K] [--k 8] [--reps 5]`; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

import redis

from benchmarks.bus_trials import DEFAULT_URL, make_sample, parse_size, trial_inputs, trial_raw
from benchmarks.codec_cpu import measure
from rollstream.runtime.process import freeze_startup_heap, tune_allocator


def raw_us_per_sample(r: redis.Redis, payload: bytes, n: int, batch: int, k: int, prefix: str) -> float:
    """µs per sample of the raw cycle carrying k samples' bytes in each entry (keys under prefix-<uuid>,
    deleted after)."""
    entries = max(1, n // k)
    t = trial_raw(r, payload * k, entries, max(1, batch // k), prefix)
    return t.total_s / (entries * k) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each size and print the JSON report; returns an exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=DEFAULT_URL, help="Redis to measure against (keys are deleted)")
    p.add_argument("--sizes", default="16K,256K", help="comma-separated sample sizes on the wire")
    p.add_argument("--k", type=int, default=8, help="samples per entry of the batched layout")
    p.add_argument("--reps", type=int, default=5, help="alternated repetitions per size")
    p.add_argument("--mb-per-trial", type=float, default=32.0, help="MB each trial moves")
    p.add_argument("--calls", type=int, default=2000, help="codec calls per timing loop")
    p.add_argument("--prefix", default="entrybatch", help="key prefix of the trials' namespaces")
    args = p.parse_args(argv)
    if args.k < 2:
        p.error(f"--k must be >= 2, got {args.k}")
    try:
        sizes = {text.strip(): parse_size(text) for text in args.sizes.split(",") if text.strip()}
    except ValueError as e:
        p.error(f"bad --sizes: {e}")
    r = redis.Redis.from_url(args.redis_url)
    tune_allocator()
    freeze_startup_heap()
    out = {}
    for text, size in sizes.items():
        wire, payload, batch, n = trial_inputs(make_sample(size), args.mb_per_trial)
        n = max(n, batch * args.k)  # at least one batch of K-sample entries
        one: list[float] = []
        many: list[float] = []
        for _ in range(args.reps):
            one.append(raw_us_per_sample(r, payload, n, batch, 1, args.prefix))
            many.append(raw_us_per_sample(r, payload, n, batch, args.k, args.prefix))
        codec = measure(r, size, args.calls, 5, held_mb=0)
        raw1, rawk = statistics.median(one), statistics.median(many)
        out[text] = {
            "wire_bytes": wire,
            "raw_us_1_per_entry": raw1,
            f"raw_us_{args.k}_per_entry": rawk,
            "codec_us": codec["encode_decode_us"],
            "bound_ours_over_raw_1_per_entry": raw1 / (raw1 + codec["encode_decode_us"]),
            f"bound_ours_over_raw_{args.k}_per_entry": raw1 / (rawk + codec["encode_decode_us"]),
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
