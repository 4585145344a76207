"""Producer statistics over a window (since the last ProducerStats event) and the run-long counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from producers.rollout import Trajectory
from rollstream.config import PipelineConfig
from rollstream.pacing.counters import RolloutCounts
from rollstream.tasks import RewardResult
from schemas import ANSWER_METRIC_PREFIX, WINDOW_GEN_S, WINDOW_IDLE_S, WINDOW_S, ProducerStats

#: A task's per-answer reward metrics (RewardResult.metrics) reach the stats under ANSWER_METRIC_PREFIX, the
#: mean over the window's trajectories, except those the window already reports: `acc` (producer/acc) and
#: `score` (producer/reward_mean).
COVERED_REWARD_METRICS = frozenset({"acc", "score"})


@dataclass
class Counters:
    """Run-long totals of one producer (logged; samples carry the global `rollout_status` instead)."""

    dispatched: int = 0  # leased prompts dispatched and generated
    published: int = 0  # samples XADDed to rollouts
    tokens: int = 0  # model-generated response tokens
    idle_s: float = 0.0  # waiting for a lease or a new version
    gen_s: float = 0.0  # inside the agent loops
    versions_loaded: int = 0
    partial_swaps: int = 0  # trajectories whose weights changed mid-generation (start < end)
    tool_calls: int = 0
    released_on_start: int = 0  # leased prompts a crashed predecessor never published (dispatched again)



@dataclass
class StatsWindow:
    """Accumulates what happened since the last ProducerStats event."""

    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    trajectories: int = 0
    tokens: int = 0
    gen_s: float = 0.0
    idle_s: float = 0.0
    partial: int = 0
    tool_calls: int = 0
    reward_sum: float = 0.0
    exact_sum: float = 0.0
    length_sum: int = 0
    reward_metric_sums: dict[str, float] = field(default_factory=dict)  # the task's own per-answer metrics
    versions: set[int] = field(default_factory=set)
    swaps: int = 0
    swap_s: float = 0.0

    def add_swap(self, seconds: float) -> None:
        """Count one weight swap (a new version loaded into the engine) and its duration."""
        self.swaps += 1
        self.swap_s += seconds

    def add_sample(self, trajs: list[Trajectory], rewards: list[RewardResult]) -> None:
        """Count one published sample (a prompt's n trajectories with their rewards)."""
        self.samples += 1
        for t, rw in zip(trajs, rewards, strict=True):
            self.trajectories += 1
            self.tokens += t.generated_tokens
            self.length_sum += len(t.response_ids)
            self.reward_sum += rw.score
            self.exact_sum += float(rw.exact)
            for name, value in rw.metrics.items():
                if name not in COVERED_REWARD_METRICS:
                    self.reward_metric_sums[name] = self.reward_metric_sums.get(name, 0.0) + float(value)
            self.partial += int(t.version_start < t.version_end)
            self.tool_calls += len(t.tool_call_s)
            self.versions.update(v for v in (t.version_start, t.version_end) if v >= 0)

    def event(self, producer: str, param_version: int) -> ProducerStats:
        """The window as a ProducerStats event tagged with `param_version`. Its metrics carry the window's
        seconds (WINDOW_S, WINDOW_GEN_S, WINDOW_IDLE_S): the aggregator merges the windows of a step's span
        with them (consumers/aggregator/windows.py merge_windows)."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        n = max(self.trajectories, 1)
        metrics: dict[str, float] = {
            "producer/samples": float(self.samples),
            WINDOW_S: elapsed,
            WINDOW_GEN_S: self.gen_s,
            WINDOW_IDLE_S: self.idle_s,
            "producer/partial_ratio": self.partial / n,
            "producer/tool_calls": float(self.tool_calls),
            "producer/weight_swaps": float(self.swaps),
        }
        if self.swaps:
            metrics["producer/weight_swap_s"] = self.swap_s / self.swaps  # mean time to load one version
        if self.trajectories:
            metrics["producer/reward_mean"] = self.reward_sum / n
            metrics["producer/acc"] = self.exact_sum / n
            metrics["producer/response_length_mean"] = self.length_sum / n
            for name, total in self.reward_metric_sums.items():
                metrics[f"{ANSWER_METRIC_PREFIX}{name}"] = total / n
        return ProducerStats(
            producer=producer,
            param_version=param_version,
            samples=self.samples,
            tokens=self.tokens,
            gen_tokens_per_s=self.tokens / self.gen_s if self.gen_s > 0 else 0.0,
            idle_ratio=min(1.0, self.idle_s / elapsed),
            versions_in_use=sorted(self.versions) or [param_version],
            metrics=metrics,
        )


def rollout_status(counts: RolloutCounts, cfg: PipelineConfig, param_version: int) -> dict[str, float | int]:
    """The rollout side's global status when a sample finished, under verl fully-async's rollouter names
    (`get_statistics`; the trainer prefixes them with `fully_async/`): all producers' counts, the queue
    (published and not yet consumed, from the pacing counters: producers may not read the rollouts
    stream) and the static pacing figures."""
    lm = cfg.bench.latency_model
    per_producer = lm.concurrency if lm.enable else cfg.rollout.prompts_per_dispatch
    return {
        "count/total_generated_samples": counts.published,
        "count/dropped_stale_samples": counts.dropped_stale,
        "count/current_param_version": param_version,
        "monitor/active_tasks_size": counts.in_flight,
        "monitor/queue/mq_queue_size": counts.queued,
        "static/max_required_samples": cfg.max_outstanding,
        "static/required_samples": cfg.actor.ppo_mini_batch_size,
        "static/staleness_threshold": cfg.async_training.staleness_threshold,
        "static/max_queue_size": cfg.max_outstanding,
        "static/max_concurrent_samples": cfg.rollout.num_producers * per_producer,
    }
