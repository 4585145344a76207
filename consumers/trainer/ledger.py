"""What a global step consumed, and the one MULTI/EXEC that commits it to the log.

A `StepLedger` lists every sample a step consumed (its `Fate`: trained or dropped), the rollout entries to ack
(each an EntryRef: its producer's stream and its id) (including redelivered duplicates) and the step's
`step_end` event. Ledgers of the steps since the previous checkpoint are stored in the checkpoint, and
committed only once that file is durable:

  MULTI
    XADD fates <g>-<i> …   one entry per consumed sample (schemas.text_entries.Fate); an explicit id makes a
                           replay fail harmlessly
    XACK rollouts:<p> trainer …   per producer stream, the step's entries of that stream
    EVAL count …           every sample's prompt counted as consumed, once (pacing's per-producer bitmaps:
                           a replay, an earlier count_consumed or an early count of an eviction, a stale
                           drop or a dead letter adds nothing)
    HINCRBY trainer dropped_stale …   only for steps not already counted (producers report it in
                           rollout_status)
    HSET trainer global_step param_version committed_step consumed_step heartbeat progress_at
    XADD metrics step_end  (so step_end is emitted exactly once)
  EXEC

Reconciliation (`reconcile_and_commit`): rank 0 keeps the ledgers of its recent commits (`CommitHistory`, also
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
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from redis.client import Pipeline

from rollstream.bus import EntryRef, group_refs, iter_stream
from rollstream.bus.replication import execute_and_wait, held_transaction, require_acks
from rollstream.keys import (
    COMMITTED_STEP_FIELD,
    CONSUMED_STEP_FIELD,
    DROPPED_STALE_FIELD,
    GLOBAL_STEP_FIELD,
    HEARTBEAT_FIELD,
    PARAM_VERSION_FIELD,
    PROGRESS_AT_FIELD,
    TRAINER_GROUP,
    Keys,
)
from rollstream.pacing.budget import queue_count_consumed
from schemas import DROPPED, Fate, StepMetrics, decode_fate, encode, encode_fate

log = logging.getLogger(__name__)


@dataclass
class StepLedger:
    """Everything one global step consumed and must commit."""

    global_step: int
    fates: list[Fate] = field(default_factory=list)
    ack_ids: list[EntryRef] = field(default_factory=list)  # (rollouts:<p> stream, entry id) each
    step_end: StepMetrics | None = None
    # (`metrics` entry id, event) of each local_update of the step, every rank's, as emitted live; emitted
    # again only by a reconciliation that finds it missing (a failover lost it with the step's commit)
    updates: list[tuple[str, StepMetrics]] = field(default_factory=list)

    @property
    def sample_ids(self) -> list[str]:
        """The sample id of every prompt this step consumed (counted once each by pacing)."""
        return [f.sample_id for f in self.fates]

    @property
    def dropped(self) -> int:
        """Prompts this step dropped as stale."""
        return sum(1 for f in self.fates if f.fate == DROPPED)

    def to_plain(self) -> dict[str, Any]:
        """A msgpack-able dict (for the checkpoint metadata; its layout is versioned in checkpoint.py)."""
        return {
            "global_step": self.global_step,
            "fates": [asdict(f) for f in self.fates],
            "ack_ids": [list(ref) for ref in self.ack_ids],
            "step_end": self.step_end.model_dump() if self.step_end is not None else None,
            "updates": [[entry_id, u.model_dump()] for entry_id, u in self.updates],
        }

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> StepLedger:
        """Inverse of to_plain."""
        end = d.get("step_end")
        return cls(
            global_step=int(d["global_step"]),
            fates=[Fate(**f) for f in d["fates"]],
            ack_ids=[_entry_ref(ref) for ref in d["ack_ids"]],
            step_end=StepMetrics.model_validate(end) if end is not None else None,
            updates=[(str(i), StepMetrics.model_validate(u)) for i, u in d.get("updates", [])],
        )  # an older checkpoint's `settled` flag is ignored: consumption is counted per prompt now


def _entry_ref(ref: Any) -> EntryRef:
    """An ack ref of the plain form: a [stream, entry id] pair (a bare id names no stream: ValueError)."""
    if isinstance(ref, str | bytes) or len(ref) != 2:
        raise ValueError(f"ack ref {ref!r} is not a [stream, entry id] pair")
    return (str(ref[0]), str(ref[1]))


def _int_field(r: redis.Redis | Pipeline, keys: Keys, name: str) -> int:
    raw: Any = r.hget(keys.trainer, name)
    return int(raw) if raw is not None else 0


def committed_step(r: redis.Redis, keys: Keys) -> int:
    """The last global step whose commit executed (0 before any)."""
    return _int_field(r, keys, COMMITTED_STEP_FIELD)


def count_consumed(r: redis.Redis, keys: Keys, ledger: StepLedger) -> None:
    """Count a finished but not yet checkpointed step's prompts as consumed now (pacing needs it before the
    next grant), each once (pacing's bitmaps), in one MULTI; its stale drops are added to the trainer hash's
    dropped_stale once, guarded by consumed_step."""
    counted = _int_field(r, keys, CONSUMED_STEP_FIELD)
    pipe = r.pipeline(transaction=True)
    queue_count_consumed(pipe, keys, ledger.sample_ids)
    if ledger.global_step > counted:
        pipe.hincrby(keys.trainer, DROPPED_STALE_FIELD, ledger.dropped)
        pipe.hset(
            keys.trainer, mapping={CONSUMED_STEP_FIELD: ledger.global_step, PROGRESS_AT_FIELD: time.time()}
        )
    pipe.execute()


def commit_steps(r: redis.Redis, keys: Keys, ledgers: list[StepLedger], param_version: int) -> None:
    """Commit checkpointed steps in one MULTI/EXEC (see the module docstring). A replay after a crash is
    harmless: fates ids already present are refused by Redis, the other commands still run, each prompt is
    counted as consumed once, and step_end / dropped_stale are written only for steps past the trainer
    hash's committed_step / consumed_step."""
    if not ledgers:
        return
    counted = _int_field(r, keys, CONSUMED_STEP_FIELD)
    done = committed_step(r, keys)  # steps whose step_end is already on the log
    pipe = r.pipeline(transaction=True)
    _execute_commit(r, pipe, keys, ledgers, param_version, done, counted)


def _execute_commit(
    r: redis.Redis,
    pipe: Pipeline,
    keys: Keys,
    ledgers: list[StepLedger],
    param_version: int,
    done: int,
    counted: int,
    updates: list[StepMetrics] | None = None,
) -> None:
    """Queue the commit of `ledgers` on `pipe` (in transaction mode), execute it and WAIT: `done` and
    `counted` are the trainer hash's committed_step and consumed_step as read before it; `updates`: local
    updates to emit again before the step_ends (a reconciliation's)."""
    last = max(lg.global_step for lg in ledgers)
    n_fates = 0
    for lg in ledgers:
        for i, f in enumerate(lg.fates, start=1):
            pipe.xadd(keys.fates, encode_fate(f), id=f"{lg.global_step}-{i}")  # type: ignore[arg-type]
            n_fates += 1
    for stream, ids in group_refs(ref for lg in ledgers for ref in lg.ack_ids).items():
        pipe.xack(stream, TRAINER_GROUP, *ids)
    queue_count_consumed(pipe, keys, [sid for lg in ledgers for sid in lg.sample_ids])
    pipe.hincrby(
        keys.trainer, DROPPED_STALE_FIELD, sum(lg.dropped for lg in ledgers if lg.global_step > counted)
    )
    pipe.hset(
        keys.trainer,
        mapping={
            GLOBAL_STEP_FIELD: last,
            PARAM_VERSION_FIELD: param_version,
            COMMITTED_STEP_FIELD: max(last, done),
            CONSUMED_STEP_FIELD: max(last, counted),
            HEARTBEAT_FIELD: time.time(),
            PROGRESS_AT_FIELD: time.time(),
        },
    )
    for update in updates or []:
        pipe.xadd(keys.metrics, encode(update))  # type: ignore[arg-type]
    for lg in ledgers:
        if lg.step_end is not None and lg.global_step > done:
            pipe.xadd(keys.metrics, encode(lg.step_end))  # type: ignore[arg-type]
    results, acked = execute_and_wait(pipe, raise_on_error=False)
    _raise_commit_errors(results, n_fates)
    # too few replicas acknowledged: NotReplicatedError (a ConnectionError), the effect's retry replays the
    # commit (idempotent, above) until a WAIT confirms it
    require_acks(r.connection_pool, acked, f"commit of step {last}")


def _raise_commit_errors(results: list[Any], n_fates: int) -> None:
    """Raise the commit's first error, except a fates entry already present (its first `n_fates` replies):
    that is a replay of a commit that landed, logged and let through."""
    for res in results[:n_fates]:
        if isinstance(res, Exception):
            if "equal or smaller" not in str(res):
                raise res
            log.warning("commit replay: fates entry already present (%s)", res)
    for res in results[n_fates:]:
        if isinstance(res, Exception):
            raise res


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
                done = _int_field(pipe, keys, COMMITTED_STEP_FIELD)
                counted = _int_field(pipe, keys, CONSUMED_STEP_FIELD)
                redo = history.ledgers_after(done) if done < history.last_step else []
                if redo or ledgers:
                    _report_lost(history, done, redo)
                    lost = _missing_updates(r, keys, redo)
                    pipe.multi()
                    todo = redo + ledgers
                    last = max(lg.global_step for lg in todo)
                    _execute_commit(r, pipe, keys, todo, last, done, counted, lost)
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


def committed_sample_ids(r: redis.Redis, keys: Keys, page: int = 1000) -> set[str]:
    """Every sample_id recorded in `fates` (trained or dropped in a committed step)."""
    return {decode_fate(fields).sample_id for _, fields in iter_stream(r, keys.fates, page=page)}


def merge_ledgers(global_step: int, ledgers: list[StepLedger]) -> StepLedger:
    """One step's ledger from every data-parallel rank's own (in rank order): all their fates, acks and local
    updates, which rank 0 checkpoints and commits for every rank in its one MULTI."""
    out = StepLedger(global_step)
    for lg in ledgers:
        out.fates += lg.fates
        out.ack_ids += lg.ack_ids
        out.updates += lg.updates
    return out
