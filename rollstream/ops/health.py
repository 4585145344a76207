"""What `rollstream status` judges a run by: worker heartbeats, training progress, rates and group lag.

- Heartbeats: a worker that writes one (the trainer: `heartbeat` in the trainer hash, on every poll, local
  update and commit; each data-parallel rank its `heartbeat:r<k>`) is `ok` while it is at most
  `stall_after_s` old, `stalled` beyond, `missing` when it never wrote one, `finished` once the trainer
  reached its last global step.
- Progress: a beating heart is not progress (a trainer waiting forever for samples beats on). The trainer
  writes `progress_at` when it (re)starts and whenever a global step completes; the `global steps` line is
  `stalled` when that is older than `stall_after_s` while the run is neither finished nor stopping
  (supervisord stopping the trainer), `stopping` while it is, `stopped` for a stopped run that never
  finished.
- Rates: trained samples per second from the committed steps (`step_end` events: their `created_at` and
  `sample_count`) over the wall clock up to now, so a stall shows as a falling rate and then 0; never from
  entry ids.
- Pacing: the counters behind the leases (rollstream/pacing/) move only through the trainer's pacing
  scripts, which keep outstanding (leased - consumed) within [0, max_outstanding] and a version's budget
  within max_outstanding. No producer may write them (ACL); the `pacing` line is `broken` when they are
  outside those bounds by more than max_outstanding's slack (a bug, or an admin's hand).
- Lag: entries of a stream after a group's last-delivered id, counted (up to LAG_COUNT_CAP), not redis'
  own `lag` (whose entries-read counter is wrong after a restart).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from rollstream.bus import parse_id, text
from rollstream.bus.ids import count_or_none
from rollstream.keys import (
    COMMITTED_STEP_FIELD,
    GLOBAL_STEP_FIELD,
    HEARTBEAT_FIELD,
    PROGRESS_AT_FIELD,
    WORLD_SIZE_FIELD,
    Keys,
    rank_heartbeat_field,
)
from schemas import DecodeError, StepMetrics, decode

#: Seconds of committed steps behind the trained samples/s figure (at least one step before it is used).
RATE_WINDOW_S = 60.0
#: Newest metrics entries searched for step_end events.
RECENT_METRICS = 2000
#: Most entries counted for a group's lag (beyond it status shows ">= cap").
LAG_COUNT_CAP = 10_000
#: supervisord states of the trainer program in which no progress is expected.
STOPPING_STATES = ("STOPPING", "STOPPED", "EXITED", "FATAL")


@dataclass
class WorkerHealth:
    """One health line: a heartbeat-writing worker (or the run's global steps), its state and age."""

    name: str
    state: str  # ok, stalled, missing, finished, stopping, stopped
    age_s: float | None  # seconds since the last heartbeat / completed step (None when there is none)
    limit_s: float
    why: str = ""  # for an unhealthy line: what is wrong, in words

    @property
    def healthy(self) -> bool:
        """True when a monitor need not alert (ok, finished or stopping)."""
        return self.state in ("ok", "finished", "stopping")


def _finished(trainer: dict[str, str], total_steps: int | None) -> bool:
    step = trainer.get(COMMITTED_STEP_FIELD) or trainer.get(GLOBAL_STEP_FIELD) or ""
    return total_steps is not None and (n := count_or_none(step)) is not None and n >= total_steps


def worker_health(
    trainer: dict[str, str], stall_after_s: float, total_steps: int | None = None, now: float | None = None
) -> list[WorkerHealth]:
    """Heartbeat health of the trainer, or of each rank of a data-parallel trainer (module docstring)."""
    now = time.time() if now is None else now
    world = trainer.get(WORLD_SIZE_FIELD, "1")
    ranks = min(count_or_none(world) or 1, 4096)  # the trainer's own field, still read as input
    fields = (
        [("trainer", HEARTBEAT_FIELD)]
        if ranks <= 1
        else [(f"trainer-r{k}", rank_heartbeat_field(k)) for k in range(ranks)]
    )
    finished = _finished(trainer, total_steps)
    out = []
    for name, beat_field in fields:
        try:
            beat = float(trainer[beat_field])
        except (KeyError, ValueError):
            out.append(WorkerHealth(name, "missing", None, stall_after_s, "no heartbeat was ever written"))
            continue
        age = max(0.0, now - beat)
        state = "finished" if finished else "ok" if age <= stall_after_s else "stalled"
        why = (
            f"heartbeat {age:.0f}s old, over trainer.heartbeat_stall_s={stall_after_s:g}"
            if state == "stalled"
            else ""
        )
        out.append(WorkerHealth(name, state, age, stall_after_s, why))
    return out


def progress_health(
    trainer: dict[str, str],
    stall_after_s: float,
    total_steps: int | None = None,
    stopping: bool = False,
    stopped: bool = False,
    last_step_at: float | None = None,
    now: float | None = None,
) -> WorkerHealth:
    """The `global steps` line: stalled when no global step completed (nor the trainer started) within
    stall_after_s while the run is not finished, stopping or stopped. `last_step_at` (the newest step_end's
    time) stands in for a trainer that writes no progress_at."""
    now = time.time() if now is None else now
    try:
        at: float | None = float(trainer[PROGRESS_AT_FIELD])
    except (KeyError, ValueError):
        at = last_step_at
    age = None if at is None else max(0.0, now - at)
    step = trainer.get(GLOBAL_STEP_FIELD, "-")
    if _finished(trainer, total_steps):
        return WorkerHealth("global steps", "finished", age, stall_after_s)
    if stopped:
        return WorkerHealth(
            "global steps",
            "stopped",
            age,
            stall_after_s,
            f"the run is stopped at global step {step}, before trainer.total_training_steps={total_steps}",
        )
    if stopping:
        return WorkerHealth("global steps", "stopping", age, stall_after_s)
    if age is None or age <= stall_after_s:
        return WorkerHealth("global steps", "ok", age, stall_after_s)
    return WorkerHealth(
        "global steps",
        "stalled",
        age,
        stall_after_s,
        f"no global step completed in {age:.0f}s (last: {step}), over trainer.heartbeat_stall_s="
        f"{stall_after_s:g}",
    )


def pacing_health(outstanding: int, budget_left: int, max_outstanding: int) -> WorkerHealth:
    """The `pacing` line: `broken` when outstanding prompts or the current budget are outside what the
    trainer's pacing scripts allow (module docstring); the slack is max_outstanding itself, so only a moved
    counter trips it."""
    why = ""
    if not -max_outstanding <= outstanding <= max_outstanding:
        why = f"outstanding={outstanding} is outside [0, max_outstanding={max_outstanding}]"
    elif budget_left > max_outstanding:
        why = f"the current budget {budget_left} is over max_outstanding={max_outstanding}"
    if why:
        return WorkerHealth(
            "pacing", "broken", None, 0.0, why + ": a pacing counter was moved outside the scripts"
        )
    return WorkerHealth("pacing", "ok", None, 0.0)


def trainer_stopping(processes: list[dict[str, Any]] | None) -> bool:
    """True when supervisord reports the trainer program stopping, stopped or exited."""
    return any(p["name"] == "trainer" and p["statename"] in STOPPING_STATES for p in processes or [])


def step_ends(r: redis.Redis, keys: Keys, count: int = RECENT_METRICS) -> list[StepMetrics]:
    """The step_end events among the newest `count` metrics entries, newest first."""
    rows: Any = r.xrevrange(keys.metrics, count=count)
    out = []
    for _, fields in rows:
        if fields.get(b"type") != b"step_end":
            continue
        try:
            ev = decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, StepMetrics):
            out.append(ev)
    return out


def trained_rate(ends: list[StepMetrics], now: float, window_s: float = RATE_WINDOW_S) -> tuple[float, float]:
    """(trained samples/s, global steps/min) over the wall clock from the anchor step to now: the anchor is
    the newest step completed before now − window_s (else the oldest known); the steps after it count."""
    if not ends:
        return 0.0, 0.0
    ordered = sorted(ends, key=lambda e: e.created_at)
    before = [e for e in ordered if e.created_at <= now - window_s]
    anchor = before[-1] if before else ordered[0]
    after = [e for e in ordered if e.created_at > anchor.created_at]
    span = max(now - anchor.created_at, 1e-9)
    return sum(e.sample_count for e in after) / span, 60.0 * len(after) / span


def group_lag(r: redis.Redis, key: str, last_delivered: str, cap: int = LAG_COUNT_CAP) -> int:
    """Entries of `key` after `last_delivered` (at most cap): what the group has not been given yet."""
    newest: Any = r.xrevrange(key, count=1)
    if not newest or parse_id(text(newest[0][0])) <= parse_id(last_delivered):
        return 0
    rows: Any = r.xrange(key, min=f"({last_delivered}", max="+", count=cap)
    return len(rows)
