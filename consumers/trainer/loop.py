"""The trainer worker: consume rollouts, train K local updates per global step, publish, checkpoint, commit.

Global step g (1-based; trains version g-1):
  1. begin_step: pin the current weights as the proximal policy
  2. K times: collect ppo_mini_batch_size fresh samples (stale ones are dropped and recorded), assemble,
     update, emit a `local_update` event
  3. evaluate (every test_freq versions) with the end-of-step weights = version g
  4. if a checkpoint is due (every save_freq steps, the last step, or on stop): write it (weights,
     optimizer, RNG, ledgers of the steps it covers), then publish version g, then commit in one MULTI
     (fates, XACK, consumed, trainer hash, step_end); otherwise publish version g and count the step's
     samples as consumed (pacing needs it before the grant)
  5. grant version g its dispatch budget; remove weight blobs no producer uses

Restart: the newest checkpoint is loaded; its version is published if `params` lacks it; its commit is
redone if the trainer hash says it never ran; the budget is granted if not yet. Entries re-delivered from
our pending list whose sample_id is already in `fates` are acked without training; the rest are trained.
A stop request mid-step abandons the partial step without acking (its samples are retrained on restart).

Sync mode (`trainer.sync_mode`, the synchronous-RL baseline of `rollstream bench async`): the first local
update of a step waits until the step's whole train_batch_size is collected, so with
staleness_threshold = 0 generation and training strictly alternate.

Transport (`timing_s/transport` per local update, the reader's `transport_s` since the last one): time
moving rollouts out of Redis and decoding them, not time waiting for producers. A poll of the consumer
loop that returns entries without blocking counts in full; when none are ready the loop waits in a
blocking poll, and of that poll only the decoding counts (the reply of a blocked read carries the few
entries that woke it; its transfer is not separable from the wait).

Warmup (`trainer.num_warmup_batches`, as in verl): before the run's first update (global step 1) the
trainer waits until that many mini-batches of samples have arrived.

Burst (`--burst`, used by `rollstream replay trainer`): the shared consumer loop's burst rule; once the
rollouts stream is drained (a read of new entries found none) and the buffer is empty, the trainer
abandons the step it is in, unacked, and exits 0, so a replay on a copied range ends when its samples are
used up.

Fully-async counters (verl's names, cumulative over the run, kept in the checkpoint; the aggregator takes
the last value): `fully_async/count/stale_samples_processed` and `…/stale_trajectory_processed` count
trained samples / trajectories whose version (a trajectory's: its last token's) is older than the version
being trained, `fully_async/count/current_param_version` is that version (g − 1).

Reconnects: every Redis call outside the reader (which retries its own) goes through
`retry_on_connection`, so a Redis restart pauses the trainer in place instead of killing it. Each call
is safe to repeat: the commit, the consumed count and the grant are guarded by the trainer hash, a
weight publish re-checks `params` first, and a repeated event is resolved by the fold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from functools import partial
from typing import Any

import redis

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.checkpoint import load_latest_checkpoint, save_checkpoint
from consumers.trainer.evaluate import evaluate
from consumers.trainer.guard import unusable_reason, version_reason
from consumers.trainer.learner import Learner
from consumers.trainer.ledger import (
    StepLedger,
    commit_steps,
    committed_sample_ids,
    committed_step,
    count_consumed,
)
from consumers.trainer.staleness import dropped_metrics, staleness
from rollstream.bus import (
    GroupReader,
    Janitor,
    Message,
    Publisher,
    entry_limits,
    retry_on_connection,
    setup_run,
)
from rollstream.config import PipelineConfig
from rollstream.factory import build_prompt_source, build_task
from rollstream.names import (
    HEARTBEAT_FIELD,
    REPLAYED_VERSIONS_FIELD,
    TRAINER_GROUP,
    TRAINING_STEP_FIELD,
    Keys,
)
from rollstream.pacing import current_budget, grant_budget, record_consumed
from rollstream.rl import staleness_metrics
from rollstream.tasks import Prompt
from rollstream.weights import gc_weights, latest_param_version, publish_module_weights
from schemas import DROPPED, TRAINED, Fate, RolloutSample, StepMetrics, ValidateMetrics

log = logging.getLogger(__name__)

STALE_SAMPLES = "stale_samples_processed"
STALE_TRAJECTORIES = "stale_trajectory_processed"


class Trainer:
    """One trainer process: owns the learner, the rollouts reader and the step bookkeeping."""

    def __init__(
        self, cfg: PipelineConfig, r: redis.Redis, keys: Keys, name: str, stop: threading.Event, burst: bool = False
    ) -> None:
        """Build the learner and the reader (group `trainer`, consumer = worker name); `burst` exits
        once the rollouts stream is drained."""
        self.cfg, self.r, self.keys, self.stop, self.burst = cfg, r, keys, stop, burst
        self.learner = Learner(cfg)
        limits = entry_limits(cfg.bus.max_entry_bytes)
        self.reader = GroupReader(
            r, keys.rollouts, TRAINER_GROUP, name, dead_stream=keys.dead, block_ms=cfg.bus.block_ms,
            count=cfg.bus.read_count, claim_idle_s=cfg.bus.claim_idle_s, max_deliveries=cfg.bus.max_deliveries,
            limits=limits, stop=stop,
        )
        self._batches: Iterator[list[Message]] = self.reader.batches(burst=burst)  # the shared consumer loop
        self.publisher = Publisher(r, nomkstream=True)
        self.janitor = Janitor.from_config(cfg, r, keys) if cfg.bus.retention else None
        self.ckpt_dir = cfg.run_dir() / "checkpoints"
        self.weights_dir = cfg.run_dir() / "weights"
        self.buffer: deque[Message] = deque()  # decoded, deduplicated, not yet used
        self.seen: set[str] = set()  # sample ids committed, in uncommitted ledgers, or buffered
        self.pending: list[StepLedger] = []  # finished steps not yet covered by a checkpoint
        self.global_step = 0  # last finished global step (= the version last published)
        self.training_step = 0  # highest global step ever begun (the trainer hash's training_step)
        # newest version on `params`: after a restart from an older checkpoint, versions published past it
        # (by steps the crash abandoned) exist and producers may have stamped samples with them
        self.newest_published = 0
        self._own_dead = 0  # non-rollout entries we dead-lettered ourselves (not prompts)
        self._dead_counted = 0
        self._step_dead = 0
        self._transport_mark = 0.0  # the reader's transport_s at the last local update
        self.recent: deque[Prompt] = deque(maxlen=max(1, cfg.data.val_size))  # newest trained prompts
        self.used_up = False  # burst: the consumer loop ended with the rollouts stream drained
        self.counters = {STALE_SAMPLES: 0, STALE_TRAJECTORIES: 0}  # cumulative, kept in the checkpoint

    # -- start / resume ----------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint, finish its publish/commit/grant if a crash cut them short (the whole
        resume is repeated if Redis goes away meanwhile: every part of it is idempotent)."""
        retry_on_connection(self._resume, "resume")

    def _resume(self) -> None:
        setup_run(self.r, self.keys)
        meta = load_latest_checkpoint(self.ckpt_dir, self.learner.policy, self.learner.optimizer)
        ledgers: list[StepLedger] = []
        if meta is not None:
            self.global_step = int(meta["global_step"])
            ledgers = [StepLedger.from_plain(d) for d in meta["steps"]]
            self.counters.update({k: int(v) for k, v in meta.get("counters", {}).items() if k in self.counters})
            log.info("resumed from checkpoint of global step %d", self.global_step)
        self._publish(self.global_step, only_if_missing=True)
        latest = latest_param_version(self.r, self.keys)
        replayed = int(self.r.hget(self.keys.trainer, REPLAYED_VERSIONS_FIELD) or 0)  # type: ignore[arg-type]
        self.newest_published = max(self.global_step, latest.version if latest is not None else 0, replayed)
        if ledgers and committed_step(self.r, self.keys) < self.global_step:
            log.warning("redoing the commit of steps %s", [lg.global_step for lg in ledgers])
            commit_steps(self.r, self.keys, ledgers, self.global_step)
        self._grant(self.global_step)
        self.training_step = int(self.r.hget(self.keys.trainer, TRAINING_STEP_FIELD) or 0)  # type: ignore[arg-type]
        self.seen = committed_sample_ids(self.r, self.keys)
        log.info("%d sample ids already committed", len(self.seen))
        if meta is None and self.cfg.trainer.test_freq > 0:
            self._evaluate(0)

    def _publish(self, version: int, only_if_missing: bool = False) -> float:
        """Publish the current weights as `version` (skipped when params has it and only_if_missing; a
        retry after a connection loss always checks, as the first attempt may have landed)."""
        t0 = time.perf_counter()
        module = self.learner.policy.module
        attempts = [only_if_missing]

        def publish() -> None:
            check, attempts[0] = attempts[0], True
            if check:
                latest = latest_param_version(self.r, self.keys)
                if latest is not None and latest.version >= version:
                    return
            publish_module_weights(  # above the inline limit: streamed to a file, never one blob in memory
                self.r, self.keys, version, module, global_step=version,
                inline_max_bytes=self.cfg.bus.weights_inline_max_bytes, file_dir=self.weights_dir,
            )

        retry_on_connection(publish, f"publishing version {version}")
        self.newest_published = max(self.newest_published, version)
        return time.perf_counter() - t0

    def _grant(self, version: int) -> None:
        """Grant `version` its dispatch budget (once), then drop weight blobs nobody uses."""

        def grant() -> None:
            if current_budget(self.r, self.keys)[0] != version:
                pressed = self.janitor is not None and self.janitor.over_budget  # unread data over the budget
                cap = self.cfg.data.train_batch_size if pressed else None
                budget, out = grant_budget(self.r, self.keys, version, self.cfg.max_outstanding, cap)
                log.info("version %d: budget %d (outstanding %d)", version, budget, out)
            gc_weights(self.r, self.keys, version, file_dir=self.weights_dir)

        retry_on_connection(grant, f"granting version {version}")

    def _evaluate(self, version: int) -> None:
        """Greedy-decode the held-out prompts (`val/…`) and the newest trained prompts
        (`val/recent_train_…`: memorisation shows as a gap between the two); emit a `validation` event."""
        task = build_task(self.cfg)
        prompts = build_prompt_source(self.cfg, task).val_prompts()
        limit = self.cfg.data.max_response_length
        metrics = evaluate(self.learner.policy, task, prompts, limit)
        recent = evaluate(self.learner.policy, task, list(self.recent), limit)
        metrics.update({k.replace("val/", "val/recent_train_"): v for k, v in recent.items()})
        if metrics:
            ev = ValidateMetrics(param_version=version, global_step=version, metrics=metrics)
            retry_on_connection(lambda: self.publisher.publish(self.keys.metrics, ev), "publishing validation")
            log.info("validation of version %d: %s", version, metrics)

    # -- consuming ---------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        retry_on_connection(lambda: self.r.hset(self.keys.trainer, HEARTBEAT_FIELD, time.time()), "heartbeat")

    def _fill(self) -> bool:
        """One pass of the consumer loop: buffer new samples, ack duplicates of seen ids, count
        dead-lettered rollouts; False once the loop has ended (stop requested, or in burst mode the
        rollouts stream drained: then `used_up`)."""
        msgs = next(self._batches, None)
        if msgs is None:
            if self.burst and not self.stop.is_set() and not self.used_up:
                log.info("burst: no rollouts left to read")
                self.used_up = True
            return False
        dupes: list[str] = []
        for m in msgs:
            ev = m.event
            if not isinstance(ev, RolloutSample):
                self._own_dead += 1
                self.reader.dead_letter(m.id, m.fields, f"not a rollout: {ev.type}")
            elif ev.sample_id in self.seen:
                dupes.append(m.id)  # the original is committed or still pending: safe to ack this copy
            elif (why := version_reason(ev, self.newest_published)) is not None:
                self.reader.dead_letter(m.id, m.fields, f"invalid: {why}")  # counted as consumed below
            elif (why := unusable_reason(ev, self.learner.policy.tokenizer.vocab_size,
                                         self.learner.policy.max_seq_len)) is not None:
                self.reader.dead_letter(m.id, m.fields, f"unusable: {why}")  # counted as consumed below
            else:
                self.seen.add(ev.sample_id)
                self.buffer.append(m)
        if dupes:
            log.warning("acking %d redelivered/duplicate samples without training", len(dupes))
            retry_on_connection(lambda: self.reader.ack(dupes), "acking duplicates")
        dead = self.reader.stats.dead - self._own_dead
        if dead > self._dead_counted:  # dead-lettered rollouts (a lost reply may count them twice)
            retry_on_connection(lambda: record_consumed(self.r, self.keys, dead - self._dead_counted), "counting dead")
            self._step_dead += dead - self._dead_counted
            self._dead_counted = dead
        self._heartbeat()
        return True

    def _starve(self) -> bool:
        """The buffer is empty: run one more pass of the loop; True when the caller must give up (stop
        requested, or in burst mode no rollout is left)."""
        return self.stop.is_set() or not self._fill()

    def _wait_warmup(self) -> None:
        """Before the run's first update: wait until num_warmup_batches mini-batches have arrived."""
        want = self.cfg.trainer.num_warmup_batches * self.cfg.actor.ppo_mini_batch_size
        while len(self.buffer) < want and not self.stop.is_set() and not self.used_up:
            if not self._fill():
                break
        log.info("warmup: %d samples buffered before the first update", len(self.buffer))

    def _collect(self, g: int, ledger: StepLedger) -> tuple[list[tuple[Message, int]], list[int]] | None:
        """Take ppo_mini_batch_size samples with staleness <= threshold; drop (and record) older ones.
        Returns (kept with staleness, dropped staleness), or None when stop was requested."""
        want, k = self.cfg.actor.ppo_mini_batch_size, self.cfg.trainer.max_off_policy_threshold
        kept: list[tuple[Message, int]] = []
        dropped: list[int] = []
        while len(kept) < want:
            if not self.buffer:
                if self._starve():
                    return None
                continue
            m = self.buffer.popleft()
            ev: Any = m.event
            st = staleness(g, ev.param_version)
            if st > k:
                ledger.fates.append(Fate(ev.sample_id, m.id, DROPPED, st, ev.param_version, g))
                ledger.ack_ids.append(m.id)
                dropped.append(st)
            else:
                kept.append((m, st))
        return kept, dropped

    # -- one global step ---------------------------------------------------------------------------

    def train_step(self, g: int) -> bool:
        """Run global step g: K local updates, then finish the step; False when stopped mid-step (the
        partial step is abandoned, nothing acked)."""
        cfg = self.cfg
        t_step = time.perf_counter()
        ledger = StepLedger(g)
        self._step_dead = 0
        if g > self.training_step:  # before any event of step g: the aggregator places nothing beyond it
            retry_on_connection(lambda: self.r.hset(self.keys.trainer, TRAINING_STEP_FIELD, g), "training_step")
            self.training_step = g
        self.learner.begin_step(g)
        K = cfg.trainer.parameter_sync_step
        collected: list[tuple[list[tuple[Message, int]], list[int]] | None] = []
        for local in range(1, K + 1):
            t0 = time.perf_counter()
            if g == 1 and local == 1 and cfg.trainer.num_warmup_batches > 0:
                self._wait_warmup()
            if cfg.trainer.sync_mode and local == 1:  # synchronous RL: the whole global batch first
                collected = [self._collect(g, ledger) for _ in range(K)]
            got = collected[local - 1] if cfg.trainer.sync_mode else self._collect(g, ledger)
            if got is None or self.stop.is_set():
                why = "no rollouts left (burst)" if self.used_up else "stop requested"
                log.warning("%s during global step %d: abandoning it (samples stay pending)", why, g)
                return False
            self._local_update(g, local, ledger, *got, t_gen=time.perf_counter() - t0)
        self._finish_step(g, ledger, t_step)
        return True

    def _local_update(
        self, g: int, local: int, ledger: StepLedger, kept: list[tuple[Message, int]], dropped: list[int], t_gen: float
    ) -> None:
        """One local update of step g on the collected samples: assemble, update, record their fates in
        the step's ledger, emit a `local_update` event."""
        t0 = time.perf_counter()
        samples: list[RolloutSample] = [m.event for m, _ in kept]  # type: ignore[misc]
        batch, asm_metrics = assemble_batch_from_rollout_samples(samples)
        t_asm = time.perf_counter() - t0
        metrics = self.learner.update(batch)
        for m, st in kept:
            ev: Any = m.event
            ledger.fates.append(Fate(ev.sample_id, m.id, TRAINED, st, ev.param_version, g))
            ledger.ack_ids.append(m.id)
            truth = ev.full_batch.non_tensors.get("ground_truth")
            if truth is not None and "raw_prompt" in ev.full_batch.non_tensors:
                text = str(ev.full_batch.non_tensors["raw_prompt"][0])
                self.recent.append(Prompt(uid=ev.sample_id, text=text, answer=str(truth[0])))
        transport_s, self._transport_mark = (self.reader.stats.transport_s - self._transport_mark,
                                             self.reader.stats.transport_s)
        metrics.update(asm_metrics)
        metrics.update(dropped_metrics(dropped))
        metrics.update(staleness_metrics([st for _, st in kept]))
        metrics.update(self._count_stale(g - 1, samples, batch.meta_info["trajectory_param_versions"]))
        metrics.update({"training/global_step": float(g), "timing_s/gen": t_gen, "timing_s/assemble": t_asm,
                        "timing_s/transport": transport_s, "fully_async/total_wait_time": t_gen})
        update = StepMetrics(type="local_update", global_step=g, local_step=local, sample_count=len(kept),
                             metrics={k: float(v) for k, v in metrics.items()})
        retry_on_connection(partial(self.publisher.publish, self.keys.metrics, update), "publishing local_update")
        self._heartbeat()

    def _finish_step(self, g: int, ledger: StepLedger, t_step: float) -> None:
        """End of step g: evaluate version g, then checkpoint / publish / commit (or publish and count the
        step's samples as consumed), grant version g its budget, run retention."""
        cfg = self.cfg
        K = cfg.trainer.parameter_sync_step
        if cfg.trainer.test_freq > 0 and g % cfg.trainer.test_freq == 0:
            self._evaluate(g)
        trained = sum(1 for f in ledger.fates if f.fate == TRAINED)
        ledger.step_end = StepMetrics(
            type="step_end", global_step=g, local_step=K, sample_count=trained, num_local_updates=K,
            metrics={
                "training/global_step": float(g),
                "trainer/param_version": float(g),
                "fully_async/count/trained_samples": float(trained),
                "fully_async/count/dropped_samples": float(len(ledger.fates) - trained),
                "fully_async/count/dead_samples": float(self._step_dead),
            },
        )
        self.pending.append(ledger)
        self.global_step = g
        due = g % cfg.trainer.save_freq == 0 or g >= cfg.trainer.total_global_steps or self.stop.is_set()
        due = due or (self.janitor is not None and self.janitor.over_budget)  # ack now: acked entries may leave Redis
        if due:
            t0 = time.perf_counter()
            ledger.step_end.metrics["timing_s/step"] = time.perf_counter() - t_step
            meta = {"param_version": g, "steps": [lg.to_plain() for lg in self.pending], "counters": self.counters}
            save_checkpoint(self.ckpt_dir, g, self.learner.policy, self.learner.optimizer, meta,
                            keep_last=cfg.trainer.keep_checkpoints)
            t_ckpt = time.perf_counter() - t0
            t_pub = self._publish(g)
            step_s = time.perf_counter() - t_step
            ledger.step_end.metrics.update({
                "timing_s/checkpoint": t_ckpt, "timing_s/publish": t_pub,
                "timing_s/step": step_s, "perf/time_per_step": step_s,
            })
            retry_on_connection(lambda: commit_steps(self.r, self.keys, self.pending, g), f"committing step {g}")
            self.reader.forget(i for lg in self.pending for i in lg.ack_ids)  # acked inside the commit
            self.pending = []
        else:
            t_pub = self._publish(g)
            step_s = time.perf_counter() - t_step
            ledger.step_end.metrics.update(
                {"timing_s/publish": t_pub, "timing_s/step": step_s, "perf/time_per_step": step_s}
            )
            retry_on_connection(lambda: count_consumed(self.r, self.keys, ledger), f"counting step {g}")
        self._grant(g)
        if self.janitor is not None:
            retry_on_connection(self.janitor.maybe_run, "retention")
        log.info("global step %d done in %.2fs (%d trained, %d dropped)", g, time.perf_counter() - t_step,
                 trained, len(ledger.fates) - trained)

    def _count_stale(self, version: int, samples: list[RolloutSample], trajectory_versions: list[int]) -> dict[str, float]:
        """Add this update's stale samples / trajectories (older than `version`, the one being trained) to
        the run's counters; returns verl's fully_async/count metrics."""
        self.counters[STALE_SAMPLES] += sum(1 for s in samples if version - s.param_version >= 1)
        self.counters[STALE_TRAJECTORIES] += sum(1 for v in trajectory_versions if version - v >= 1)
        return {
            f"fully_async/count/{STALE_SAMPLES}": float(self.counters[STALE_SAMPLES]),
            f"fully_async/count/{STALE_TRAJECTORIES}": float(self.counters[STALE_TRAJECTORIES]),
            "fully_async/count/current_param_version": float(version),
        }

    def run(self) -> int:
        """Resume, then train global steps until total_global_steps, a stop request or (burst) no rollouts
        left; returns 0."""
        self.resume()
        total = self.cfg.trainer.total_global_steps
        while self.global_step < total and not self.stop.is_set():
            if not self.train_step(self.global_step + 1):
                break
        log.info("trainer stopping at global step %d", self.global_step)
        return 0
