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
weight publish re-checks `params` first, and a repeated event is resolved by the fold. No collective
runs inside a retried call (a repeat on one rank would pair it with the wrong collective elsewhere).

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
from functools import partial
from typing import Any

import redis

from consumers.trainer.assembly import assemble_micro_batches
from consumers.trainer.checkpoint import list_checkpoints, read_checkpoint, rng_plain, write_checkpoint
from consumers.trainer.collect import Collected, Collector
from consumers.trainer.distributed import DataParallel, RankInfo
from consumers.trainer.evaluate import evaluate
from consumers.trainer.learner import UPDATE_SKIPPED, Learner
from consumers.trainer.ledger import (
    StepLedger,
    commit_steps,
    committed_sample_ids,
    committed_step,
    count_consumed,
    merge_ledgers,
)
from consumers.trainer.staleness import (
    ROLLOUT_FAILURE_EVICTED,
    LengthBuckets,
    dropped_metrics,
    filter_groups_metrics,
)
from rollstream.bus import (
    GroupReader,
    Janitor,
    Publisher,
    entry_limits,
    retry_on_connection,
    setup_run,
)
from rollstream.config import PipelineConfig
from rollstream.from_config import build_prompt_source, build_task
from rollstream.model.base import resolve_device
from rollstream.names import (
    DEAD_LETTERED_FIELD,
    PROGRESS_AT_FIELD,
    REPLAYED_VERSIONS_FIELD,
    TRAINER_GROUP,
    TRAINING_STEP_FIELD,
    WORLD_SIZE_FIELD,
    Keys,
)
from rollstream.pacing import current_budget, grant_budget, uncount_evicted
from rollstream.rl import finite_metrics, staleness_metrics
from rollstream.tasks import Prompt
from rollstream.weights import gc_weights, latest_param_version, publish_module_weights, publish_weights
from rollstream.weights_io import state_bytes
from schemas import DROPPED, SKIPPED, TRAINED, Fate, RolloutSample, StepMetrics, ValidateMetrics

log = logging.getLogger(__name__)

STALE_SAMPLES = "stale_samples_processed"
STALE_TRAJECTORIES = "stale_trajectory_processed"


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
        limits = entry_limits(cfg.bus.max_entry_bytes)
        self.reader = GroupReader(
            r,
            keys.rollouts,
            TRAINER_GROUP,
            name,
            dead_stream=keys.dead,
            block_ms=cfg.bus.block_ms,
            count=cfg.bus.read_count,
            claim_idle_s=cfg.bus.claim_idle_s,
            max_deliveries=cfg.bus.max_deliveries,
            limits=limits,
            stop=stop,
            dead_count=(keys.trainer, DEAD_LETTERED_FIELD),
        )
        self.collector = Collector(
            cfg,
            r,
            keys,
            self.reader,
            self.dp,
            stop,
            burst,
            self.learner.policy.tokenizer.vocab_size,
            self.learner.policy.max_seq_len,
        )
        self.publisher = Publisher(r, nomkstream=True)
        self.janitor = Janitor.from_config(cfg, r, keys) if cfg.bus.retention and self.dp.is_main else None
        self.ckpt_dir = cfg.run_dir() / "checkpoints"
        self.weights_dir = cfg.run_dir() / "weights"
        self.pending: list[StepLedger] = []  # finished steps not yet covered by a checkpoint
        self.global_step = 0  # last finished global step (= the version last published)
        self.training_step = 0  # highest global step ever begun (the trainer hash's training_step)
        self._transport_mark = 0.0  # the reader's transport_s at the last local update
        self.recent: deque[Prompt] = deque(maxlen=max(1, cfg.data.val_size))  # newest trained prompts
        self.counters = {STALE_SAMPLES: 0, STALE_TRAJECTORIES: 0}  # cumulative, kept in the checkpoint
        self.lengths = LengthBuckets(cfg.data.max_response_length)  # this step's trained/dropped by length
        self.agreed_stop = False  # data parallel: some rank asked to stop at the last step end
        self.pending_ids: list[list[str]] = [
            [] for _ in range(self.dp.world_size)
        ]  # per rank, since the checkpoint
        self._own_acks: list[str] = []  # this rank's ack ids in `pending` (forgotten once committed)

    # -- start / resume ----------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint (rank 0 reads it, every rank loads it), then on rank 0 finish its
        publish/commit/grant if a crash cut them short (repeated if Redis goes away meanwhile: every part is
        idempotent); then every rank reads what is already committed."""
        meta = self._load_checkpoint()
        whole = self.learner.whole_weights() if self.dp.sharded else None  # fsdp: a collective
        if self.dp.is_main:
            retry_on_connection(lambda: self._resume_main(meta, whole), "resume")
        self.dp.barrier()  # the redone commit is in `fates` before any rank reads it
        retry_on_connection(self._resume_rank, "resume")
        if meta is None and self.cfg.trainer.test_freq > 0:
            self._evaluate(0)

    def _load_checkpoint(self) -> dict[str, Any] | None:
        """Restore the newest checkpoint into the learner (and this rank's RNG and counters); None when
        there is none. Rank 0 reads the file and broadcasts its bytes (other hosts need no shared folder)."""
        found = list_checkpoints(self.ckpt_dir) if self.dp.is_main else []
        data = self.dp.broadcast_bytes(found[-1][1].read_bytes() if found else None)
        if not data:
            return None
        weights, optimizer_state, meta = read_checkpoint(data, self.dp.rank, self.dp.world_size)
        self.learner.load_checkpoint_state(weights, optimizer_state)
        self.global_step = int(meta["global_step"])
        ranks = meta.get("ranks") or []
        if self.dp.active and len(ranks) == self.dp.world_size:
            counters = ranks[self.dp.rank].get("counters", {})
        else:  # a world of one, or another world size: the totals go to rank 0
            counters = meta.get("counters", {}) if self.dp.is_main else {}
        self.counters.update({k: int(v) for k, v in counters.items() if k in self.counters})
        log.info("resumed from checkpoint of global step %d", self.global_step)
        return meta

    def _resume_main(self, meta: dict[str, Any] | None, whole: dict[str, Any] | None) -> None:
        """Rank 0's part of the resume: set up the run, publish the checkpoint's version if `params` lacks
        it, redo its commit if it never ran, grant its budget."""
        setup_run(self.r, self.keys)
        ledgers = [StepLedger.from_plain(d) for d in meta["steps"]] if meta is not None else []
        self._publish(self.global_step, whole, only_if_missing=True)
        if ledgers and committed_step(self.r, self.keys) < self.global_step:
            log.warning("redoing the commit of steps %s", [lg.global_step for lg in ledgers])
            commit_steps(self.r, self.keys, ledgers, self.global_step)
        if uncounted := uncount_evicted(self.r, self.keys):  # a crashed process's evictions come back pending
            log.warning("%d evictions of an abandoned step no longer counted as consumed", uncounted)
        self._grant(self.global_step)
        self.r.hset(self.keys.trainer, PROGRESS_AT_FIELD, time.time())  # the clock of `status`'s stall check
        if self.dp.active:
            self.r.hset(self.keys.trainer, WORLD_SIZE_FIELD, self.dp.world_size)

    def _resume_rank(self) -> None:
        """Every rank's part of the resume: the newest published version, the trainer's begun step and
        the sample ids already committed."""
        latest = latest_param_version(self.r, self.keys)
        replayed = int(self.r.hget(self.keys.trainer, REPLAYED_VERSIONS_FIELD) or 0)  # type: ignore[arg-type]
        self.newest_published = max(self.global_step, latest.version if latest is not None else 0, replayed)
        self.training_step = int(self.r.hget(self.keys.trainer, TRAINING_STEP_FIELD) or 0)  # type: ignore[arg-type]
        self.collector.seen = committed_sample_ids(self.r, self.keys)
        log.info("%d sample ids already committed", len(self.seen))

    def _publish(
        self, version: int, whole: dict[str, Any] | None = None, only_if_missing: bool = False
    ) -> float:
        """Publish the current weights as `version` (skipped when params has it and only_if_missing; a retry
        after a connection loss always checks, as the first attempt may have landed): from the policy's
        module, or (fsdp) from `whole`, the weights gathered on rank 0."""
        t0 = time.perf_counter()
        module = self.learner.policy.module
        attempts = [only_if_missing]

        def publish() -> None:
            check, attempts[0] = attempts[0], True
            if check:
                latest = latest_param_version(self.r, self.keys)
                if latest is not None and latest.version >= version:
                    return
            bus = self.cfg.bus
            where: dict[str, Any] = dict(
                inline_max_bytes=bus.weights_inline_max_bytes,
                file_dir=self.weights_dir,
                transport=bus.weights_transport,
                chunk_bytes=bus.weights_chunk_bytes,
            )
            if whole is not None:  # fsdp: the gathered copy (already a second copy: bytes are one more)
                publish_weights(self.r, self.keys, version, state_bytes(whole), global_step=version, **where)
                return
            # above the inline limit: streamed to a file or to Redis chunks, never one blob in memory
            publish_module_weights(self.r, self.keys, version, module, global_step=version, **where)

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
        (`val/recent_train_…`: memorisation shows as a gap between the two); emit a `validation` event.
        Rank 0 alone; under fsdp every rank decodes in step (the weights are sharded), on rank 0's prompts."""
        if not (self.dp.is_main or self.dp.sharded):
            return
        task = build_task(self.cfg)
        prompts = build_prompt_source(self.cfg, task).val_prompts()
        limit = self.cfg.data.max_response_length
        recent_prompts = list(self.recent)
        if self.dp.sharded and self.dp.active:
            rows = self.dp.broadcast_plain([[p.uid, p.text, p.answer] for p in recent_prompts])
            recent_prompts = [Prompt(uid=u, text=t, answer=a) for u, t, a in rows]
        metrics = evaluate(self.learner.policy, task, prompts, limit)
        recent = evaluate(self.learner.policy, task, recent_prompts, limit)
        metrics.update({k.replace("val/", "val/recent_train_"): v for k, v in recent.items()})
        if metrics and self.dp.is_main:
            ev = ValidateMetrics(param_version=version, global_step=version, metrics=metrics)
            retry_on_connection(
                lambda: self.publisher.publish(self.keys.metrics, ev), "publishing validation"
            )
            log.info("validation of version %d: %s", version, metrics)

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
        """Run global step g: K local updates, then finish the step; False when stopped mid-step (the
        partial step is abandoned, nothing acked)."""
        cfg = self.cfg
        t_step = time.perf_counter()
        ledger = StepLedger(g)
        self.collector.step_dead = 0
        if g > self.training_step:  # before any event of step g: the aggregator places nothing beyond it
            if self.dp.is_main:  # the other ranks emit nothing of step g before rank 0's first collective
                retry_on_connection(
                    lambda: self.r.hset(self.keys.trainer, TRAINING_STEP_FIELD, g), "training_step"
                )
            self.training_step = g
        self.learner.begin_step(g)
        K = cfg.trainer.parameter_sync_step
        collected: list[Collected | None] = []
        self.lengths = LengthBuckets(cfg.data.max_response_length)
        for local in range(1, K + 1):
            t0 = time.perf_counter()
            if g == 1 and local == 1 and cfg.trainer.num_warmup_batches > 0:
                self.collector.wait_warmup()
            if cfg.trainer.sync_mode and local == 1:  # synchronous RL: the whole global batch first
                collected = [self._collect(g, ledger) for _ in range(K)]
            got = collected[local - 1] if cfg.trainer.sync_mode else self._collect(g, ledger)
            if got is None or (self.stop.is_set() and not self.dp.active):  # ranks stop only when they agree
                why = "no rollouts left (burst)" if self.collector.used_up else "stop requested"
                log.warning("%s during global step %d: abandoning it (samples stay pending)", why, g)
                return False
            self._local_update(g, local, ledger, got, t_gen=time.perf_counter() - t0)
        self._finish_step(g, ledger, t_step)
        return True

    def _local_update(self, g: int, local: int, ledger: StepLedger, got: Collected, t_gen: float) -> None:
        """One local update of step g on the collected samples: assemble, update, record their fates in
        the step's ledger, emit a `local_update` event."""
        kept = got.kept
        t0 = time.perf_counter()
        samples: list[RolloutSample] = [m.event for m, _ in kept]  # type: ignore[misc]
        micro, asm_metrics = assemble_micro_batches(samples, self.cfg.actor.micro_batch_size)
        t_asm = time.perf_counter() - t0
        metrics = self.learner.update(micro)
        fate = SKIPPED if metrics.get(UPDATE_SKIPPED) else TRAINED  # a skipped step trained nothing
        for m, st in kept:
            ev: Any = m.event
            ledger.fates.append(Fate(ev.sample_id, m.id, fate, st, ev.param_version, g))
            ledger.ack_ids.append(m.id)
            truth = ev.full_batch.non_tensors.get("ground_truth")
            if truth is not None and "raw_prompt" in ev.full_batch.non_tensors:
                text = str(ev.full_batch.non_tensors["raw_prompt"][0])
                self.recent.append(Prompt(uid=ev.sample_id, text=text, answer=str(truth[0])))
        transport_s, self._transport_mark = (
            self.reader.stats.transport_s - self._transport_mark,
            self.reader.stats.transport_s,
        )
        metrics.update(asm_metrics)
        metrics.update(dropped_metrics(got.dropped))
        fg_metrics, fg_counts = (
            filter_groups_metrics(got.evicted) if self.cfg.trainer.filter_groups.enable else ({}, {})
        )
        metrics.update(fg_metrics)
        metrics[ROLLOUT_FAILURE_EVICTED] = float(got.failed)
        self.lengths.add(got.kept, got.dropped_lengths)
        metrics.update(staleness_metrics([st for _, st in kept]))
        metrics.update(self._count_stale(g - 1, samples, micro[0].meta_info["trajectory_param_versions"]))
        metrics.update(
            {
                "training/global_step": float(g),
                "timing_s/gen": t_gen,
                "timing_s/assemble": t_asm,
                "timing_s/transport": transport_s,
                "fully_async/total_wait_time": t_gen,
            }
        )
        update = StepMetrics(
            type="local_update",
            global_step=g,
            local_step=local,
            sample_count=len(kept),
            rank=self.dp.rank,
            metrics=finite_metrics(metrics),
            counts=fg_counts,
        )
        retry_on_connection(
            partial(self.publisher.publish, self.keys.metrics, update), "publishing local_update"
        )
        self.collector.heartbeat()

    def _gather_step(self, ledger: StepLedger) -> list[dict[str, Any]]:
        """Every rank's end-of-step report, in rank order: its ledger, dead-lettered rollouts, stop flag, its
        janitor's over-budget flag (rank 0 has the janitor), counters and RNG state (a world of one: its own,
        nothing exchanged)."""
        over_budget = self.janitor is not None and self.janitor.over_budget
        mine = {
            "dead": self.collector.step_dead,
            "stop": self.stop.is_set(),
            "counters": dict(self.counters),
            "over_budget": over_budget,
            "lengths": self.lengths.to_plain(),
        }
        if not self.dp.active:
            return [{**mine, "ledger": ledger}]
        mine.update({"ledger": ledger.to_plain(), "rng": rng_plain()})
        reports = self.dp.all_gather_plain(mine)
        for rep in reports:
            rep["ledger"] = StepLedger.from_plain(rep["ledger"])
        return reports

    def _finish_step(self, g: int, ledger: StepLedger, t_step: float) -> None:
        """End of step g: gather every rank's ledger; evaluate version g; then rank 0 checkpoints /
        publishes / commits (or publishes and counts the step's samples as consumed), grants version g its
        budget and runs retention."""
        cfg = self.cfg
        K, W = cfg.trainer.parameter_sync_step, self.dp.world_size
        reports = self._gather_step(ledger)
        merged = merge_ledgers(g, [rep["ledger"] for rep in reports]) if self.dp.active else ledger
        for r, rep in enumerate(reports):
            self.pending_ids[r] += [f.sample_id for f in rep["ledger"].fates]
        self._own_acks += ledger.ack_ids
        self.newest_published = max(self.newest_published, g)
        self.agreed_stop = any(rep["stop"] for rep in reports)
        if cfg.trainer.test_freq > 0 and g % cfg.trainer.test_freq == 0:
            self._evaluate(g)
        trained = sum(1 for f in merged.fates if f.fate == TRAINED)
        dropped = sum(1 for f in merged.fates if f.fate == DROPPED)
        skipped = sum(1 for f in merged.fates if f.fate == SKIPPED)
        lengths = LengthBuckets.merged(cfg.data.max_response_length, [rep["lengths"] for rep in reports])
        merged.step_end = StepMetrics(
            type="step_end",
            global_step=g,
            local_step=K,
            sample_count=trained,
            num_local_updates=K,
            world_size=W,
            metrics={
                "training/global_step": float(g),
                "trainer/param_version": float(g),
                "trainer/world_size": float(W),
                "fully_async/count/trained_samples": float(trained),
                "fully_async/count/dropped_samples": float(dropped),
                "fully_async/count/evicted_samples": float(len(merged.fates) - trained - dropped - skipped),
                "fully_async/count/skipped_samples": float(skipped),
                "fully_async/count/dead_samples": float(sum(rep["dead"] for rep in reports)),
                **lengths.share_metrics(),
            },
        )
        if self.dp.active:  # the run's counters are every rank's together (each local update has its own)
            for name in self.counters:
                merged.step_end.metrics[f"fully_async/count/{name}"] = float(
                    sum(rep["counters"][name] for rep in reports)
                )
        self.pending.append(merged)
        self.global_step = g
        due = g % cfg.trainer.save_freq == 0 or g >= cfg.trainer.total_global_steps or self.agreed_stop
        due = due or any(
            rep["over_budget"] for rep in reports
        )  # rank 0's janitor: ack now, acked entries may leave Redis
        t0 = time.perf_counter()
        # under fsdp reading the whole weights and optimizer state is a collective: every rank takes part
        whole = self.learner.whole_weights() if self.dp.sharded else None
        optimizer_state = (
            self.learner.optimizer_state() if due and (self.dp.is_main or self.dp.sharded) else {}
        )
        if self.dp.is_main:
            self._finish_main(g, merged, reports, whole, optimizer_state, due, t_step, t0)
        if due:
            self.reader.forget(self._own_acks)  # acked inside rank 0's commit
            self._own_acks, self.pending = [], []
            self.pending_ids = [[] for _ in range(W)]
        log.info(
            "global step %d done in %.2fs (%d trained, %d dropped, %d evicted, %d skipped; %d ranks)",
            g,
            time.perf_counter() - t_step,
            trained,
            dropped,
            len(merged.fates) - trained - dropped - skipped,
            skipped,
            W,
        )

    def _finish_main(
        self,
        g: int,
        merged: StepLedger,
        reports: list[dict[str, Any]],
        whole: dict[str, Any] | None,
        optimizer_state: dict[str, Any],
        due: bool,
        t_step: float,
        t0: float,
    ) -> None:
        """Rank 0's end of step g: checkpoint (when due) / publish / commit or count, grant, retention."""
        cfg, step_end = self.cfg, merged.step_end
        assert step_end is not None
        if due:
            step_end.metrics["timing_s/step"] = time.perf_counter() - t_step
            meta: dict[str, Any] = {"param_version": g, "steps": [lg.to_plain() for lg in self.pending]}
            meta["counters"] = {name: sum(rep["counters"][name] for rep in reports) for name in self.counters}
            if (
                self.dp.active
            ):  # each rank's RNG, counters and the sample ids it consumed since the last checkpoint
                meta["ranks"] = [
                    {
                        "rank": r,
                        "rng": rep["rng"],
                        "counters": rep["counters"],
                        "sample_ids": self.pending_ids[r],
                    }
                    for r, rep in enumerate(reports)
                ]
            weights = whole if whole is not None else self.learner.whole_weights()  # the module's own tensors
            write_checkpoint(
                self.ckpt_dir, g, weights, optimizer_state, meta, keep_last=cfg.trainer.keep_checkpoints
            )
            t_ckpt = time.perf_counter() - t0
            t_pub = self._publish(g, whole)
            step_s = time.perf_counter() - t_step
            step_end.metrics.update(
                {
                    "timing_s/checkpoint": t_ckpt,
                    "timing_s/publish": t_pub,
                    "timing_s/step": step_s,
                    "perf/time_per_step": step_s,
                }
            )
            retry_on_connection(
                lambda: commit_steps(self.r, self.keys, self.pending, g), f"committing step {g}"
            )
        else:
            t_pub = self._publish(g, whole)
            step_s = time.perf_counter() - t_step
            step_end.metrics.update(
                {"timing_s/publish": t_pub, "timing_s/step": step_s, "perf/time_per_step": step_s}
            )
            retry_on_connection(lambda: count_consumed(self.r, self.keys, merged), f"counting step {g}")
        self._grant(g)
        if self.janitor is not None:
            retry_on_connection(self.janitor.maybe_run, "retention")

    def _count_stale(
        self, version: int, samples: list[RolloutSample], trajectory_versions: list[int]
    ) -> dict[str, float]:
        """Add this update's stale samples / trajectories (older than `version`, the one being trained) to
        the run's counters; returns verl's fully_async/count metrics."""
        self.counters[STALE_SAMPLES] += sum(1 for s in samples if version - s.param_version >= 1)
        self.counters[STALE_TRAJECTORIES] += sum(1 for v in trajectory_versions if version - v >= 1)
        return {
            f"fully_async/count/{STALE_SAMPLES}": float(self.counters[STALE_SAMPLES]),
            f"fully_async/count/{STALE_TRAJECTORIES}": float(self.counters[STALE_TRAJECTORIES]),
            "fully_async/count/current_param_version": float(version),
        }

    def _stopping(self) -> bool:
        """Stop before the next step: a world of one asks its stop flag; ranks use what they agreed at
        the last step end (a stop arriving since is agreed in the next step's first round)."""
        return self.agreed_stop if self.dp.active else self.stop.is_set()

    def run(self) -> int:
        """Resume, then train global steps until total_global_steps, a stop request or (burst) no rollouts
        left; returns 0."""
        self.resume()
        total = self.cfg.trainer.total_global_steps
        while self.global_step < total and not self._stopping():
            if not self.train_step(self.global_step + 1):
                break
        log.info("trainer stopping at global step %d", self.global_step)
        return 0
