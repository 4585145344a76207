"""reasoning-gym datasets as tasks: `data.task=rg:<dataset>`, its settings in `data.task_args`.

reasoning-gym (the `rg` extra) generates each item of a dataset from `Random(seed + index)`; a prompt here is
the item at an index drawn from the caller's rng, so prompts are as reproducible as the built-in tasks'. The
reward is the dataset's own verifier (`score_answer`) applied to the answer extracted from the response
(`data.answer_extract`). Each prompt's uid carries its index, so the verifier gets the full item back even
where the uid travelled. The held-out split is kept apart by `holdout_key`: the
problem itself (the item's `expression` when the dataset gives one, else its question), so a training
prompt never repeats a validation problem, not even worded differently.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import re
from collections.abc import Mapping
from typing import Any

from rollstream.tasks.base import Prompt, RewardResult

#: `data.task` values naming a reasoning-gym dataset start with this.
PREFIX = "rg:"
#: Indices are drawn from [0, INDEX_SPACE): each is one item of the dataset.
INDEX_SPACE = 2**40
#: How an answer is read out of a response (`data.answer_extract`).
EXTRACTORS = ("last_number", "answer_tag", "last_line", "whole")
#: Settings rollstream sets itself (the run's seed and rng pick the items).
RESERVED = ("seed", "size")
INSTALL_HINT = "pip install -e '.[rg]'"

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.S)


def is_rg_task(task: str) -> bool:
    """True when `task` (a `data.task` value) names a reasoning-gym dataset."""
    return task.startswith(PREFIX)


def extract_answer(response_text: str, how: str) -> str | None:
    """The answer in a response: the last number (`last_number`), the last `<answer>…</answer>`
    (`answer_tag`), the last non-empty line (`last_line`) or the whole stripped text (`whole`); None when
    there is none."""
    if how == "last_number":
        found = _NUMBER_RE.findall(response_text)
        return found[-1] if found else None
    if how == "answer_tag":
        tags = _TAG_RE.findall(response_text)
        return tags[-1].strip() if tags else None
    if how == "last_line":
        lines = [line.strip() for line in response_text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if how == "whole":
        return response_text.strip() or None
    raise ValueError(f"data.answer_extract={how!r} must be one of {EXTRACTORS}")


def check_credit(sign_credit: float, magnitude_credit: float) -> None:
    """ValueError naming the field and value unless both credits are in [0, 1) and their sum is below 1 (a
    wrong answer must score below a right one)."""
    for name, value in (("sign_credit", sign_credit), ("magnitude_credit", magnitude_credit)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"data.{name}={value!r} must be in [0, 1)")
    if sign_credit + magnitude_credit >= 1.0:
        raise ValueError(f"data.sign_credit={sign_credit!r} + data.magnitude_credit={magnitude_credit!r} "
                         "must be < 1 (a wrong answer must score below a right one)")


def _parts_right(answer: str | None, oracle: str) -> tuple[bool, bool, bool]:
    """(sign right, magnitude right, both numbers) of `answer` against `oracle`; (False, False, False) when
    either is not a number. Zero has its own sign (neither positive nor negative)."""
    try:
        a, o = float(answer or ""), float(oracle)
    except ValueError:
        return False, False, False
    return (a > 0) - (a < 0) == (o > 0) - (o < 0), abs(a) == abs(o), True


def _registry() -> dict[str, tuple[Any, Any]]:
    """reasoning-gym's dataset registry (name -> (dataset class, config class)); ValueError when the package
    is missing."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(f"data.task={PREFIX}…: reasoning-gym is not installed ({INSTALL_HINT})") from None
    return dict(DATASETS)


def check_spec(dataset: str, settings: Mapping[str, Any]) -> Any:
    """The dataset's config object for `settings`; ValueError naming the field and value at fault
    (`data.task` for an unknown dataset, `data.task_args.<key>` for an unknown or rejected setting)."""
    registry = _registry()
    if dataset not in registry:
        close = difflib.get_close_matches(dataset, registry, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(registry)} datasets)"
        raise ValueError(f"data.task={PREFIX}{dataset}: reasoning-gym has no dataset {dataset!r}{hint}")
    config_cls = registry[dataset][1]
    known = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED]
    for key in settings:
        if key in RESERVED:
            raise ValueError(
                f"data.task_args.{key}: set by rollstream (run.seed and the prompt draws pick the items)"
            )
        if key not in known:
            raise ValueError(
                f"data.task_args.{key}={settings[key]!r}: not a setting of reasoning-gym dataset {dataset!r} "
                f"(settings: {', '.join(known)})"
            )
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    try:
        config = config_cls(**values, seed=0, size=INDEX_SPACE)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(
            f"data.task_args={dict(settings)!r}: reasoning-gym {dataset!r} refuses it: {e}"
        ) from None
    return config


class ReasoningGymTask:
    """One reasoning-gym dataset: questions (plus `instruction`) as prompts, its verifier as the reward."""

    multi_turn = False

    def __init__(
        self,
        dataset: str,
        settings: Mapping[str, Any] | None = None,
        instruction: str = "",
        extract: str = "last_number",
        sign_credit: float = 0.0,
        magnitude_credit: float = 0.0,
    ) -> None:
        """Build the dataset (ValueError naming the field and value for a bad name or setting). A wrong
        numeric answer scores `sign_credit` when its sign is right plus `magnitude_credit` when its magnitude
        is right (training shaping, never exact) instead of the verifier's substring credit."""
        if extract not in EXTRACTORS:
            raise ValueError(f"data.answer_extract={extract!r} must be one of {EXTRACTORS}")
        check_credit(sign_credit, magnitude_credit)
        self.sign_credit = sign_credit
        self.magnitude_credit = magnitude_credit
        config = check_spec(dataset, dict(settings or {}))
        self.name = f"{PREFIX}{dataset}"
        self.dataset_name = dataset
        self.instruction = instruction
        self.extract = extract
        self.dataset = _registry()[dataset][0](config=config)

    def entry(self, index: int) -> dict[str, Any]:
        """The dataset's item at `index` (question, answer, metadata)."""
        item: dict[str, Any] = self.dataset[index]
        return item

    def item_of(self, prompt: Prompt) -> dict[str, Any]:
        """The dataset item a prompt was made from: rebuilt from the index its uid carries
        (`rg:<dataset>:<index>`); a prompt known only by text and answer (the trainer's newest trained
        prompts, rebuilt from samples) gets an item of its question and answer, all a verifier that compares
        answers needs."""
        prefix = f"{self.name}:"
        tail = prompt.uid[len(prefix):] if prompt.uid.startswith(prefix) else ""
        if tail.isdigit():
            return self.entry(int(tail))
        return {"question": prompt.text, "answer": prompt.answer, "metadata": {}}

    def make_prompt(self, rng: random.Random) -> Prompt:
        """The item at an index drawn from `rng`: its question (+ a new line and `instruction`) and answer."""
        index = rng.randrange(INDEX_SPACE)
        item = self.entry(index)
        question = str(item["question"])
        text = f"{question}\n{self.instruction}" if self.instruction else question
        key = item.get("metadata", {}).get("expression", question)
        return Prompt(uid=f"{self.name}:{index}", text=text, answer=str(item["answer"]),
                      meta={"holdout_key": f"{self.name}:{key}"})

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """The dataset's verifier on the extracted answer, clipped to [0, 1]; exact when it scores 1."""
        answer = extract_answer(response_text, self.extract)
        item = self.item_of(prompt)
        try:
            score = float(self.dataset.score_answer(answer, item))
        except Exception:  # noqa: BLE001 - a verifier that trips over a model's answer scores it 0
            score = 0.0
        score = min(max(score, 0.0), 1.0) if score == score else 0.0
        exact = score >= 1.0
        sign, magnitude, numeric = _parts_right(answer, str(item.get("answer", "")))
        wrong_sign = magnitude and not sign
        if not exact and numeric and (self.sign_credit or self.magnitude_credit):
            # the numeric credit replaces the verifier's substring credit, which scores "-35" 2/3 for 35
            score = self.sign_credit * sign + self.magnitude_credit * magnitude
        metrics = {"acc": float(exact), "score": score, "answered": float(answer is not None),
                   "wrong_sign": float(wrong_sign)}
        return RewardResult(score=score, exact=exact, metrics=metrics)

    def tool(self, call_text: str) -> str | None:
        """Single turn: no tool."""
        return None
