"""Every Redis effect of the trainer, named, idempotent, and retried by one policy.

Each public method is one effect, run under `retried` (rollstream/bus/connection.py: `retry_on_connection`
with the effect's name), so a Redis restart pauses the trainer in place instead of killing it. This is the
trainer's only retry site: the collector's reads and writes (leases, revoked bits, dead letters, acks of
duplicates, consumed counts) are effects here too; only the rollouts reader (its polls and dead letters;
rollstream/bus/reader.py, which re-reads its pending list after a reconnect) and rank 0's lease loop
(rollstream/pacing/) retry their own. Each is safe to repeat (its reply may be lost after it landed): the
commit, the consumed count and the grant are guarded by the trainer hash, a weight publish re-checks
`params` before a retry, an ack or a consumed count of an id already counted changes nothing, and a
repeated event is resolved by the aggregator's fold. No collective runs inside an effect: a repeat on one
rank would pair it with the wrong collective elsewhere. A refused login (redis.AuthenticationError) is not
retried: the process exits with EXIT_REFUSED.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from torch import nn

from consumers.trainer.distributed import DataParallel
from consumers.trainer.leaser import Leaser
from consumers.trainer.ledger import (
    StepLedger,
    commit_steps,
    committed_sample_ids,
    committed_step,
    count_consumed,
)
from consumers.trainer.reconcile import Commit, CommitHistory, reconcile_and_commit
from rollstream.bus import (
    EntryRef,
    GroupReader,
    Janitor,
    Publisher,
    iter_stream,
    setup_run,
)
from rollstream.bus.connection import can_fail_over, retried
from rollstream.bus.ids import count_or_none
from rollstream.bus.outbox import OutboxDrain, record_id
from rollstream.config import PipelineConfig
from rollstream.keys import (
    AGGREGATOR_GROUP,
    BUDGET_VERSION_FIELD,
    COMMITTED_STEP_FIELD,
    PROGRESS_AT_FIELD,
    REPLAY_COPY_FIELD,
    REPLAYED_VERSIONS_FIELD,
    TRAINING_STEP_FIELD,
    WORLD_SIZE_FIELD,
    Keys,
    producer_names,
)
from rollstream.pacing.budget import consume, current_budget, grant_budget
from rollstream.pacing.counters import leases
from rollstream.pacing.expiry import LeaseExpiry, RevokedWatch
from rollstream.pacing.fence import FloodFence
from rollstream.topology.replication import acks_of, execute_replicated
from rollstream.weights.store import (
    Probe,
    gc_weights,
    latest_param_version,
    publish_module_weights,
    publish_weights,
)
from rollstream.weights.tensors import state_bytes
from schemas import StepMetrics, ValidateMetrics

log = logging.getLogger("consumers.trainer.loop")  # the trainer's log lines keep the one logger name

#: Longest a stopping trainer waits for the aggregator's record of its last step, to move it into `records`.
OUTBOX_SETTLE_S = 5.0

class TrainerEffects:
    """The trainer's writes to (and progress reads from) Redis: the trainer hash, `metrics`, `params`,
    the commit, the budget grant and the janitor."""

    def __init__(
        self, cfg: PipelineConfig, r: redis.Redis, keys: Keys, weights_dir: Path, dp: DataParallel
    ) -> None:
        """Rank 0 alone runs the janitor (when `bus.retention` is on)."""
        self.cfg, self.r, self.keys, self.weights_dir = cfg, r, keys, weights_dir
        self.publisher = Publisher(r, nomkstream=True)
        self.roles = dp.roles
        self.janitor = dp.roles.only_main(Janitor.from_config, cfg, r, keys) if cfg.bus.retention else None
        self.heartbeat_fields = dp.roles.heartbeat_fields()  # rank 0 `heartbeat`; several ranks: `…:r<rank>`
        self.leaser: Leaser | None = None  # rank 0's lease loop, once resumed
        self.history = CommitHistory()  # rank 0: its recent commits, redone if a failover loses them
        # Redis can lose acknowledged writes in a failover (replicas, Sentinel, a Cluster): only then does the
        # trainer check for lost commits at each step, keep its local updates' entry ids and checkpoint the
        # history (a single Redis with AOF keeps every acknowledged write)
        self.can_fail_over = cfg.run.redis.replicated or can_fail_over(r)

    def start_leaser(self) -> None:
        """Rank 0: start leasing the current budget to the producers that ask (consumers/trainer/leaser.py
        Leaser), until `stop_leaser`."""
        if self.leaser is None:
            names = producer_names(self.cfg.rollout.num_producers)
            expiry = LeaseExpiry(
                self.cfg.rollout.lease_timeout_s,
                self.cfg.max_outstanding,
                self.cfg.rollout.prompts_per_dispatch,
            )
            fence = FloodFence(self.cfg.bus.producer_bound(), self.cfg.max_outstanding)
            self.leaser = Leaser(
                self.r, self.keys, names, threading.Event(), expiry=expiry, fence=fence,
                outbox=OutboxDrain(self.keys),
            ).start()

    def stop_leaser(self) -> None:
        """Stop the lease loop and move the aggregator's outbox a last time (a no-op when none runs)."""
        if self.leaser is not None:
            self.leaser.stop.set()
            self.leaser = None
            self.settle_outbox()

    def settle_outbox(self, wait_s: float = OUTBOX_SETTLE_S) -> None:
        """Move the aggregator's outboxes into `records` and `dead:aggregator` before the trainer exits,
        waiting up to `wait_s` for the record of its last committed step while an aggregator is reading
        (rollstream/bus/outbox.py: nobody else moves them under ACLs). Redis unreachable for that long:
        given up with a warning (the next trainer moves them), so a trainer never hangs on its way out."""
        self._settle(time.monotonic() + wait_s)

    @retried("moving the aggregator's outbox before exit (else the next trainer moves it)", until="deadline")
    def _settle(self, deadline: float) -> None:
        """One attempt of settle_outbox: move the outboxes until the awaited record is in or the deadline
        passed (a repeat moves only what is still there)."""
        drain = OutboxDrain(self.keys)
        while True:
            drain.drain(self.r)
            if time.monotonic() >= deadline or not self._record_awaited():
                return
            time.sleep(0.05)

    def _record_awaited(self) -> bool:
        """The last committed step has no record yet and an aggregator consumer of `metrics` was active in the
        last 3 s (XINFO CONSUMERS `idle`: on Redis 7.0, since it was last delivered an entry)."""
        committed: Any = self.r.hget(self.keys.trainer, COMMITTED_STEP_FIELD)
        g = count_or_none(committed)
        if g is None or self.r.xrange(self.keys.records, min=record_id(g), max=record_id(g)):
            return False
        try:
            consumers: Any = self.r.xinfo_consumers(self.keys.metrics, AGGREGATOR_GROUP)
        except redis.ResponseError:
            return False  # no metrics stream or group: no aggregator
        return any(int(c.get("idle", 1 << 40)) < 3000 for c in consumers)

    def committed_for_checkpoint(self) -> list[dict[str, Any]]:
        """The kept commits for the checkpoint's `committed` (CommitHistory.to_plain), so a restarted trainer
        commits again what a failover lost; none where Redis cannot fail over (no replicas, Sentinel nor
        Cluster: a single Redis keeps every acknowledged write)."""
        return self.history.to_plain() if self.can_fail_over else []

    @property
    def over_budget(self) -> bool:
        """The janitor's last run found unread data over the retention budget (False without a janitor)."""
        return self.janitor is not None and self.janitor.over_budget

    # -- resume ------------------------------------------------------------------------------------

    @retried("resume")
    def resume_main(
        self,
        global_step: int,
        meta: dict[str, Any] | None,
        module: nn.Module,
        whole: dict[str, Any] | None,
        probe: Probe | None = None,
    ) -> None:
        """Rank 0's part of the resume from the checkpoint of `global_step` (`meta`: its metadata, None
        without one): set up the run, publish its version (with its swap-check `probe`) if `params` lacks it,
        redo its commit if it never ran and every earlier commit it keeps (`committed`) that Redis lacks
        (reconcile_and_commit), grant its budget, record the world size (several ranks). A replay copy redoes
        only the checkpoint's own commit (its earlier steps were never in this run)."""
        ledgers = [StepLedger.from_plain(d) for d in meta["steps"]] if meta is not None else []
        history = CommitHistory.from_plain(meta.get("committed", []) if meta is not None else [])
        setup_run(self.r, self.keys, producer_names(self.cfg.rollout.num_producers))
        self.publish_weights(global_step, module, whole, only_if_missing=True, probe=probe)
        if self.r.hexists(self.keys.trainer, REPLAY_COPY_FIELD):
            self.history = CommitHistory()
            if ledgers and committed_step(self.r, self.keys) < global_step:
                log.warning("redoing the commit of steps %s", [lg.global_step for lg in ledgers])
                commit_steps(self.r, self.keys, ledgers, global_step)
            self.history.add(ledgers)
        else:
            # the checkpoint's commits, none pruned by age (the trainer may have been down for long), then its
            # own steps: committed below if they never were (a crash before the commit)
            kept = history.commits
            self.history = CommitHistory([*kept, Commit(time.time(), ledgers)] if ledgers else kept)
            reconcile_and_commit(self.r, self.keys, self.history)
        self.grant(global_step)
        self.r.hset(self.keys.trainer, PROGRESS_AT_FIELD, time.time())  # the clock of `status`'s stall check
        self.roles.if_several(self.r.hset, self.keys.trainer, WORLD_SIZE_FIELD, self.roles.world_size)

    @retried("resume")
    def read_progress(self, global_step: int) -> tuple[int, int, set[str]]:
        """Every rank's part of the resume: the newest published version (at least `global_step`), the
        trainer's begun step and the sample ids already committed."""
        latest = latest_param_version(self.r, self.keys)
        replayed = int(self.r.hget(self.keys.trainer, REPLAYED_VERSIONS_FIELD) or 0)  # type: ignore[arg-type]
        newest = max(global_step, latest.version if latest is not None else 0, replayed)
        training_step = int(self.r.hget(self.keys.trainer, TRAINING_STEP_FIELD) or 0)  # type: ignore[arg-type]
        return newest, training_step, committed_sample_ids(self.r, self.keys)

    # -- reading rollouts (consumers/trainer/collect.py) ---------------------------------------------

    @retried("reading the trainer hash")
    def is_replay_copy(self) -> bool:
        """The run is a replay copy (its rollouts were copied by an admin, not published under leases)."""
        return bool(self.r.hexists(self.keys.trainer, REPLAY_COPY_FIELD))

    @retried("reading leases")
    def read_leases(self) -> dict[str, int]:
        """Producer -> prompts leased to it (rollstream/pacing/)."""
        return leases(self.r, self.keys)

    @retried("reading revoked")
    def is_revoked(self, watch: RevokedWatch, producer: str, seq: int) -> bool:
        """The trainer took `producer`'s prompt `seq` back (rollstream/pacing/expiry.py)."""
        return watch.is_revoked(self.r, producer, seq)

    @retried("reading dead letters")
    def read_dead_letters(self, start: str) -> list[tuple[str, Any]]:
        """The entries of `dead` from `start` on (a repeat reads again from the same start)."""
        return list(iter_stream(self.r, self.keys.dead, start=start))

    @retried("counting {what}")
    def consume(self, sample_ids: list[str], what: str) -> tuple[int, int]:
        """Count the samples' prompts as consumed, each once, topping the current version's budget up by
        the room they freed (rollstream/pacing/budget.py `consume`); (newly counted, added to the budget)."""
        return consume(self.r, self.keys, sample_ids, self.cfg.max_outstanding)

    @retried("acking duplicates")
    def ack_duplicates(self, reader: GroupReader, refs: list[EntryRef]) -> None:
        """XACK entries of `reader` not to be trained (their sample id is committed or another rank's)."""
        reader.ack(refs)

    # -- one global step ---------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Write this rank's heartbeat (the time now; a retry writes the same time)."""
        self._beat(time.time())

    @retried("heartbeat")
    def _beat(self, now: float) -> None:
        """One attempt of heartbeat."""
        self.r.hset(self.keys.trainer, mapping=dict.fromkeys(self.heartbeat_fields, now))

    @retried("training_step")
    def mark_training_step(self, global_step: int) -> None:
        """Record that step `global_step` has begun (before any of its events: the aggregator places
        nothing beyond it)."""
        self.r.hset(self.keys.trainer, TRAINING_STEP_FIELD, global_step)

    @retried("publishing local_update")
    def emit_local_update(self, update: StepMetrics) -> str:
        """Emit a `local_update` event; its entry id."""
        return self.publisher.publish(self.keys.metrics, update)

    @retried("publishing validation")
    def emit_validation(self, event: ValidateMetrics) -> None:
        """Emit a `validation` event (and log it)."""
        self.publisher.publish(self.keys.metrics, event)
        log.info("validation of version %d: %s", event.param_version, event.metrics)

    def publish_weights(
        self,
        version: int,
        module: nn.Module,
        whole: dict[str, Any] | None,
        only_if_missing: bool = False,
        probe: Probe | None = None,
    ) -> None:
        """Publish `module`'s weights, or (fsdp) `whole`, the weights gathered on rank 0, as `version` with
        the swap check's `probe` (skipped when `params` has it and only_if_missing; a retry after a
        connection loss always checks, as the first attempt may have landed)."""
        self._publish(version, module, whole, iter([only_if_missing]), probe)

    @retried("publishing version {version}")
    def _publish(
        self,
        version: int,
        module: nn.Module,
        whole: dict[str, Any] | None,
        checks: Iterator[bool],
        probe: Probe | None = None,
    ) -> None:
        """One attempt of publish_weights; `checks` says whether to look at `params` first (exhausted: a
        retry, which always looks)."""
        if next(checks, True):
            latest = latest_param_version(self.r, self.keys)
            if latest is not None and latest.version >= version:
                self.confirm_replicated(f"version {version}")
                return
        bus = self.cfg.bus
        where: dict[str, Any] = dict(
            inline_max_bytes=bus.weights_inline_max_bytes,
            file_dir=self.weights_dir,
            transport=bus.weights_transport,
            chunk_bytes=bus.weights_chunk_bytes,
            probe=probe,
        )
        if whole is not None:  # fsdp: the gathered copy (already a second copy: bytes are one more)
            publish_weights(self.r, self.keys, version, state_bytes(whole), global_step=version, **where)
        else:  # above the inline limit: streamed to a file or to Redis chunks, never one blob in memory
            publish_module_weights(self.r, self.keys, version, module, global_step=version, **where)
        self.confirm_replicated(f"version {version}")

    def confirm_replicated(self, what: str) -> None:
        """With replicas (WAIT configured): a barrier, this rank's heartbeat written and WAITed for, so the
        replicas hold everything the primary applied before it (the replication stream is one ordered log:
        an acknowledged offset covers every earlier write, from any connection). Too few acknowledgements
        raise NotReplicatedError, and the calling effect is retried (its check sees what a failover lost)."""
        if acks_of(self.r.connection_pool)[0] <= 0:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.trainer, mapping=dict.fromkeys(self.heartbeat_fields, time.time()))
        execute_replicated(pipe, what)

    @retried("committing step {global_step}")
    def commit(self, ledgers: list[StepLedger], global_step: int) -> None:
        """Commit the steps' ledgers up to `global_step` in one MULTI, with any earlier commit Redis lacks
        (reconcile.reconcile_and_commit: a failover may have lost it)."""
        reconcile_and_commit(self.r, self.keys, self.history, ledgers)

    @retried("checking the commits")
    def reconcile(self, granted: int) -> list[int]:
        """Rank 0, at a step's start: commit again every kept commit Redis lacks (its committed_step behind
        the last step this trainer committed: a failover to a replica that had not received them), and grant
        version `granted` (the last one granted) again when Redis's budget is an older version's (the grant
        lost with them: the producers would wait for a budget, the trainer for their samples); the steps
        redone. One HMGET when nothing is lacking."""
        raw: Any = self.r.hmget(self.keys.trainer, COMMITTED_STEP_FIELD, BUDGET_VERSION_FIELD)
        done, budget = (count_or_none(v) for v in raw)
        redone = []
        if (done or 0) < self.history.last_step:
            redone = reconcile_and_commit(self.r, self.keys, self.history)
        if (budget if budget is not None else -1) < granted:
            log.warning("the budget of version %d is not on Redis (it has version %s's): a failover lost the "
                        "grant, granting it again", granted, budget)
            self.grant(granted)
        return redone

    @retried("counting step {global_step}")
    def count_consumed(self, ledger: StepLedger, global_step: int) -> None:
        """Count a step's samples as consumed without committing it (pacing needs it before the grant)."""
        count_consumed(self.r, self.keys, ledger)

    @retried("granting version {version}")
    def grant(self, version: int) -> None:
        """Grant `version` its dispatch budget (once), then drop weight blobs nobody uses."""
        if current_budget(self.r, self.keys)[0] != version:
            cap = self.cfg.data.train_batch_size if self.over_budget else None  # unread data over the budget
            budget, out = grant_budget(self.r, self.keys, version, self.cfg.max_outstanding, cap)
            log.info("version %d: budget %d (outstanding %d)", version, budget, out)
        self.confirm_replicated(f"budget of version {version}")  # a budget a failover lost is granted again
        gc_weights(self.r, self.keys, version, file_dir=self.weights_dir)

    @retried("retention")
    def run_janitor(self) -> None:
        """Retention: the janitor's run, when one is due (rank 0 with `bus.retention` only)."""
        if self.janitor is not None:
            self.janitor.maybe_run()
