"""Latency-model producers, for benchmarks on machines where producers and trainer would fight for cores.

    python -m benchmarks.latency pipeline.yaml [key=value ...] [--name rollout_NN] [--burst] [--max-dispatches N]

(what `rollstream run` starts as producers when `rollout.latency_model.enable`). A latency-model producer
runs the real producer loop (producers/worker.py: budget take, dispatch, param_version stamping, weight
sync, scoring, publish, pacing) with a modelled decode injected as its generate function: it sleeps for
the modelled decode time and returns trajectories of the modelled lengths:

- each trajectory's response length is drawn from a lognormal (median `length_median`, log-space std
  `length_sigma`), rounded, clipped to [1, data.max_response_length] (truncation, as real rollouts);
- a trajectory's decode time = length / `tokens_per_s`; the n trajectories of one prompt decode together,
  so a dispatch sleeps for its longest one (`processing_time_s` of each row is its own length / speed);
- tokens are random digits (then eos unless truncated), log-probs log(1/10) (uniform over digits); the
  task scores them as usual. `param_version_end` is the version loaded when the sleep ends when partial
  rollout is on (weights swapped mid-trajectory), else the dispatch version.

`latency_model.concurrency` slots (threads) run the producer's loop side by side (an inference engine's
continuous batching), each taking budget for one prompt at a time; they share the producer's prompt
source, counters, stats window and weights under one lock. Idle and generation seconds are slot-averaged
(divided by the slot count), so idle_ratio stays the idle fraction of the slots. A dispatch whose budget a
reconnect (by any slot) released meanwhile is discarded instead of published.
"""

from __future__ import annotations

if __name__ == "__main__":  # a worker process: a SIGTERM during the torch import below must not kill it
    from rollstream.worker import install_early_signal_handlers

    install_early_signal_handlers()

import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

from producers.data import AgentTrajectory  # noqa: E402
from producers.worker import POLL_S, GenerateFn, Producer, producer_index, producer_seed  # noqa: E402
from rollstream.config import PipelineConfig  # noqa: E402
from rollstream.factory import build_policy  # noqa: E402
from rollstream.model import BasePolicy, Tokenizer  # noqa: E402
from rollstream.tasks import Prompt, Task  # noqa: E402
from rollstream.worker import WorkerContext  # noqa: E402
from schemas import DataProto, RolloutSample  # noqa: E402

log = logging.getLogger(__name__)

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
        """The model of `rollout.latency_model`, truncated at `data.max_response_length`."""
        lm = cfg.rollout.latency_model
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
    model: LatencyModel, batch: DataProto, tokenizer: Tokenizer, rng: np.random.Generator
) -> Plan:
    """Draw lengths and tokens for every row of a generation batch (rows left-padded, mask 1 = token)."""
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]  # [rows, P] each
    rows = [[int(t) for t, m in zip(r, mr, strict=True) if m] for r, mr in zip(ids, mask, strict=True)]
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
) -> list[AgentTrajectory]:
    """Sleep the plan's decode time, then return its trajectories. `version_now()` (when given) is the
    loaded version read after the sleep (partial rollout: the version that generated the last tokens)."""
    if sleep:
        time.sleep(plan.decode_s)
    end = version_start if version_now is None else version_now()
    out = []
    for prompt, resp, done in zip(plan.prompt_rows, plan.responses, plan.finished, strict=True):
        t = AgentTrajectory(prompt_ids=prompt, finished=done, num_turns=1, version_start=version_start, version_end=end)
        t.extend(resp, [DIGIT_LOGP] * len(resp), generated=True)
        t.processing_time_s = len(resp) / plan.tokens_per_s
        out.append(t)
    return out


def modelled_generate(
    model: LatencyModel, tokenizer: Tokenizer, rng: np.random.Generator, version_now: Callable[[], int] | None = None
) -> GenerateFn:
    """A producer's generate function that sleeps the modelled decode time of each dispatch (draws from
    `rng`, one slot at a time); `version_now` as for run_plan."""
    lock = threading.Lock()  # slots share the rng

    def generate(batch: DataProto, param_version: int) -> list[AgentTrajectory]:
        with lock:
            plan = plan_dispatch(model, batch, tokenizer, rng)
        return run_plan(plan, param_version, version_now)

    return generate


class LatencyProducer(Producer):
    """A Producer with the modelled decode injected, its loop run in `latency_model.concurrency` slots."""

    def __init__(self, ctx: WorkerContext, policy: BasePolicy | None = None, task: Task | None = None) -> None:
        cfg = ctx.cfg
        policy = policy or build_policy(cfg)
        rng = np.random.default_rng(producer_seed(cfg.run.seed, producer_index(ctx.name, cfg.rollout.num_producers)))
        version_now = (lambda: self.weights.version) if cfg.rollout.partial_rollout else None
        generate = modelled_generate(LatencyModel.from_config(cfg), policy.tokenizer, rng, version_now)
        self.slots = cfg.rollout.latency_model.concurrency
        self.lock = threading.RLock()  # slots share the source, counters, stats window and weights
        self.generation = 0  # bumped by each reconnect; a dispatch taken under an older one is not published
        self._slot = threading.local()  # the generation a slot's current dispatch was taken under
        self._newest = (-1, 0.0)  # (version, monotonic time of the check), shared by idle slots
        super().__init__(ctx, policy, task, generate=generate)

    def _serve(self, limit: int | None, burst: bool) -> None:
        """`slots` loops side by side, one prompt a dispatch (one slot: the producer's own loop)."""
        if self.slots == 1:
            super()._serve(limit, burst)
            return
        slots = [
            threading.Thread(target=self._loop, args=(1, limit, burst), name=f"{self.name}-slot{i}", daemon=True)
            for i in range(self.slots)
        ]
        for t in slots:
            t.start()
        for t in slots:
            t.join()

    # ---- the producer's steps, one slot at a time ---------------------------------------------------
    def _reserve(self, limit: int | None) -> bool:
        with self.lock:  # other slots see the reservation
            return super()._reserve(limit)

    def _unreserve(self) -> None:
        with self.lock:
            super()._unreserve()

    def _refresh(self) -> tuple[bool, int]:
        with self.lock:
            self._slot.generation = self.generation
            return super()._refresh()

    def _reconnect(self, error: BaseException) -> None:
        with self.lock:  # once for all slots: every dispatch in flight belongs to the old generation
            super()._reconnect(error)
            self.generation += 1

    def _newest_version(self) -> int:
        """The newest published version; idle slots share one check per POLL_S."""
        version, at = self._newest
        if self.slots > 1 and time.monotonic() - at < POLL_S:
            return version
        self._newest = (super()._newest_version(), time.monotonic())
        return self._newest[0]

    def _add_idle(self, seconds: float) -> None:
        with self.lock:
            super()._add_idle(seconds / self.slots)  # slot-averaged

    def _take_prompts(self, amount: int) -> tuple[list[tuple[int, int, Prompt]], int]:
        with self.lock:
            return super()._take_prompts(amount)

    def _finish(
        self, ids: list[str], items: list[tuple[int, int, Prompt]], param_version: int, trajs: list[AgentTrajectory],
        gen_s: float, status: dict[str, float | int],
    ) -> list[RolloutSample]:
        with self.lock:
            if getattr(self._slot, "generation", self.generation) != self.generation:
                log.warning("discarding %d samples: their budget was released by a reconnect", len(items))
                return []
            return super()._finish(ids, items, param_version, trajs, gen_s / self.slots, status)  # slot-averaged

    def _maybe_stats(self) -> None:
        with self.lock:
            super()._maybe_stats()

    def _emit_stats(self, param_version: int) -> None:
        with self.lock:
            super()._emit_stats(param_version)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m benchmarks.latency`: `python -m producers` with a LatencyProducer."""
    from producers.__main__ import main

    return main(argv, build=LatencyProducer, role="benchmarks.latency")


if __name__ == "__main__":
    sys.exit(worker_main())
