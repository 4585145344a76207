"""A reasoning-gym arithmetic task with the calculator as a tool turn (`data.tool: calculator`).

The prompts, the held-out split and the verifier are the wrapped dataset's (same uids, same `holdout_key`), so
a run with the tool is scored on the same problems as one without. The model may write `[calc:EXPR]`; the
multi-turn agent cuts its turn there, runs `calculate` and inserts `[=VALUE]` (or `[=err]`) as the chat
template's tool turn, masked from the loss. The answer is the last number the model wrote after the last tool
result (`final_answer`: a number copied from the tool turn alone answers nothing), scored by the dataset's
verifier. A wrong answer that made a well-formed call scores `tool_call_reward` (a format reward; 0 = none).

Per-answer metrics (the producers' stats average them over a step's trajectories): `called` (made a call),
`tool_calls` (calls), `tool_errors` (calls the calculator refused), `wrong_expr` (well-formed calls whose
value is not the answer), `right_called` / `right_uncalled` (right with / without a call). Ratios of these
means are the rates the records derive (`tool_ratios`): accuracy with and without a call, the share of bad
calls.
"""

from __future__ import annotations

import random
import re

from rollstream.tasks.arith import TOOL_CALL_REWARD, calculate, final_answer, find_tool_call, run_tool
from rollstream.tasks.base import Prompt, RewardResult
from rollstream.tasks.reasoning_gym import ReasoningGymTask

#: `data.tool` values.
TOOLS = ("none", "calculator")
_CALL_RE = re.compile(r"\[calc:([^\[\]]*)\]")

#: Rates a record derives from the per-answer means: name -> (numerator, denominator).
TOOL_RATIOS: dict[str, tuple[str, str]] = {
    "acc_with_call": ("right_called", "called"),
    "acc_without_call": ("right_uncalled", "uncalled"),
    "calls_errored": ("tool_errors", "tool_calls"),
    "calls_wrong_expr": ("wrong_expr", "tool_calls"),
}


def tool_ratios(means: dict[str, float], prefix: str = "") -> dict[str, float]:
    """The TOOL_RATIOS of per-answer means keyed `prefix + name` (a ratio whose denominator is 0 or missing is
    left out), keyed the same way."""
    out: dict[str, float] = {}
    for name, (num, den) in TOOL_RATIOS.items():
        n, d = means.get(prefix + num), means.get(prefix + den)
        if n is not None and d:
            out[prefix + name] = n / d
    return out


class CalculatorTask:
    """`inner`'s prompts and verifier, with the calculator tool and the answer read after the last result."""

    multi_turn = True

    def __init__(self, inner: ReasoningGymTask, tool_call_reward: float = TOOL_CALL_REWARD) -> None:
        """Wrap `inner`; a wrong answer with a well-formed call scores `tool_call_reward` (ValueError naming
        data.tool_call_reward outside [0, 1))."""
        if not 0.0 <= tool_call_reward < 1.0:
            raise ValueError(f"data.tool_call_reward={tool_call_reward!r} must be in [0, 1)")
        self.inner = inner
        self.name = inner.name
        self.tool_call_reward = tool_call_reward

    def make_prompt(self, rng: random.Random) -> Prompt:
        """The wrapped dataset's prompt (same uid, text and held-out key)."""
        return self.inner.make_prompt(rng)

    def expression(self, prompt: Prompt) -> str:
        """The problem's expression as the dataset states it (`26 - 92`): what a right call holds."""
        item = self.inner.item_of(prompt)
        expr = item.get("metadata", {}).get("expression")
        if expr is None:
            raise ValueError(f"{self.name} item {prompt.uid} has no metadata.expression to call with")
        return str(expr)

    def tool(self, call_text: str) -> str | None:
        """`[=VALUE]`/`[=err]` when `call_text` ends with a complete `[calc:EXPR]`, else None."""
        expr = find_tool_call(call_text)
        return None if expr is None else run_tool(expr)

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """1 for the right final answer (the verifier's exact), else `tool_call_reward` when a call was
        well-formed, else 0; with the tool metrics of the module docstring."""
        calls = _CALL_RE.findall(response_text)
        errors = wrong = 0
        for expr in calls:
            try:
                value = calculate(expr)
            except ValueError:
                errors += 1
                continue
            wrong += int(str(value) != prompt.answer.strip())
        answer = final_answer(response_text)
        verdict = self.inner.reward(prompt, answer or "")
        exact = answer is not None and verdict.exact
        score = 1.0 if exact else (self.tool_call_reward if len(calls) > errors else 0.0)
        called = float(bool(calls))
        metrics = {
            "acc": float(exact),
            "score": score,
            "answered": float(answer is not None),
            "called": called,
            "uncalled": 1.0 - called,
            "tool_calls": float(len(calls)),
            "tool_errors": float(errors),
            "wrong_expr": float(wrong),
            "right_called": float(exact) * called,
            "right_uncalled": float(exact) * (1.0 - called),
        }
        return RewardResult(score=score, exact=exact, metrics=metrics)


def trace_texts(task: CalculatorTask, prompt: Prompt) -> tuple[str, str, str]:
    """A right tool-call episode for `prompt` as text: (the call the model writes, the tool's result, the
    answer the model writes after it), e.g. ("[calc: 26 - 92]", "[=-66]", "-66")."""
    expr = task.expression(prompt)
    result = run_tool(expr)
    return f"[calc: {expr}]", result, result[2:-1]
