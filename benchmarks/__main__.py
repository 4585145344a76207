"""`python -m benchmarks NAME ARGS…` runs benchmark NAME's `main(ARGS)`; `python -m benchmarks [--list]` lists
them (`rollstream bench` runs this module, so the runtime imports no benchmark). Every module of this package
that defines a top-level `main(argv)` is one, named after its module without a trailing `_`
(`benchmarks/async_.py` is `async`)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The package the benchmarks live in (this one).
PACKAGE = "benchmarks"


class BenchmarkError(LookupError):
    """No benchmark of that name (the message lists the ones there are)."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its command name, module, and the first paragraph of its module docstring."""

    name: str
    module: str
    description: str


def _package_dir() -> Path | None:
    """The benchmarks package's folder, or None when it is not on sys.path."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _describe(path: Path) -> Benchmark | None:
    """The benchmark a module file is (parsed, not imported: listing imports neither torch nor workers),
    or None when it defines no top-level `main` taking an argument."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    if not any(isinstance(n, ast.FunctionDef) and n.name == "main" and n.args.args for n in tree.body):
        return None
    paragraph = (ast.get_docstring(tree) or "").strip().split("\n\n", 1)[0]
    return Benchmark(path.stem.rstrip("_"), f"{PACKAGE}.{path.stem}", " ".join(paragraph.split()))


def list_benchmarks() -> list[Benchmark]:
    """Every benchmark, by name ([] when the benchmarks package is not there)."""
    folder = _package_dir()
    if folder is None:
        return []
    found = (_describe(p) for p in sorted(folder.glob("*.py")) if not p.name.startswith("_"))
    return sorted((b for b in found if b is not None), key=lambda b: b.name)


def format_list(benchmarks: Sequence[Benchmark]) -> str:
    """One line per benchmark: name, then its description."""
    width = max((len(b.name) for b in benchmarks), default=0)
    return "\n".join(f"{b.name:<{width}}  {b.description}" for b in benchmarks)


def load_benchmark(name: str) -> Callable[[list[str]], int | None]:
    """The `main(argv)` of benchmark `name`, imported by module name; BenchmarkError when there is none."""
    known = {b.name: b for b in list_benchmarks()}
    if name not in known:
        there = ", ".join(known) or f"none: no {PACKAGE} package on the path"
        raise BenchmarkError(f"no benchmark {name!r} (there are: {there})")
    main: Callable[[list[str]], int | None] = importlib.import_module(known[name].module).main
    return main


def main(argv: Sequence[str] | None = None) -> int:
    """List the benchmarks (no NAME, or --list), or run benchmark NAME with the remaining arguments; exit 1
    naming the known ones when there is no NAME."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "--list":
        print(format_list(list_benchmarks()))
        return 0
    try:
        bench_main = load_benchmark(argv[0])
    except BenchmarkError as e:
        print(f"rollstream bench: {e}", file=sys.stderr)
        return 1
    sys.argv[0] = f"rollstream bench {argv[0]}"  # the program name argparse shows in usage and errors
    return int(bench_main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
