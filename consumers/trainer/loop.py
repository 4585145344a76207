"""The trainer worker: consume rollouts, train K local updates per global step, publish, checkpoint, commit.

Global step g (1-based; trains version g-1):
  1. begin_step: pin the current weights as the proximal policy
  2. K times: collect ppo_mini_batch_size fresh samples (stale ones are dropped and recorded), assemble,
     update, emit a `local_update` event
  3. validate (every test_freq versions) with the end-of-step weights = version g
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

Transport (`timing_s/transport` per local update): time moving rollouts out of Redis and decoding them,
not time waiting for producers. A poll that returns entries without blocking counts in full; when none
are ready the trainer waits in a blocking poll, and of that poll only the decoding counts (the reply of a
blocked read carries the few entries that woke it; its transfer is not separable from the wait).

Reconnects: every Redis call outside the reader (which retries its own) goes through
`retry_on_connection`, so a Redis restart pauses the trainer in place instead of killing it. Each call
is safe to repeat: the commit, the consumed count and the grant are guarded by the trainer hash, a
weight publish re-checks `params` first, and a repeated event is resolved by the fold.

Warmup: for global steps <= trainer.num_warmup_batches, the time spent waiting for samples is reported as
`timing_s/gen_warmup` instead of `timing_s/gen`, so the aggregator's idle ratio (gen / step) skips them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any

import redis

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.checkpoint import load_latest_checkpoint, save_checkpoint
from consumers.trainer.guard import unusable_reason, version_reason
from consumers.trainer.learner import Learner
from consumers.trainer.ledger import (
    DROPPED,
    TRAINED,
    Fate,
    StepLedger,
    commit_steps,
    committed_sample_ids,
    committed_step,
    count_consumed,
)
from consumers.trainer.staleness import dropped_metrics, staleness
from consumers.trainer.validate import validate
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
from rollstream.names import TRAINER_GROUP, TRAINING_STEP_FIELD, Keys
from rollstream.pacing import current_budget, grant_budget, record_consumed
from rollstream.rl import staleness_metrics
from rollstream.weights import gc_weights, latest_param_version, publish_weights
from schemas import RolloutSample, StepMetrics, ValidateMetrics

log = logging.getLogger(__name__)


class Trainer:
    """One trainer process: owns the learner, the rollouts reader and the step bookkeeping."""

    def __init__(self, cfg: PipelineConfig, r: redis.Redis, keys: Keys, name: str, stop: threading.Event) -> None:
        """Build the learner and the reader (group `trainer`, consumer = worker name)."""
        self.cfg, self.r, self.keys, self.stop = cfg, r, keys, stop
        self.learner = Learner(cfg)
        limits = entry_limits(cfg.bus.max_entry_bytes)
        self.reader = GroupReader(
            r, keys.rollouts, TRAINER_GROUP, name, dead_stream=keys.dead, block_ms=cfg.bus.block_ms,
            count=cfg.bus.read_count, claim_idle_s=cfg.bus.claim_idle_s, max_deliveries=cfg.bus.max_deliveries,
            limits=limits, stop=stop,
        )
        self.publisher = Publisher(r, nomkstream=True)
        self.janitor = (
            Janitor(
                r, [keys.rollouts, keys.metrics], cfg.bus.trim_every_s, cfg.bus.max_stream_bytes,
                capped={
                    **{k: cfg.bus.audit_maxlen for k in (keys.fates, keys.dispatch_log, keys.params)},
                    **({keys.records: cfg.bus.records_maxlen} if cfg.bus.records_maxlen else {}),
                },
            )
            if cfg.bus.retention else None
        )
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
        self._transport_s = 0.0  # reading + decoding rollouts since the last local update

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
            log.info("resumed from checkpoint of global step %d", self.global_step)
        self._publish(self.global_step, only_if_missing=True)
        latest = latest_param_version(self.r, self.keys)
        self.newest_published = max(self.global_step, latest.version if latest is not None else 0)
        if ledgers and committed_step(self.r, self.keys) < self.global_step:
            log.warning("redoing the commit of steps %s", [lg.global_step for lg in ledgers])
            commit_steps(self.r, self.keys, ledgers, self.global_step)
        self._grant(self.global_step)
        self.training_step = int(self.r.hget(self.keys.trainer, TRAINING_STEP_FIELD) or 0)  # type: ignore[arg-type]
        self.seen = committed_sample_ids(self.r, self.keys)
        log.info("%d sample ids already committed", len(self.seen))
        if meta is None and self.cfg.trainer.test_freq > 0:
            self._validate(0)

    def _publish(self, version: int, only_if_missing: bool = False) -> float:
        """Publish the current weights as `version` (skipped when params has it and only_if_missing; a
        retry after a connection loss always checks, as the first attempt may have landed)."""
        t0 = time.perf_counter()
        blob = self.learner.policy.state_dict_bytes()
        attempts = [only_if_missing]

        def publish() -> None:
            check, attempts[0] = attempts[0], True
            if check:
                latest = latest_param_version(self.r, self.keys)
                if latest is not None and latest.version >= version:
                    return
            publish_weights(
                self.r, self.keys, version, blob, global_step=version,
                inline_max_bytes=self.cfg.bus.weights_inline_max_bytes, file_dir=self.weights_dir,
            )

        retry_on_connection(publish, f"publishing version {version}")
        self.newest_published = max(self.newest_published, version)
        return time.perf_counter() - t0

    def _grant(self, version: int) -> None:
        """Grant `version` its dispatch budget (once), then drop weight blobs nobody uses."""

        def grant() -> None:
            if current_budget(self.r, self.keys)[0] != version:
                budget, out = grant_budget(self.r, self.keys, version, self.cfg.max_outstanding)
                log.info("version %d: budget %d (outstanding %d)", version, budget, out)
            gc_weights(self.r, self.keys, version, file_dir=self.weights_dir)

        retry_on_connection(grant, f"granting version {version}")

    def _validate(self, version: int) -> None:
        """Greedy-decode the held-out prompts and emit a `validation` event for `version`."""
        task = build_task(self.cfg)
        prompts = build_prompt_source(self.cfg, task).val_prompts()
        metrics = validate(self.learner.policy, task, prompts, self.cfg.data.max_response_length)
        if metrics:
            ev = ValidateMetrics(param_version=version, global_step=version, metrics=metrics)
            retry_on_connection(lambda: self.publisher.publish(self.keys.metrics, ev), "publishing validation")
            log.info("validation of version %d: %s", version, metrics)

    # -- consuming ---------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        retry_on_connection(lambda: self.r.hset(self.keys.trainer, "heartbeat", time.time()), "heartbeat")

    def _poll(self) -> list[Message]:
        """A non-blocking poll (counted as transport), then, only when it found nothing, a blocking one
        (waiting for producers: only its decode time counts as transport)."""
        t0, decode0 = time.perf_counter(), self.reader.stats.decode_s
        msgs = self.reader.poll_retrying(block_ms=1)
        if msgs:
            self._transport_s += time.perf_counter() - t0
            return msgs
        decode0 = self.reader.stats.decode_s
        msgs = self.reader.poll_retrying()
        self._transport_s += self.reader.stats.decode_s - decode0
        return msgs

    def _fill(self) -> None:
        """One poll: buffer new samples, ack duplicates of seen ids, count dead-lettered rollouts."""
        msgs = self._poll()
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

    def _collect(self, g: int, ledger: StepLedger) -> tuple[list[tuple[Message, int]], list[int]] | None:
        """Take ppo_mini_batch_size samples with staleness <= threshold; drop (and record) older ones.
        Returns (kept with staleness, dropped staleness), or None when stop was requested."""
        want, k = self.cfg.actor.ppo_mini_batch_size, self.cfg.trainer.max_off_policy_threshold
        kept: list[tuple[Message, int]] = []
        dropped: list[int] = []
        while len(kept) < want:
            if not self.buffer:
                if self.stop.is_set():
                    return None
                self._fill()
                continue
            m = self.buffer.popleft()
            ev: Any = m.event
            st = staleness(g, ev.param_version)
            if st > k:
                ledger.fates.append(Fate(ev.sample_id, m.id, DROPPED, st, ev.param_version))
                ledger.ack_ids.append(m.id)
                dropped.append(st)
            else:
                kept.append((m, st))
        return kept, dropped

    # -- one global step ---------------------------------------------------------------------------

    def train_step(self, g: int) -> bool:
        """Run global step g; False when stopped mid-step (the partial step is abandoned, nothing acked)."""
        cfg = self.cfg
        t_step = time.perf_counter()
        warmup = g <= cfg.trainer.num_warmup_batches
        gen_key = "timing_s/gen_warmup" if warmup else "timing_s/gen"
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
            if cfg.trainer.sync_mode and local == 1:  # synchronous RL: the whole global batch first
                collected = [self._collect(g, ledger) for _ in range(K)]
            got = collected[local - 1] if cfg.trainer.sync_mode else self._collect(g, ledger)
            if got is None or self.stop.is_set():
                log.warning("stop requested during global step %d: abandoning it (samples stay pending)", g)
                return False
            kept, dropped = got
            t_gen = time.perf_counter() - t0
            t0 = time.perf_counter()
            samples: list[RolloutSample] = [m.event for m, _ in kept]  # type: ignore[misc]
            batch, asm_metrics = assemble_batch_from_rollout_samples(samples)
            t_asm = time.perf_counter() - t0
            metrics = self.learner.update(batch)
            for m, st in kept:
                ev: Any = m.event
                ledger.fates.append(Fate(ev.sample_id, m.id, TRAINED, st, ev.param_version))
                ledger.ack_ids.append(m.id)
            metrics.update(asm_metrics)
            metrics.update(dropped_metrics(dropped))
            metrics.update(staleness_metrics([st for _, st in kept]))
            metrics.update({"training/global_step": float(g), gen_key: t_gen, "timing_s/assemble": t_asm,
                            "timing_s/transport": self._transport_s})
            self._transport_s = 0.0
            update = StepMetrics(type="local_update", global_step=g, local_step=local, sample_count=len(kept),
                                 metrics={k: float(v) for k, v in metrics.items()})
            retry_on_connection(partial(self.publisher.publish, self.keys.metrics, update), "publishing local_update")
            self._heartbeat()

        # end of the step: validate version g, then checkpoint / publish / commit / grant
        if cfg.trainer.test_freq > 0 and g % cfg.trainer.test_freq == 0:
            self._validate(g)
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
        if due:
            t0 = time.perf_counter()
            ledger.step_end.metrics["timing_s/step"] = time.perf_counter() - t_step
            meta = {"param_version": g, "steps": [lg.to_plain() for lg in self.pending]}
            save_checkpoint(self.ckpt_dir, g, self.learner.policy, self.learner.optimizer, meta)
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
        return True

    def run(self) -> int:
        """Resume, then train global steps until total_global_steps or a stop request; returns 0."""
        self.resume()
        total = self.cfg.trainer.total_global_steps
        while self.global_step < total and not self.stop.is_set():
            if not self.train_step(self.global_step + 1):
                break
        log.info("trainer stopping at global step %d", self.global_step)
        return 0
