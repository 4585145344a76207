"""Every relative link and image in the README, BENCHMARKS.md and docs/ points at a file that exists, and a
link to a heading of a markdown page (`page.md#anchor`, or `#anchor` on the same page) names a heading that
page has, by GitHub's rule for anchors. Links inside fenced code blocks are not links; web addresses are not
checked."""

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
    """The link targets of a page that point into the repository (no scheme)."""
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", t)]


def anchors(page: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", prose(page), flags=re.M)}


def test_links_are_found_outside_code_only() -> None:
    page = "see [a](docs/A.md#x) and ![b](b.png 'title')\n```\n[c](c.md)\n```\n[d](https://x.org) [e](#top)\n"
    assert relative_links(page) == ["docs/A.md#x", "b.png", "#top"]


def test_anchors_follow_githubs_rule() -> None:
    page = "# Real model: SmolLM2\n## On `basic_arithmetic` (≥ 60 %)\n```\n# not a heading\n```\n"
    assert anchors(page) == {"real-model-smollm2", "on-basic_arithmetic--60-"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in relative_links(text):
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            broken.append(target)
    assert broken == []
