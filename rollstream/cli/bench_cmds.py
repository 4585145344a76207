"""`rollstream bench`: run a benchmark of the benchmarks package, or list them, as its own process
(`python -m benchmarks`: the runtime imports no benchmark)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys


def cmd_bench(args: argparse.Namespace) -> int:
    """`rollstream bench`: run benchmark NAME with the remaining arguments; list them without NAME. The
    benchmark's exit status is this command's; 1 when there is no benchmarks package on the path."""
    if importlib.util.find_spec("benchmarks") is None:
        print("rollstream bench: no benchmarks package on the path (run it from a source checkout)",
              file=sys.stderr)
        return 1
    argv = ["--list"] if args.list or args.name is None else [args.name, *args.args]
    return subprocess.run([sys.executable, "-m", "benchmarks", *argv]).returncode
