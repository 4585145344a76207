"""MetricsAggregator: every v1 rule against hand-computed values (CPU, no Redis)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from consumers.aggregator import MetricsAggregator, aggregation_rule

approx = pytest.approx


def fold(*updates: tuple[dict, int], total_gpus: int = 1) -> dict[str, float]:
    """Aggregate (metrics, sample_count) updates in order."""
    agg = MetricsAggregator(total_gpus=total_gpus)
    for metrics, count in updates:
        agg.add_step_metrics(metrics, sample_count=count)
    return agg.get_aggregated_metrics()


def test_weighted_average_by_sample_count() -> None:
    # (1*2 + 5*6) / 8 = 4
    assert fold(({"actor/pg_loss": 1.0}, 2), ({"actor/pg_loss": 5.0}, 6)) == {"actor/pg_loss": 4.0}


def test_all_zero_weights_fall_back_to_plain_mean() -> None:
    out = fold(({"actor/pg_loss": 1.0}, 0), ({"actor/pg_loss": 5.0}, 0))
    assert out == {"actor/pg_loss": 3.0}
    assert not math.isnan(out["actor/pg_loss"])
    assert fold(({"actor/pg_loss": 1.0}, 0), ({"actor/pg_loss": 5.0}, 4)) == {"actor/pg_loss": 5.0}


def test_explicit_sum_list() -> None:
    out = fold(
        ({"training/off_policy/dropped_samples": 2, "validation/off_policy/dropped_samples": 1}, 2),
        ({"training/off_policy/dropped_samples": 3, "validation/off_policy/dropped_samples": 0}, 6),
    )
    assert out == {"training/off_policy/dropped_samples": 5.0, "validation/off_policy/dropped_samples": 1.0}


def test_explicit_last_list() -> None:
    out = fold(
        ({"training/global_step": 7, "training/rollout_probs_diff_valid": 1.0}, 6),
        ({"training/global_step": 8, "training/rollout_probs_diff_valid": 0.0}, 2),
    )
    assert out == {"training/global_step": 8.0, "training/rollout_probs_diff_valid": 0.0}


@pytest.mark.parametrize("key", ["actor/lr", "critic_lr", "lr", "optim/LR"])
def test_lr_variants_take_last(key: str) -> None:
    assert fold(({key: 1e-3}, 6), ({key: 5e-4}, 2)) == {key: 5e-4}


def test_lr_substring_elsewhere_is_not_last() -> None:
    assert aggregation_rule("actor/lr_warmup") == "avg"
    assert aggregation_rule("lrx") == "avg"


def test_time_sum() -> None:
    out = fold(
        ({"timing_s/update_actor": 1.5, "timing_per_token_ms/gen": 0.25}, 2),
        ({"timing_s/update_actor": 2.0, "timing_per_token_ms/gen": 0.5}, 6),
    )
    assert out == {"timing_s/update_actor": 3.5, "timing_per_token_ms/gen": 0.75}
    # "timing" contains "min": the time prefix must win over the min rule
    assert aggregation_rule("timing_s/min_wait") == "time_sum"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("response_length/max", 9.0),
        ("perf/max_memory_allocated_gb", 9.0),
        ("score/maximum", 9.0),
        ("response_length/min", 1.0),
        ("score/minimum", 1.0),
        ("perf/sum_tokens", 10.0),
        ("perf/total_num_tokens", 10.0),
    ],
)
def test_substring_rules(key: str, expected: float) -> None:
    assert fold(({key: 1.0}, 2), ({key: 9.0}, 6)) == {key: expected}


def test_precedence_max_before_min_before_sum() -> None:
    assert aggregation_rule("x/max_min") == "max"
    assert aggregation_rule("x/min_total") == "min"
    assert aggregation_rule("x/total") == "sum"
    assert aggregation_rule("training/off_policy/dropped_samples") == "sum"
    assert aggregation_rule("training/global_step") == "last"


def test_dropped_samples_staleness_mean_weighted_by_dropped_count() -> None:
    dropped = "training/off_policy/dropped_samples"
    key = "training/off_policy/dropped_samples_staleness/mean"
    smax, smin = (
        "training/off_policy/dropped_samples_staleness/max",
        "training/off_policy/dropped_samples_staleness/min",
    )
    out = fold(
        ({dropped: 1, key: 2.0, smax: 2.0, smin: 2.0}, 100),
        ({dropped: 3, key: 4.0, smax: 5.0, smin: 3.0}, 1),
    )
    # (2*1 + 4*3) / 4 = 3.5, ignoring sample counts 100 and 1
    assert out[key] == 3.5
    assert out[dropped] == 4.0
    assert out[smax] == 5.0
    assert out[smin] == 2.0


def test_validation_staleness_mean_uses_its_own_sibling() -> None:
    key = "validation/off_policy/dropped_samples_staleness/mean"
    out = fold(
        ({"validation/off_policy/dropped_samples": 0, key: 9.0, "training/off_policy/dropped_samples": 5}, 1),
        ({"validation/off_policy/dropped_samples": 2, key: 3.0}, 1),
    )
    assert out[key] == 3.0


def test_dropped_samples_staleness_zero_weight_falls_back_to_plain_mean() -> None:
    dropped, key = "training/off_policy/dropped_samples", "training/off_policy/dropped_samples_staleness/mean"
    assert fold(({dropped: 0, key: 2.0}, 5), ({dropped: 0, key: 4.0}, 5))[key] == 3.0



def test_value_types() -> None:
    out = fold(
        (
            {
                "flag": True,
                "np_flag": np.bool_(True),
                "a": 2,
                "b": np.float32(0.5),
                "c": np.int64(3),
                "t1": torch.tensor([2.5]),
                "t0": torch.tensor(1.5),
                "t3": torch.tensor([1.0, 2.0, 3.0]),
                "arr1": np.array([4.0]),
                "arr3": np.array([1.0, 2.0, 3.0]),
                "tbool": torch.tensor([True]),
                "s": "text",
                "none": None,
                "lst": [1.0],
            },
            1,
        ),
    )
    # verl's type tests: numpy arrays are not np.number (skipped, even size 1); a size-1 bool tensor is
    # a size-1 tensor (taken as 1.0); Python and numpy bools are skipped
    assert out == {"a": 2.0, "b": 0.5, "c": 3.0, "t1": 2.5, "t0": 1.5, "tbool": 1.0}
    assert all(type(v) is float for v in out.values())


def test_key_missing_from_some_updates() -> None:
    out = fold(({"x": 1.0, "y/max": 4.0}, 2), ({"x": 3.0}, 6), ({"y/max": 2.0, "z": 7.0}, 8))
    # x: (1*2 + 3*6)/8 = 2.5 over the two updates that have it; z: only one update
    assert out == {"x": 2.5, "y/max": 4.0, "z": 7.0}


def test_empty_gives_empty_dict() -> None:
    assert MetricsAggregator().get_aggregated_metrics() == {}
    assert fold(({"only_bool": True, "text": "x"}, 1)) == {}


def test_derived_metrics() -> None:
    out = fold(
        (
            {
                "global_seqlen/max": 10.0,
                "global_seqlen/min": 4.0,
                "global_seqlen/minmax_diff": 6.0,
                "perf/total_num_tokens": 1000,
                "perf/time_per_step": 2.0,
                "timing_s/gen": 1.0,
                "timing_s/step": 4.0,
            },
            2,
        ),
        (
            {
                "global_seqlen/max": 12.0,
                "global_seqlen/min": 5.0,
                "global_seqlen/minmax_diff": 7.0,
                "perf/total_num_tokens": 600,
                "perf/time_per_step": 6.0,
                "timing_s/gen": 0.5,
                "timing_s/step": 1.0,
            },
            6,
        ),
        total_gpus=4,
    )
    assert out["global_seqlen/minmax_diff"] == 12.0 - 4.0  # recomputed from folded max/min
    # tokens summed (1600); time_per_step weighted mean (2*2 + 6*6)/8 = 5; 1600 / (5 * 4) = 80
    assert out["perf/time_per_step"] == 5.0
    assert out["perf/throughput"] == 80.0
    assert out["fully_async/trainer/idle_ratio"] == 1.5 / 5.0


def test_derived_metrics_need_their_inputs() -> None:
    out = fold(({"global_seqlen/max": 10.0, "global_seqlen/min": 4.0, "perf/total_num_tokens": 5}, 1))
    assert "global_seqlen/minmax_diff" not in out
    assert "perf/throughput" not in out
    out = fold(
        (
            {
                "perf/total_num_tokens": 5,
                "perf/time_per_step": 0.0,
                "timing_s/gen": 1.0,
                "timing_s/step": 0.0,
            },
            1,
        )
    )
    assert "perf/throughput" not in out
    assert "fully_async/trainer/idle_ratio" not in out


def test_reset_and_step_count() -> None:
    agg = MetricsAggregator()
    assert agg.step_count == 0
    agg.add_step_metrics({"x": 1.0}, sample_count=1)
    agg.add_step_metrics({}, sample_count=1)
    assert agg.step_count == 2
    agg.reset()
    assert agg.step_count == 0
    assert agg.get_aggregated_metrics() == {}
    agg.add_step_metrics({"x": 5.0})
    assert agg.get_aggregated_metrics() == {"x": 5.0}


def test_order_independent_except_last() -> None:
    updates = [
        ({"a": 0.1, "b/max": 3.0, "c/min": -1.0, "d_total": 0.1, "timing_s/x": 0.2, "lr": 1.0}, 3),
        ({"a": 0.7, "b/max": 5.0, "c/min": 2.0, "d_total": 0.2, "timing_s/x": 0.1, "lr": 2.0}, 1),
        ({"a": 1e-9, "b/max": 4.0, "d_total": 0.3, "timing_s/x": 0.3, "lr": 3.0}, 7),
    ]
    results = []
    for perm in itertools.permutations(updates):
        out = fold(*perm)
        assert out["lr"] == perm[-1][0]["lr"]
        results.append({k: v for k, v in out.items() if k != "lr"})
    assert all(r == results[0] for r in results)  # bit-identical, not just approx


def test_state_dict_round_trip_through_json() -> None:
    agg = MetricsAggregator(total_gpus=2)
    agg.add_step_metrics({"x": 1.0, "actor/lr": 0.1}, sample_count=2)
    state = json.loads(json.dumps(agg.state_dict()))
    restored = MetricsAggregator()
    restored.load_state_dict(state)
    assert restored.step_count == 1 and restored.total_gpus == 2
    for a in (agg, restored):
        a.add_step_metrics({"x": 5.0, "actor/lr": 0.2}, sample_count=6)
    assert restored.get_aggregated_metrics() == agg.get_aggregated_metrics() == {"x": 4.0, "actor/lr": 0.2}
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict({"version": 99})


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        MetricsAggregator(total_gpus=0)
    with pytest.raises(ValueError):
        MetricsAggregator().add_step_metrics({"x": 1.0}, sample_count=-1)


def test_time_marker_anywhere_in_the_name_wins_over_min() -> None:
    # "timing" contains "min": a prefixed time key must still be summed, not folded as min
    for key in ("fully_async/timing_s/x", "actor/timing_per_token_ms/gen", "Fully_Async/TIMING_S/wait"):
        assert aggregation_rule(key) == "time_sum"
    assert fold(({"fully_async/timing_s/x": 1.5}, 1), ({"fully_async/timing_s/x": 2.5}, 1)) == {
        "fully_async/timing_s/x": 4.0
    }


def test_staleness_mean_without_sibling_is_weighted_by_sample_count() -> None:
    key = "training/off_policy/dropped_samples_staleness/mean"
    # (2*1 + 6*3) / 4 = 5 (weights 0 would give the plain mean 4)
    assert fold(({key: 2.0}, 1), ({key: 6.0}, 3))[key] == 5.0
    # mixed: the sibling where present, sample_count where absent: (2*1 + 6*3) / 4
    dropped = "training/off_policy/dropped_samples"
    assert fold(({key: 2.0, dropped: 1}, 100), ({key: 6.0}, 3))[key] == 5.0


@pytest.mark.parametrize(
    ("sibling", "weight"),
    [
        (2.9, 2),  # int() truncation
        (np.float32(3.7), 3),
        (torch.tensor([3.0]), 3),  # size-1 tensor as a weight
        (torch.tensor(1.9), 1),
        (True, 1),  # a bool is an int to verl's isinstance test
        (torch.tensor([1.0, 2.0]), 10),  # other tensors: sample_count
        (np.array([3.0]), 10),  # numpy arrays are not np.number: sample_count
        ("3", 10),
        (None, 10),
        (float("nan"), 10),  # verl raises here; we fall back to sample_count
    ],
)
def test_sibling_weight_types(sibling: object, weight: int) -> None:
    key = "training/off_policy/dropped_samples_staleness/mean"
    # first update weighs `weight` (value 1.0), second weighs 5 (value 0.0): mean = weight / (weight + 5)
    first: dict[str, object] = {key: 1.0}
    if sibling is not None:
        first["training/off_policy/dropped_samples"] = sibling
    out = fold((first, 10), ({key: 0.0, "training/off_policy/dropped_samples": 5}, 1))
    assert out[key] == approx(weight / (weight + 5))


def test_fully_async_counters_take_the_last_value() -> None:
    counters = [
        "fully_async/count/total_generated_samples",  # contains "total": would be summed
        "fully_async/count/stale_samples_processed",
        "fully_async/count/stale_trajectory_processed",
        "fully_async/count/current_param_version",
        "fully_async/count/dropped_stale_samples",
        "training/global_step",
    ]
    for key in counters:
        assert aggregation_rule(key) == "last", key
    out = fold(({k: 10.0 for k in counters}, 1), ({k: 12.0 for k in counters}, 3))
    assert out == {k: 12.0 for k in counters}


def test_add_step_metrics_accepts_the_fully_async_timestamp() -> None:
    agg = MetricsAggregator()
    agg.add_step_metrics({"x": 1.0}, 2, timestamp=123.0)
    agg.add_step_metrics({"x": 4.0}, sample_count=1, timestamp=None)
    assert agg.get_aggregated_metrics() == {"x": 2.0}
