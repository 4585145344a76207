"""The trainer's reconciliation after a Redis failover: its recent commits, kept and committed again.

Rank 0 keeps the ledgers of its recent commits (`CommitHistory`, also
in each checkpoint). With `run.redis.wait_replicas` below the number of replicas, a commit WAIT-acknowledged
by one replica is lost when Sentinel promotes another that had not received it: the new primary's
committed_step is an older commit's, the lost steps' samples are pending again (and acked as duplicates by a
collector that remembers their ids). So before every commit, at each step's start and on resume, the trainer
hash is read (under WATCH, on the connection that then commits) and the kept ledgers of every step past its
committed_step are committed again in the same MULTI, before any later step's: fates by explicit id, acks,
consumed counts once, step_end only past committed_step, and the steps' local_update events that are not on
`metrics` any more (a ledger keeps each one's entry id), so the log ends as if nothing was lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from consumers.trainer.ledger import StepLedger, execute_commit, trainer_field
from rollstream.keys import COMMITTED_STEP_FIELD, CONSUMED_STEP_FIELD, Keys
from rollstream.topology.replication import held_transaction
from schemas import StepMetrics

log = logging.getLogger(__name__)


#: How long the ledgers of a commit are kept after it (CommitHistory), to commit them again if a failover
#: loses it. A failover loses what the promoted replica had not received; Sentinel promotes only a replica
#: whose link to the primary was up within about 10 x down-after-milliseconds (its replica validity rule,
#: 50 s with the default down_after_ms 5000), and the one with the highest offset it saw (INFO every second
#: during a failover), so in practice it lags by under a second. 120 s covers the rule with a margin.
RETAIN_COMMITS_S = 120.0
#: Most steps kept (unless MIN_RETAINED_COMMITS hold more): where Redis can fail over the history goes into
#: every checkpoint, which a fast run writes every step (trainer.save_freq 1, ~40 ms steps on the tiny CPU
#: model): 64 steps are ~2.5 s of such a run, past a replica's usual lag, and cost ~2 ms and ~0.6 MB a
#: checkpoint at 32 samples a step (each commit's plain form is made once and cached, then only encoded);
#: a run with steps of seconds keeps minutes of them.
MAX_RETAINED_STEPS = 64
#: Fewest commits kept, whatever their age and size: the last commit, and the one before it (a slow run's
#: commits are minutes apart; the last is the one a failover most likely lost).
MIN_RETAINED_COMMITS = 2


@dataclass
class Commit:
    """One commit of the trainer: when (time.time()) and the ledgers of the steps it committed."""

    at: float
    ledgers: list[StepLedger]
    plain: list[dict[str, Any]] | None = field(default=None, repr=False, compare=False)  # cached to_plain

    def to_plain(self) -> dict[str, Any]:
        """The commit as a msgpack-able dict {at, steps} (its ledgers' plain form, made once)."""
        if self.plain is None:
            self.plain = [lg.to_plain() for lg in self.ledgers]
        return {"at": self.at, "steps": self.plain}


class CommitHistory:
    """The ledgers of rank 0's recent commits, oldest first, kept so a commit that a failover lost (the
    promoted replica had not received it) is committed again (`reconcile_and_commit`); in each checkpoint."""

    def __init__(self, commits: list[Commit] | None = None) -> None:
        """Start from `commits` (a checkpoint's), oldest first."""
        self.commits: list[Commit] = list(commits or [])

    @property
    def last_step(self) -> int:
        """The last global step committed (0 before any)."""
        return max((lg.global_step for c in self.commits for lg in c.ledgers), default=0)

    @property
    def first_step(self) -> int | None:
        """The oldest global step whose ledger is kept (None when none is)."""
        return min((lg.global_step for c in self.commits for lg in c.ledgers), default=None)

    def ledgers_after(self, step: int) -> list[StepLedger]:
        """The kept ledgers of the steps after `step`, in step order."""
        found = [lg for c in self.commits for lg in c.ledgers if lg.global_step > step]
        return sorted(found, key=lambda lg: lg.global_step)

    def add(self, ledgers: list[StepLedger], at: float | None = None) -> None:
        """Record a commit of `ledgers` (at `at`, default now), then drop the oldest commits past the bounds
        (RETAIN_COMMITS_S, MAX_RETAINED_STEPS; never fewer than MIN_RETAINED_COMMITS)."""
        if not ledgers:
            return
        now = time.time() if at is None else at
        self.commits.append(Commit(now, list(ledgers)))
        while len(self.commits) > MIN_RETAINED_COMMITS and (
            self.commits[0].at < now - RETAIN_COMMITS_S
            or sum(len(c.ledgers) for c in self.commits) > MAX_RETAINED_STEPS
        ):
            self.commits.pop(0)

    def to_plain(self) -> list[dict[str, Any]]:
        """A msgpack-able list (a checkpoint's `committed`; its layout is versioned in checkpoint.py)."""
        return [c.to_plain() for c in self.commits]

    @classmethod
    def from_plain(cls, commits: list[dict[str, Any]]) -> CommitHistory:
        """Inverse of to_plain."""
        return cls([
            Commit(float(c["at"]), [StepLedger.from_plain(d) for d in c["steps"]], list(c["steps"]))
            for c in commits
        ])


def reconcile_and_commit(
    r: redis.Redis, keys: Keys, history: CommitHistory, ledgers: list[StepLedger] | None = None
) -> list[int]:
    """Commit `ledgers` (none: only reconcile) in one MULTI/EXEC together with the kept ledgers of every
    step `history` committed that Redis lacks (its committed_step behind history's last step: a failover to a
    replica that had not received those commits, or a crash between a checkpoint and its commit), then add
    `ledgers` to `history`. Returns the steps committed again. The trainer hash is read under WATCH on the
    connection that executes and WAITs (held_transaction), so a failover in between aborts the EXEC and it is
    all read again: a lost step's fates (ids `<g>-<i>`) must reach the log before any later step's. Steps
    Redis lacks that history no longer keeps are logged as an error: their samples, acked, have no fate."""
    ledgers = list(ledgers or [])
    while True:
        try:
            with held_transaction(r) as pipe:
                pipe.watch(keys.trainer)
                done = trainer_field(pipe, keys, COMMITTED_STEP_FIELD)
                counted = trainer_field(pipe, keys, CONSUMED_STEP_FIELD)
                redo = history.ledgers_after(done) if done < history.last_step else []
                if redo or ledgers:
                    _report_lost(history, done, redo)
                    lost = _missing_updates(r, keys, redo)
                    pipe.multi()
                    todo = redo + ledgers
                    last = max(lg.global_step for lg in todo)
                    execute_commit(r, pipe, keys, todo, last, done, counted, lost)
            break
        except redis.WatchError:
            log.info("trainer hash changed (or the connection was lost) before the commit: reading it again")
    history.add(ledgers)
    return [lg.global_step for lg in redo]


def _missing_updates(r: redis.Redis, keys: Keys, ledgers: list[StepLedger]) -> list[StepMetrics]:
    """The local updates of `ledgers` whose entry is not on `metrics` (lost with their step's commit), to
    emit again: without them the aggregator could never complete those steps. One pipelined XRANGE each."""
    wanted = [(entry_id, u) for lg in ledgers for entry_id, u in lg.updates]
    if not wanted:
        return []
    pipe = r.pipeline(transaction=False)
    for entry_id, _ in wanted:
        pipe.xrange(keys.metrics, min=entry_id, max=entry_id)
    found = pipe.execute()
    lost = [u for (_, u), rows in zip(wanted, found, strict=True) if not rows]
    if lost:
        log.warning("emitting again %d local updates the failover lost (steps %s)", len(lost),
                    sorted({u.global_step for u in lost}))
    return lost


def _report_lost(history: CommitHistory, done: int, redo: list[StepLedger]) -> None:
    """Log the steps Redis lacks: a warning naming those committed again, an error naming those no longer
    kept (Redis behind further than `history` reaches)."""
    if done >= history.last_step:
        return
    first = history.first_step
    if first is None or first > done + 1:
        upto = history.last_step if first is None else first - 1
        log.error(
            "Redis's committed_step is %d but this trainer committed up to step %d: the commits of steps "
            "%d-%d are lost (a failover to a replica that had not received them?) and no longer kept here "
            "(CommitHistory keeps %d s / %d steps): their samples' fates, consumed counts and step_end "
            "cannot be restored, the audit will show those samples acked without a fate",
            done, history.last_step, done + 1, upto, int(RETAIN_COMMITS_S), MAX_RETAINED_STEPS,
        )
    if redo:
        log.warning(
            "Redis's committed_step is %d but this trainer committed (or checkpointed) up to step %d: "
            "committing steps %s again (a failover to a replica that had not received them, or a crash "
            "before the commit)",
            done, history.last_step, [lg.global_step for lg in redo],
        )
