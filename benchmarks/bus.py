"""Bus benchmark: RolloutSample throughput through our publish → GroupReader → decode → ack path, against a
raw redis-py baseline moving the same bytes, plus our codec against pickle (baseline only).

Per sample size (default ~16 KB, 256 KB, 4 MB on the wire) and per repetition, "ours" and "raw" trials
alternate so that machine drift hits both alike; the table reports medians and their ratio.

- ours: `Publisher.publish_many` of a batch (encode + pipelined XADD), then `GroupReader.poll` (XREADGROUP
  COUNT batch + decode to a validated RolloutSample) until the batch is in, then one `GroupReader.ack`.
- raw: the same cycle with one opaque `payload` field of the same total size: pipelined XADD of the batch,
  XREADGROUP COUNT batch, one XACK. No encoding, no decoding. It uses the very client ours uses (as
  `connect()` builds it: rollstream's RESP command packer, redis-py's hiredis reply parser) in the same
  process, which tuned its allocator and froze its start-up heap first as workers do; `--packer
  python|hiredis` puts both on one of redis-py's own command packers instead (raw is no faster with either:
  docs/history/BENCHMARKS-codec.md, issue 17).
- pickle: the raw cycle carrying `pickle.dumps(sample)` as its one field and `pickle.loads` after the read:
  the issue's decode baseline moved end to end, with none of our checks (a second baseline: "pickle/raw").

Each trial uses a fresh run namespace (`Keys(f"{prefix}-<uuid>")`) whose keys are deleted afterwards. Run:
`rollstream bench bus [--quick] [--json] [--sizes 16K,256K,4M] [--redis-url URL]`; `--tokens` for the
token-equal mode (benchmarks/bus_tokens.py), `--phases` for µs per sample of each phase
(benchmarks/bus_phases.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks import bus_phases, bus_tokens
from benchmarks.bus_trials import (
    DEFAULT_SIZES,
    DEFAULT_URL,
    Settings,
    bench_client,
    human_size,
    measure_size,
    packer_name,
    parse_size,
)
from rollstream.runtime.process import freeze_startup_heap, tune_allocator


def run_bench(
    url: str, s: Settings, shapes: list[tuple[int, int, int]] | None = None, phases: bool = False
) -> dict[str, Any]:
    """Measure every size (or, given token shapes, the token-equal mode of benchmarks.bus_tokens; with
    phases, benchmarks.bus_phases per size instead); returns the JSON-ready report (settings, machine,
    bytes per token, per-size medians and trials, phase rows)."""
    r = bench_client(url, s.packer)
    tune_allocator()  # as every worker does at start, and
    freeze_startup_heap()  # once built (ours and raw run in this one process alike)
    try:
        packer = packer_name(r)
        info: Any = r.info("server")
        rows = [bus_phases.measure_phases(r, size, s) for size in s.sizes] if phases else []
        results = [] if shapes or phases else [measure_size(r, size, s) for size in s.sizes]
        tokens = bus_tokens.run_tokens(r, shapes or [], s)
    finally:
        r.close()
        gc.unfreeze()  # (the process may go on: a test calling main())
    return {
        **tokens,
        "phases": rows,
        "settings": asdict(s),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "redis": info.get("redis_version"),
            "redis_url": url.split("@")[-1],
            "command_packer": packer,
        },
        "sizes": [
            {
                "size": human_size(res.wire_bytes),
                "target_bytes": res.target_bytes,
                "wire_bytes": res.wire_bytes,
                "samples_per_trial": res.samples_per_trial,
                "batch": res.batch,
                **res.summary(),
                "trials": {
                    which: [asdict(t) for t in getattr(res, which)] for which in ("ours", "raw", "pickle")
                },
                "codec_us_rounds": res.codec_us,
            }
            for res in results
        ],
    }


def format_table(report: dict[str, Any]) -> str:
    """The markdown tables of a report's medians (bytes per token first)."""
    tokens = bus_tokens.format_tokens(report)
    if report.get("phases"):
        return tokens.split("\n\n")[0] + "\n\n" + bus_phases.format_phases(report["phases"])
    if not report["sizes"]:
        return tokens
    lines = [
        tokens.split("\n\n")[0],
        "",
        "| size | batch | ours samples/s | ours MB/s | raw MB/s | ours/raw | pickle/raw "
        "| encode µs ours vs pickle | decode µs ours vs pickle | decode pickle/ours | decode + assembly µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["sizes"]:
        lines.append(
            f"| {row['size']} | {row['batch']} | {row['ours_samples_per_s']:,.0f} "
            f"| {row['ours_mb_per_s']:,.0f} "
            f"| {row['raw_mb_per_s']:,.0f} | {row['ours_over_raw']:.2f} | {row['pickle_over_raw']:.2f} "
            f"| {row['encode_ours_us']:,.0f} vs {row['encode_pickle_us']:,.0f} "
            f"| {row['decode_ours_us']:,.0f} vs {row['decode_pickle_us']:,.0f} "
            f"| {row['decode_pickle_over_ours']:.2f} | {row['decode_assemble_us']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollstream bench bus`."""
    p = argparse.ArgumentParser(prog="rollstream bench bus", description=__doc__.splitlines()[0])
    p.add_argument(
        "--redis-url", default=DEFAULT_URL, help="Redis to benchmark against (keys are cleaned up)"
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="comma-separated sample sizes on the wire, e.g. 16K,4M"
    )
    p.add_argument(
        "--mb-per-trial", type=float, default=None, help="MB each trial moves (default 48; quick 2)"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="interleaved ours/raw/pickle repetitions per size (default 5)"
    )
    p.add_argument(
        "--batch", type=int, default=None, help="samples per pipeline and XREADGROUP (default ~4 MB)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a few seconds: small trials, 2 repetitions, no warm-up"
    )
    p.add_argument("--json", action="store_true", help="print the full report as JSON instead of the table")
    p.add_argument(
        "--packer",
        default="client",
        choices=["client", "python", "hiredis"],
        help="RESP command packer of ours and raw: as connect() builds it (client), or redis-py's "
        "pure-Python or hiredis one",
    )
    p.add_argument("--prefix", default="bench", help="run-name prefix of the benchmark's Redis namespaces")
    p.add_argument(
        "--phases",
        action="store_true",
        help="instead of the rates: µs per sample of each phase (encode, XADD, XREADGROUP, decode, "
        "XACK, gc) at each --sizes, against raw's",
    )
    p.add_argument(
        "--tokens",
        default=None,
        const="8x512x2048,8x512x16384",
        nargs="?",
        help="token-equal mode instead of --sizes: comma-separated NxPROMPTxRESPONSE shapes "
        "(alone: 8x512x2048,8x512x16384); ours vs raw at equal tokens",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bus benchmark and print the markdown table (or --json); returns an exit code."""
    args = build_parser().parse_args(argv)
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError as e:
        print(f"bench bus: bad --sizes: {e}", file=sys.stderr)
        return 2
    try:
        wanted = args.tokens.split(",") if args.tokens else []
        shapes = [bus_tokens.parse_shape(x) for x in wanted if x.strip()] or None
    except ValueError as e:
        print(f"bench bus: bad --tokens: {e}", file=sys.stderr)
        return 2
    s = Settings(
        sizes=sizes,
        mb_per_trial=args.mb_per_trial or (2.0 if args.quick else 48.0),
        reps=args.reps or (2 if args.quick else 5),
        batch=args.batch,
        codec_min_s=0.003 if args.quick else 0.03,
        warmup=not args.quick,
        prefix=args.prefix,
        packer=args.packer,
    )
    t0 = time.perf_counter()
    report = run_bench(args.redis_url, s, shapes, phases=args.phases)
    report["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        cmd = " ".join(["rollstream bench bus", *(argv if argv is not None else sys.argv[1:])])
        print(
            f"<!-- {cmd}: {report['machine']['cpus']} cpus, redis {report['machine']['redis']}, "
            f"{report['machine']['command_packer']}, "
            f"{s.reps} reps x {s.mb_per_trial:g} MB, {report['elapsed_s']:.0f} s -->"
        )
        print(format_table(report), end="")
    return 0
