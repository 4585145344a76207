"""RL math for rollstream: advantages, masked reductions, PPO losses, KL, batch metrics (pure torch)."""

from rollstream.rl.advantages import (
    grpo_advantages,
    grpo_token_advantages,
    reinforce_pp_advantages,
    returns_to_go,
)
from rollstream.rl.masked import AggMode, agg_loss, masked_mean, masked_sum
from rollstream.rl.metrics import (
    finite_metrics,
    length_metrics,
    reward_metrics,
    staleness_metrics,
    summary_stats,
)
from rollstream.rl.ppo import PPOMode, clipped_surrogate, low_var_kl, ppo_loss

__all__ = [
    "AggMode",
    "PPOMode",
    "agg_loss",
    "clipped_surrogate",
    "finite_metrics",
    "grpo_advantages",
    "grpo_token_advantages",
    "length_metrics",
    "low_var_kl",
    "masked_mean",
    "masked_sum",
    "ppo_loss",
    "reinforce_pp_advantages",
    "returns_to_go",
    "reward_metrics",
    "staleness_metrics",
    "summary_stats",
]
