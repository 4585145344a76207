"""Digit-reversal task: ``"1234>"`` -> ``"4321"`` with per-position partial credit.

Two prompt formats: variable length (``"1234>"``, the harder variant: the answer's first digit sits at a
different position for every length) and fixed width (``"  1234>"``: right-aligned to max_digits with
visible spaces, so the last digit, which the answer starts with, is always just before ``>``).
"""

from __future__ import annotations

import random

from rollstream.tasks.base import Prompt, RewardResult, content_uid


class ReverseTask:
    """Reverse a string of ``min_digits``..``max_digits`` random digits; single turn, no tool."""

    name = "reverse"
    multi_turn = False

    def __init__(self, min_digits: int = 3, max_digits: int = 6, fixed_width: bool = False) -> None:
        """Validate and store the digit-count range; `fixed_width` right-aligns prompts with spaces."""
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.fixed_width = fixed_width

    def make_prompt(self, rng: random.Random) -> Prompt:
        """Draw digits from ``rng``: prompt ``"<digits>>"`` (fixed width: ``"  <digits>>"``, right-aligned to
        max_digits with spaces, so every prompt has the same length), answer the reversed digits."""
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        text = f"{digits:>{self.max_digits}}>" if self.fixed_width else f"{digits}>"
        answer = digits[::-1]
        return Prompt(uid=content_uid(self.name, text, answer), text=text, answer=answer, meta={"digits": n})

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """Score = matching positions / max(len(answer), len(response)); exact match scores 1.0.

        ``char_scores`` put each match's 1/len(answer) on its character and charge what a too-long answer
        loses (matches/len(answer) - score) to the characters past the answer's length, equally."""
        answer = prompt.answer
        denom = max(len(answer), len(response_text))
        hits = [float(i < len(answer) and answer[i] == ch) for i, ch in enumerate(response_text)]
        score = sum(hits) / denom if denom else 0.0
        chars = [h / len(answer) for h in hits] if answer else [0.0] * len(hits)
        extra = len(response_text) - len(answer)
        if extra > 0 and answer:
            penalty = (sum(hits) / len(answer) - score) / extra
            chars[len(answer) :] = [-penalty] * extra
        exact = response_text == answer
        metrics = {"acc": float(exact), "score": 1.0 if exact else score}
        return RewardResult(
            score=1.0 if exact else score, exact=exact, metrics=metrics, char_scores=tuple(chars)
        )

    def tool(self, call_text: str) -> str | None:
        """Single-turn task: never a tool call."""
        return None
