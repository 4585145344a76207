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

Reconciliation after a failover: consumers/trainer/reconcile.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from redis.client import Pipeline

from rollstream.bus import EntryRef, group_refs, iter_stream
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
from rollstream.topology.replication import execute_and_wait, require_acks
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


def trainer_field(r: redis.Redis | Pipeline, keys: Keys, name: str) -> int:
    """An integer field of the trainer hash (0 when absent)."""
    raw: Any = r.hget(keys.trainer, name)
    return int(raw) if raw is not None else 0


def committed_step(r: redis.Redis, keys: Keys) -> int:
    """The last global step whose commit executed (0 before any)."""
    return trainer_field(r, keys, COMMITTED_STEP_FIELD)


def count_consumed(r: redis.Redis, keys: Keys, ledger: StepLedger) -> None:
    """Count a finished but not yet checkpointed step's prompts as consumed now (pacing needs it before the
    next grant), each once (pacing's bitmaps), in one MULTI; its stale drops are added to the trainer hash's
    dropped_stale once, guarded by consumed_step."""
    counted = trainer_field(r, keys, CONSUMED_STEP_FIELD)
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
    counted = trainer_field(r, keys, CONSUMED_STEP_FIELD)
    done = committed_step(r, keys)  # steps whose step_end is already on the log
    pipe = r.pipeline(transaction=True)
    execute_commit(r, pipe, keys, ledgers, param_version, done, counted)


def execute_commit(
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
