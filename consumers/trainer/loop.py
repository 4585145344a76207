"""The trainer worker: consume rollouts, train K local updates per global step, publish, checkpoint, commit.

Global step g (1-based; trains version g-1):
  1. begin_step: pin the current weights as the proximal policy
  2. K times: collect ppo_mini_batch_size fresh samples (stale ones are dropped and recorded), assemble,
     update, emit a `local_update` event
  3. if a checkpoint is due (every save_freq steps, the last step, or on stop): start writing it on a
     thread (weights, optimizer, RNG, ledgers of the steps it covers); evaluate (every test_freq versions,
     the RNG left as it was) with the end-of-step weights = version g; publish version g. Neither reads
     more than the weights, so the write overlaps them
  4. if a checkpoint is due: wait until it is durable, then commit in one MULTI (fates, XACK, consumed,
     trainer hash, step_end); otherwise count the step's samples as consumed (pacing needs it before the
     grant)
  5. grant version g its dispatch budget; remove weight blobs no producer uses

Restart: the newest checkpoint is loaded; its version is published if `params` lacks it; its commit is
redone if the trainer hash says it never ran, and so is every earlier commit it keeps (`committed`) that
Redis lacks; the budget is granted if not yet. Entries re-delivered from our pending list whose sample_id is
already in `fates` are acked without training; the rest are trained. A stop request mid-step abandons the
partial step without acking (its samples are retrained on restart).

Failover (replicas; consumers/trainer/reconcile.py): rank 0 keeps the ledgers of its
recent commits; at each step's start and before each commit it compares the trainer hash's committed_step
with the last step it committed, and commits again what a failover to a replica that had not received it
lost (fates, acks, consumed counts, step_end, the local updates no longer on `metrics`), before any later
step's commit; at a step's start it also grants the last version's budget again if the failover lost it.

Sync mode (`trainer.sync_mode`, the synchronous-RL baseline of `rollstream bench async`): the first local
update of a step waits until the step's whole train_batch_size is collected, so with
staleness_threshold = 0 generation and training strictly alternate.

Reading (consumers/trainer/collect.py): warmup, the transport timing and the burst rule.

Reconnects: every Redis effect outside the reader (which retries its own polls and dead letters) and the lease
loop (rollstream/pacing/leaser.py, its own thread), the collector's reads and acks included, is a named method
of TrainerEffects (consumers/trainer/effects.py), run under its one retry policy (`effect`), so a Redis
restart pauses the trainer in place instead of killing it. Each is safe to repeat: the commit, the consumed
count and the grant are guarded by the trainer hash, a weight publish re-checks `params` first, and a repeated
event is resolved by the fold. No collective runs inside a retried call (a repeat on one rank would pair it
with the wrong collective elsewhere).

Data parallel (`trainer.nproc_per_node` / `nnodes` > 1, under torchrun; consumers/trainer/distributed.py):
every rank runs this loop on its own reader (consumer `trainer-r<rank>` of the `trainer` group) and
trains `ppo_mini_batch_size / world_size` samples per local update (so `train_batch_size / world_size`
per global step), collected in agreed rounds (consumers/trainer/rank_agreement.py: same step, same stop, no
sample id on two ranks); DDP averages the gradients. Each rank emits its own `local_update` (with its
rank and sample_count). At the end of a step the ranks all-gather their ledgers, RNG states, counters
and stop flags; rank 0 alone evaluates (all ranks under fsdp), writes the checkpoint (weights and
optimizer once, every rank's RNG and sample ids), publishes the weights, commits every rank's fates and
XACKs in its one MULTI (with `step_end`, world_size W), grants the budget and runs retention. A restarted
group resumes from that checkpoint (rank 0 reads it and broadcasts it), and each rank re-reads its own
pending entries, acking without training those whose sample_id is already in `fates`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from consumers.trainer import step_report
from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.checkpoint import checkpoint_writer, restore_newest, restore_rng_plain, rng_plain
from consumers.trainer.collect import Collected, Collector, rollouts_reader
from consumers.trainer.distributed import DataParallel, RankInfo
from consumers.trainer.effects import TrainerEffects
from consumers.trainer.evaluate import validate
from consumers.trainer.learner import Learner
from consumers.trainer.ledger import StepLedger, merge_ledgers
from consumers.trainer.minibatch import UPDATE_SKIPPED
from consumers.trainer.reconcile import CommitHistory
from consumers.trainer.staleness import STALE_SAMPLES, STALE_TRAJECTORIES, LengthBuckets
from rollstream.bus import EntryRef
from rollstream.config import PipelineConfig
from rollstream.keys import Keys
from rollstream.model.base import resolve_device
from rollstream.tasks import Prompt
from rollstream.weights.store import Probe
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
        """Build the learner and the reader (group `trainer`, consumer = worker name); `burst` exits
        once the rollouts stream is drained; `dp` is this rank's data-parallel group (None: a world of
        one)."""
        self.cfg, self.r, self.keys, self.stop, self.burst = cfg, r, keys, stop, burst
        self.dp = dp if dp is not None else DataParallel(RankInfo(), resolve_device(cfg.run.device))
        self.learner = Learner(cfg, self.dp)
        self.reader = rollouts_reader(cfg, r, keys, name, stop)
        self.effects = TrainerEffects(cfg, r, keys, cfg.run_dir() / "weights", self.dp)
        vocab_size, max_seq_len = self.learner.policy.tokenizer.vocab_size, self.learner.policy.max_seq_len
        self.collector = Collector(
            cfg, self.effects, self.reader, self.dp, stop, burst, vocab_size, max_seq_len
        )
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

    # -- start / resume ----------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint (rank 0 reads it, every rank loads it), then on rank 0 finish its
        publish/commit/grant if a crash cut them short (repeated if Redis goes away meanwhile: every part is
        idempotent); then every rank reads what is already committed."""
        meta = restore_newest(self.ckpt_dir, self.dp, self.learner, self.counters)  # and this rank's RNG
        if meta is not None:
            self.global_step = int(meta["global_step"])
            log.info("resumed from checkpoint of global step %d", self.global_step)
        g0 = self.global_step
        roles = self.dp.roles
        whole = self.learner.whole_weights() if roles.sharded else None  # fsdp: a collective
        probe = self.learner.probe()  # every rank: a forward (a collective under fsdp)
        if roles.main:
            ledgers = [StepLedger.from_plain(d) for d in meta["steps"]] if meta is not None else []
            history = CommitHistory.from_plain(meta.get("committed", []) if meta is not None else [])
            module = self.learner.policy.module
            self.effects.resume_main(g0, ledgers, module, whole, self.dp.world_size, probe, history)
            self.effects.start_leaser()  # producers get their leases from here on
        self.dp.barrier()  # the redone commit is in `fates` before any rank reads it
        self.newest_published, self.training_step, self.collector.seen = self.effects.read_progress(g0)
        log.info("%d sample ids already committed", len(self.seen))
        if meta is None and self.cfg.trainer.test_freq > 0:
            self._evaluate(0)

    # -- reading (consumers/trainer/collect.py) ------------------------------------------------------

    @property
    def seen(self) -> set[str]:
        """Sample ids committed, in uncommitted ledgers, or buffered."""
        return self.collector.seen

    @property
    def newest_published(self) -> int:
        """The newest version on `params` (samples stamped later are dead-lettered)."""
        return self.collector.newest_published

    @newest_published.setter
    def newest_published(self, version: int) -> None:
        self.collector.newest_published = version

    def _collect(self, g: int, ledger: StepLedger) -> Collected | None:
        """This rank's share of a mini-batch of step g (Collector.collect)."""
        return self.collector.collect(g, ledger)

    # -- one global step ---------------------------------------------------------------------------

    def train_step(self, g: int) -> bool:
        """Run global step g: (1) begin, (2) K local updates, then (3-5) finish the step; False when
        stopped mid-step (the partial step is abandoned, nothing acked)."""
        t_step = time.perf_counter()
        ledger = self._begin_step(g)
        synced: list[Collected | None] = []  # sync mode: the step's K shares, collected at the first update
        for local in range(1, self.cfg.async_training.trigger_parameter_sync_step + 1):
            t0 = time.perf_counter()
            got = self._samples(g, local, ledger, synced)
            if got is None:
                return False
            self._local_update(g, local, ledger, got, t_gen=time.perf_counter() - t0)
        self._finish_step(g, ledger, t_step)
        return True

    def _begin_step(self, g: int) -> StepLedger:
        """(1) Begin step g: where Redis can fail over, rank 0 first commits again any commit a failover
        lost and grants again a lost budget (TrainerEffects.reconcile); then it records step g as begun
        (once, before any event of step g: the aggregator places nothing beyond it); pin the current weights
        as the proximal policy, reset the step's counts; returns its empty ledger."""
        self.collector.step_dead = 0
        self.lengths = LengthBuckets(self.cfg.data.max_response_length)
        if self.dp.roles.main and self.effects.can_fail_over:  # a failover may have lost commits and a grant
            self.effects.reconcile(self.global_step)
        if g > self.training_step:
            if self.dp.roles.main:  # the other ranks emit nothing of step g before rank 0's first collective
                self.effects.mark_training_step(g)
            self.training_step = g
        self.learner.begin_step(g)
        return StepLedger(g)

    def _samples(
        self, g: int, local: int, ledger: StepLedger, synced: list[Collected | None]
    ) -> Collected | None:
        """(2) The samples of local update `local` of step g: after the run's warmup (before its first
        update); in sync mode the whole global batch is collected at the first update (into `synced`). None
        when the step is to be abandoned: no rollouts left (burst) or a stop (several ranks: only an agreed
        one)."""
        cfg = self.cfg
        if g == 1 and local == 1 and cfg.trainer.num_warmup_batches > 0:
            self.collector.wait_warmup()
        if not cfg.trainer.sync_mode:
            got = self._collect(g, ledger)
        else:  # synchronous RL: the whole global batch first
            if local == 1:
                K = cfg.async_training.trigger_parameter_sync_step
                synced[:] = [self._collect(g, ledger) for _ in range(K)]
            got = synced[local - 1]
        if got is None or (self.stop.is_set() and not self.dp.roles.agreed):  # ranks stop when they agree
            why = "no rollouts left (burst)" if self.collector.used_up else "stop requested"
            log.warning("%s during global step %d: abandoning it (samples stay pending)", why, g)
            return None
        return got

    def _local_update(self, g: int, local: int, ledger: StepLedger, got: Collected, t_gen: float) -> None:
        """(2) One local update of step g on the collected samples: assemble, update, record their fates in
        the step's ledger, emit a `local_update` event (its metrics: step_report.local_update_event)."""
        t0 = time.perf_counter()
        samples: list[RolloutSample] = [m.event for m, _ in got.kept]  # type: ignore[misc]
        batch, batch_metrics = assemble_batch_from_rollout_samples(samples)
        t_asm = time.perf_counter() - t0
        learned = self.learner.update(batch)
        fate = SKIPPED if learned.get(UPDATE_SKIPPED) else TRAINED  # a skipped step trained nothing
        self.recent.extend(step_report.record_fates(ledger, got.kept, fate, g))
        self.lengths.add(got.kept, got.dropped_lengths)
        timings = step_report.UpdateTimings(t_gen, t_asm, self.collector.transport_since_last())
        versions = batch.meta_info["trajectory_param_versions"]
        fg = self.cfg.algorithm.filter_groups.enable
        update = step_report.local_update_event(
            g, local, self.dp.rank, got, learned, batch_metrics, versions, self.counters, timings, fg
        )
        entry_id = self.effects.emit_local_update(update)
        if self.effects.can_fail_over:  # emitted again if a failover loses it with the step's commit
            ledger.updates.append((entry_id, update))
        self.effects.heartbeat()

    def _finish_step(self, g: int, ledger: StepLedger, t_step: float) -> None:
        """End of step g: gather every rank's ledger; (3) evaluate version g; then (4) rank 0 checkpoints /
        publishes / commits (or publishes and counts the step's samples as consumed), (5) grants version g
        its budget and runs retention."""
        cfg, W = self.cfg, self.dp.world_size
        mine = {"dead": self.collector.step_dead, "stop": self.stop.is_set(), "counters": dict(self.counters),
                "over_budget": self.effects.over_budget, "lengths": self.lengths.to_plain()}
        reports = step_report.gather_reports(self.dp, ledger, mine)
        merged = merge_ledgers(g, [rep["ledger"] for rep in reports])
        for r, rep in enumerate(reports):
            self.pending_ids[r] += [f.sample_id for f in rep["ledger"].fates]
        self._own_acks += ledger.ack_ids
        self.newest_published = max(self.newest_published, g)
        self.agreed_stop = any(rep["stop"] for rep in reports)
        K, max_len = cfg.async_training.trigger_parameter_sync_step, cfg.data.max_response_length
        merged.step_end = step_report.step_end_event(g, K, W, merged, reports, max_len)
        self.pending.append(merged)
        self.global_step = g
        due = g % cfg.trainer.save_freq == 0 or g >= cfg.trainer.total_training_steps or self.agreed_stop
        due = due or any(rep["over_budget"] for rep in reports)  # ack now: acked entries may leave Redis
        # under fsdp reading the whole weights and optimizer state is a collective: every rank takes part
        roles = self.dp.roles
        whole = self.learner.whole_weights() if roles.sharded else None
        probe = self.learner.probe()  # the swap check's fingerprint of version g (every rank: fsdp)
        optimizer_state = self.learner.optimizer_state() if due and roles.whole_model else {}
        writing = None
        if due and roles.main:  # written while version g validates and publishes (neither changes a tensor)
            write = self._checkpoint_writer(g, reports, whole, optimizer_state, t_step)
            writing = self._writer.submit(_timed, write)
        if cfg.trainer.test_freq > 0 and g % cfg.trainer.test_freq == 0:
            self._evaluate(g)
        if roles.main:
            self._publish_commit_grant(g, merged, whole, writing, t_step, probe)
        if due:
            self.reader.forget(self._own_acks)  # acked inside rank 0's commit
            self._own_acks, self.pending = [], []
            self.pending_ids = [[] for _ in range(W)]
        trained, dropped, evicted, skipped = step_report.fate_counts(merged)
        log.info("global step %d done in %.2fs (%d trained, %d dropped, %d evicted, %d skipped; %d ranks)",
                 g, time.perf_counter() - t_step, trained, dropped, evicted, skipped, W)

    def _evaluate(self, version: int) -> None:
        """(3) Validate version `version` (evaluate.validate) and emit a `validation` event, the RNG states
        unchanged. Rank 0 alone; under fsdp every rank decodes in step (the weights are sharded)."""
        if not self.dp.roles.whole_model:
            return
        rng = rng_plain()  # validation leaves the RNG as it found it: the checkpoint took it before
        metrics = validate(self.cfg, self.learner.policy, self.dp, list(self.recent))
        restore_rng_plain(rng)
        if metrics and self.dp.roles.main:
            ev = ValidateMetrics(param_version=version, global_step=version, metrics=metrics)
            self.effects.emit_validation(ev)
            log.info("validation of version %d: %s", version, metrics)

    def _checkpoint_writer(self, g: int, reports: list[dict[str, Any]], whole: dict[str, Any] | None,
                           optimizer_state: dict[str, Any], t_step: float) -> Callable[[], Path]:
        """(4, rank 0) The writer of version g's checkpoint (checkpoint.checkpoint_writer: meta, RNG states
        and tensor references captured now, the file written when it is called)."""
        step_end = self.pending[-1].step_end
        assert step_end is not None
        step_end.metrics["timing_s/step"] = time.perf_counter() - t_step
        meta = step_report.checkpoint_meta(g, self.pending, reports, self.pending_ids)
        meta["committed"] = self.effects.committed_for_checkpoint()  # redone on resume if a failover lost it
        weights = whole if whole is not None else self.learner.whole_weights()  # the module's own tensors
        keep = self.cfg.trainer.keep_checkpoints
        return checkpoint_writer(self.ckpt_dir, g, weights, optimizer_state, meta, keep_last=keep)

    def _publish_commit_grant(self, g: int, merged: StepLedger, whole: dict[str, Any] | None,
                              writing: Future[float] | None, t_step: float, probe: Probe) -> None:
        """(4, 5; rank 0) Publish version g, then commit once its checkpoint (`writing`, when due) is
        durable, or count the step's samples as consumed; grant version g its budget; retention."""
        t0 = time.perf_counter()
        self.effects.publish_weights(g, self.learner.policy.module, whole, probe=probe)
        t_pub = time.perf_counter() - t0
        timings = {"timing_s/publish": t_pub}
        if writing is not None:
            t0 = time.perf_counter()
            write_s = writing.result()  # raises what the write raised: no commit without its checkpoint
            timings.update({"timing_s/checkpoint": write_s,
                            "timing_s/checkpoint_wait": time.perf_counter() - t0})
        step_s = time.perf_counter() - t_step
        assert merged.step_end is not None
        timings.update({"timing_s/step": step_s, "perf/time_per_step": step_s})
        merged.step_end.metrics.update(timings)
        if writing is not None:
            self.effects.commit(self.pending, g)
        else:
            self.effects.count_consumed(merged, g)
        self.effects.grant(g)
        self.effects.run_janitor()

    def run(self) -> int:
        """Resume, then train global steps until total_training_steps, a stop request or (burst) no rollouts
        left; returns 0."""
        try:
            self.resume()
            total = self.cfg.trainer.total_training_steps
            # stop before the next step: a world of one asks its stop flag; ranks use what they agreed at
            # the last step end (a stop arriving since is agreed in the next step's first round)
            while self.global_step < total and not (
                self.agreed_stop if self.dp.roles.agreed else self.stop.is_set()
            ):
                if not self.train_step(self.global_step + 1):
                    break
        finally:
            self.effects.stop_leaser()
            self._writer.shutdown()  # waits for a write an exception left running; ends the idle thread
        log.info("trainer stopping at global step %d", self.global_step)
        return 0


def _timed(fn: Callable[[], Any]) -> float:
    """Run fn; the seconds it took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
