"""The trainer worker: consume rollouts, train K local updates per global step, publish, checkpoint, commit.

`Trainer.train_step(g)` runs global step g (1-based; it trains version g-1) and names its phases in order;
reading is consumers/trainer/collect.py. Restart, failover, sync mode, reconnects and data parallel:
docs/DESIGN.md, "The trainer's global step".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from consumers.trainer import step_report
from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.batch import MiniBatch
from consumers.trainer.checkpoint import checkpoint_writer, restore_newest, restore_rng_plain, rng_plain
from consumers.trainer.collect import Collected, Collector, rollouts_reader
from consumers.trainer.distributed import DataParallel, RankInfo
from consumers.trainer.effects import TrainerEffects
from consumers.trainer.evaluate import validate
from consumers.trainer.learner import Learner
from consumers.trainer.ledger import StepLedger, merge_ledgers
from consumers.trainer.metrics import UPDATE_SKIPPED, UpdateTimings, local_update_metrics
from consumers.trainer.staleness import STALE_SAMPLES, STALE_TRAJECTORIES, LengthBuckets
from consumers.trainer.step_report import StepEnd
from rollstream.bus import EntryRef
from rollstream.config import PipelineConfig
from rollstream.keys import Keys
from rollstream.model.base import resolve_device
from rollstream.tasks import Prompt
from schemas import SKIPPED, TRAINED, RolloutSample, ValidateMetrics

log = logging.getLogger(__name__)


class Trainer:
    """One trainer process: owns the learner, the rollouts reader and the step bookkeeping."""

    def __init__(
        self,
        cfg: PipelineConfig,
        r: redis.Redis,
        keys: Keys,
        name: str,
        stop: threading.Event,
        burst: bool = False,
        dp: DataParallel | None = None,
    ) -> None:
        """Build the learner, the reader (consumer `name` of group `trainer`; `burst`: exit once drained) and
        the effects; `dp` is this rank's data-parallel group (None: a world of one)."""
        self.cfg, self.r, self.keys, self.stop, self.burst = cfg, r, keys, stop, burst
        self.dp = dp if dp is not None else DataParallel(RankInfo(), resolve_device(cfg.run.device))
        self.learner = Learner(cfg, self.dp)
        self.reader = rollouts_reader(cfg, r, keys, name, stop)
        self.effects = TrainerEffects(cfg, r, keys, cfg.run_dir() / "weights", self.dp)
        policy = self.learner.policy
        self.collector = Collector(cfg, self.effects, self.reader, self.dp, stop, burst,
                                   policy.tokenizer.vocab_size, policy.max_seq_len)
        self.ckpt_dir = cfg.run_dir() / "checkpoints"
        self.pending: list[StepLedger] = []  # finished steps not yet covered by a checkpoint
        self.global_step = 0  # last finished global step (= the version last published)
        self.training_step = 0  # highest global step ever begun (the trainer hash's training_step)
        self.recent: deque[Prompt] = deque(maxlen=cfg.data.val_recent_size)  # newest trained prompts
        self.counters = {STALE_SAMPLES: 0, STALE_TRAJECTORIES: 0}  # cumulative, kept in the checkpoint
        self.lengths = LengthBuckets(cfg.data.max_response_length)  # this step's trained/dropped by length
        self.agreed_stop = False  # data parallel: some rank asked to stop at the last step end
        self.pending_ids: list[list[str]] = [[] for _ in range(self.dp.world_size)]  # per rank, since ckpt
        self._own_acks: list[EntryRef] = []  # this rank's ack refs in `pending` (forgotten once committed)
        # writes a due checkpoint while its version validates and publishes (rank 0; its thread starts lazily)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

    @property
    def newest_published(self) -> int:
        """The newest version on `params` as the collector knows it (samples stamped later are invalid)."""
        return self.collector.newest_published

    def resume(self) -> None:
        """Load the newest checkpoint (rank 0 reads it, every rank loads it); rank 0 finishes its publish,
        commit and grant if a crash cut them short (each idempotent); every rank reads what is committed."""
        meta = restore_newest(self.ckpt_dir, self.dp, self.learner, self.counters)  # and this rank's RNG
        if meta is not None:
            self.global_step = int(meta["global_step"])
            log.info("resumed from checkpoint of global step %d", self.global_step)
        g0, roles = self.global_step, self.dp.roles
        whole = roles.gather_if_sharded(self.learner.whole_weights)  # fsdp: a collective
        probe = self.learner.probe()  # every rank: a forward (a collective under fsdp)
        roles.only_main(self.effects.resume_main, g0, meta, self.learner.policy.module, whole, probe)
        roles.only_main(self.effects.start_leaser)  # producers get their leases from here on
        self.dp.barrier()  # the redone commit is in `fates` before any rank reads it
        c = self.collector  # reading: consumers/trainer/collect.py
        c.newest_published, self.training_step, c.seen = self.effects.read_progress(g0)
        log.info("%d sample ids already committed", len(c.seen))
        if meta is None and self.cfg.trainer.test_freq > 0:
            self._evaluate(0)

    def train_step(self, g: int) -> bool:
        """Run global step g; False when stopped mid-step (the partial step is abandoned, nothing acked).
        Its phases, in order:
          1. begin       pin the weights as the proximal policy (rank 0: reconcile, mark the step begun)
          2. K times     collect this rank's share -> assemble -> update (Learner.update; its optimizer
                         step: Learner._step) -> record the fates, emit the `local_update`
          3. end         every rank's report gathered into the step's ledger and step_end
          4. checkpoint  when due, written on a thread while 5 and 6 run
          5. validate    every trainer.test_freq versions
          6. publish     version g's weights (rank 0, as 7 and 8)
          7. commit      once the checkpoint is durable, one MULTI (TrainerEffects.commit); otherwise the
                         step's samples are counted as consumed
          8. grant       version g's dispatch budget, then retention"""
        t_step = time.perf_counter()
        ledger = self._begin_step(g)
        synced: list[Collected | None] = []  # sync mode: the step's K shares, collected at the first update
        for local in range(1, self.cfg.async_training.trigger_parameter_sync_step + 1):
            t0 = time.perf_counter()
            got = self._samples(g, local, ledger, synced)
            if got is None:
                return False
            t_gen = time.perf_counter() - t0
            samples: list[RolloutSample] = [m.event for m, _ in got.kept]  # type: ignore[misc]
            batch, batch_metrics = assemble_batch_from_rollout_samples(samples)
            t_asm = time.perf_counter() - t0 - t_gen
            learned = self.learner.update(batch)
            self._record_update(g, local, ledger, got, batch, batch_metrics, learned, (t_gen, t_asm))
        self._finish_step(g, ledger, t_step)
        return True

    def _finish_step(self, g: int, ledger: StepLedger, t_step: float) -> None:
        """Phases 3-8 of step g (see train_step); 6-8 on rank 0 alone."""
        end = self._end_step(g, ledger)  # 3. end
        writing = self._start_checkpoint(end, t_step)  # 4. checkpoint
        if self.cfg.trainer.test_freq > 0 and g % self.cfg.trainer.test_freq == 0:
            self._evaluate(g)  # 5. validate
        roles = self.dp.roles
        roles.only_main(self._publish, end, writing, t_step)  # 6. publish, then the checkpoint awaited
        if writing is not None:
            roles.only_main(self.effects.commit, self.pending, g)  # 7. commit
        else:
            roles.only_main(self.effects.count_consumed, end.merged, g)
        roles.only_main(self.effects.grant, g)  # 8. grant, then retention
        roles.only_main(self.effects.run_janitor)
        if end.due:  # every rank forgets the acks rank 0 made in its commit
            self.reader.forget(self._own_acks)
            self._own_acks, self.pending = [], []
            self.pending_ids = [[] for _ in range(self.dp.world_size)]
        trained, dropped, evicted, skipped = step_report.fate_counts(end.merged)
        log.info("global step %d done in %.2fs (%d trained, %d dropped, %d evicted, %d skipped; %d ranks)",
                 g, time.perf_counter() - t_step, trained, dropped, evicted, skipped, self.dp.world_size)

    def _begin_step(self, g: int) -> StepLedger:
        """(1) Begin step g: rank 0 commits again what a failover lost (TrainerEffects.reconcile) and marks
        step g begun (before any event of step g: the aggregator places nothing beyond it); pin the weights
        as the proximal policy, reset the step's counts; returns its empty ledger."""
        self.collector.step_dead = 0
        self.lengths = LengthBuckets(self.cfg.data.max_response_length)
        if self.effects.can_fail_over:  # a failover may have lost commits and a grant
            self.dp.roles.only_main(self.effects.reconcile, self.global_step)
        if g > self.training_step:  # the other ranks emit nothing of step g before rank 0's first collective
            self.dp.roles.only_main(self.effects.mark_training_step, g)
            self.training_step = g
        self.learner.begin_step(g)
        return StepLedger(g)

    def _samples(
        self, g: int, local: int, ledger: StepLedger, synced: list[Collected | None]
    ) -> Collected | None:
        """(2) This rank's share of local update `local` of step g (Collector.collect), after the warmup; in
        sync mode the whole global batch at the first update (into `synced`). None when the step is to be
        abandoned: no rollouts left (burst) or a stop (several ranks: only an agreed one)."""
        cfg = self.cfg
        if g == 1 and local == 1 and cfg.trainer.num_warmup_batches > 0:
            self.collector.wait_warmup()
        if not cfg.trainer.sync_mode:
            got = self.collector.collect(g, ledger)
        else:  # synchronous RL: the whole global batch first
            if local == 1:
                K = cfg.async_training.trigger_parameter_sync_step
                synced[:] = [self.collector.collect(g, ledger) for _ in range(K)]
            got = synced[local - 1]
        if got is None or self.dp.roles.stopping(self.stop.is_set(), agreed=False):  # ranks: in a round
            why = "no rollouts left (burst)" if self.collector.used_up else "stop requested"
            log.warning("%s during global step %d: abandoning it (samples stay pending)", why, g)
            return None
        return got

    def _record_update(self, g: int, local: int, ledger: StepLedger, got: Collected, batch: MiniBatch,
                       batch_metrics: dict[str, float], learned: dict[str, float],
                       times: tuple[float, float]) -> None:
        """(2) After local update `local` of step g: its samples' fates into the ledger, its `local_update`
        event emitted (step_report.local_update_event; `times`: collect and assemble seconds)."""
        fate = SKIPPED if learned.get(UPDATE_SKIPPED) else TRAINED  # a skipped step trained nothing
        self.recent.extend(step_report.record_fates(ledger, got.kept, fate, g))
        self.lengths.add(got.kept, got.dropped_lengths)
        timings = UpdateTimings(*times, self.collector.transport_since_last())
        versions = batch.meta_info["trajectory_param_versions"]
        fg = self.cfg.algorithm.filter_groups.enable
        metrics, fg_counts = local_update_metrics(g, got, learned, batch_metrics, versions, self.counters,
                                                  timings, fg)
        update = step_report.local_update_event(g, local, self.dp.rank, len(got.kept), metrics, fg_counts)
        entry_id = self.effects.emit_local_update(update)
        if self.effects.can_fail_over:  # emitted again if a failover loses it with the step's commit
            ledger.updates.append((entry_id, update))
        self.effects.heartbeat()

    def _end_step(self, g: int, ledger: StepLedger) -> StepEnd:
        """(3) End of step g: every rank's ledger and report gathered into the step's ledger and step_end;
        whether a checkpoint is due; the whole weights (fsdp: a collective) and version g's probe."""
        cfg, W = self.cfg, self.dp.world_size
        mine = {"dead": self.collector.step_dead, "stop": self.stop.is_set(), "counters": dict(self.counters),
                "over_budget": self.effects.over_budget, "lengths": self.lengths.to_plain()}
        reports = step_report.gather_reports(self.dp, ledger, mine)
        merged = merge_ledgers(g, [rep["ledger"] for rep in reports])
        for r, rep in enumerate(reports):
            self.pending_ids[r] += [f.sample_id for f in rep["ledger"].fates]
        self._own_acks += ledger.ack_ids
        self.collector.newest_published = max(self.collector.newest_published, g)
        self.agreed_stop = any(rep["stop"] for rep in reports)
        K, max_len = cfg.async_training.trigger_parameter_sync_step, cfg.data.max_response_length
        merged.step_end = step_report.step_end_event(g, K, W, merged, reports, max_len)
        self.pending.append(merged)
        self.global_step = g
        due = g % cfg.trainer.save_freq == 0 or g >= cfg.trainer.total_training_steps or self.agreed_stop
        due = due or any(rep["over_budget"] for rep in reports)  # ack now: acked entries may leave Redis
        whole = self.dp.roles.gather_if_sharded(self.learner.whole_weights)
        probe = self.learner.probe()  # the swap check's fingerprint of version g (every rank: fsdp)
        return StepEnd(g, merged, reports, due, whole, probe)

    def _start_checkpoint(self, end: StepEnd, t_step: float) -> Future[float] | None:
        """(4) When due, rank 0 writes the checkpoint on a thread (meta, RNG and tensor references captured
        now) while version g validates and publishes (neither changes a tensor)."""
        if not end.due:
            return None
        optim_state = self.dp.roles.with_whole_model(self.learner.optimizer_state) or {}  # fsdp: a collective
        return self.dp.roles.only_main(self._submit_checkpoint, end, t_step, optim_state)

    def _submit_checkpoint(self, end: StepEnd, t_step: float, optim_state: dict[str, Any]) -> Future[float]:
        """(4, rank 0) The checkpoint's meta and tensor references, its write submitted to the writer."""
        assert end.merged.step_end is not None
        end.merged.step_end.metrics["timing_s/step"] = time.perf_counter() - t_step
        meta = step_report.checkpoint_meta(end.g, self.pending, end.reports, self.pending_ids)
        meta["committed"] = self.effects.committed_for_checkpoint()  # redone on resume if a failover lost it
        weights = end.whole if end.whole is not None else self.learner.whole_weights()  # the module's own
        keep = self.cfg.trainer.keep_checkpoints
        write = checkpoint_writer(self.ckpt_dir, end.g, weights, optim_state, meta, keep_last=keep)
        return self._writer.submit(step_report.timed, write)

    def _publish(self, end: StepEnd, writing: Future[float] | None, t_step: float) -> None:
        """(6, rank 0) Publish version g's weights, then wait until its checkpoint (`writing`, when due) is
        durable (raising what its write raised: no commit without it); its timings into step_end."""
        t0 = time.perf_counter()
        self.effects.publish_weights(end.g, self.learner.policy.module, end.whole, probe=end.probe)
        pub_s = time.perf_counter() - t0
        timings = {"timing_s/publish": pub_s}
        if writing is not None:
            t0 = time.perf_counter()
            write_s = writing.result()
            timings.update({"timing_s/checkpoint": write_s,
                            "timing_s/checkpoint_wait": time.perf_counter() - t0})
        step_s = time.perf_counter() - t_step
        assert end.merged.step_end is not None
        timings.update({"timing_s/step": step_s, "perf/time_per_step": step_s})
        end.merged.step_end.metrics.update(timings)

    def _evaluate(self, version: int) -> None:
        """(5) Validate version `version` (evaluate.validate) and emit a `validation` event, the RNG states
        unchanged. Rank 0 alone; under fsdp every rank decodes in step (the weights are sharded)."""
        rng = rng_plain()  # validation leaves the RNG as it found it: the checkpoint took it before
        policy, recent = self.learner.policy, list(self.recent)
        t0 = time.perf_counter()
        metrics = self.dp.roles.with_whole_model(validate, self.cfg, policy, self.dp, recent)
        restore_rng_plain(rng)
        if metrics:
            metrics["timing_s/validate"] = time.perf_counter() - t0  # the step's time the trainer spent on it
            ev = ValidateMetrics(param_version=version, global_step=version, metrics=metrics)
            self.dp.roles.only_main(self.effects.emit_validation, ev)

    def run(self) -> int:
        """Resume, then train global steps until total_training_steps, a stop request or (burst) no rollouts
        left; returns 0."""
        try:
            self.resume()
            total = self.cfg.trainer.total_training_steps
            # a world of one asks its stop flag; ranks use what they agreed at the last step end
            while self.global_step < total and not self.dp.roles.stopping(self.stop.is_set(),
                                                                          self.agreed_stop):
                if not self.train_step(self.global_step + 1):
                    break
        finally:
            self.effects.stop_leaser()
            self._writer.shutdown()  # waits for a write an exception left running; ends the idle thread
        log.info("trainer stopping at global step %d", self.global_step)
        return 0
