"""Batch statistics for the trainer's metric events (plain python floats, namespaced names).

Names are chosen so the MetricsAggregator rules fold them correctly across local updates:
`…/max` folds by max, `…/min` by min, everything else by sample-weighted average.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def summary_stats(values: torch.Tensor | Sequence[float] | Any, prefix: str) -> dict[str, float]:
    """`{prefix}/mean`, `/max`, `/min` of the elements of a tensor, array or sequence (in float64); {} when
    there are none."""
    flat = torch.as_tensor(values).detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": float(flat.mean()),
        f"{prefix}/max": float(flat.max()),
        f"{prefix}/min": float(flat.min()),
    }


def reward_metrics(rewards: torch.Tensor, prefix: str = "critic/rewards") -> dict[str, float]:
    """Mean/max/min of per-trajectory rewards [N] under `critic/rewards/…` (verl's names)."""
    return summary_stats(rewards, prefix)


def length_metrics(
    response_mask: torch.Tensor, max_response_length: int, prefix: str = "response_length"
) -> dict[str, float]:
    """Response length mean/max/min and `clip_ratio` from a mask [B, T]: the share of responses that used
    all `max_response_length` allowed tokens (the configured limit, not the batch's padded width T)."""
    return response_length_metrics(
        response_mask.detach().to(torch.float64).sum(dim=-1), max_response_length, prefix
    )


def response_length_metrics(
    lengths: torch.Tensor, max_response_length: int, prefix: str = "response_length"
) -> dict[str, float]:
    """length_metrics of the responses' lengths [B] (float64: each row's loss tokens)."""
    if max_response_length < 1:
        raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
    out = summary_stats(lengths, prefix)
    if out:
        out[f"{prefix}/clip_ratio"] = float((lengths >= max_response_length).to(torch.float64).mean())
    return out


def staleness_metrics(
    staleness: Sequence[int | float], prefix: str = "training/off_policy/staleness"
) -> dict[str, float]:
    """Mean/max/min of per-sample staleness (g − param_version) under `…/off_policy/staleness/`."""
    return summary_stats([float(s) for s in staleness], prefix)


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics as floats without their non-finite values (NaN and ±inf never reach `metrics`, records
    or records.jsonl, whose strict JSON has no literal for them); `actor/nonfinite_metrics` counts the
    left-out."""
    out = {k: float(v) for k, v in metrics.items()}
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    for k in bad:
        del out[k]
    if bad:
        out["actor/nonfinite_metrics"] = float(len(bad))
    return out
