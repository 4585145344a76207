"""The rollout producer worker: take budget -> dispatch prompts -> generate -> score -> publish.

    python -m producers pipeline.yaml [key=value ...] [--name rollout_00] [--burst] [--max-dispatches N]

A producer named `rollout_NN` draws shard NN of `rollout.num_producers` from the prompt source and keeps
its cursor in Redis (`producer_cursor`), advanced in the same MULTI/EXEC as the samples it publishes, so
a restart resumes where the last publish left off. On start it releases the budget a crashed
predecessor took but never published, then waits for param version 0.

Loop (until stop): load the newest weights (between dispatches), take up to `prompts_per_dispatch`
from that version's budget (none left: wait, idle, for the next version), stamp `param_version` = the
loaded version, generate all prompts x n in one agent-loop call (weights may change mid-generation
with partial rollout), score each response, and publish one RolloutSample per prompt together with
`mark_published` in one transaction. A ProducerStats event goes to `metrics` on each version switch
(tagged with the version left) and every `rollout.stats_every_s`. The first SIGTERM finishes and
publishes the current dispatch, then exits 0.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from producers.agent import GenerationSettings, run_agent_loop
from producers.data import build_rollout_sample, concat_generation_data, prepare_single_generation_data
from producers.stats import Counters, StatsWindow
from producers.sync import WeightSync
from rollstream.bus import Publisher, RunNotSetUpError
from rollstream.factory import build_policy, build_prompt_source, build_task
from rollstream.model import BasePolicy
from rollstream.pacing import current_budget, mark_published, release_unpublished, take_budget
from rollstream.tasks import Prompt, Task
from rollstream.weights import WeightsError, latest_param_version
from rollstream.worker import EXIT_CONFIG, EXIT_ERROR, EXIT_OK, WorkerContext, start_worker
from schemas import RolloutSample, encode

log = logging.getLogger(__name__)

POLL_S = 0.02  # sleep between checks while idle (budget or version)


def producer_index(name: str, count: int) -> int:
    """Shard index from the worker name: `rollout_NN` -> NN, anything else -> 0; must be < count."""
    m = re.fullmatch(r"rollout_(\d+)", name)
    index = int(m.group(1)) if m else 0
    if index >= count:
        raise ValueError(f"producer {name!r} has index {index} but rollout.num_producers={count}")
    return index


def producer_seed(seed: int, index: int) -> int:
    """Sampling seed of producer `index` (distinct per producer, fixed by run.seed)."""
    return seed * 1_000_003 + index


class Producer:
    """One rollout producer on a WorkerContext; `run()` loops until stop (or a bounded amount of work)."""

    def __init__(self, ctx: WorkerContext, policy: BasePolicy | None = None, task: Task | None = None) -> None:
        cfg = ctx.cfg
        self.ctx = ctx
        self.name = ctx.name
        self.index = producer_index(ctx.name, cfg.rollout.num_producers)
        self.task = task or build_task(cfg)
        self.source = build_prompt_source(cfg, self.task).shard(self.index, cfg.rollout.num_producers)
        self.policy = policy or build_policy(cfg)
        self.generator = torch.Generator().manual_seed(producer_seed(cfg.run.seed, self.index))
        self.settings = GenerationSettings.from_config(cfg)
        self.multi_turn = cfg.rollout.multi_turn.enable and self.task.multi_turn
        self.weights = WeightSync(ctx.r, ctx.keys, self.policy, ctx.name, on_switch=self._on_switch)
        self.metrics = Publisher(ctx.r, nomkstream=True)
        self.counters = Counters()
        self.window = StatsWindow()
        self.last_stats = time.monotonic()

    # ---- start-up ---------------------------------------------------------------------------------
    def start(self) -> bool:
        """Release a crashed predecessor's unpublished budget, resume the cursor, load version 0.
        False when stopped before any version appeared."""
        r, keys = self.ctx.r, self.ctx.keys
        self.counters.released_on_start = release_unpublished(r, keys, self.name)
        if self.counters.released_on_start:
            log.warning("released %d dispatched-but-unpublished prompts of a previous run of %s",
                        self.counters.released_on_start, self.name)
        saved: Any = r.hget(keys.producer_cursor, self.name)
        if saved is not None:
            epoch, index = (int(x) for x in saved.decode().split(":"))
            self.source.cursor = (epoch, index)
            log.info("resuming prompts at epoch %d index %d", epoch, index)
        log.info("producer %s: shard %d of %d; waiting for param version 0", self.name, self.index,
                 self.ctx.cfg.rollout.num_producers)
        if not self.weights.wait_initial(self.ctx.stop):
            return False
        if not r.exists(keys.rollouts):
            raise RunNotSetUpError(f"stream {keys.rollouts} does not exist: run `rollstream run` or setup_run first")
        self.counters.versions_loaded = self.weights.loads
        return True

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, max_dispatches: int | None = None, burst: bool = False) -> int:
        """Dispatch until stop, `max_dispatches` dispatches, or (burst) no budget left; returns dispatches."""
        if not self.start():
            return 0
        r, keys, stop = self.ctx.r, self.ctx.keys, self.ctx.stop
        want = self.ctx.cfg.rollout.prompts_per_dispatch
        done = 0
        while not stop.is_set() and (max_dispatches is None or done < max_dispatches):
            self.weights.refresh()  # between dispatches: always the newest version
            mine = self.weights.version
            take = take_budget(r, keys, mine, want, self.name)
            if take.stale:
                if take.budget_version < mine:  # our version's grant is not made yet
                    self._idle_until(lambda v=mine: current_budget(r, keys)[0] >= v)
                elif not self.weights.refresh():  # budget is for a newer version we could not load yet
                    self._idle_until(lambda: False, once=True)  # one poll step, then retry
                continue
            if take.amount == 0:
                if burst:
                    break
                self._idle_until(lambda v=mine: self._newest_version() > v)
                continue
            self.dispatch(take.amount)
            done += 1
            self._maybe_stats()
        self._emit_stats(self.weights.version)
        return done

    def _newest_version(self) -> int:
        """The newest published version (one XREVRANGE)."""
        pv = latest_param_version(self.ctx.r, self.ctx.keys)
        return -1 if pv is None else pv.version

    def _idle_until(self, ready: Callable[..., bool], once: bool = False) -> None:
        """Sleep in short steps until `ready()` or stop (or after one step when `once`), counting idle time."""
        t0 = time.monotonic()
        while not self.ctx.stop.is_set() and not ready():
            time.sleep(POLL_S)
            self._maybe_stats()
            if once:
                break
        idle = time.monotonic() - t0
        self.counters.idle_s += idle
        self.window.idle_s += idle

    # ---- one dispatch -----------------------------------------------------------------------------
    def dispatch(self, amount: int) -> list[RolloutSample]:
        """Generate `amount` prompts (budget already taken) x n, score and publish them; returns the samples."""
        cfg = self.ctx.cfg
        items = self.source.take(amount)
        param_version = self.weights.version  # stamped at dispatch
        self.counters.dispatched += len(items)
        ids = [f"{self.name}-{uuid.uuid4().hex[:12]}" for _ in items]
        groups = [
            prepare_single_generation_data(p, cfg.rollout.n, self.multi_turn, self.policy.tokenizer, sample_id=sid)
            for sid, (_, _, p) in zip(ids, items, strict=True)
        ]
        batch = concat_generation_data(groups, self.policy.tokenizer.pad_id)  # prompts*n rows, prompt-major
        t0 = time.perf_counter()
        trajs = run_agent_loop(self.policy, self.task, batch, self.settings, self.weights, self.generator)
        gen_s = time.perf_counter() - t0
        self.counters.gen_s += gen_s
        self.window.gen_s += gen_s

        n = cfg.rollout.n
        samples = []
        for k, (sid, (epoch, _, prompt)) in enumerate(zip(ids, items, strict=True)):
            group = trajs[k * n : (k + 1) * n]
            samples.append(self._sample(sid, epoch, param_version, prompt, group))
        self._publish(samples)
        return samples

    def _sample(self, sample_id: str, epoch: int, param_version: int, prompt: Prompt, group: list[Any]) -> RolloutSample:
        """Score one prompt's trajectories and pack them as a RolloutSample."""
        tok = self.policy.tokenizer
        rewards = [self.task.reward(prompt, tok.decode(t.response_ids)) for t in group]
        self.window.add_sample(group, rewards)
        self.counters.tokens += sum(t.generated_tokens for t in group)
        self.counters.partial_swaps += sum(int(t.version_start < t.version_end) for t in group)
        tool_calls = [s for t in group for s in t.tool_call_s]
        self.counters.tool_calls += len(tool_calls)
        self.counters.versions_loaded = self.weights.loads
        return build_rollout_sample(
            sample_id=sample_id,
            epoch=epoch,
            param_version=param_version,
            producer=self.name,
            trajectories=group,
            rewards=rewards,
            raw_prompt=prompt.text,
            tokenizer=tok,
            rollout_status=self.counters.as_status(self.weights.version),
            tool_calls=tool_calls,
        )

    def _publish(self, samples: Sequence[RolloutSample]) -> None:
        """XADD the samples, mark them published and advance the cursor, in one MULTI/EXEC."""
        keys = self.ctx.keys
        pipe = self.ctx.r.pipeline(transaction=True)
        for s in samples:
            pipe.xadd(keys.rollouts, encode(s), nomkstream=True)  # type: ignore[arg-type]
        mark_published(pipe, keys, self.name, len(samples))
        epoch, index = self.source.cursor
        pipe.hset(keys.producer_cursor, self.name, f"{epoch}:{index}")
        res = pipe.execute()
        if any(x is None for x in res[: len(samples)]):
            raise RunNotSetUpError(f"stream {keys.rollouts} does not exist: run `rollstream run` or setup_run first")
        self.counters.published += len(samples)

    # ---- statistics -------------------------------------------------------------------------------
    def _on_switch(self, old: int, new: int) -> None:
        """Weights changed (between dispatches or mid-generation): report the window of the version left."""
        self.counters.versions_loaded = self.weights.loads
        self._emit_stats(old)

    def _maybe_stats(self) -> None:
        """Emit a ProducerStats event when `rollout.stats_every_s` has passed."""
        if time.monotonic() - self.last_stats >= self.ctx.cfg.rollout.stats_every_s:
            self._emit_stats(self.weights.version)

    def _emit_stats(self, param_version: int) -> None:
        """Publish the current window as a ProducerStats on `metrics` and start a new window."""
        ev = self.window.event(self.name, param_version)
        self.metrics.publish(self.ctx.keys.metrics, ev)
        self.window = StatsWindow()
        self.last_stats = time.monotonic()


def set_torch_threads(threads: int) -> None:
    """Process-wide torch intra-op threads (0 leaves torch's default); called by entry points only."""
    if threads > 0:
        torch.set_num_threads(threads)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m producers` / `python -m producers.worker`; returns the exit code."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--max-dispatches", type=int, default=None, help="exit after this many dispatches (tests)")
    known, rest = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    ctx, args = start_worker("producers", rest)
    set_torch_threads(ctx.cfg.rollout.torch_threads)
    try:
        producer = Producer(ctx)
    except ValueError as e:  # e.g. a name whose index exceeds rollout.num_producers
        log.error("%s", e)
        return EXIT_CONFIG
    try:
        done = producer.run(max_dispatches=known.max_dispatches, burst=args.burst)
    except (RunNotSetUpError, WeightsError) as e:
        log.error("%s", e)
        return EXIT_ERROR
    log.info("producer %s: %d dispatches, exiting", ctx.name, done)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
