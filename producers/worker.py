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
`mark_published` in one transaction. A ProducerStats event goes to `stats` on each version switch
(tagged with the version left) and every `rollout.stats_every_s`. The first SIGTERM finishes and
publishes the current dispatch, then exits 0.

Reconnects: a Redis connection loss anywhere in the loop is handled in place, the way a restart would
handle it: wait (with backoff) until Redis answers, release what this producer took and has not
published (`release_unpublished`), reload its cursor from Redis, and go on; a dispatch whose budget was
released meanwhile (another slot's, in latency-model mode) is discarded instead of published. A publish
whose reply was lost either landed (the cursor in Redis moved with it) or not (its prompts are
dispatched again), so nothing is published twice or skipped.

Latency-model mode (`rollout.latency_model.enable`, benchmarks; see producers/latency.py): decoding is
replaced by sleeping the modelled decode time, and `latency_model.concurrency` slots (threads) run the
loop above side by side, each taking budget for one prompt at a time. Idle and generation seconds are
then slot-averaged (divided by the slot count), so idle_ratio stays the idle fraction of the slots.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from producers.agent import GenerationSettings, run_agent_loop
from producers.data import (
    AgentTrajectory,
    build_rollout_sample,
    concat_generation_data,
    prepare_single_generation_data,
)
from producers.latency import LatencyModel, plan_dispatch, run_plan
from producers.stats import Counters, StatsWindow, rollout_status
from producers.weight_sync import WeightSync
from rollstream.bus import CONNECTION_ERRORS, Publisher, RunNotSetUpError, retry_on_connection
from rollstream.factory import build_policy, build_prompt_source, build_task
from rollstream.model import BasePolicy
from rollstream.names import producer_names
from rollstream.pacing import current_budget, mark_published, release_unpublished, rollout_counts, take_budget
from rollstream.tasks import Prompt, Task
from rollstream.weights import WeightsError, latest_param_version
from rollstream.worker import EXIT_CONFIG, EXIT_ERROR, EXIT_OK, WorkerContext, start_worker
from schemas import DataProto, RolloutSample, encode

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
        lm = cfg.rollout.latency_model
        self.latency = LatencyModel.from_config(cfg) if lm.enable else None
        self.slots = lm.concurrency if lm.enable else 1
        self.rng = np.random.default_rng(producer_seed(cfg.run.seed, self.index))  # latency-model draws
        self.lock = threading.RLock()  # slots share the source, counters, stats window and weights
        self._done = 0
        self._newest = (-1, 0.0)  # (version, monotonic time of the check), shared by idle slots
        self.generation = 0  # bumped by each reconnect; a dispatch taken under an older one is not published
        self.reconnects = 0

    # ---- start-up ---------------------------------------------------------------------------------
    def start(self) -> bool:
        """Release a crashed predecessor's unpublished budget, resume the cursor, load version 0.
        False when stopped before any version appeared."""
        r, keys = self.ctx.r, self.ctx.keys
        self.counters.released_on_start = retry_on_connection(self._resync, "start")
        if self.counters.released_on_start:
            log.warning("released %d dispatched-but-unpublished prompts of a previous run of %s",
                        self.counters.released_on_start, self.name)
        log.info("producer %s: shard %d of %d; waiting for param version 0", self.name, self.index,
                 self.ctx.cfg.rollout.num_producers)
        if not retry_on_connection(lambda: self.weights.wait_initial(self.ctx.stop), "waiting for version 0"):
            return False
        if not r.exists(keys.setup):  # set by setup_run once the streams exist (the producer's ACL cannot read rollouts)
            raise RunNotSetUpError(f"stream {keys.rollouts} does not exist: run `rollstream run` or setup_run first")
        self.counters.versions_loaded = self.weights.loads
        return True

    def _resync(self) -> int:
        """Release what this producer took and never published, reload its cursor from Redis (at start
        and after a reconnect); returns the prompts released."""
        r, keys = self.ctx.r, self.ctx.keys
        released = release_unpublished(r, keys, self.name)
        saved: Any = r.get(keys.producer_cursor(self.name))
        if saved is not None:
            epoch, index = (int(x) for x in saved.decode().split(":"))
            self.source.cursor = (epoch, index)
            log.info("resuming prompts at epoch %d index %d", epoch, index)
        return released

    def _reconnect(self, error: BaseException) -> None:
        """After a connection loss: wait for Redis, then resync as a restarted producer would (once for
        all slots: every dispatch in flight belongs to the old generation and is discarded)."""
        log.warning("redis connection lost (%s); reconnecting in place", error)
        with self.lock:
            released = retry_on_connection(self._resync, "reconnect")
            self.generation += 1
            self.reconnects += 1
        log.warning("reconnected; released %d dispatched-but-unpublished prompts", released)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, max_dispatches: int | None = None, burst: bool = False) -> int:
        """Dispatch until stop, `max_dispatches` dispatches, or (burst) no budget left; returns dispatches."""
        if not self.start():
            return 0
        with self.lock:  # the first window starts once version 0 is loaded
            self.window = StatsWindow()
            self.last_stats = time.monotonic()
        start = self._done
        limit = None if max_dispatches is None else start + max_dispatches
        if self.slots == 1:
            self._loop(self.ctx.cfg.rollout.prompts_per_dispatch, limit, burst)
        else:
            slots = [
                threading.Thread(target=self._loop, args=(1, limit, burst), name=f"{self.name}-slot{i}", daemon=True)
                for i in range(self.slots)
            ]
            for t in slots:
                t.start()
            for t in slots:
                t.join()
        try:
            self._emit_stats(self.weights.version)
        except CONNECTION_ERRORS as e:  # leaving anyway: the window's stats are lost, nothing else
            log.warning("final stats not published: %s", e)
        return self._done - start

    def _loop(self, want: int, limit: int | None, burst: bool) -> None:
        """One slot: `_turn` until stop, `limit` dispatches by all slots together, or (burst) no budget
        left; a connection loss is handled in place (`_reconnect`)."""
        while not self.ctx.stop.is_set():
            with self.lock:
                if limit is not None and self._done >= limit:
                    break
                self._done += 1  # reserve a dispatch (other slots see it); given back when none happens
            published: list[bool] = []
            keep_going = True
            try:
                keep_going = self._turn(want, burst, published)
            except CONNECTION_ERRORS as e:
                self._reconnect(e)
            if not published:
                with self.lock:
                    self._done -= 1
            if not keep_going:
                break

    def _turn(self, want: int, burst: bool, published: list[bool]) -> bool:
        """Refresh weights, take budget and dispatch (appending to `published` once on the log), or wait
        for budget or a new version; False to stop (burst mode, no budget)."""
        r, keys = self.ctx.r, self.ctx.keys
        with self.lock:
            self.weights.refresh()  # between dispatches: always the newest version
            mine = self.weights.version
            generation = self.generation
        take = take_budget(r, keys, mine, want, self.name)
        if take.amount > 0:
            if self.dispatch(take.amount, generation=generation):  # [] = discarded: budget released
                published.append(True)
            self._maybe_stats()
            return True
        if take.stale:
            if take.budget_version < mine:  # our version's grant is not made yet
                self._idle_until(lambda v=mine: current_budget(r, keys)[0] >= v)
            else:
                with self.lock:
                    loaded = self.weights.refresh()
                if not loaded:  # budget is for a newer version we could not load yet
                    self._idle_until(lambda: False, once=True)  # one poll step, then retry
            return True
        if burst:
            return False
        self._idle_until(lambda v=mine: self._newest_version() > v)
        return True

    def _newest_version(self) -> int:
        """The newest published version (one XREVRANGE; idle slots share one check per POLL_S)."""
        version, at = self._newest
        if self.slots > 1 and time.monotonic() - at < POLL_S:
            return version
        pv = latest_param_version(self.ctx.r, self.ctx.keys)
        self._newest = (-1 if pv is None else pv.version, time.monotonic())
        return self._newest[0]

    def _idle_until(self, ready: Callable[..., bool], once: bool = False) -> None:
        """Sleep in short steps until `ready()` or stop (or after one step when `once`), counting idle time."""
        t0 = time.monotonic()
        while not self.ctx.stop.is_set() and not ready():
            time.sleep(POLL_S)
            self._maybe_stats()
            if once:
                break
        idle = (time.monotonic() - t0) / self.slots  # slot-averaged
        with self.lock:
            self.counters.idle_s += idle
            self.window.idle_s += idle

    # ---- one dispatch -----------------------------------------------------------------------------
    def dispatch(self, amount: int, generation: int | None = None) -> list[RolloutSample]:
        """Generate `amount` prompts (budget already taken) x n, score and publish them; returns the samples
        ([] when a reconnect since the take, i.e. a newer `generation`, released their budget)."""
        cfg = self.ctx.cfg
        with self.lock:
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
        trajs = self._generate(batch, param_version)
        gen_s = (time.perf_counter() - t0) / self.slots  # slot-averaged

        n = cfg.rollout.n
        counts = rollout_counts(self.ctx.r, self.ctx.keys, producer_names(cfg.rollout.num_producers))
        status = rollout_status(counts, cfg, self.weights.version)
        with self.lock:
            self.counters.gen_s += gen_s
            self.window.gen_s += gen_s
            samples = []
            for k, (sid, (epoch, _, prompt)) in enumerate(zip(ids, items, strict=True)):
                group = trajs[k * n : (k + 1) * n]
                samples.append(self._sample(sid, epoch, param_version, prompt, group, status))
            if generation is not None and generation != self.generation:
                log.warning("discarding %d samples: their budget was released by a reconnect", len(samples))
                return []
            self._publish(samples)
        return samples

    def _generate(self, batch: DataProto, param_version: int) -> list[AgentTrajectory]:
        """Run the agent loop on the batch, or (latency model) sleep its modelled decode time."""
        if self.latency is None:
            return run_agent_loop(self.policy, self.task, batch, self.settings, self.weights, self.generator)
        with self.lock:
            plan = plan_dispatch(self.latency, batch, self.policy.tokenizer, self.rng)
        partial = self.ctx.cfg.rollout.partial_rollout
        return run_plan(plan, param_version, (lambda: self.weights.version) if partial else None)

    def _sample(
        self, sample_id: str, epoch: int, param_version: int, prompt: Prompt, group: list[Any],
        status: dict[str, float | int],
    ) -> RolloutSample:
        """Score one prompt's trajectories and pack them as a RolloutSample carrying the global `status`."""
        tok = self.policy.tokenizer
        rewards = [self.task.reward(prompt, tok.decode(t.response_ids)) for t in group]
        self.window.add_sample(group, rewards)
        self.counters.tokens += sum(t.generated_tokens for t in group)
        self.counters.partial_swaps += sum(int(t.version_start < t.version_end) for t in group)
        self.counters.tool_calls += sum(len(t.tool_call_s) for t in group)
        tool_calls = [sum(t.tool_call_s) for t in group] if self.multi_turn else []  # per row, as verl
        self.counters.versions_loaded = self.weights.loads
        return build_rollout_sample(
            sample_id=sample_id,
            epoch=epoch,
            param_version=param_version,
            producer=self.name,
            trajectories=group,
            rewards=rewards,
            raw_prompt=prompt.text,
            ground_truth=prompt.answer,
            tokenizer=tok,
            rollout_status=status,
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
        pipe.set(keys.producer_cursor(self.name), f"{epoch}:{index}")
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
            with self.lock:
                if time.monotonic() - self.last_stats >= self.ctx.cfg.rollout.stats_every_s:
                    self._emit_stats(self.weights.version)

    def _emit_stats(self, param_version: int) -> None:
        """Publish the current window as a ProducerStats on `stats` and start a new window."""
        with self.lock:
            ev = self.window.event(self.name, param_version)
            self.metrics.publish(self.ctx.keys.stats, ev)
            self.window = StatsWindow()
            self.last_stats = time.monotonic()


def set_torch_threads(threads: int) -> None:
    """Process-wide torch intra-op threads (0 leaves torch's default); called by entry points only."""
    if threads > 0:
        torch.set_num_threads(threads)


def lower_priority(nice: int) -> None:
    """Raise this process's nice value by `nice` (0: unchanged), so the trainer wins shared cores."""
    if nice > 0:
        os.nice(nice)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m producers` / `python -m producers.worker`; returns the exit code."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--max-dispatches", type=int, default=None, help="exit after this many dispatches (tests)")
    known, rest = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    ctx, args = start_worker("producers", rest)
    set_torch_threads(ctx.cfg.rollout.torch_threads)
    lower_priority(ctx.cfg.rollout.nice)
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
