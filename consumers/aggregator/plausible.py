"""What the aggregator may fold: no trainer event ahead of the trainer's own progress.

Only the trainer writes `metrics` (ACL), but without ACLs (an external Redis, `run.acl=false`) anyone
with the run's credentials could append a step_end for a step far ahead, which would complete a record
with forged values and block every real one before it. So an event is placed only when the trainer hash
vouches for it: a `step_end` of step g needs `committed_step >= g` (the trainer writes both in one
MULTI/EXEC); a `local_update` of g or a validation of version g needs `training_step >= g` (set before
the trainer emits anything of step g). The hash is re-read only when an event claims more than was
last seen, so the check costs nothing in steady state.
"""

from __future__ import annotations

from typing import Any

import redis

from rollstream.bus import retry_on_connection
from rollstream.names import COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD, Keys
from schemas import StepMetrics, ValidateMetrics


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
            lambda: self.r.hmget(self.keys.trainer, COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD), "reading trainer progress"
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
