"""Arithmetic with a calculator tool: ``"12*34+5=?"`` -> ``"413"``, via ``[calc:...]`` / ``[=...]``."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from rollstream.tasks.base import Prompt, RewardResult, content_uid

MAX_EXPR_CHARS = 64
MAX_ABS_VALUE = 10**12
CALL_OPEN = "[calc:"
RESULT_ERR = "[=err]"
TOOL_CALL_REWARD = 0.1

_CALL_RE = re.compile(r"\[calc:([^\[\]]*)\]")
_RESULT_RE = re.compile(r"\[=[^\[\]]*\]")
_PARTIAL_CALL_RE = re.compile(r"\[calc:[^\]]*\]?")
_INT_RE = re.compile(r"(?<![0-9])-?[0-9]+")
_DIGITS = frozenset("0123456789")
_MAX_ANSWER_DIGITS = 40


class _Parser:
    """Recursive-descent parser/evaluator for integers with + - * unary sign and parentheses."""

    def __init__(self, expr: str) -> None:
        """Hold the expression and a read position; spaces may separate tokens."""
        self.s = expr
        self.i = 0

    def parse(self) -> int:
        """Evaluate the whole expression or raise ValueError."""
        if not self.s.strip(" "):
            raise ValueError("empty expression")
        value = self._expr()
        self._peek()
        if self.i != len(self.s):
            raise ValueError(f"unexpected {self.s[self.i]!r} at position {self.i}")
        return value

    def _peek(self) -> str:
        """Skip spaces, then return the current character, or '' at the end."""
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def _expr(self) -> int:
        """expr := term (('+'|'-') term)*."""
        value = self._term()
        while self._peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            rhs = self._term()
            value = _bounded(value + rhs if op == "+" else value - rhs)
        return value

    def _term(self) -> int:
        """term := factor ('*' factor)*."""
        value = self._factor()
        while self._peek() == "*":
            self.i += 1
            value = _bounded(value * self._factor())
        return value

    def _factor(self) -> int:
        """factor := ('+'|'-') factor | '(' expr ')' | digits."""
        ch = self._peek()
        if ch in ("+", "-"):
            self.i += 1
            inner = self._factor()
            return -inner if ch == "-" else inner
        if ch == "(":
            self.i += 1
            value = self._expr()
            if self._peek() != ")":
                raise ValueError(f"expected ')' at position {self.i}")
            self.i += 1
            return value
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in _DIGITS:
            self.i += 1
        if start == self.i:
            raise ValueError(f"expected a number at position {start}" + (f", got {ch!r}" if ch else ""))
        return _bounded(int(self.s[start : self.i]))


def _bounded(value: int) -> int:
    """Return ``value`` or raise ValueError if its magnitude exceeds MAX_ABS_VALUE."""
    if abs(value) > MAX_ABS_VALUE:
        raise ValueError(f"value out of range (|x| > {MAX_ABS_VALUE})")
    return value


def calculate(expr: str) -> int:
    """Safely evaluate integer arithmetic (+ - * parentheses); ValueError on bad, long or huge input."""
    if not isinstance(expr, str):
        raise ValueError("expression must be a string")
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    return _Parser(expr).parse()


def find_tool_call(text: str) -> str | None:
    """Return the expression of the complete ``[calc:EXPR]`` call that ``text`` ends with, else None."""
    if not text.endswith("]"):
        return None
    start = text.rfind("[")
    segment = text[start:]
    if start < 0 or not segment.startswith(CALL_OPEN) or "]" in segment[:-1]:
        return None
    return segment[len(CALL_OPEN) : -1]


def run_tool(expr: str) -> str:
    """Evaluate ``expr`` and return the tool result text ``"[=VALUE]"`` or ``"[=err]"``."""
    try:
        return f"[={calculate(expr)}]"
    except ValueError:
        return RESULT_ERR


def final_answer(response_text: str) -> str | None:
    """Return the last integer written after the last tool result (ignoring call text), else None."""
    last = None
    for m in _RESULT_RE.finditer(response_text):
        last = m
    tail = response_text[last.end() :] if last is not None else response_text
    tail = _PARTIAL_CALL_RE.sub(" ", tail)
    ints = _INT_RE.findall(tail)
    return ints[-1] if ints else None


def _same_int(a: str, b: str) -> bool:
    """Compare two integer strings numerically, refusing absurdly long ones."""
    if len(a.lstrip("-")) > _MAX_ANSWER_DIGITS or len(b.lstrip("-")) > _MAX_ANSWER_DIGITS:
        return False
    try:
        return int(a) == int(b)
    except ValueError:
        return False


class ArithToolTask:
    """Evaluate ``n_ops`` operations on operands in [0, max_operand]; the model may call a calculator."""

    name = "arith"
    multi_turn = True

    def __init__(self, max_operand: int = 99, n_ops: int | Sequence[int] = (1, 2), ops: str = "+-*") -> None:
        """Store operand bound, operator-count range (int or (lo, hi)) and allowed operators."""
        if isinstance(n_ops, int):
            lo, hi = n_ops, n_ops
        else:
            if len(n_ops) != 2:
                raise ValueError(f"n_ops must be an int or (lo, hi), got {n_ops!r}")
            lo, hi = int(n_ops[0]), int(n_ops[1])
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= n_ops lo <= hi, got {lo}, {hi}")
        if max_operand < 0:
            raise ValueError(f"max_operand must be >= 0, got {max_operand}")
        if not ops or any(op not in "+-*" for op in ops):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
        self.max_operand = max_operand
        self.min_ops, self.max_ops = lo, hi
        self.ops = ops
        # The prompt must stay within the calculator's limits so a verbatim call works.
        worst = f"{max_operand}" + ("*" + f"{max_operand}") * hi
        try:
            calculate(worst)
        except ValueError as exc:
            raise ValueError(
                f"max_operand={max_operand} with up to {hi} ops can exceed the calculator limits: {exc}"
            ) from None

    def make_prompt(self, rng: random.Random) -> Prompt:
        """Draw an expression from ``rng``; prompt ``"EXPR=?"``, answer its value as a decimal string."""
        k = rng.randint(self.min_ops, self.max_ops)
        parts = [str(rng.randint(0, self.max_operand))]
        for _ in range(k):
            parts.append(rng.choice(self.ops))
            parts.append(str(rng.randint(0, self.max_operand)))
        expr = "".join(parts)
        text = f"{expr}=?"
        answer = str(calculate(expr))
        return Prompt(uid=content_uid(self.name, text, answer), text=text, answer=answer, meta={"n_ops": k})

    def tool(self, call_text: str) -> str | None:
        """If ``call_text`` ends with a complete ``[calc:EXPR]``, return ``"[=VALUE]"``/``"[=err]"``; else
        None."""
        expr = find_tool_call(call_text)
        return None if expr is None else run_tool(expr)

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """1.0 if the final integer equals the answer; else 0.1 if a well-formed call was made; else 0."""
        calls = _CALL_RE.findall(response_text)
        errors = 0
        for expr in calls:
            try:
                calculate(expr)
            except ValueError:
                errors += 1
        ok_calls = len(calls) - errors
        final = final_answer(response_text)
        exact = final is not None and _same_int(final, prompt.answer)
        score = 1.0 if exact else (TOOL_CALL_REWARD if ok_calls > 0 else 0.0)
        metrics = {
            "acc": float(exact),
            "score": score,
            "tool_calls": float(len(calls)),
            "tool_errors": float(errors),
            "answered": float(final is not None),
        }
        return RewardResult(score=score, exact=exact, metrics=metrics)
