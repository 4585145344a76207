"""Staleness: how many versions behind the trainer a sample is, and which samples are too old to train.

A sample stamped with param_version v and consumed at global step g (which trains version g-1) has
staleness g - v: 1 means on-policy. With max_off_policy_threshold = k, staleness <= k is kept and
staleness > k is dropped (counted and recorded, never silently lost), or, with
trainer.max_off_policy_strategy=train, trained under the rollout correction like every sample.

Dropping skews training toward fast rollouts (short, easy responses finish first, long ones go stale), so
every step_end reports the dropped share, overall and per response-length quarter (`LengthBuckets`).
Dynamic sampling's metrics (`filter_groups_metrics`) are verl's names too.

Fully-async counters (`count_stale`; verl's names, cumulative over the run, kept in the checkpoint; the
aggregator takes the last value): `fully_async/count/stale_samples_processed` and
`…/stale_trajectory_processed` count trained samples / trajectories whose version (a trajectory's: its last
token's) is older than the version being trained, `fully_async/count/current_param_version` is that
version (g − 1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollstream.bus import Message
from rollstream.rl.metrics import summary_stats
from schemas import RolloutSample

DROPPED_SAMPLES = "training/off_policy/dropped_samples"  # the metric (schemas.DROPPED is the fate)
DROPPED_SHARE = "training/off_policy/dropped_share"
BUCKETS = 4  # quarters of data.max_response_length
FG_EVICTED = "training/filter_groups/evicted_samples"
ROLLOUT_FAILURE_EVICTED = "training/rollout_failure/evicted_samples"
STALE_SAMPLES = "stale_samples_processed"  # the run's counters (fully_async/count/…)
STALE_TRAJECTORIES = "stale_trajectory_processed"
DAPO_FILTERED_REWARD_COUNTS_KEY = "_dapo_filtered_reward_counts"


def mean_response_length(ev: RolloutSample) -> float:
    """Mean response length (tokens) over a sample's trajectories."""
    batch = ev.full_batch
    mask = batch.tokens.get("response_mask")  # present when tool tokens are masked out: count generated ones
    total = float(mask.sum()) if mask is not None else float(batch.response_lens.sum())
    return total / max(len(batch), 1)


def staleness(global_step: int, param_version: int) -> int:
    """Staleness of a sample stamped `param_version` consumed at `global_step` (1 = on-policy)."""
    return global_step - param_version


def count_stale(
    counters: dict[str, int],
    version: int,
    samples: Sequence[RolloutSample],
    trajectory_versions: Sequence[int],
) -> dict[str, float]:
    """Add an update's stale samples / trajectories (older than `version`, the one being trained) to the
    run's `counters`; returns verl's fully_async/count metrics."""
    counters[STALE_SAMPLES] += sum(1 for s in samples if version - s.param_version >= 1)
    counters[STALE_TRAJECTORIES] += sum(1 for v in trajectory_versions if version - v >= 1)
    return {
        f"fully_async/count/{STALE_SAMPLES}": float(counters[STALE_SAMPLES]),
        f"fully_async/count/{STALE_TRAJECTORIES}": float(counters[STALE_TRAJECTORIES]),
        "fully_async/count/current_param_version": float(version),
    }


def dropped_metrics(dropped_staleness: Sequence[int]) -> dict[str, float]:
    """`training/off_policy/dropped_samples` (count, also 0) and `…_staleness/{mean,max,min}` when any."""
    values = [float(s) for s in dropped_staleness]
    return {DROPPED_SAMPLES: float(len(values)), **summary_stats(values, f"{DROPPED_SAMPLES}_staleness")}


def filter_groups_metrics(
    evicted_rewards: Sequence[float],
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """verl's `training/filter_groups/evicted_samples` (also 0) and the dict metric
    `_dapo_filtered_reward_counts` {shared reward: evicted groups} (empty when none)."""
    counts = Counter(repr(float(r)) for r in evicted_rewards)
    dicts = (
        {DAPO_FILTERED_REWARD_COUNTS_KEY: {k: float(v) for k, v in sorted(counts.items())}} if counts else {}
    )
    return {FG_EVICTED: float(len(evicted_rewards))}, dicts


class LengthBuckets:
    """One step's trained and dropped-as-stale samples counted per quarter of max_response_length (by each
    sample's mean response length), for the dropped share per length."""

    def __init__(self, max_response_length: int) -> None:
        """Empty counts; lengths are bucketed against `max_response_length`."""
        self.max_len = max(1, max_response_length)
        self.trained = [0] * BUCKETS
        self.dropped = [0] * BUCKETS

    def bucket(self, length: float) -> int:
        """The quarter (0..3) of max_response_length a mean response length falls in (the limit: the last)."""
        return min(BUCKETS - 1, max(0, int(BUCKETS * length / self.max_len)))

    def add(self, kept: Sequence[tuple[Message, int]], dropped_lengths: Sequence[float]) -> None:
        """Count a local update's trained samples and the lengths of the samples it dropped."""
        for m, _ in kept:
            self.trained[self.bucket(mean_response_length(m.event))] += 1  # type: ignore[arg-type]
        for length in dropped_lengths:
            self.dropped[self.bucket(length)] += 1

    def to_plain(self) -> dict[str, Any]:
        """Plain counts (exchanged between data-parallel ranks)."""
        return {"trained": list(self.trained), "dropped": list(self.dropped)}

    @classmethod
    def merged(cls, max_response_length: int, parts: Sequence[dict[str, Any]]) -> LengthBuckets:
        """Every rank's counts added up."""
        out = cls(max_response_length)
        for part in parts:
            out.trained = [a + b for a, b in zip(out.trained, part["trained"], strict=True)]
            out.dropped = [a + b for a, b in zip(out.dropped, part["dropped"], strict=True)]
        return out

    def share_metrics(self) -> dict[str, float]:
        """`training/off_policy/dropped_share` = dropped / (trained + dropped) over the step (0 when none),
        and `…/dropped_share/resp_len_q<i>` for each quarter i = 1..4 of max_response_length that had a
        sample."""
        total = sum(self.trained) + sum(self.dropped)
        out = {DROPPED_SHARE: sum(self.dropped) / total if total else 0.0}
        for i, (t, d) in enumerate(zip(self.trained, self.dropped, strict=True), start=1):
            if t + d:
                out[f"{DROPPED_SHARE}/resp_len_q{i}"] = d / (t + d)
        return out
