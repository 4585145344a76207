"""Every relative link and image in the README, BENCHMARKS.md and docs/ points at a file that exists (links
inside fenced code blocks are not links; web addresses are not checked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")])
#: `[text](target)` and `![alt](target)`; the target ends at the first space or closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def prose(page: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page, flags=re.M | re.S)


def relative_links(page: str) -> list[str]:
    """The link targets of a page that point into the repository (no scheme, not only an anchor)."""
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_links_are_found_outside_code_only() -> None:
    page = "see [a](docs/A.md#x) and ![b](b.png 'title')\n```\n[c](c.md)\n```\n[d](https://x.org) [e](#top)\n"
    assert relative_links(page) == ["docs/A.md#x", "b.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = [t for t in relative_links(page.read_text(encoding="utf-8"))
              if not (page.parent / t.split("#", 1)[0]).exists()]
    assert broken == []
