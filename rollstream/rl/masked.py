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


def agg_count(mask: torch.Tensor, mode: AggMode = "token-mean") -> float:
    """What `agg_loss` divides by: valid tokens (token-mean), rows (seq-mean-token-sum) or rows with a valid
    token (seq-mean-token-mean). A micro-batch's agg_loss times its count / the mini-batch's count, summed
    over micro-batches, is the mini-batch's agg_loss (gradient accumulation without changing the loss)."""
    if mode == "token-mean":
        return float(mask.float().sum())
    if mode == "seq-mean-token-sum":
        return float(mask.shape[0])
    if mode == "seq-mean-token-mean":
        return float((mask.float().sum(dim=-1) > 0).sum())
    raise ValueError(f"unknown loss aggregation mode {mode!r}")
