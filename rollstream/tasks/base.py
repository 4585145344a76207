"""Shared task types: prompts, reward results, the Task protocol and the text vocabulary."""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: Every character a prompt, answer or tool string may contain (a char-level tokenizer is built from it).
VOCAB_CHARS: str = "0123456789+-*/=()<>?:.,; " + string.ascii_lowercase + "[]|"
_VOCAB_SET = frozenset(VOCAB_CHARS)


def check_vocab(text: str, what: str = "text") -> None:
    """Raise ValueError naming ``what`` and the first character of ``text`` outside VOCAB_CHARS."""
    for pos, ch in enumerate(text):
        if ch not in _VOCAB_SET:
            raise ValueError(f"{what} has character {ch!r} at position {pos} outside the task vocabulary")


def in_vocab(text: str) -> bool:
    """Return True if every character of ``text`` is in VOCAB_CHARS."""
    return all(ch in _VOCAB_SET for ch in text)


def content_uid(prefix: str, text: str, answer: str) -> str:
    """Return a stable id for a prompt derived from its prefix, text and answer."""
    digest = hashlib.sha1(f"{prefix}\x00{text}\x00{answer}".encode(), usedforsecurity=False).hexdigest()
    return f"{prefix}-{digest[:16]}"


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable ``uid``, the ``text`` fed to the model, the reference ``answer`` and ``meta``."""

    uid: str
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def holdout_key(prompt: Prompt) -> str:
    """What keeps a training prompt off the held-out split: `meta["holdout_key"]` when the task sets one (the
    problem itself, however it is worded), else the prompt's text."""
    key = prompt.meta.get("holdout_key")
    return key if isinstance(key, str) else prompt.text


#: The range every task's reward (and token score) lies in; the trainer dead-letters a sample outside it.
REWARD_RANGE: tuple[float, float] = (0.0, 1.0)


@dataclass(frozen=True)
class RewardResult:
    """A scored response: ``score`` in [0, 1], ``exact`` match flag and per-response float ``metrics``.

    ``char_scores`` (optional) splits ``score`` over the characters of the response text, for token-level
    credit (``algorithm.adv_estimator=grpo_token``); they must sum to ``score``. None: outcome reward only.
    """

    score: float
    exact: bool
    metrics: dict[str, float] = field(default_factory=dict)
    char_scores: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        """Reject a score outside [0, 1] and character scores that do not sum to it."""
        if not REWARD_RANGE[0] <= self.score <= REWARD_RANGE[1]:
            raise ValueError(f"reward score must be in [0, 1], got {self.score}")
        if self.char_scores is not None and abs(sum(self.char_scores) - self.score) > 1e-6:
            raise ValueError(f"char_scores sum to {sum(self.char_scores)}, not to score {self.score}")


@runtime_checkable
class Task(Protocol):
    """A task with a verifiable reward; ``tool`` returns None unless the task is multi-turn."""

    name: str
    multi_turn: bool

    def make_prompt(self, rng: random.Random) -> Prompt:
        """Draw one prompt using only ``rng`` for randomness."""
        ...

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """Score the decoded response (no special tokens) against ``prompt.answer``."""
        ...

    def tool(self, call_text: str) -> str | None:
        """Return the text to append if ``call_text`` ends with a complete tool call, else None."""
        ...
