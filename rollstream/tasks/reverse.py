"""Digit-reversal task: ``"1234>"`` -> ``"4321"`` with per-position partial credit."""

from __future__ import annotations

import random

from rollstream.tasks.base import Prompt, RewardResult, content_uid


class ReverseTask:
    """Reverse a string of ``min_digits``..``max_digits`` random digits; single turn, no tool."""

    name = "reverse"
    multi_turn = False

    def __init__(self, min_digits: int = 3, max_digits: int = 6) -> None:
        """Validate and store the digit-count range."""
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits = min_digits
        self.max_digits = max_digits

    def make_prompt(self, rng: random.Random) -> Prompt:
        """Draw digits from ``rng`` and return prompt ``"<digits>>"`` with the reversed digits as answer."""
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        text = f"{digits}>"
        answer = digits[::-1]
        return Prompt(uid=content_uid(self.name, text, answer), text=text, answer=answer, meta={"digits": n})

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """Score = matching positions / max(len(answer), len(response)); exact match scores 1.0."""
        answer = prompt.answer
        if response_text == answer:
            return RewardResult(score=1.0, exact=True, metrics={"acc": 1.0, "score": 1.0})
        denom = max(len(answer), len(response_text))
        matches = sum(1 for a, b in zip(answer, response_text, strict=False) if a == b)
        score = matches / denom if denom else 0.0
        return RewardResult(score=score, exact=False, metrics={"acc": 0.0, "score": score})

    def tool(self, call_text: str) -> str | None:
        """Single-turn task: never a tool call."""
        return None
