"""Tasks with verifiable rewards (reverse, arith-with-calculator) and prompt sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollstream.tasks.arith import ArithToolTask, calculate, final_answer, find_tool_call
from rollstream.tasks.base import REWARD_RANGE, VOCAB_CHARS, Prompt, RewardResult, Task, check_vocab, in_vocab
from rollstream.tasks.reverse import ReverseTask
from rollstream.tasks.source import PromptSource, load_jsonl

TASKS: dict[str, Callable[..., Task]] = {"reverse": ReverseTask, "arith": ArithToolTask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name ("reverse", "arith"); ValueError listing the known names otherwise."""
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
    return factory(**kwargs)


__all__ = [
    "REWARD_RANGE",
    "TASKS",
    "VOCAB_CHARS",
    "ArithToolTask",
    "Prompt",
    "PromptSource",
    "ReverseTask",
    "RewardResult",
    "Task",
    "calculate",
    "check_vocab",
    "final_answer",
    "find_tool_call",
    "in_vocab",
    "load_jsonl",
    "make_task",
]
