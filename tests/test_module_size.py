"""Modules stay small: none over 500 lines, and one over 400 says why on its first line
(`# Over 400 lines on purpose: <the reason>`), as the style guide asks. Checked over every module of the
runtime packages, the benchmarks and the scripts."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "rollstream", "producers", "consumers", "benchmarks", "scripts")
MAX_LINES = 500
REASON_OVER = 400
REASON_PREFIX = "# Over 400 lines on purpose: "


def size_problems(path: str, text: str) -> list[str]:
    """What breaks the size rule in one module's text: over MAX_LINES lines, or over REASON_OVER without
    a reason (some words after REASON_PREFIX) on line 1."""
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        return [f"{path}: {len(lines)} lines, over {MAX_LINES}"]
    if len(lines) <= REASON_OVER:
        return []
    reason = lines[0].removeprefix(REASON_PREFIX) if lines[0].startswith(REASON_PREFIX) else ""
    if len(reason.strip()) < 10:  # a few words at least
        return [f"{path}: {len(lines)} lines and line 1 does not say why ({REASON_PREFIX!r}...)"]
    return []


@pytest.mark.parametrize(
    ("lines", "first", "ok"),
    [(400, '"""doc', True), (401, '"""doc', False), (401, REASON_PREFIX, False),
     (401, REASON_PREFIX + "one state machine, read top to bottom", True),
     (501, REASON_PREFIX + "one state machine, read top to bottom", False)],
)
def test_the_rule(lines: int, first: str, ok: bool) -> None:
    text = "\n".join([first] + ["x = 1"] * (lines - 1))
    assert (size_problems("m.py", text) == []) is ok


def test_no_module_is_over_500_lines_and_one_over_400_says_why() -> None:
    modules = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert modules
    problems = [
        problem
        for path in modules
        for problem in size_problems(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    ]
    assert problems == []


def test_the_trainer_loop_reads_in_under_300_lines() -> None:
    """consumers/trainer/loop.py holds one global step (train_step names its phases): under 300 lines."""
    lines = (ROOT / "consumers" / "trainer" / "loop.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300
