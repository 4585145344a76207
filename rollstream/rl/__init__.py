"""RL math for rollstream: advantages, masked reductions, PPO losses, KL, batch metrics (pure torch)."""

from rollstream.rl.advantages import grpo_advantages, grpo_token_advantages, returns_to_go
from rollstream.rl.masked import AggMode, agg_loss, masked_mean, masked_sum
from rollstream.rl.metrics import (
    finite_metrics,
    length_metrics,
    reward_metrics,
    staleness_metrics,
    tensor_summary,
)
from rollstream.rl.ppo import (
    KLKind,
    PPOMode,
    clipped_surrogate,
    dual_clip,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    ppo_loss,
)

__all__ = [
    "AggMode",
    "KLKind",
    "PPOMode",
    "agg_loss",
    "clipped_surrogate",
    "dual_clip",
    "entropy_from_logits",
    "finite_metrics",
    "grpo_advantages",
    "grpo_token_advantages",
    "kl_penalty",
    "length_metrics",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "ppo_loss",
    "returns_to_go",
    "reward_metrics",
    "staleness_metrics",
    "tensor_summary",
]
