"""What the aggregator may fold: no trainer event ahead of the trainer's own progress, no value outside its
domain (non-finite metrics; producer stats of a producer the run does not have, or out of range).

Only the trainer writes `metrics` (ACL), but without ACLs (an external Redis, `run.acl=false`) anyone
with the run's credentials could append a step_end for a step far ahead, which would complete a record
with forged values and block every real one before it. So an event is placed only when the trainer hash
vouches for it: a `step_end` of step g needs `committed_step >= g` (the trainer writes both in one
MULTI/EXEC); a `local_update` of g or a validation of version g needs `training_step >= g` (set before
the trainer emits anything of step g). The hash is re-read only when an event claims more than was
last seen, so the check costs nothing in steady state.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import redis

from rollstream.bus import retry_on_connection
from rollstream.keys import COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD, Keys
from schemas import ProducerStats, StepMetrics, ValidateMetrics


class TrainerProgress:
    """The trainer's committed and begun steps, as its hash says (cached; re-read when exceeded)."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        """Nothing is read until an event needs it."""
        self.r: Any = r
        self.keys = keys
        self.committed = 0
        self.training = 0

    def refresh(self) -> None:
        """Re-read both fields from the trainer hash (missing = 0)."""
        committed, training = retry_on_connection(
            lambda: self.r.hmget(self.keys.trainer, COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD),
            "reading trainer progress",
        )
        self.committed = int(committed or 0)
        self.training = max(int(training or 0), self.committed)

    def _check(self, value: int, bound: str) -> int:
        current = self.committed if bound == COMMITTED_STEP_FIELD else self.training
        if value > current:
            self.refresh()
            current = self.committed if bound == COMMITTED_STEP_FIELD else self.training
        return current

    def reason(self, ev: StepMetrics | ValidateMetrics) -> str | None:
        """Why `ev` cannot be placed (a dead-letter reason naming the field and value), or None."""
        if isinstance(ev, ValidateMetrics):
            v = ev.param_version
            if v < 0:
                return f"validation param_version={v} is negative"
            if v > (t := self._check(v, TRAINING_STEP_FIELD)):
                return f"validation param_version={v} is ahead of the trainer's {TRAINING_STEP_FIELD}={t}"
            return None
        g = ev.global_step
        if g < 1:
            return f"{ev.type} global_step={g} is not a training step (>= 1)"
        if ev.type == "local_update" and ev.local_step < 1:
            return f"local_update local_step={ev.local_step} is not >= 1"
        bound = COMMITTED_STEP_FIELD if ev.type == "step_end" else TRAINING_STEP_FIELD
        if g > (t := self._check(g, bound)):
            return f"{ev.type} global_step={g} is ahead of the trainer's {bound}={t}"
        return None

    def can_complete(self, g: int) -> bool:
        """True while step g may still complete: its step_end is not committed yet (re-reads the hash)."""
        self.refresh()
        return g > self.committed


def nonfinite_reason(metrics: Mapping[str, float], what: str = "metric") -> str | None:
    """Why `metrics` cannot reach a record: a non-finite value (NaN, ±inf; records.jsonl is strict JSON)."""
    for name, value in metrics.items():
        if not math.isfinite(value):
            return f"{what} {name}={value} is not finite"
    return None


def stats_reason(ev: ProducerStats, producers: Collection[str]) -> str | None:
    """Why a producer stats entry cannot be folded (a dead-letter reason naming the field and value): a
    producer outside the run's set (it would become a permanent record column), a negative count, a rate
    that is not finite and >= 0, an idle_ratio outside [0, 1], or a non-finite metric."""
    if ev.producer not in producers:
        return f"producer={ev.producer!r} is not one of the run's producers"
    for name in ("samples", "tokens", "param_version"):
        if getattr(ev, name) < 0:
            return f"{name}={getattr(ev, name)} is negative"
    if not (math.isfinite(ev.gen_tokens_per_s) and ev.gen_tokens_per_s >= 0):
        return f"gen_tokens_per_s={ev.gen_tokens_per_s} is not a finite rate >= 0"
    if not (math.isfinite(ev.idle_ratio) and 0.0 <= ev.idle_ratio <= 1.0):
        return f"idle_ratio={ev.idle_ratio} is not in [0, 1]"
    return nonfinite_reason(ev.metrics)
