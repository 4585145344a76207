"""A mini-batch's advantages, as `algorithm.adv_estimator` asks: GRPO per sample group ([B], each
trajectory's reward normalised within its prompt's group), or token-level ([B, W]: grpo_token, position by
position within a group, or reinforce_plus_plus, whitened over the batch) from per-token rewards (a
sample's `token_level_scores`, else its reward on its last response token). The math is
rollstream/rl/advantages.py; this module picks it and lays the rewards out as the padded mini-batch has them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollstream.config import AlgorithmConfig
from rollstream.rl.advantages import grpo_advantages, grpo_token_advantages, reinforce_pp_advantages


def group_advantages(
    rewards: torch.Tensor, group_sizes: list[int], norm_by_std: bool = True, norm_by_mean: bool = False
) -> torch.Tensor:
    """GRPO advantages [B] for contiguous groups of the given sizes (std-normalised unless
    norm_by_std=False; divided by the group's mean reward above its lowest instead when norm_by_mean)."""
    if len(set(group_sizes)) == 1:
        return grpo_advantages(rewards, n=group_sizes[0], norm_by_std=norm_by_std, norm_by_mean=norm_by_mean)
    parts, start = [], 0
    for n in group_sizes:
        parts.append(grpo_advantages(rewards[start : start + n], n=n, norm_by_std=norm_by_std,
                                     norm_by_mean=norm_by_mean))
        start += n
    return torch.cat(parts)


def token_rewards(
    rewards: torch.Tensor, resp_mask: torch.Tensor, scores: torch.Tensor | None
) -> torch.Tensor:
    """Per-token rewards [B, R]: the sample's `token_level_scores` when it has them, else each response's
    reward on its last response token (verl's placement of an outcome score)."""
    if scores is not None:
        return scores * resp_mask
    last = (resp_mask.cumsum(-1) == resp_mask.sum(-1, keepdim=True)) & (resp_mask > 0)  # [B, R]
    first_last = last & (last.cumsum(-1) == 1)
    return first_last.to(rewards.dtype) * rewards[:, None]


def _token_advantages(
    rewards: torch.Tensor,
    resp_mask: torch.Tensor,
    scores: torch.Tensor | None,
    groups: list[int],
    algorithm: AlgorithmConfig,
    reduce: Callable[[list[float]], list[float]],
) -> torch.Tensor:
    """Token-level advantages [B, W] of the mini-batch (`algorithm.adv_estimator` grpo_token or
    reinforce_plus_plus): its responses share one column layout, so a group is compared position by
    position as padded. `reduce` sums REINFORCE++'s batch statistics over ranks."""
    per_token = token_rewards(rewards, resp_mask, scores)
    if algorithm.adv_estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(per_token, resp_mask, gamma=algorithm.gamma, reduce=reduce)
    return grpo_token_advantages(
        per_token,
        resp_mask,
        groups,
        norm_by_std=algorithm.norm_adv_by_std_in_grpo,
        gamma=algorithm.gamma,
        norm_by_mean=algorithm.norm_adv_by_mean,
    )


def minibatch_advantages(
    algorithm: AlgorithmConfig,
    resp_mask: torch.Tensor | None,
    groups: list[int],
    rewards: torch.Tensor,
    scores: torch.Tensor | None,
    reduce: Callable[[list[float]], list[float]],
) -> tuple[torch.Tensor, float]:
    """The mini-batch's advantages (on the CPU), GRPO per sample group [B] or token-level [B, W] over
    `resp_mask` [B, W] (read only then: None will do for GRPO's), and their mean over the response tokens
    (outcome: over the samples); `reduce` sums REINFORCE++'s batch statistics over ranks."""
    if algorithm.adv_estimator != "grpo":
        if resp_mask is None:
            raise ValueError(f"adv_estimator={algorithm.adv_estimator} needs the padded response mask")
        mask = resp_mask.cpu()
        adv = _token_advantages(rewards, mask, scores, groups, algorithm, reduce)
        n_tok = float(mask.sum())
        return adv, (float((adv * mask).sum()) / n_tok if n_tok else 0.0)
    adv = group_advantages(rewards, groups, algorithm.norm_adv_by_std_in_grpo, algorithm.norm_adv_by_mean)
    return adv, float(adv.mean())
