# Over 400 lines on purpose: one Producer whose loop steps share its state (publishing: producers/publish.py).
"""The rollout producer: lease -> dispatch prompts -> generate -> score -> publish.

Started as `python -m producers pipeline.yaml [key=value ...] [--name rollout_00] [--burst]
[--max-dispatches N]` (producers/__main__.py).

A producer named `rollout_NN` draws shard NN of `rollout.num_producers` from the prompt source and keeps
its cursor in Redis (`producer_cursor`), advanced in the same MULTI/EXEC as the samples it publishes, so
a restart resumes where the last publish left off. Its prompts are numbered over the run (`seq`, sample
id `<name>-<seq>`), and its published count (`producer:<name>:published`) moves with the cursor, so a
restarted producer dispatches what a crashed predecessor leased and never published again, under the same
ids. Then it waits for a param version and loads the newest (one collected while it loads is passed over
for the next).

Loop (until stop): read its lease (rollstream/pacing/: the trainer leases prompts to producers; a
producer runs no script); with prompts left on it, load the newest weights (after reading the lease: a
prompt leased under version v is never generated with older weights), dispatch up to
`prompts_per_dispatch` of them, stamp `param_version` = the loaded version, generate all prompts x n in one
agent-loop call (weights may change mid-generation with partial rollout), score each response, and publish
one RolloutSample per prompt together with `mark_published` and the cursor in one transaction
(producers/publish.py). With none
left it asks for one more dispatch (`producer:<name>:want`) and waits, idle, for the trainer's lease.
A ProducerStats event goes to `stats` on each version switch (tagged with the version left) and every
`rollout.stats_every_s`. The first SIGTERM finishes and
publishes the current dispatch, then exits 0.

Reconnects: a Redis connection loss anywhere in the loop is handled in place, the way a restart would
handle it: wait (with backoff) until Redis answers, reload its cursor and published count from Redis (the
dispatch in flight is abandoned: its prompts are dispatched again), and go on. A publish whose reply was lost
either landed (the cursor in Redis moved with it) or not (its prompts are dispatched again), so nothing is
published twice or skipped.

Generation is a function the producer is given (`GenerateFn`); the default runs the policy through the
agent loop. With `slots` > 1 (for a generate function that can run concurrently: the latency-model
benchmarks, `bench.latency_model`, benchmarks/latency_producer.py, inject a modelled decode) copies of the
loop run side by side, one prompt a dispatch each (producers/slots.py); the producer's lock guards what they
share. With one slot the loop runs in the caller's thread, taking that lock uncontended.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from producers.agent import GenerationSettings, run_agent_loop
from producers.engines import EngineError
from producers.publish import Publishing
from producers.rollout import GenerationRequest, Trajectory, generation_request
from producers.slots import Slots
from producers.stats import Counters, StatsWindow
from producers.watchdog import GenerationHung, GenerationWatchdog, exit_hung
from producers.weight_sync import WeightSync
from rollstream.bus import CONNECTION_ERRORS, Publisher, RunNotSetUpError
from rollstream.bus.connection import retried
from rollstream.config import PipelineConfig
from rollstream.keys import Keys
from rollstream.model import BasePolicy, build_policy
from rollstream.pacing.budget import ask_lease, leased_sample_id
from rollstream.pacing.counters import lease_of, published_count
from rollstream.runtime.process import EXIT_HUNG, WorkerContext
from rollstream.tasks import Prompt, Task, build_prompt_source, build_task
from rollstream.weights.fingerprint import SWAP_CHECK_DIFF, SWAP_CHECK_DIFF_MAX, SWAP_CHECK_VERSION
from rollstream.weights.store import latest_param_version
from schemas import RolloutSample, decode_cursor

if TYPE_CHECKING:
    from producers.continuous import ContinuousLoop
    from producers.engines.vllm import VLLMPolicy

log = logging.getLogger(__name__)

POLL_S = 0.005  # sleep between checks while idle (a lease or a version): the wait for a lease is latency
BURST_WAIT_S = 0.25  # burst mode: how long to wait for a lease asked for before stopping

#: Generation of one dispatch: (the request, prompts x n rows prompt-major; the param version stamped at
#: dispatch) -> one trajectory per row, in row order.
GenerateFn = Callable[[GenerationRequest, int], list[Trajectory]]


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


class Producer(Publishing):
    """One rollout producer on a WorkerContext; `run()` loops until stop (or a bounded amount of work).
    `generate` replaces the policy's generation (benchmarks inject a modelled decode); `slots` > 1 runs that
    many copies of the loop side by side, one prompt a dispatch each (producers/slots.py)."""

    def __init__(
        self,
        ctx: WorkerContext,
        policy: BasePolicy | VLLMPolicy | None = None,
        task: Task | None = None,
        generate: GenerateFn | None = None,
        slots: int = 1,
    ) -> None:
        cfg = ctx.cfg
        if cfg.bench.latency_model.enable and generate is None:
            raise ValueError(
                "bench.latency_model.enable is for benchmarks: run the latency-model producer "
                "(`python -m benchmarks.latency_producer`, which `rollstream run` starts for such a config)"
            )
        if slots > 1 and generate is None:
            raise ValueError(
                f"{slots} slots need a generate function that can run concurrently: the agent loop (and the "
                "continuous loop) share one policy and one torch generator"
            )
        self.slots = Slots(slots, POLL_S)
        #: guards the state the slots (and the generation watchdog's thread) share: the prompt source, lease,
        #: counters, stats window and weights
        self.lock = threading.RLock()
        self.ctx = ctx
        self.name = ctx.name
        self.index = producer_index(ctx.name, cfg.rollout.num_producers)
        self.task = task or build_task(cfg)
        self.source = build_prompt_source(cfg, self.task).shard(self.index, cfg.rollout.num_producers)
        self.policy: BasePolicy | VLLMPolicy
        engine: VLLMPolicy | None = None
        if cfg.rollout.name == "vllm" and generate is None:
            from producers.engines.vllm import VLLMPolicy  # vllm is imported only by producers that run it

            if policy is None or isinstance(policy, VLLMPolicy):  # a running engine given (tests) is used
                engine = policy or VLLMPolicy.from_config(cfg, seed=producer_seed(cfg.run.seed, self.index))
        if engine is not None:
            self.policy = engine
            self.weights = WeightSync(
                ctx.r, ctx.keys, None, ctx.name, self._on_switch, engine.load_param_version,
                prober=engine.probe_logprobs, max_diff=swap_check_bound(cfg, engine.dtype_name),
            )
        else:
            # a VLLMPolicy became `engine` above
            builtin = cast(BasePolicy, policy) or build_policy(cfg, dtype=cfg.rollout.dtype)
            self.policy = builtin
            module = getattr(builtin, "module", None)  # test fakes have none
            dtype = str(next(module.parameters()).dtype).removeprefix("torch.") if module else "float32"
            self.weights = WeightSync(ctx.r, ctx.keys, builtin, ctx.name, on_switch=self._on_switch,
                                      max_diff=swap_check_bound(cfg, dtype))
        self.generator = torch.Generator().manual_seed(producer_seed(cfg.run.seed, self.index))
        self.settings = GenerationSettings.from_config(cfg)
        self.multi_turn = cfg.rollout.multi_turn.enable and self.task.multi_turn
        #: the continuous loop (producers/continuous.py) when this producer runs one
        self.continuous: ContinuousLoop | None = None
        if engine is not None and cfg.rollout.vllm.continuous:
            if self.multi_turn:
                log.info("rollout.vllm.continuous: the tool agent loop generates per dispatch")
            else:
                from producers.continuous import ContinuousLoop

                self.continuous = ContinuousLoop(self, engine)
        elif engine is None and cfg.rollout.continuous:
            if generate is not None:
                raise ValueError("rollout.continuous=true runs the built-in engine's own running batch: it "
                                 "cannot use a generate function given to the producer")
            from producers.continuous import ContinuousLoop, builtin_engine

            rows = builtin_engine(cfg, cast(BasePolicy, self.policy), self.generator)
            self.continuous = ContinuousLoop(self, rows)
        self.generate: GenerateFn = generate or self.agent_loop
        self.metrics = Publisher(ctx.r, nomkstream=True)
        self.counters = Counters()
        self.window = StatsWindow()
        self.generating = 0  # dispatches inside generate now (slots run several)
        self.next_seq = 0  # the seq of the next prompt to dispatch (published + in flight)
        self.leased = 0  # prompts leased to this producer, as last read
        self.last_stats = time.monotonic()
        self._done = 0
        self.reconnects = 0
        #: called by the generation watchdog after publishing a hung dispatch (tests replace the exit)
        self.on_hung: Callable[[], None] = partial(exit_hung, EXIT_HUNG)

    def agent_loop(self, request: GenerationRequest, param_version: int) -> list[Trajectory]:
        """The default generation: the policy through the agent loop (weights may change mid-generation)."""
        return run_agent_loop(self.policy, self.task, request, self.settings, self.weights, self.generator)

    # ---- start-up ---------------------------------------------------------------------------------
    def start(self) -> bool:
        """Resume the cursor and published count (a crashed predecessor's leased, unpublished prompts are
        dispatched again), load the newest version. False when stopped before any version appeared."""
        r, keys = self.ctx.r, self.ctx.keys
        self.counters.released_on_start = self._resync()
        if self.counters.released_on_start:
            log.warning(
                "%d leased prompts not published yet (taken by a previous run of %s, or leased ahead): "
                "dispatching them",
                self.counters.released_on_start,
                self.name,
            )
        log.info(
            "producer %s: shard %d of %d; waiting for a param version",
            self.name,
            self.index,
            self.ctx.cfg.rollout.num_producers,
        )
        if not self._wait_initial():
            return False
        # set by setup_run once the streams exist (the producer's ACL cannot read rollouts)
        if not r.exists(keys.setup):
            raise RunNotSetUpError.for_stream(keys.rollouts_of(self.name))
        self.counters.versions_loaded = self.weights.loads
        return True

    @retried("waiting for a param version")
    def _wait_initial(self) -> bool:
        """Wait for a param version and load the newest (one collected while it loads is passed over for the
        next); False when stopped first."""
        return self.weights.wait_initial(self.ctx.stop)

    @retried("reloading the cursor and published count")
    def _resync(self) -> int:
        """Reload the cursor and published count from Redis (at start and after a reconnect); returns the
        leased prompts not published (dispatched again)."""
        r, keys = self.ctx.r, self.ctx.keys
        self.next_seq = published_count(r, keys, self.name)
        self.leased = lease_of(r, keys, self.name)
        released = max(0, self.leased - self.next_seq)
        saved: Any = r.get(keys.producer_cursor(self.name))
        if saved is not None:
            epoch, index = decode_cursor(saved)
            self.source.cursor = (epoch, index)
            log.info("resuming prompts at epoch %d index %d", epoch, index)
        return released

    def _reconnect(self, error: BaseException) -> None:
        """After a connection loss: wait for Redis, then resync as a restarted producer would (the dispatch
        in flight is abandoned: its prompts are dispatched again)."""
        log.warning("redis connection lost (%s); reconnecting in place", error)
        with self.lock:  # once for all slots: every dispatch in flight belongs to the old generation
            released = self._resync()
            self.reconnects += 1
            self.slots.reconnected()
        log.warning("reconnected; %d leased prompts not published, dispatching them again", released)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, max_dispatches: int | None = None, burst: bool = False) -> int:
        """Dispatch until stop, `max_dispatches` dispatches, or (burst) no lease comes; returns dispatches."""
        if not self.start():
            return 0
        self.window = StatsWindow()  # the first window starts once version 0 is loaded
        self.last_stats = time.monotonic()
        start = self._done
        self._serve(None if max_dispatches is None else start + max_dispatches, burst)
        try:
            self._emit_stats(self.weights.version)
        except CONNECTION_ERRORS as e:  # leaving anyway: the window's stats are lost, nothing else
            log.warning("final stats not published: %s", e)
        return self._done - start

    def _serve(self, limit: int | None, burst: bool) -> None:
        """The dispatch loop, `prompts_per_dispatch` prompts a dispatch, or the continuous loop (which counts
        every `prompts_per_dispatch` prompts it publishes as a dispatch); with slots, `slots` dispatch loops
        side by side, one prompt a dispatch."""
        per = self.ctx.cfg.rollout.prompts_per_dispatch
        if self.slots.count > 1:
            self.slots.run(partial(self._loop, 1, limit, burst), self.name)
            return
        if self.continuous is None:
            self._loop(per, limit, burst)
            return
        while not self.ctx.stop.is_set() and (limit is None or self._done < limit):
            try:
                published = self.continuous.run(None if limit is None else (limit - self._done) * per, burst)
            except CONNECTION_ERRORS as e:
                self._reconnect(e)
                continue
            self._done += -(-published // per)
            break

    def _loop(self, want: int, limit: int | None, burst: bool) -> None:
        """`_turn` until stop, `limit` dispatches in all, or (burst) no lease comes; a connection loss is
        handled in place (`_reconnect`)."""
        while not self.ctx.stop.is_set() and self._reserve(limit):
            published: list[bool] = []
            keep_going = True
            try:
                keep_going = self._turn(want, burst, published)
            except CONNECTION_ERRORS as e:
                self._reconnect(e)
            if not published:
                self._unreserve()
            if not keep_going:
                break

    def _reserve(self, limit: int | None) -> bool:
        """Count a dispatch about to happen; False when `limit` dispatches are done."""
        with self.lock:  # other slots see the reservation
            if limit is not None and self._done >= limit:
                return False
            self._done += 1
            return True

    def _unreserve(self) -> None:
        """Give back a reserved dispatch that published nothing."""
        with self.lock:
            self._done -= 1

    def _turn(self, want: int, burst: bool, published: list[bool]) -> bool:
        """With prompts left on the lease: load the newest weights and dispatch (appending to `published`
        once on the log); else load the newest weights, ask for `want` more and wait for the trainer's lease
        or a newer version. False to stop (burst mode, neither within BURST_WAIT_S)."""
        r, keys = self.ctx.r, self.ctx.keys
        self.leased = max(self.leased, lease_of(r, keys, self.name))  # read before the weights (liveness)
        seq = self.next_seq
        if self.leased > seq:
            self._refresh()  # between dispatches: always the newest version
            if self.dispatch(want):  # [] = nothing published
                published.append(True)
            self._maybe_stats()
            return True
        _, mine = self._refresh()  # idle or not, follow the versions (a switch reports its stats window)
        ask_lease(r, keys, self.name, seq + want * self.slots.count)  # one dispatch for each slot
        deadline = time.monotonic() + BURST_WAIT_S if burst else None
        self._idle_until(
            lambda: lease_of(r, keys, self.name) > seq
            or self._newest_version() > mine
            or (deadline is not None and time.monotonic() > deadline)
        )
        return not burst or lease_of(r, keys, self.name) > seq or self._newest_version() > mine

    def _refresh(self) -> tuple[bool, int]:
        """Load the newest weights when a newer version is out: (loaded one, the version in use)."""
        with self.lock:
            loaded = self.weights.refresh()
            return loaded, self.weights.version

    def _newest_version(self) -> int:
        """The newest published version (one XREVRANGE; idle slots share one per POLL_S)."""
        return self.slots.newest(partial(newest_version, self.ctx.r, self.ctx.keys))

    def _idle_until(self, ready: Callable[..., bool], once: bool = False) -> None:
        """Sleep in short steps until `ready()` or stop (or after one step when `once`), counting idle
        time."""
        t0 = time.monotonic()
        while not self.ctx.stop.is_set() and not ready():
            time.sleep(POLL_S)
            self._maybe_stats()
            if once:
                break
        self._add_idle(time.monotonic() - t0)

    def _add_idle(self, seconds: float) -> None:
        """Count idle seconds (waiting for a lease or a version; slot-averaged)."""
        seconds = self.slots.share(seconds)
        with self.lock:
            self.counters.idle_s += seconds
            self.window.idle_s += seconds

    # ---- one dispatch -----------------------------------------------------------------------------
    def dispatch(self, amount: int) -> list[RolloutSample]:
        """Generate up to `amount` prompts x n (as many as the lease has left), score and publish them;
        returns the samples ([] when none was left, or they were discarded instead of published)."""
        cfg = self.ctx.cfg
        with self.lock:  # `before`: the cursor ahead of the prompts taken (slots take in turn)
            before = self.source.cursor
            items, param_version, ids = self._take_prompts(amount)
        if not items:
            return []
        # prompts*n rows, prompt-major; each group's sample id and prompt stay in ids/items for _finish
        request = generation_request(
            [p for _, _, p in items], cfg.rollout.n, self.multi_turn, self.policy.tokenizer
        )
        t0 = time.perf_counter()
        failures = partial(self._publish_failures, ids, items, param_version, request, t0, before)
        try:
            with GenerationWatchdog(cfg.rollout.generate_timeout_s, partial(self._hung, failures)):
                with self.lock:
                    self.generating += 1
                try:
                    trajs = self.generate(request, param_version)
                finally:
                    with self.lock:
                        self.generating -= 1
        except (GenerationHung, EngineError):  # a failed swap or a broken engine: exit, keep the lease
            raise
        except CONNECTION_ERRORS:
            raise
        except Exception:  # an engine error or timeout: the prompts still end on the log, as failures
            log.exception("generation of %d prompts failed: publishing them as rollout failures", len(items))
            return failures()
        gen_s = time.perf_counter() - t0
        return self._finish(ids, items, param_version, trajs, gen_s, self._status(False), before)

    def _hung(self, publish_failures: Callable[[], list[RolloutSample]]) -> None:
        """The watchdog's end of a generation past `rollout.generate_timeout_s`: publish its prompts as
        rollout failures, then `on_hung` (exit EXIT_HUNG; the supervisor restarts the producer). A publish
        that fails loses nothing: the restarted producer dispatches the leased, unpublished prompts again."""
        log.error(
            "a generation did not finish within rollout.generate_timeout_s=%s s: publishing its prompts as "
            "rollout failures; exiting (%d) for the supervisor to restart this producer",
            self.ctx.cfg.rollout.generate_timeout_s, EXIT_HUNG,
        )
        try:
            publish_failures()
        except Exception:
            log.exception("publishing the hung dispatch failed: a restart dispatches its prompts again")
        self.on_hung()

    def _take_prompts(self, amount: int) -> tuple[list[tuple[int, int, Prompt]], int, list[str]]:
        """Take up to `amount` prompts from the source, no more than the lease has left: ((epoch, index,
        prompt) each, the version stamped on them, their sample ids `<name>-<seq>`)."""
        with self.lock:
            amount = min(amount, self.leased - self.next_seq)
            if amount <= 0:
                return [], self.weights.version, []
            self.slots.taken()
            items = self.source.take(amount)
            ids = [leased_sample_id(self.name, self.next_seq + k) for k in range(len(items))]
            self.next_seq += len(items)
            self.counters.dispatched += len(items)
            return items, self.weights.version, ids  # stamped at dispatch

    # ---- statistics -------------------------------------------------------------------------------
    def _on_switch(self, old: int, new: int) -> None:
        """Weights changed (between dispatches or mid-generation): report the window of the version left,
        unless it holds only the wait for this version (no sample published, no generation in flight: no
        work of the version left; the wait goes into the next window instead, which the aggregator merges
        with the others of its step's span); the window then goes on with the swap's duration."""
        with self.lock:
            self.counters.versions_loaded = self.weights.loads
            if self.window.samples or self.generating:
                self._emit_stats(old)
            self.window.add_swap(self.weights.last_load_s)

    def _maybe_stats(self) -> None:
        """Emit a ProducerStats event when `rollout.stats_every_s` has passed."""
        with self.lock:
            if time.monotonic() - self.last_stats >= self.ctx.cfg.rollout.stats_every_s:
                self._emit_stats(self.weights.version)

    def _emit_stats(self, param_version: int) -> None:
        """Publish the current window as a ProducerStats on `stats` and start a new window."""
        with self.lock:
            ev = self.window.event(self.name, param_version)
            ev.metrics.update(swap_check_metrics(self.weights.last_check))
            self.metrics.publish(self.ctx.keys.stats_of(self.name), ev)
            self.window = StatsWindow()
            self.last_stats = time.monotonic()


def newest_version(r: Any, keys: Keys) -> int:
    """The newest published param version (one XREVRANGE), -1 before any."""
    pv = latest_param_version(r, keys)
    return -1 if pv is None else pv.version


def swap_check_bound(cfg: PipelineConfig, dtype: str) -> float:
    """The swap check's bound for an engine computing in `dtype`: rollout.swap_check_max_diff, else the
    default of `dtype` or model.autocast, the looser (rollstream/weights/fingerprint.py)."""
    from rollstream.weights.fingerprint import default_max_diff

    configured = cfg.rollout.swap_check_max_diff
    if configured is not None:
        return configured
    # under model.autocast the trainer's side computes in the lower precision: the looser of the two bounds
    # (`dtype` is the engine's own, rollout.dtype's when that is set)
    return max(default_max_diff(d) for d in (dtype, cfg.model.autocast or dtype))


def swap_check_metrics(check: tuple[int, float, float] | None) -> dict[str, float]:
    """The newest swap check as ProducerStats metrics (none before any check): the version checked and the
    mean and max |log-prob difference| per probe token."""
    if check is None:
        return {}
    version, mean, worst = check
    return {
        SWAP_CHECK_VERSION: float(version),
        SWAP_CHECK_DIFF: mean,
        SWAP_CHECK_DIFF_MAX: worst,
    }


def set_torch_threads(threads: int) -> None:
    """Process-wide torch intra-op threads (0 leaves torch's default); called by entry points only."""
    if threads > 0:
        torch.set_num_threads(threads)


def lower_priority(nice: int) -> None:
    """Raise this process's nice value by `nice` (0: unchanged), so the trainer wins shared cores."""
    if nice > 0:
        os.nice(nice)
