"""Decode while holding a batch: µs per sample and page faults of decoding samples as a trainer does
(the previous batch still alive in its buffer), with the workers' malloc tuning and without.

    rollstream bench decode_held [--sizes 256K,4M] [--batch 15] [--batches 100] [--reps 3] [--json]

Per size, one fake sample (benchmarks.bus_trials.make_sample: n = 4, calibrated to the size on the wire) is
encoded once; a fresh interpreter then decodes `--batches` batches of `--batch` copies of its entry, each
batch replacing the last, so every decode allocates while the previous batch is held. "tuned" calls
`rollstream.runtime.process.tune_allocator()` first, as every worker does at start; "plain" keeps glibc's
defaults. The two modes alternate over --reps fresh interpreters; the table gives medians of the per-batch µs
per sample and the minor page faults per sample, and plain ÷ tuned. No Redis is involved: this is the decode
alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.bus_trials import human_size, parse_size

PROBE = """
import json, resource, statistics, sys, time
from rollstream.runtime.process import tune_allocator
if sys.argv[1] == "tuned":
    tune_allocator()
from benchmarks.bus_trials import make_sample
from schemas import decode, encode
size, batch, batches = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fields = {k.encode(): bytes(v) for k, v in encode(make_sample(size)).items()}  # as redis-py returns them
entries = [dict(fields) for _ in range(batch)]
held = [decode(e) for e in entries]
times = []
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(batches):
    t0 = time.perf_counter()
    held = [decode(e) for e in entries]  # the previous batch is freed once this one exists
    times.append((time.perf_counter() - t0) / batch * 1e6)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"us": statistics.median(times), "faults": faults / (batch * batches)}))
"""


def run_probe(mode: str, size: int, batch: int, batches: int) -> dict[str, float]:
    """One fresh interpreter's median µs per sample and faults per sample (mode: tuned or plain)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(size), str(batch), str(batches)],
                         env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    return dict(json.loads(out.strip().splitlines()[-1]))


def measure(sizes: Sequence[int], batch: int, batches: int, reps: int) -> list[dict[str, Any]]:
    """Per size: medians over reps of each mode (alternating which runs first)."""
    rows = []
    for size in sizes:
        got: dict[str, list[dict[str, float]]] = {"plain": [], "tuned": []}
        for rep in range(reps):
            for mode in ("plain", "tuned") if rep % 2 == 0 else ("tuned", "plain"):
                got[mode].append(run_probe(mode, size, batch, batches))
        row: dict[str, Any] = {"size": size, "batch": batch, "batches": batches, "reps": reps}
        for mode, runs in got.items():
            row[f"{mode}_us"] = statistics.median(r["us"] for r in runs)
            row[f"{mode}_faults"] = statistics.median(r["faults"] for r in runs)
        row["plain_over_tuned"] = row["plain_us"] / row["tuned_us"]
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of BENCHMARKS.md."""
    out = [
        "| size | batch held | plain µs/sample | tuned µs/sample | plain ÷ tuned | faults/sample plain → "
        "tuned |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {human_size(r['size'])} | {r['batch']} | {r['plain_us']:,.0f} | {r['tuned_us']:,.0f} | "
            f"{r['plain_over_tuned']:.2f} | {r['plain_faults']:,.0f} → {r['tuned_faults']:,.0f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table (or --json)."""
    p = argparse.ArgumentParser(
        prog="rollstream bench decode_held", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--sizes", default="256K,4M", help="comma-separated sample sizes on the wire, e.g. 16K,4M")
    p.add_argument("--batch", type=int, default=15, help="samples per batch (the held buffer)")
    p.add_argument("--batches", type=int, default=100, help="timed batches per interpreter")
    p.add_argument("--reps", type=int, default=3, help="fresh interpreters per mode, alternating")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    rows = measure([parse_size(s) for s in args.sizes.split(",")], args.batch, args.batches, args.reps)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
