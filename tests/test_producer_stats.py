"""A producer's stats window: what its sampled answers scored, the task's own metrics included (no Redis)."""

from __future__ import annotations

import pytest

from producers.rollout import Trajectory
from producers.stats import StatsWindow
from rollstream.tasks import RewardResult
from schemas import WINDOW_GEN_S, WINDOW_IDLE_S, WINDOW_S


def test_the_window_reports_accuracy_reward_and_every_task_metric_as_a_mean_over_its_trajectories() -> None:
    window = StatsWindow()
    trajs = [Trajectory(prompt_ids=[1], response_ids=[2, 3]), Trajectory(prompt_ids=[1], response_ids=[4])]
    window.add_sample(trajs, [
        RewardResult(1.0, True, {"acc": 1.0, "score": 1.0, "wrong_sign": 0.0, "answered": 1.0}),
        RewardResult(0.25, False, {"acc": 0.0, "score": 0.25, "wrong_sign": 1.0, "answered": 1.0}),
    ])
    window.add_sample(trajs, [RewardResult(0.0, False, {"wrong_sign": 0.0, "answered": 0.0})] * 2)
    m = window.event("p", 3).metrics
    assert m["producer/acc"] == pytest.approx(0.25) and m["producer/reward_mean"] == pytest.approx(0.3125)
    assert m["producer/reward/wrong_sign"] == pytest.approx(0.25)
    assert m["producer/reward/answered"] == pytest.approx(0.5)
    assert "producer/reward/acc" not in m and "producer/reward/score" not in m  # reported once, above


def test_the_window_carries_its_seconds_for_the_aggregator_to_merge_a_step_of_windows() -> None:
    """A step's record merges every window of its span: rates from the windows' generation and window
    seconds (schemas WINDOW_*), so each window must carry them, consistent with its own rate and ratio."""
    window = StatsWindow()
    window.add_sample([Trajectory(prompt_ids=[1], response_ids=[2, 3])],
                      [RewardResult(1.0, True, {})])
    window.gen_s, window.idle_s = 0.5, 0.25
    ev = window.event("p", 0)
    assert ev.metrics[WINDOW_GEN_S] == 0.5 and ev.metrics[WINDOW_IDLE_S] == 0.25
    assert ev.gen_tokens_per_s == pytest.approx(ev.tokens / ev.metrics[WINDOW_GEN_S])
    assert ev.idle_ratio == pytest.approx(min(1.0, 0.25 / ev.metrics[WINDOW_S]))
