"""A producer's stats window: what its sampled answers scored, the task's own metrics included (no Redis)."""

from __future__ import annotations

import pytest

from producers.rollout import Trajectory
from producers.stats import StatsWindow
from rollstream.tasks import RewardResult


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
