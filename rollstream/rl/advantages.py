"""Advantages: GRPO (each trajectory's reward normalised within its prompt's group), token-level GRPO, and
REINFORCE++ (token returns whitened over the whole batch)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    n: int,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    unbiased: bool = True,
    norm_by_mean: bool = False,
) -> torch.Tensor:
    """Group-normalised advantages [B*n] from rewards [B*n] (group-contiguous) or [B, n].

    A = (r - mean_group) / (std_group + eps), or r - mean_group when `norm_by_std` is False.
    `unbiased=True` (the default) is verl's choice: `torch.std`'s Bessel-corrected std.
    `norm_by_mean` (instead of the std): divide by the group's mean reward above its lowest one, so with 0/1
    rewards the expected gradient is that of log P(right) rather than P(right):
    one right answer in 8 gets 7 (the std gives it 2.5), one wrong answer in 8 gets -1 (the std: -2.5), and
    a problem the group rarely solves weighs as much as a solved one. Measured from the group's lowest
    reward, a partial credit that every answer earns shifts nothing (as with the std).
    An all-equal group gets 0. A group of one (n=1) keeps its raw reward, as verl does
    (mean 0, std 1 for singleton groups): plain REINFORCE without a baseline.
    """
    if n < 1:
        raise ValueError(f"group size n must be >= 1, got {n}")
    if rewards.numel() % n != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n={n}")
    scores = rewards.detach().reshape(-1, n).to(torch.float32)  # [B, n]
    if n == 1:
        return (scores / (1.0 + eps) if norm_by_std else scores).reshape(-1)  # [B]
    mean = scores.mean(dim=-1, keepdim=True)  # [B, 1]
    centred = scores - mean  # [B, n]
    if norm_by_mean:
        centred = centred / (mean - scores.amin(dim=-1, keepdim=True) + eps)  # [B, n]
    elif norm_by_std:
        std = scores.std(dim=-1, keepdim=True, unbiased=unbiased)  # [B, 1]
        centred = centred / (std + eps)
    return centred.reshape(-1)  # [B*n]


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G[b, t] = sum over response tokens t' >= t of gamma^(t'-t) * token_rewards[b, t'] (mask 1);
    [B, T] -> [B, T], 0 off the mask. gamma 1 is the plain return-to-go, 0 each token's own reward."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = token_rewards.detach().to(torch.float32) * mask  # [B, T]
    if gamma == 1.0:
        return r.flip(-1).cumsum(-1).flip(-1) * mask
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * mask


def grpo_token_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_sizes: list[int],
    eps: float = 1e-6,
    norm_by_std: bool = True,
    gamma: float = 1.0,
    norm_by_mean: bool = False,
) -> torch.Tensor:
    """Token-level GRPO advantages [B, T]: each token's (gamma-discounted) return-to-go minus the mean
    return-to-go of the
    group's responses that also have a token at that position (divided by their std when `norm_by_std`).

    token_rewards, mask [B, T] (groups contiguous, sizes `group_sizes`). A token is credited only with
    rewards at or after it, and compared only with its group's tokens at the same position, so a position
    that every response of a group gets right (or wrong) contributes nothing to the others' advantages
    (with one reward on the last token this is outcome GRPO with a per-position baseline). A position held
    by a single response of a group gets 0; a group of one keeps its raw returns (as `grpo_advantages`).

    `norm_by_mean` (instead of the std): divide by the mean |return| at that position, floored at the
    largest |return| / group size. With 0/1 credit the expected gradient is then that of log P(right) at
    each position (supervised learning on the right tokens the group found) rather than of P(right), so a
    position the group rarely gets right weighs as much as one it nearly always gets right.
    """
    if token_rewards.shape != mask.shape or token_rewards.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and mask {tuple(mask.shape)} must be the same [B, T]"
        )
    if sum(group_sizes) != token_rewards.shape[0] or any(n < 1 for n in group_sizes):
        raise ValueError(f"group sizes {group_sizes} do not cover {token_rewards.shape[0]} rows")
    m = mask.detach().to(torch.float32)  # [B, T]
    ret = returns_to_go(token_rewards, m, gamma)  # [B, T]
    out = torch.zeros_like(ret)
    start = 0
    for n in group_sizes:
        g_ret, g_m = ret[start : start + n], m[start : start + n]  # [n, T]
        if n == 1:
            out[start : start + n] = g_ret
        else:
            count = g_m.sum(0, keepdim=True)  # [1, T] responses with a token at t
            mean = g_ret.sum(0, keepdim=True) / count.clamp_min(1)
            centred = (g_ret - mean) * g_m
            if norm_by_mean:
                floor = (g_ret.abs() * g_m).amax(0, keepdim=True) / n  # [1, T]
                centred = centred / (torch.maximum(mean.abs(), floor) + eps)
            elif norm_by_std:
                var = (centred**2).sum(0, keepdim=True) / (count - 1).clamp_min(1)  # Bessel, as torch.std
                centred = centred / (var.sqrt() + eps)
            out[start : start + n] = centred * (count > 1)
        start += n
    return out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    reduce: Callable[[list[float]], list[float]] | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages [B, T] (verl's `reinforce_plus_plus`, without its in-reward KL): each token's
    (gamma-discounted) return-to-go, whitened over every response token of the batch: (G - mean) / sqrt(var +
    1e-8), var Bessel-corrected, 0 off the mask. The baseline is the batch's, not the group's, so a position
    that every response of a group gets wrong still gets a negative advantage when the rest of the batch
    does better there. `reduce` sums [sum, sum of squares, count] over data-parallel ranks (None: this
    process holds the whole batch)."""
    if token_rewards.shape != mask.shape or token_rewards.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and mask {tuple(mask.shape)} must be the same [B, T]"
        )
    m = mask.detach().to(torch.float32)  # [B, T]
    ret = returns_to_go(token_rewards, m, gamma)  # [B, T]
    stats = [float(ret.sum()), float((ret**2).sum()), float(m.sum())]
    total, squares, count = reduce(stats) if reduce is not None else stats
    if count < 1:
        return torch.zeros_like(ret)
    mean = total / count
    var = max(squares / count - mean * mean, 0.0) * (count / (count - 1) if count > 1 else 1.0)
    return (ret - mean) / math.sqrt(var + 1e-8) * m
