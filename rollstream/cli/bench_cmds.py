"""`rollstream bench`: run a benchmark of the benchmarks package (loaded by module name), or list them."""

from __future__ import annotations

import argparse
import sys


def cmd_bench(args: argparse.Namespace) -> int:
    """`rollstream bench`: run benchmark NAME with the remaining arguments; list them without NAME."""
    from rollstream.ops.bench import BenchmarkError, format_list, list_benchmarks, load_benchmark

    if args.list or args.name is None:
        print(format_list(list_benchmarks()))
        return 0
    try:
        main = load_benchmark(args.name)
    except BenchmarkError as e:
        print(f"rollstream bench: {e}", file=sys.stderr)
        return 1
    return int(main(list(args.args)) or 0)
