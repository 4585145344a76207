"""Tasks with verifiable rewards (reverse, arith-with-calculator, reasoning-gym datasets) and prompt
sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollstream.tasks.arith import ArithToolTask, calculate, final_answer, find_tool_call
from rollstream.tasks.base import (
    REWARD_RANGE,
    VOCAB_CHARS,
    Prompt,
    RewardResult,
    Task,
    check_vocab,
    holdout_key,
    in_vocab,
)
from rollstream.tasks.reasoning_gym import PREFIX as RG_PREFIX
from rollstream.tasks.reasoning_gym import ReasoningGymTask, is_rg_task
from rollstream.tasks.reverse import ReverseTask
from rollstream.tasks.source import PromptSource, load_jsonl

TASKS: dict[str, Callable[..., Task]] = {"reverse": ReverseTask, "arith": ArithToolTask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name ("reverse", "arith", or "rg:<dataset>" for a reasoning-gym dataset, its settings
    as keyword arguments of ReasoningGymTask); ValueError listing the known names otherwise."""
    if is_rg_task(name):
        return ReasoningGymTask(name.removeprefix(RG_PREFIX), **kwargs)
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}, "
            f"or {RG_PREFIX}<reasoning-gym dataset>"
        ) from None
    return factory(**kwargs)


__all__ = [
    "REWARD_RANGE",
    "TASKS",
    "VOCAB_CHARS",
    "ArithToolTask",
    "Prompt",
    "PromptSource",
    "ReasoningGymTask",
    "ReverseTask",
    "RewardResult",
    "Task",
    "calculate",
    "check_vocab",
    "final_answer",
    "find_tool_call",
    "holdout_key",
    "in_vocab",
    "load_jsonl",
    "make_task",
]
