"""The layering rule: lower packages never import higher ones. The runtime (rollstream/) and the wire
contract (schemas/) import no worker package; workers import no benchmark, and producers and consumers never
import each other. Checked on the source with ast (every import statement, also inside functions and
TYPE_CHECKING blocks), so it cannot be fooled by a lazy import; the CLI loads workers and benchmarks by module
name (importlib) instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: package -> top-level packages none of its modules may import.
FORBIDDEN = {
    "schemas": {"rollstream", "producers", "consumers", "benchmarks"},
    "rollstream": {"producers", "consumers", "benchmarks"},
    "producers": {"consumers", "benchmarks"},
    "consumers": {"producers", "benchmarks"},
}


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import statement in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def test_the_check_sees_imports_anywhere_in_a_module() -> None:
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from producers.worker import Producer\n"
           "def f():\n    import consumers.trainer.loop as loop\n    from benchmarks import bus\n")
    assert [p for _, p in imported_packages(src)] == ["typing", "producers", "consumers", "benchmarks"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_no_higher_package(package: str) -> None:
    paths = sorted((ROOT / package).rglob("*.py"))
    assert paths, f"no modules under {package}/"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {top}"
        for path in paths
        for line, top in imported_packages(path.read_text(encoding="utf-8"))
        if top in FORBIDDEN[package]
    ]
    assert offenders == []
