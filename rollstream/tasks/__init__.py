"""Tasks with verifiable rewards (reverse, arith-with-calculator, reasoning-gym datasets), prompt sources, and
the task and prompt source a config names (`build_task`, `build_prompt_source`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
from rollstream.tasks.calculator import CalculatorTask
from rollstream.tasks.reasoning_gym import PREFIX as RG_PREFIX
from rollstream.tasks.reasoning_gym import ReasoningGymTask, is_rg_task
from rollstream.tasks.reverse import ReverseTask
from rollstream.tasks.source import PromptSource, load_jsonl

if TYPE_CHECKING:
    from rollstream.config import PipelineConfig

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


def build_task(cfg: PipelineConfig) -> Task:
    """The task named by data.task with its settings (reverse: digits; rg:<dataset>: task_args, instruction,
    answer_extract, sign and magnitude credit, and the calculator tool around it with data.tool)."""
    if cfg.data.task == "reverse":
        return make_task(
            "reverse",
            min_digits=cfg.data.reverse.min_digits,
            max_digits=cfg.data.reverse.max_digits,
            fixed_width=cfg.data.reverse.fixed_width,
        )
    if cfg.data.task.startswith("rg:"):
        task = make_task(cfg.data.task, settings=cfg.data.task_args, instruction=cfg.data.instruction,
                         extract=cfg.data.answer_extract, sign_credit=cfg.data.sign_credit,
                         magnitude_credit=cfg.data.magnitude_credit)
        if cfg.data.tool == "calculator":
            assert isinstance(task, ReasoningGymTask)
            return CalculatorTask(task, cfg.data.tool_call_reward)
        return task
    return make_task(cfg.data.task)


def build_prompt_source(cfg: PipelineConfig, task: Task | None = None) -> PromptSource:
    """Training prompts (fresh draws or a fixed set cycled by epochs, seeded) plus the held-out validation
    split."""
    # the char vocabulary is checked only where the tiny GPT's tokenizer must cover it
    if cfg.data.prompts_file:
        return PromptSource.from_jsonl(cfg.data.prompts_file, seed=cfg.run.seed, val_size=cfg.data.val_size,
                                       vocab_check=cfg.model.backend == "tiny")
    make = PromptSource.fresh_from_task if cfg.data.fresh_prompts else PromptSource.from_task
    data = cfg.data
    return make(task or build_task(cfg), seed=cfg.run.seed, epoch_size=data.epoch_size,
                val_size=data.val_size, val_seed=data.val_seed)


__all__ = [
    "REWARD_RANGE",
    "TASKS",
    "VOCAB_CHARS",
    "ArithToolTask",
    "CalculatorTask",
    "Prompt",
    "PromptSource",
    "ReasoningGymTask",
    "ReverseTask",
    "RewardResult",
    "Task",
    "build_prompt_source",
    "build_task",
    "calculate",
    "check_vocab",
    "final_answer",
    "find_tool_call",
    "holdout_key",
    "in_vocab",
    "load_jsonl",
    "make_task",
]
