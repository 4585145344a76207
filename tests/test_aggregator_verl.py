"""verl's own MetricsAggregator cases (tests/trainer/ppo/v1/test_metrics_aggregator_on_cpu.py as of verl
PR 7082), each re-expressed against our MetricsAggregator with the same inputs and expectations."""

from __future__ import annotations

import math

import pytest
import torch

from consumers.aggregator import MetricsAggregator
from consumers.aggregator.metrics import DAPO_FILTERED_REWARD_COUNTS_KEY

approx = pytest.approx


def test_empty_aggregator_returns_empty() -> None:
    assert MetricsAggregator().get_aggregated_metrics() == {}


def test_mean_metrics_are_weighted_by_sample_count() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"actor/pg_loss/mean": 1.0}, sample_count=1)
    agg.add_step_metrics({"actor/pg_loss/mean": 3.0}, sample_count=3)
    assert agg.get_aggregated_metrics()["actor/pg_loss/mean"] == approx(2.5)


def test_default_metric_is_weighted_by_sample_count() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"actor/kl": 2.0}, sample_count=1)
    agg.add_step_metrics({"actor/kl": 4.0}, sample_count=3)
    assert agg.get_aggregated_metrics()["actor/kl"] == approx(3.5)


def test_max_and_min_are_reduced() -> None:
    agg = MetricsAggregator()
    for v in (1.0, 5.0, 3.0):
        agg.add_step_metrics({"grad/max": v, "grad/min": v})
    out = agg.get_aggregated_metrics()
    assert (out["grad/max"], out["grad/min"]) == (5.0, 1.0)


def test_timing_and_sum_metrics_accumulate() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"timing_s/update_actor": 1.5, "some/total_tokens": 10})
    agg.add_step_metrics({"timing_s/update_actor": 2.5, "some/total_tokens": 20})
    out = agg.get_aggregated_metrics()
    assert out["timing_s/update_actor"] == approx(4.0)
    assert out["some/total_tokens"] == approx(30.0)


def test_evicted_samples_are_summed_across_iterations() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"training/off_policy/evicted_samples": 2})
    agg.add_step_metrics({"training/off_policy/evicted_samples": 3})
    assert agg.get_aggregated_metrics()["training/off_policy/evicted_samples"] == approx(5.0)


def test_evicted_samples_staleness_mean_uses_evicted_count_weight() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics(
        {
            "training/off_policy/evicted_samples": 1,
            "training/off_policy/evicted_samples_staleness/mean": 10.0,
        },
        sample_count=100,
    )
    agg.add_step_metrics(
        {"training/off_policy/evicted_samples": 3, "training/off_policy/evicted_samples_staleness/mean": 2.0},
        sample_count=1,
    )
    assert agg.get_aggregated_metrics()["training/off_policy/evicted_samples_staleness/mean"] == approx(4.0)


def test_last_metric_keeps_final_value() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"training/global_step": 7})
    agg.add_step_metrics({"training/global_step": 8})
    assert agg.get_aggregated_metrics()["training/global_step"] == 8


def test_rollout_probs_diff_valid_keeps_last() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"training/rollout_probs_diff_valid": 1})
    agg.add_step_metrics({"training/rollout_probs_diff_valid": 0})
    assert agg.get_aggregated_metrics()["training/rollout_probs_diff_valid"] == 0


def test_global_seqlen_minmax_diff_is_recomputed_from_aggregated_min_max() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics(
        {"global_seqlen/min": 10.0, "global_seqlen/max": 20.0, "global_seqlen/minmax_diff": 10.0}
    )
    agg.add_step_metrics(
        {"global_seqlen/min": 0.0, "global_seqlen/max": 15.0, "global_seqlen/minmax_diff": 15.0}
    )
    out = agg.get_aggregated_metrics()
    assert (out["global_seqlen/min"], out["global_seqlen/max"]) == (0.0, 20.0)
    assert out["global_seqlen/minmax_diff"] == approx(20.0)  # a max over the per-update diffs would give 15


def test_minmax_diff_falls_back_when_min_max_absent() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"global_seqlen/minmax_diff": 7.0})
    agg.add_step_metrics({"global_seqlen/minmax_diff": 3.0})
    assert agg.get_aggregated_metrics()["global_seqlen/minmax_diff"] == approx(7.0)


def test_tensor_and_non_scalar_handling() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics(
        {"actor/loss/mean": torch.tensor(2.0), "actor/vec": torch.tensor([1.0, 2.0])}, sample_count=1
    )
    agg.add_step_metrics({"actor/loss/mean": torch.tensor(4.0)}, sample_count=3)
    out = agg.get_aggregated_metrics()
    assert out["actor/loss/mean"] == approx(3.5)
    assert "actor/vec" not in out


def test_bool_values_are_ignored() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"flag": True, "actor/loss/mean": 1.0})
    out = agg.get_aggregated_metrics()
    assert "flag" not in out and out["actor/loss/mean"] == approx(1.0)


def test_reset_clears_state() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"actor/loss/mean": 1.0, DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 1}})
    agg.reset()
    assert agg.get_aggregated_metrics() == {} and agg.step_count == 0


def test_missing_key_in_some_iterations_uses_present_values() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"actor/loss/mean": 2.0}, sample_count=1)
    agg.add_step_metrics({}, sample_count=100)
    agg.add_step_metrics({"actor/loss/mean": 6.0}, sample_count=3)
    out = agg.get_aggregated_metrics()
    assert out["actor/loss/mean"] == approx(5.0) and not math.isnan(out["actor/loss/mean"])


def test_dapo_filtered_reward_counts_survive_aggregation() -> None:
    """The {reward value: filtered groups} breakdown is merged additively across local updates."""
    agg = MetricsAggregator()
    agg.add_step_metrics({DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 3, 1.0: 1}}, sample_count=8)
    agg.add_step_metrics({DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 2}}, sample_count=8)
    assert agg.get_aggregated_metrics()[DAPO_FILTERED_REWARD_COUNTS_KEY] == {0.0: 5, 1.0: 1}


@pytest.mark.parametrize("split", ["training", "validation"])
def test_filter_groups_evicted_samples_are_summed_across_iterations(split: str) -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({f"{split}/filter_groups/evicted_samples": 2})
    agg.add_step_metrics({f"{split}/filter_groups/evicted_samples": 3})
    assert agg.get_aggregated_metrics()[f"{split}/filter_groups/evicted_samples"] == approx(5.0)


@pytest.mark.parametrize("split", ["training", "validation"])
def test_filter_groups_discarded_surplus_samples_are_summed_across_iterations(split: str) -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({f"{split}/filter_groups/discarded_surplus_samples": 4})
    agg.add_step_metrics({f"{split}/filter_groups/discarded_surplus_samples": 1})
    assert agg.get_aggregated_metrics()[f"{split}/filter_groups/discarded_surplus_samples"] == approx(5.0)


@pytest.mark.parametrize("split", ["training", "validation"])
def test_rollout_failure_evicted_samples_are_summed_across_iterations(split: str) -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({f"{split}/rollout_failure/evicted_samples": 1})
    agg.add_step_metrics({f"{split}/rollout_failure/evicted_samples": 2})
    assert agg.get_aggregated_metrics()[f"{split}/rollout_failure/evicted_samples"] == approx(3.0)


# Beyond verl's file: what the merge does with the edges of the dict rule.


def test_only_the_named_dict_metric_is_merged() -> None:
    """verl merges only its DAPO breakdown; any other dict value is skipped like a non-number."""
    agg = MetricsAggregator()
    agg.add_step_metrics({"other/dict": {1.0: 2}, DAPO_FILTERED_REWARD_COUNTS_KEY: 3.0})
    out = agg.get_aggregated_metrics()
    assert "other/dict" not in out
    assert out[DAPO_FILTERED_REWARD_COUNTS_KEY] == 3.0  # a number under that name folds as a number


def test_empty_breakdown_is_left_out_and_state_round_trips() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({DAPO_FILTERED_REWARD_COUNTS_KEY: {}}, sample_count=1)
    assert DAPO_FILTERED_REWARD_COUNTS_KEY not in agg.get_aggregated_metrics()
    agg.add_step_metrics({DAPO_FILTERED_REWARD_COUNTS_KEY: {"0.0": 2}}, sample_count=1)
    again = MetricsAggregator()
    again.load_state_dict(agg.state_dict())
    again.add_step_metrics({DAPO_FILTERED_REWARD_COUNTS_KEY: {"0.0": 1, "1.0": 4}}, sample_count=1)
    assert again.get_aggregated_metrics()[DAPO_FILTERED_REWARD_COUNTS_KEY] == {"0.0": 3, "1.0": 4}
