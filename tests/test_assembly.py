"""Batch assembly: the samples' rows in order, padded once as the learner pads them (prompts left, responses
right), response_mask derivation, fully-async metric values."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import padded_arrays

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from rollstream.testing.fakes import fake_rollout_sample
from schemas import RolloutSample


def _sample(sid: str, prompt_len: int, response_len: int, **kw: object) -> RolloutSample:
    s = fake_rollout_sample(sid, n=2, prompt_len=prompt_len, response_len=response_len, seed=len(sid))
    return s.model_copy(update=kw) if kw else s


def test_empty_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        assemble_batch_from_rollout_samples([])


def test_metric_values_on_hand_built_samples() -> None:
    a = _sample(
        "a", 3, 4,
        processing_times=[1.0, 2.0], tool_calls=[0.5, 1.5],
        param_version_start=[1, 1], param_version_end=[1, 3],
        rollout_status={"count/total_generated_samples": 7, "monitor/queue/mq_queue_size": 1.5},
    )
    b = _sample(
        "bb", 3, 4,
        processing_times=[3.0, 4.0], tool_calls=[],
        param_version_start=[2, 2], param_version_end=[3, 2],
        rollout_status={"count/total_generated_samples": 99},
    )
    batch, m = assemble_batch_from_rollout_samples([a, b])
    assert len(batch) == 4
    assert batch.meta_info["sample_ids"] == ["a", "bb"]
    assert m["fully_async/processing_time/avg"] == pytest.approx(2.5)
    assert m["fully_async/processing_time/max"] == 4.0
    assert m["fully_async/processing_time/min"] == 1.0
    assert m["fully_async/processing_time/tp50"] == pytest.approx(2.5)
    assert m["fully_async/processing_time/tp95"] == pytest.approx(np.percentile([1, 2, 3, 4], 95))
    assert m["fully_async/processing_time/tp99"] == pytest.approx(np.percentile([1, 2, 3, 4], 99))
    # one value per row: a's rows 0.5 and 1.5, b carries none (0.0 per row)
    assert m["timing_s/agent_loop/tool_calls/max"] == 1.5
    assert m["timing_s/agent_loop/tool_calls/min"] == 0.0
    assert m["timing_s/agent_loop/tool_calls/mean"] == 0.5
    assert not any(k.startswith("fully_async/tool_calls/") for k in m)
    # trajectories a1 (1->3, span 2) and b0 (2->3, span 1) are partial: 2 of 4
    assert m["fully_async/partial/total_partial_num"] == 2
    assert m["fully_async/partial/partial_ratio"] == 0.5
    assert m["fully_async/partial/max_partial_span"] == 2
    # the first sample's rollout_status only
    assert m["fully_async/count/total_generated_samples"] == 7
    assert m["fully_async/monitor/queue/mq_queue_size"] == 1.5
    # verl's meta_info names
    assert batch.meta_info["rollout_param_versions"] == [a.param_version, b.param_version]
    assert batch.meta_info["trajectory_param_versions"] == [1, 3, 3, 2]
    assert batch.meta_info["param_version_diversity"] == 3  # distinct end versions {1, 2, 3}
    assert batch.meta_info["global_token_num"] == padded_arrays(batch)["attention_mask"].sum(-1).tolist()
    assert all(type(x) is int for x in batch.meta_info["global_token_num"])


def test_no_tool_call_stats_without_tool_calls() -> None:
    _, m = assemble_batch_from_rollout_samples([_sample("a", 3, 4)])
    assert not any("tool_calls" in k for k in m)
    assert m["fully_async/partial/total_partial_num"] == 0


def test_different_widths_are_padded_left_for_prompts_right_for_responses() -> None:
    short = _sample("s", 2, 3)
    long = _sample("long", 4, 5)
    batch, _ = assemble_batch_from_rollout_samples([short, long])
    t = padded_arrays(batch)
    assert t["prompts"].shape == (4, 4) and t["responses"].shape == (4, 5)
    assert t["input_ids"].shape == (4, 9) and t["rollout_log_probs"].shape == (4, 5)
    assert t["input_ids"].dtype == np.int64 and t["attention_mask"].dtype == np.int64
    sb, lb = short.full_batch, long.full_batch
    prompt, resp = sb.prompt_ids.tolist(), sb.response_ids[:3].tolist()
    # prompt left-padded with 0, response right-padded with 0
    np.testing.assert_array_equal(t["prompts"][0], [0, 0, *prompt])
    np.testing.assert_array_equal(t["responses"][0], [*resp, 0, 0])
    np.testing.assert_array_equal(t["input_ids"][0], [0, 0, *prompt, *resp, 0, 0])
    np.testing.assert_array_equal(t["attention_mask"][0], [0, 0, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(t["response_mask"][0], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(t["rollout_log_probs"][0], [*sb.tokens["rollout_log_probs"][:3], 0, 0])
    # the long sample's rows: nothing to pad
    np.testing.assert_array_equal(t["input_ids"][2], [*lb.prompt_ids, *lb.response_ids[:5]])
    assert batch.meta_info["global_token_num"] == [5, 5, 9, 9]


def test_samples_with_different_keys_are_refused() -> None:
    a, b = _sample("a", 2, 3), _sample("b", 2, 3)
    b.full_batch.tokens["token_level_scores"] = np.zeros(b.full_batch.response_ids.size, np.float32)
    with pytest.raises(ValueError, match="sample b: tokens keys"):
        assemble_batch_from_rollout_samples([a, b])
