"""Outcome advantages for GRPO: each trajectory's reward normalised within its prompt's group."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    n: int,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    unbiased: bool = True,
) -> torch.Tensor:
    """Group-normalised advantages [B*n] from rewards [B*n] (group-contiguous) or [B, n].

    A = (r - mean_group) / (std_group + eps), or r - mean_group when `norm_by_std` is False.
    `unbiased=True` (the default) is verl's choice: `torch.std`'s Bessel-corrected std.
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
    if norm_by_std:
        std = scores.std(dim=-1, keepdim=True, unbiased=unbiased)  # [B, 1]
        centred = centred / (std + eps)
    return centred.reshape(-1)  # [B*n]
