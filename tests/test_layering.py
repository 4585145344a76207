"""The layering rule: lower packages never import higher ones. The runtime (rollstream/) and the wire contract
(schemas/) import no worker package; workers import no benchmark, and producers and consumers never import
each other. The fixtures (rollstream/testing/) are part of the runtime package: they import no worker either,
and no runtime code imports them. Checked on the source with ast (every import statement, also inside
functions and TYPE_CHECKING blocks, and every `importlib.import_module(...)` / `__import__(...)` call: by its
string, and one whose module is not a string literal counts as an offender), so neither a lazy import nor an
import by name can hide one; the CLI runs workers and benchmarks as their own processes (`python -m`)."""

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
#: What an import by name whose module is not a string literal counts as (it could be any package).
DYNAMIC = "<import by a computed name>"
#: The functions that import a module by its name.
IMPORTERS = {"import_module", "__import__"}


def _import_by_name(node: ast.Call) -> str | None:
    """The dotted module an `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` call
    imports (DYNAMIC when it is not a string literal); None for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in IMPORTERS:
        return None
    arg = node.args[0] if node.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else DYNAMIC


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import statement in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and (module := _import_by_name(node)) is not None:
            out.append((node.lineno, module if module == DYNAMIC else module.split(".")[0]))
    return out


def test_the_check_sees_imports_anywhere_in_a_module() -> None:
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from producers.worker import Producer\n"
           "def f():\n    import consumers.trainer.loop as loop\n    from benchmarks import bus\n")
    assert [p for _, p in imported_packages(src)] == ["typing", "producers", "consumers", "benchmarks"]


def test_the_check_sees_imports_by_name() -> None:
    src = ("import importlib\nfrom importlib import import_module\n"
           "def f(name):\n    importlib.import_module('producers.worker').Producer\n"
           "    import_module('consumers.trainer')\n    __import__('benchmarks.bus')\n"
           "    importlib.import_module(name)\n    getattr(importlib, 'x')\n")
    found = sorted(p for _, p in imported_packages(src))
    assert found == sorted([DYNAMIC, "benchmarks", "consumers", "importlib", "importlib", "producers"])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_no_higher_package(package: str) -> None:
    paths = sorted((ROOT / package).rglob("*.py"))
    assert paths, f"no modules under {package}/"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {top}"
        for path in paths
        for line, top in imported_packages(path.read_text(encoding="utf-8"))
        if top in FORBIDDEN[package] or top == DYNAMIC
    ]
    assert offenders == []


def imported_names(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import in `source`; `from a import b` gives `a.b`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("package", ["schemas", "rollstream", "producers", "consumers"])
def test_runtime_code_imports_no_fixture(package: str) -> None:
    """rollstream/testing/ (fakes, tiny HF models) is for tests and benchmarks only."""
    fixtures = ROOT / "rollstream" / "testing"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        if fixtures not in path.parents
        for line, name in imported_names(path.read_text(encoding="utf-8"))
        if (name + ".").startswith("rollstream.testing.")
    ]
    assert offenders == []


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in it, lazily or for type checking too)."""
    modules: dict[str, Path] = {}
    for package in FORBIDDEN.keys() | {"benchmarks"}:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(m for a in node.names if (m := ours(a.name)))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                base = ours(node.module)
                for a in node.names:
                    sub = ours(f"{node.module}.{a.name}")
                    deps.update(m for m in ((sub if sub != base else None) or base,) if m)
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circles() -> None:
    found = circles(module_graph())
    assert found == []
