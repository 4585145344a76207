"""Masked reductions and token-level loss aggregation (pure torch).

Masks are 0/1 tensors (bool or float) of the same shape as the values. A reduction over an
all-zero mask returns 0 rather than NaN: an empty micro-batch must never poison a gradient step.
"""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set, over `dim` (all elements when None)."""
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is set; 0 where the mask is empty."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar the way verl's `agg_loss` does.

    token-mean:          sum over all valid tokens / number of valid tokens
    seq-mean-token-sum:  per-sequence token sum, then mean over all B sequences (Dr. GRPO style)
    seq-mean-token-mean: per-sequence token mean, then mean over sequences with >= 1 valid token
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        seq_loss = masked_sum(loss_mat, mask, dim=-1)  # [B]
        return seq_loss.mean()
    if mode == "seq-mean-token-mean":
        seq_loss = masked_mean(loss_mat, mask, dim=-1)  # [B]
        seq_valid = mask.to(loss_mat.dtype).sum(dim=-1) > 0  # [B]
        return masked_mean(seq_loss, seq_valid)
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


#: Which of `loss_denominators` each aggregation mode divides by.
_DENOMINATOR = {"token-mean": 0, "seq-mean-token-sum": 1, "seq-mean-token-mean": 2}


def loss_denominators(mask: torch.Tensor) -> tuple[float, float, float]:
    """What `agg_loss` divides by, per mode, for a [B, T] mask: (valid tokens, rows, rows with >= 1 valid token)."""
    valid = mask.detach().to(torch.float64)
    return float(valid.sum()), float(mask.shape[0]), float((valid.sum(dim=-1) > 0).sum())


def dp_loss_scale(
    mask: torch.Tensor, mode: AggMode, global_denominators: tuple[float, float, float] | list[float], dp_size: int
) -> float:
    """Factor turning `agg_loss` over one data-parallel rank's rows into that rank's share of the loss over
    every rank's rows, as verl's `agg_loss(..., dp_size, batch_num_tokens, global_batch_size)` does.

    `global_denominators` is `loss_denominators` summed over the ranks. token-mean becomes (this rank's
    masked token sum) / (all ranks' valid tokens) * dp_size, and the seq-means likewise over all ranks'
    rows; DDP then averages gradients over dp_size ranks, so the update equals one process training every
    rank's rows at once. A world of one gives exactly 1.0.
    """
    i = _DENOMINATOR[mode]
    local = loss_denominators(mask)[i]
    return max(local, 1.0) * dp_size / max(float(global_denominators[i]), 1.0)
