"""MetricsAggregator: fold the metric dicts of one global step's local updates into one record.

The rules are verl v1's (`verl/trainer/ppo/v1/utils.py`, the `separate_async` trainer), plus the
fully-async aggregator's "counts take the last value", applied per key in this precedence:

  0. dict-valued metrics named in DICT_METRICS (`_dapo_filtered_reward_counts`, the DAPO breakdown
     `{reward value: filtered groups}`)                                                -> counts added per
     key (verl's `Counter.update`); any other dict is skipped like any other non-number
  1. explicit sum list (`{training,validation}/off_policy/{dropped,evicted}_samples`,
     `…/filter_groups/{evicted,discarded_surplus}_samples`, `…/rollout_failure/evicted_samples`) -> sum
  2. explicit last list (`training/global_step`, `training/rollout_probs_diff_valid`) -> last added
  3. name starts with `fully_async/count/` (cumulative counters: the trainer's and the
     rollout status's; verl fully-async's `last` list)                               -> last added
  4. name ends with `/lr` or `_lr`, or is `lr`                                        -> last added
  5. name contains `timing_s/` or `timing_per_token_ms/` anywhere, or is
     `fully_async/total_wait_time` (verl sums it by rule 8; the same fold)            -> time_sum (sum)
  6. name contains `max` / `maximum`                                                  -> max
  7. name contains `min` / `minimum`                                                  -> min
  8. name contains `sum` / `total`                                                    -> sum
  9. everything else                                                                  -> average weighted
     by the update's sample_count (a plain mean when the weights sum to 0)

Rules 4-9 match the lower-cased name, as verl does. A key ending `/off_policy/dropped_samples_staleness/mean`
(or `evicted_…`) is weighted instead by its sibling `…/off_policy/dropped_samples` in the same update,
truncated with `int()`; when the sibling is absent or not a number the update's sample_count is used.
Values: Python and numpy numbers and size-1 torch tensors count; bools, numpy arrays, bigger tensors and
anything else are skipped (verl's type tests). The fold is order-independent (exact `math.fsum`) except
for "last". Derived keys (`global_seqlen/minmax_diff`, `perf/throughput`, `fully_async/trainer/idle_ratio`)
are computed on the folded record.

Where verl would raise we skip instead: complex numbers as values, and a sibling weight `int()` cannot
take (NaN, inf, complex) falls back to sample_count.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

Rule = Literal["sum", "last", "time_sum", "max", "min", "avg"]

# verl v1 (PR 7082) sums these counts over the local updates of a step; the dropped_* pair is our name
# for the off-policy eviction the trainer does itself.
SUM_METRICS = frozenset(
    f"{split}/{name}"
    for split in ("training", "validation")
    for name in (
        "off_policy/dropped_samples",
        "off_policy/evicted_samples",
        "filter_groups/evicted_samples",
        "filter_groups/discarded_surplus_samples",
        "rollout_failure/evicted_samples",
    )
)
DAPO_FILTERED_REWARD_COUNTS_KEY = "_dapo_filtered_reward_counts"
DICT_METRICS = frozenset({DAPO_FILTERED_REWARD_COUNTS_KEY})
LAST_METRICS = frozenset({"training/global_step", "training/rollout_probs_diff_valid"})
# Times without a timing marker in their name: summed like any "total" (verl's rule 8), but a time, so that
# data-parallel ranks that waited side by side count as their mean (consumers/aggregator/fold.py).
TIME_METRICS = frozenset({"fully_async/total_wait_time"})
COUNT_PREFIX = "fully_async/count/"
TIME_MARKERS = ("timing_s/", "timing_per_token_ms/")
STALENESS_MEAN_SUFFIXES = (
    "/off_policy/dropped_samples_staleness/mean",
    "/off_policy/evicted_samples_staleness/mean",
)
_STATE_VERSION = 1


def aggregation_rule(name: str) -> Rule:
    """Which fold a metric name gets (see the module docstring for the precedence)."""
    if name in SUM_METRICS:
        return "sum"
    if name in LAST_METRICS or name.startswith(COUNT_PREFIX):
        return "last"
    lower = name.lower()
    if lower == "lr" or lower.endswith("/lr") or lower.endswith("_lr"):
        return "last"
    if name in TIME_METRICS or any(marker in lower for marker in TIME_MARKERS):
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
    if name.endswith(STALENESS_MEAN_SUFFIXES):
        return name[: -len("_staleness/mean")]
    return None


def _torch_tensor(value: Any) -> bool:
    """True when value is a torch.Tensor (without importing torch: a tensor implies torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_number(value: Any) -> float | None:
    """A metric value as float, or None when it must be skipped (verl: bools and non-numbers skipped,
    `int | float | np.number` and size-1 tensors taken; numpy arrays are not np.number, so skipped)."""
    if isinstance(value, bool):
        return None
    if _torch_tensor(value):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.detach().item())
    if isinstance(value, int | float | np.number) and not isinstance(value, np.complexfloating):
        return float(value)
    return None


def sibling_weight(sibling: Any, sample_count: int) -> int:
    """Weight of a staleness mean from its sibling count, as verl's `_get_metric_weight`: a size-1 tensor
    or a number truncated with int() (a bool counts as 0/1); absent or anything else -> sample_count."""
    try:
        if _torch_tensor(sibling):
            return int(sibling.item()) if sibling.numel() == 1 else sample_count
        if isinstance(sibling, int | float | np.number):
            return int(sibling)  # type: ignore[arg-type]
    except (ValueError, OverflowError, TypeError):  # NaN, inf, complex: verl would raise
        pass
    return sample_count


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
        self._counts: dict[str, Counter[Any]] = {}
        self._step_count = 0

    @property
    def step_count(self) -> int:
        """Number of updates added since the last reset."""
        return self._step_count

    def add_step_metrics(
        self, metrics: Mapping[str, Any], sample_count: int = 0, timestamp: float | None = None
    ) -> None:
        """Add one local update's metrics; `sample_count` weights its averaged keys. `timestamp` is
        accepted for verl fully-async's signature and not used (records take the step_end's time)."""
        if sample_count < 0:
            raise ValueError(f"sample_count must be >= 0, got {sample_count}")
        for key, raw in metrics.items():
            if key in DICT_METRICS and isinstance(raw, Mapping):
                self._counts.setdefault(key, Counter()).update(raw)
                continue
            value = as_number(raw)
            if value is None:
                continue
            sibling = staleness_weight_key(key)
            weight = (
                sibling_weight(metrics.get(sibling), sample_count) if sibling is not None else sample_count
            )
            self._pairs.setdefault(key, []).append((value, float(weight)))
        self._step_count += 1

    def get_aggregated_metrics(self) -> dict[str, Any]:
        """The folded record with derived metrics, and each non-empty dict metric as a plain dict of merged
        counts (as verl returns them); {} when nothing was added."""
        record: dict[str, Any] = self.scalar_metrics()
        record.update(self.dict_metrics())
        return record

    def scalar_metrics(self) -> dict[str, float]:
        """The folded numbers with derived metrics (no dict metrics); {} when nothing was added."""
        if self._step_count == 0:
            return {}
        record = {key: fold(aggregation_rule(key), pairs) for key, pairs in self._pairs.items()}
        return add_derived_metrics(record, self.total_gpus)

    def dict_metrics(self) -> dict[str, dict[Any, float]]:
        """The merged dict metrics, `{name: {key: summed count}}`, empty breakdowns left out."""
        return {name: dict(counts) for name, counts in self._counts.items() if counts}

    def reset(self) -> None:
        """Forget every update (start the next global step)."""
        self._pairs = {}
        self._counts = {}
        self._step_count = 0

    def state_dict(self) -> dict[str, Any]:
        """A plain, msgpack/JSON-friendly snapshot of the partial fold."""
        return {
            "version": _STATE_VERSION,
            "total_gpus": self.total_gpus,
            "step_count": self._step_count,
            "pairs": {key: [[v, w] for v, w in pairs] for key, pairs in self._pairs.items()},
            "counts": {name: [[k, c] for k, c in counts.items()] for name, counts in self._counts.items()},
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
        self._counts = {str(name): Counter(dict(items)) for name, items in state.get("counts", {}).items()}
