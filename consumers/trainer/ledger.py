"""What a global step consumed, and the one MULTI/EXEC that commits it to the log.

A `StepLedger` lists every sample a step consumed (its `Fate`: trained or dropped), the rollout entries to ack
(each an EntryRef: its producer's stream and its id) (including redelivered duplicates) and the step's
`step_end` event. Ledgers of the steps since the previous checkpoint are stored in the checkpoint, and
committed only once that file is durable:

  MULTI
    XADD fates <g>-<i> …   one entry per consumed sample (schemas.text_entries.Fate); an explicit id makes a
                           replay fail harmlessly
    XACK rollouts:<p> trainer …   per producer stream, the step's entries of that stream
    INCRBY consumed …      only for steps not already counted (see count_consumed), and
    HINCRBY trainer dropped_stale …   alike (producers report it in rollout_status)
    HINCRBY trainer evicted_early -e  the step's evictions, counted as consumed when they happened
                           (pacing's EVICT), are settled; a step counted before (retrained after a
                           restart) takes its re-counted evictions back off `consumed` instead
    HSET trainer global_step param_version committed_step consumed_step heartbeat progress_at
    XADD metrics step_end  (so step_end is emitted exactly once)
  EXEC
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from rollstream.bus import EntryRef, group_refs, iter_stream
from rollstream.names import (
    COMMITTED_STEP_FIELD,
    CONSUMED_STEP_FIELD,
    DROPPED_STALE_FIELD,
    EVICTED_EARLY_FIELD,
    GLOBAL_STEP_FIELD,
    HEARTBEAT_FIELD,
    PARAM_VERSION_FIELD,
    PROGRESS_AT_FIELD,
    TRAINER_GROUP,
    Keys,
)
from rollstream.pacing import record_consumed
from schemas import DROPPED, EVICTED, Fate, StepMetrics, decode_fate, encode, encode_fate

log = logging.getLogger(__name__)


@dataclass
class StepLedger:
    """Everything one global step consumed and must commit."""

    global_step: int
    fates: list[Fate] = field(default_factory=list)
    ack_ids: list[EntryRef] = field(default_factory=list)  # (rollouts:<p> stream, entry id) each
    step_end: StepMetrics | None = None
    settled: bool = False  # its evictions' early count settled (count_consumed or the commit ran)

    @property
    def consumed(self) -> int:
        """Prompts this step consumed for pacing and not counted when it happened: trained or dropped
        (evictions are counted at once, rollstream.pacing.consume_evicted)."""
        return len(self.fates) - self.evicted

    @property
    def evicted(self) -> int:
        """Prompts this step evicted (filter_groups), already counted as consumed by pacing."""
        return sum(1 for f in self.fates if f.fate == EVICTED)

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
            "settled": self.settled,
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
            settled=bool(d.get("settled", False)),
        )


def _entry_ref(ref: Any) -> EntryRef:
    """An ack ref of the plain form: a [stream, entry id] pair (a bare id names no stream: ValueError)."""
    if isinstance(ref, str | bytes) or len(ref) != 2:
        raise ValueError(f"ack ref {ref!r} is not a [stream, entry id] pair")
    return (str(ref[0]), str(ref[1]))


def _int_field(r: redis.Redis, keys: Keys, name: str) -> int:
    raw: Any = r.hget(keys.trainer, name)
    return int(raw) if raw is not None else 0


def committed_step(r: redis.Redis, keys: Keys) -> int:
    """The last global step whose commit executed (0 before any)."""
    return _int_field(r, keys, COMMITTED_STEP_FIELD)


def count_consumed(r: redis.Redis, keys: Keys, ledger: StepLedger) -> None:
    """Count a finished but not yet checkpointed step toward `consumed` now (pacing needs it before the
    next grant), once: guarded by the trainer hash's consumed_step, in one MULTI. Its evictions are settled
    here either way (settle_evicted)."""
    counted = _int_field(r, keys, CONSUMED_STEP_FIELD)
    pipe = r.pipeline(transaction=True)
    if ledger.global_step > counted:
        record_consumed(pipe, keys, ledger.consumed)
        pipe.hincrby(keys.trainer, DROPPED_STALE_FIELD, ledger.dropped)
        pipe.hset(
            keys.trainer, mapping={CONSUMED_STEP_FIELD: ledger.global_step, PROGRESS_AT_FIELD: time.time()}
        )
    settle_evicted(pipe, keys, ledger, counted)
    pipe.execute()
    ledger.settled = True


def settle_evicted(pipe: Any, keys: Keys, ledger: StepLedger, counted: int) -> None:
    """Queue on `pipe`, once per ledger (its `settled` flag): its evictions leave `evicted_early` (they were
    counted as consumed when they happened); for a step whose consumed count was already taken (<= `counted`:
    retrained after a restart) they also leave `consumed`, counted twice otherwise."""
    if ledger.settled or not ledger.evicted:
        return
    pipe.hincrby(keys.trainer, EVICTED_EARLY_FIELD, -ledger.evicted)
    if ledger.global_step <= counted:
        pipe.decrby(keys.consumed, ledger.evicted)


def commit_steps(r: redis.Redis, keys: Keys, ledgers: list[StepLedger], param_version: int) -> None:
    """Commit checkpointed steps in one MULTI/EXEC (see the module docstring). A replay after a crash is
    harmless: fates ids already present are refused by Redis, the other commands still run, and step_end
    / consumed are written only for steps past the trainer hash's committed_step / consumed_step."""
    if not ledgers:
        return
    last = max(lg.global_step for lg in ledgers)
    counted = _int_field(r, keys, CONSUMED_STEP_FIELD)
    done = committed_step(r, keys)  # steps whose step_end is already on the log
    pipe = r.pipeline(transaction=True)
    n_fates = 0
    for lg in ledgers:
        for i, f in enumerate(lg.fates, start=1):
            pipe.xadd(keys.fates, encode_fate(f), id=f"{lg.global_step}-{i}")  # type: ignore[arg-type]
            n_fates += 1
    for stream, ids in group_refs(ref for lg in ledgers for ref in lg.ack_ids).items():
        pipe.xack(stream, TRAINER_GROUP, *ids)
    record_consumed(pipe, keys, sum(lg.consumed for lg in ledgers if lg.global_step > counted))
    pipe.hincrby(
        keys.trainer, DROPPED_STALE_FIELD, sum(lg.dropped for lg in ledgers if lg.global_step > counted)
    )
    for lg in ledgers:
        settle_evicted(pipe, keys, lg, counted)
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
    for lg in ledgers:
        if lg.step_end is not None and lg.global_step > done:
            pipe.xadd(keys.metrics, encode(lg.step_end))  # type: ignore[arg-type]
    _raise_commit_errors(pipe.execute(raise_on_error=False), n_fates)
    for lg in ledgers:
        lg.settled = True


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
    """One step's ledger from every data-parallel rank's own (in rank order): all their fates and acks,
    which rank 0 checkpoints and commits for every rank in its one MULTI."""
    out = StepLedger(global_step)
    for lg in ledgers:
        out.fates += lg.fates
        out.ack_ids += lg.ack_ids
    return out
