"""docs/DESIGN.md's Layout is the tree as it is: every folder, module and file it names exists, and it
names every module of the runtime packages; the README's short tree names only what exists and every runtime
package. A Layout block's grammar: a name ending in `/` is a folder, nested under the nearest folder named
left of it on a line above (or on the same line); any other name is a module of that folder (`.py` left out)
or, with a dot, a file; words in parentheses (which may span lines) describe the name before them and are
not read; `+` joins names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Packages whose every module the Layout must name.
RUNTIME = ("schemas", "rollstream", "producers", "consumers", "benchmarks")


def layout_block(page: str) -> str:
    """The code block of a page's Layout section."""
    section = page.split("\n## Layout\n", 1)[1]
    return section.split("```\n", 2)[1]


def named_paths(block: str) -> tuple[set[str], set[str]]:
    """(folders, files) the block names, as paths relative to the repository root (modules as `x/y.py`)."""
    folders: set[str] = set()
    files: set[str] = set()
    stack: list[tuple[int, str]] = []  # (column, folder path) of the folders open at this point
    depth = 0  # parentheses open (descriptions may span lines)
    for line in block.splitlines():
        for m in re.finditer(r"[()]|[^\s()]+", line):
            token = m.group()
            if token in "()":
                depth += 1 if token == "(" else -1
                continue
            if depth or token == "+":
                continue
            name = token.rstrip(",")
            while stack and stack[-1][0] >= m.start():
                stack.pop()
            parent = stack[-1][1] + "/" if stack else ""
            if name.endswith("/"):
                path = parent + name.rstrip("/")
                folders.add(path)
                stack.append((m.start(), path))
            else:
                files.add(parent + (name if "." in name else name + ".py"))
    assert depth == 0, "unbalanced parentheses in the Layout block"
    return folders, files


def test_the_grammar_nests_by_column() -> None:
    block = "a/   x (about\n     y) y + z\n     b/  w\n     v\nc.txt\n"
    assert named_paths(block) == ({"a", "a/b"}, {"a/x.py", "a/y.py", "a/z.py", "a/b/w.py", "a/v.py", "c.txt"})


def _block(page: str) -> str:
    return layout_block((ROOT / page).read_text(encoding="utf-8"))


def test_everything_the_layout_names_exists() -> None:
    folders, files = named_paths(_block("docs/DESIGN.md"))
    assert sorted(f for f in folders if not (ROOT / f).is_dir()) == []
    assert sorted(f for f in files if not (ROOT / f).is_file()) == []


def test_the_readme_tree_names_existing_packages_and_every_runtime_one() -> None:
    folders, files = named_paths(_block("README.md"))
    assert sorted(f for f in folders | files if not (ROOT / f).exists()) == []
    assert sorted(set(RUNTIME) - folders) == []


def test_the_layout_names_every_runtime_module() -> None:
    _, files = named_paths(_block("docs/DESIGN.md"))
    modules = {str(p.relative_to(ROOT)) for pkg in RUNTIME for p in (ROOT / pkg).rglob("*.py")
               if p.name != "__init__.py"}
    assert sorted(modules - files) == []
