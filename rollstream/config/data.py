"""`data:`: the task, its prompts and the batch size; each task's own settings under it (`data.reverse`,
`data.task_args` for reasoning-gym datasets)."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, model_validator

from rollstream.config.base import Section


class ReverseTaskConfig(Section):
    """The reverse task: reverse a string of random digits."""

    min_digits: int = Field(3, ge=1, description="Shortest digit string")
    max_digits: int = Field(6, ge=1, description="Longest digit string")
    fixed_width: bool = Field(
        False,
        description="Right-align the digits to max_digits with spaces (every prompt the same length)",
    )

    @model_validator(mode="after")
    def _digits(self) -> ReverseTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits={self.min_digits} must be <= max_digits={self.max_digits}")
        return self


class DataConfig(Section):
    """Prompts and batch sizes."""

    task: str = Field(
        "reverse",
        description="Task: reverse (digits), arith (arithmetic with a calculator tool), or rg:<dataset> (a "
                    "reasoning-gym dataset, e.g. rg:basic_arithmetic; needs model.backend=hf and the rg "
                    "extra)",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict,
        description="rg:<dataset> only: the dataset's settings (its reasoning-gym config fields), e.g. "
                    "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    )
    instruction: str = Field(
        "", description="rg:<dataset> only: text put after each question on a new line (e.g. 'Answer with "
                        "the number only.')"
    )
    answer_extract: Literal["last_number", "answer_tag", "last_line", "whole"] = Field(
        "last_number",
        description="rg:<dataset> only: what of a response the verifier scores: its last number, its last "
                    "<answer>…</answer>, its last non-empty line, or all of it",
    )
    sign_credit: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="rg:<dataset> only: training score for a wrong numeric answer whose sign is right "
                    "(reward shaping, added to magnitude_credit; val/acc counts exact answers); 0 = none",
    )
    magnitude_credit: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="rg:<dataset> only: training score for a wrong numeric answer whose magnitude is right "
                    "(the right number with the wrong sign; reward shaping, val/acc unchanged); 0 = none",
    )
    tool: Literal["none", "calculator"] = Field(
        "none",
        description="rg:<dataset> only: a tool the model may call, run by the multi-turn agent "
                    "(rollout.multi_turn.enable): calculator = `[calc:EXPR]` answered by `[=VALUE]` in the "
                    "chat template's tool turn, the answer read after the last result "
                    "(rollstream/tasks/calculator.py)",
    )
    tool_call_reward: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="data.tool=calculator: training score of a wrong answer that made a well-formed call (a "
                    "format reward; val/acc counts exact answers); 0 = none",
    )
    train_batch_size: int = Field(16, ge=1, description="Samples (prompts) per global step")
    reverse: ReverseTaskConfig = Field(
        default_factory=ReverseTaskConfig, description="The reverse task's prompts (data.task=reverse)"
    )
    prompts_file: str | None = Field(None, description="JSONL prompt file instead of the seeded generator")
    fresh_prompts: bool = Field(
        True,
        description="Seeded generator: draw a new prompt at every position (never a validation one) instead "
                    "of cycling epoch_size prompts",
    )
    epoch_size: int = Field(4096, ge=1, description="Generated prompts per epoch (seeded generator mode)")
    val_size: int = Field(256, ge=0, description="Held-out prompts used for validation")
    val_seed: int | None = Field(
        None,
        description="Seed of the held-out prompts a task generates (null = run.seed); pinned, every run.seed "
        "is scored on one held-out set and trains on draws disjoint from it",
    )
    val_recent_size: int = Field(
        64,
        ge=0,
        description="Newest trained prompts re-decoded at each validation (`val/recent_train_…`; "
        "memorisation shows as a gap to `val/…`); 0 = none",
    )
    val_batch_size: int | None = Field(
        64,
        ge=1,
        description="Held-out prompts greedy-decoded per batch at validation (null = all in one batch: on "
        "one CPU core 200 SmolLM2 prompts take 9 s at once, 13 s in 64s; the KV cache grows with it)",
    )
    max_response_length: int = Field(12, ge=1, description="Max generated tokens per turn")

    @model_validator(mode="after")
    def _task(self) -> DataConfig:
        if self.val_seed is not None and self.prompts_file:
            raise ValueError(
                f"data.val_seed={self.val_seed} is for generated prompts: data.prompts_file="
                f"{self.prompts_file!r} holds its own held-out split (its last data.val_size lines)"
            )
        if self.task.startswith("rg:"):
            if importlib.util.find_spec("reasoning_gym") is not None:  # else refused where the task is built
                from rollstream.tasks.reasoning_gym import check_spec

                check_spec(self.task.removeprefix("rg:"), self.task_args)
        elif self.tool != "none":
            raise ValueError(
                f"data.tool={self.tool!r} is for rg:<dataset> tasks, not data.task={self.task!r}"
            )
        elif self.task not in ("reverse", "arith"):
            raise ValueError(f"data.task={self.task!r} must be reverse, arith or rg:<reasoning-gym dataset>")
        elif self.task_args:
            raise ValueError(
                f"data.task_args={self.task_args!r} is for rg:<dataset> tasks, not data.task={self.task!r}"
            )
        elif self.sign_credit or self.magnitude_credit:
            name, value = ("sign_credit", self.sign_credit) if self.sign_credit else (
                "magnitude_credit", self.magnitude_credit)
            raise ValueError(f"data.{name}={value!r} is for rg:<dataset> tasks, not data.task={self.task!r}")
        from rollstream.tasks.reasoning_gym import check_credit  # no reasoning-gym import: plain arithmetic

        check_credit(self.sign_credit, self.magnitude_credit)
        return self

