"""Latency-model generation, for benchmarks on machines where producers and trainer would fight for cores.

With `bench.latency_model.enable`, a producer runs its real loop (budget take, dispatch, param_version
stamping, weight sync, scoring, publish, pacing) with `modelled_generate` injected as its generate function
(benchmarks/latency_producer.py): it sleeps for the modelled decode time and returns trajectories of the
modelled lengths:

- each trajectory's response length is drawn from a lognormal (median `length_median`, log-space std
  `length_sigma`), rounded, clipped to [1, data.max_response_length] (truncation, as real rollouts);
- a trajectory's decode time = length / `tokens_per_s`; the n trajectories of one prompt decode together,
  so a dispatch sleeps for its longest one (`processing_time_s` of each row is its own length / speed);
- tokens are random digits (then eos unless truncated), log-probs log(1/10) (uniform over digits); the
  task scores them as usual. `param_version_end` is the version loaded when the sleep ends when partial
  rollout is on (weights swapped mid-trajectory), else the dispatch version.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from producers.rollout import GenerationRequest, Trajectory
from rollstream.config import PipelineConfig
from rollstream.model import Tokenizer

if TYPE_CHECKING:
    from producers.worker import GenerateFn

DIGITS = "0123456789"
DIGIT_LOGP = -math.log(len(DIGITS))  # behaviour log-prob of a uniformly drawn digit


@dataclass(frozen=True)
class LatencyModel:
    """A long-tailed response-length distribution and a decode speed."""

    tokens_per_s: float
    length_median: float
    length_sigma: float
    max_len: int

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> LatencyModel:
        """The model of `bench.latency_model`, truncated at `data.max_response_length`."""
        lm = cfg.bench.latency_model
        return cls(lm.tokens_per_s, lm.length_median, lm.length_sigma, cfg.data.max_response_length)

    def draw_lengths(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` response lengths in tokens [count] (lognormal, rounded, clipped to [1, max_len])."""
        raw = rng.lognormal(math.log(self.length_median), self.length_sigma, size=count)
        return np.clip(np.rint(raw), 1, self.max_len).astype(np.int64)

    def mean_dispatch_tokens(self, n: int, draws: int = 20_000, seed: int = 0) -> float:
        """Expected longest length among a prompt's n trajectories (Monte Carlo): the tokens a slot
        decodes per prompt; mean decode time of a prompt = this / tokens_per_s."""
        rng = np.random.default_rng(seed)
        return float(self.draw_lengths(rng, draws * n).reshape(draws, n).max(axis=1).mean())


@dataclass
class Plan:
    """One dispatch's modelled generation: rows (prompt ids), their lengths and response tokens."""

    prompt_rows: list[list[int]]
    responses: list[list[int]]
    lengths: list[int]
    finished: list[bool]
    tokens_per_s: float

    @property
    def decode_s(self) -> float:
        """Modelled wall time of the dispatch: its longest trajectory's decode time."""
        return max(self.lengths) / self.tokens_per_s


def plan_dispatch(
    model: LatencyModel, request: GenerationRequest, tokenizer: Tokenizer, rng: np.random.Generator
) -> Plan:
    """Draw lengths and tokens for every row of a generation request (its prompt ids per row)."""
    rows = [list(row) for row in request.rows]
    lengths = model.draw_lengths(rng, len(rows))
    responses, finished = [], []
    for length in lengths:
        done = bool(length < model.max_len)  # truncated rows never emit eos
        text = "".join(DIGITS[int(d)] for d in rng.integers(0, len(DIGITS), size=int(length) - int(done)))
        toks = tokenizer.encode(text)[: int(length) - int(done)]
        responses.append(toks + [tokenizer.eos_id] if done else toks)
        finished.append(done)
    return Plan(rows, responses, [len(r) for r in responses], finished, model.tokens_per_s)


def run_plan(
    plan: Plan, version_start: int, version_now: Callable[[], int] | None = None, sleep: bool = True
) -> list[Trajectory]:
    """Sleep the plan's decode time, then return its trajectories. `version_now()` (when given) is the
    loaded version read after the sleep (partial rollout: the version that generated the last tokens)."""
    if sleep:
        time.sleep(plan.decode_s)
    end = version_start if version_now is None else version_now()
    out = []
    for prompt, resp, done in zip(plan.prompt_rows, plan.responses, plan.finished, strict=True):
        t = Trajectory(
            prompt_ids=prompt, finished=done, num_turns=1, version_start=version_start, version_end=end
        )
        t.extend(resp, [DIGIT_LOGP] * len(resp), generated=True)
        t.processing_time_s = len(resp) / plan.tokens_per_s
        out.append(t)
    return out


def modelled_generate(
    model: LatencyModel,
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    version_now: Callable[[], int] | None = None,
) -> GenerateFn:
    """A producer's generate function that sleeps the modelled decode time of each dispatch (draws from
    `rng`, one slot at a time); `version_now` as for run_plan."""
    lock = threading.Lock()  # slots share the rng

    def generate(request: GenerationRequest, param_version: int) -> list[Trajectory]:
        with lock:
            plan = plan_dispatch(model, request, tokenizer, rng)
        return run_plan(plan, param_version, version_now)

    return generate
