"""Staleness: how many versions behind the trainer a sample is, and which samples are too old to train.

A sample stamped with param_version v and consumed at global step g (which trains version g-1) has
staleness g - v: 1 means on-policy. With max_off_policy_threshold = k, staleness <= k is kept and
staleness > k is dropped (counted and recorded, never silently lost).
"""

from __future__ import annotations

from collections.abc import Sequence

DROPPED = "training/off_policy/dropped_samples"


def staleness(global_step: int, param_version: int) -> int:
    """Staleness of a sample stamped `param_version` consumed at `global_step` (1 = on-policy)."""
    return global_step - param_version


def dropped_metrics(dropped_staleness: Sequence[int]) -> dict[str, float]:
    """`training/off_policy/dropped_samples` (count, also 0) and `…_staleness/{mean,max,min}` when any."""
    out: dict[str, float] = {DROPPED: float(len(dropped_staleness))}
    if dropped_staleness:
        values = [float(s) for s in dropped_staleness]
        out[f"{DROPPED}_staleness/mean"] = sum(values) / len(values)
        out[f"{DROPPED}_staleness/max"] = max(values)
        out[f"{DROPPED}_staleness/min"] = min(values)
    return out
