"""MetricsAggregator: fold the metric dicts of one global step's local updates into one record.

The rules are verl v1's (`separate_async` trainer), applied per key in this precedence:

  1. explicit sum list (`training/off_policy/dropped_samples`, `validation/…`)  -> sum
  2. explicit last list (`training/global_step`, `training/rollout_probs_diff_valid`) -> last added
  3. name ends with `/lr` or `_lr`, or is `lr`                                   -> last added
  4. name starts with `timing_s/` or `timing_per_token_ms/`                      -> time_sum (sum)
  5. name contains `max` / `maximum`                                             -> max
  6. name contains `min` / `minimum`                                             -> min
  7. name contains `sum` / `total`                                               -> sum
  8. everything else                                                             -> average weighted
     by the update's sample_count (a plain mean when every weight is 0)

Pattern rules 3-7 match the lower-cased name, as verl does. A key ending
`/off_policy/dropped_samples_staleness/mean` is weighted by its sibling `…/off_policy/dropped_samples`
value in the same update instead. The fold is order-independent (exact `math.fsum`) except for
"last". Derived keys (`global_seqlen/minmax_diff`, `perf/throughput`,
`fully_async/trainer/idle_ratio`) are computed on the folded record.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

Rule = Literal["sum", "last", "time_sum", "max", "min", "avg"]

SUM_METRICS = frozenset({"training/off_policy/dropped_samples", "validation/off_policy/dropped_samples"})
LAST_METRICS = frozenset({"training/global_step", "training/rollout_probs_diff_valid"})
TIME_PREFIXES = ("timing_s/", "timing_per_token_ms/")
STALENESS_MEAN_SUFFIX = "/off_policy/dropped_samples_staleness/mean"
_STATE_VERSION = 1


def aggregation_rule(name: str) -> Rule:
    """Which fold a metric name gets under the v1 rules (see the module docstring)."""
    if name in SUM_METRICS:
        return "sum"
    if name in LAST_METRICS:
        return "last"
    lower = name.lower()
    if lower == "lr" or lower.endswith("/lr") or lower.endswith("_lr"):
        return "last"
    if lower.startswith(TIME_PREFIXES):
        return "time_sum"
    if "max" in lower:  # also covers "maximum"
        return "max"
    if "min" in lower:  # also covers "minimum"
        return "min"
    if "sum" in lower or "total" in lower:
        return "sum"
    return "avg"


def staleness_weight_key(name: str) -> str | None:
    """The sibling `…/off_policy/dropped_samples` key weighting `name`, or None for normal keys."""
    if name.endswith(STALENESS_MEAN_SUFFIX):
        return name[: -len("_staleness/mean")]
    return None


def as_number(value: Any) -> float | None:
    """A metric value as float, or None when it must be skipped (bools, non-numbers, big arrays)."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, numbers.Real):  # int, float, numpy integer/floating scalars
        return float(value)
    if isinstance(value, np.ndarray):
        if value.size == 1 and value.dtype.kind in "iuf":
            return float(value.item())
        return None
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
            return float(value.detach().item())
    return None


def _exact_sum(values: Iterable[float]) -> float:
    """Order-independent sum: correctly rounded for finite values, IEEE rules for inf/nan."""
    items = list(values)
    try:
        return math.fsum(items)
    except (OverflowError, ValueError):  # finite overflow, or inf + -inf
        return sum(items)


def _max(values: list[float]) -> float:
    """Max that returns nan when any value is nan, whatever the order."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _min(values: list[float]) -> float:
    """Min that returns nan when any value is nan, whatever the order."""
    return math.nan if any(math.isnan(v) for v in values) else min(values)


def _weighted_mean(pairs: list[tuple[float, float]]) -> float:
    """Sum(v*w)/sum(w), or the plain mean of v when the weights sum to 0."""
    total_weight = _exact_sum(w for _, w in pairs)
    if total_weight == 0:
        return _exact_sum(v for v, _ in pairs) / len(pairs)
    return _exact_sum(v * w for v, w in pairs) / total_weight


def fold(rule: Rule, pairs: list[tuple[float, float]]) -> float:
    """Fold one key's (value, weight) pairs, in the order added, with `rule`."""
    values = [v for v, _ in pairs]
    if rule == "last":
        return values[-1]
    if rule in ("sum", "time_sum"):
        return _exact_sum(values)
    if rule == "max":
        return _max(values)
    if rule == "min":
        return _min(values)
    return _weighted_mean(pairs)


def add_derived_metrics(record: dict[str, float], total_gpus: int) -> dict[str, float]:
    """Add the derived keys verl computes on an aggregated record (in place; returns it)."""
    if all(k in record for k in ("global_seqlen/max", "global_seqlen/min", "global_seqlen/minmax_diff")):
        record["global_seqlen/minmax_diff"] = record["global_seqlen/max"] - record["global_seqlen/min"]
    tokens, step_time_s = record.get("perf/total_num_tokens"), record.get("perf/time_per_step")
    if tokens is not None and step_time_s is not None and step_time_s > 0:
        record["perf/throughput"] = tokens / (step_time_s * total_gpus)
    gen_s, step_s = record.get("timing_s/gen"), record.get("timing_s/step")
    if gen_s is not None and step_s is not None and step_s > 0:
        record["fully_async/trainer/idle_ratio"] = gen_s / step_s
    return record


class MetricsAggregator:
    """Folds the local updates of one global step into one metric record (verl v1 rules)."""

    def __init__(self, total_gpus: int = 1) -> None:
        """Start empty; `total_gpus` scales `perf/throughput`."""
        if total_gpus < 1:
            raise ValueError(f"total_gpus must be >= 1, got {total_gpus}")
        self.total_gpus = total_gpus
        self._pairs: dict[str, list[tuple[float, float]]] = {}
        self._step_count = 0

    @property
    def step_count(self) -> int:
        """Number of updates added since the last reset."""
        return self._step_count

    def add_step_metrics(self, metrics: Mapping[str, Any], sample_count: int = 0) -> None:
        """Add one local update's metrics; `sample_count` weights its averaged keys."""
        if sample_count < 0:
            raise ValueError(f"sample_count must be >= 0, got {sample_count}")
        numeric = {key: num for key, value in metrics.items() if (num := as_number(value)) is not None}
        for key, value in numeric.items():
            sibling = staleness_weight_key(key)
            weight = numeric.get(sibling, 0.0) if sibling is not None else float(sample_count)
            self._pairs.setdefault(key, []).append((value, weight))
        self._step_count += 1

    def get_aggregated_metrics(self) -> dict[str, float]:
        """The folded record with derived metrics; {} when nothing was added."""
        if self._step_count == 0:
            return {}
        record = {key: fold(aggregation_rule(key), pairs) for key, pairs in self._pairs.items()}
        return add_derived_metrics(record, self.total_gpus)

    def reset(self) -> None:
        """Forget every update (start the next global step)."""
        self._pairs = {}
        self._step_count = 0

    def state_dict(self) -> dict[str, Any]:
        """A plain, msgpack/JSON-friendly snapshot of the partial fold."""
        return {
            "version": _STATE_VERSION,
            "total_gpus": self.total_gpus,
            "step_count": self._step_count,
            "pairs": {key: [[v, w] for v, w in pairs] for key, pairs in self._pairs.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a snapshot taken by `state_dict` (replaces the current fold)."""
        version = state.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported MetricsAggregator state version {version!r}")
        self.total_gpus = int(state["total_gpus"])
        self._step_count = int(state["step_count"])
        self._pairs = {
            str(key): [(float(v), float(w)) for v, w in pairs] for key, pairs in state["pairs"].items()
        }
