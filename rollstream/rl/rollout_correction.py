"""Rollout correction (verl's docs/algo/rollout_corr.md): the rollout's log-probs against the trainer's.

The policy that sampled the tokens (pi_rollout: the producer's weights, its engine, its precision) is never
exactly the trainer's (pi_old: the proximal weights in decoupled mode). With the per-token log-ratio
log_ratio = log pi_old - log pi_rollout [B, T]:

  IS weights      rollout_is=token:    w_t = exp(log_ratio_t)                      (per token)
                  rollout_is=sequence: w   = exp(sum_t log_ratio_t), on every token (per sequence)
                  threshold "U": TIS, w clamped to <= U; threshold "L_U": IcePop, w zeroed outside [L, U];
                  optional batch normalisation to mean 1. Detached: they change the measure, not the
                  objective.
  rejection (RS)  tokens or whole sequences whose divergence leaves a trust region are masked out of the loss.
                  Divergences per token: k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 -
                  log_ratio.
                  token_k{1,2,3}     per token                       (token-level rejection)
                  seq_sum_k{1,2,3}   sum over the sequence           (sequence-level: the product of ratios)
                  seq_mean_k{1,2,3}  mean over the sequence          (geometric: seq_mean_k1 bounds the
                                                                      geometric mean of the ratios)
                  seq_max_k{2,3}     the sequence's worst token      (the veto: one outlier token rejects
                                                                      its whole sequence)
                  k1 options take ratio bounds "L_U" (a single U means L = 1/U) and keep L <= exp(stat) <= U;
                  k2/k3 options take one upper bound. Options chain with commas; every one must pass.
  mismatch        `rollout_corr/…` (KL, k3 KL, perplexities, chi^2) and `training/rollout_probs_diff_…`
  metrics         (|p_rollout - p_trainer| max/mean/std, Pearson correlation of the probabilities):
                  verl's names, computed whatever the options.

Names, defaults of the math and metric keys follow verl's `verl/trainer/ppo/rollout_corr_helper.py` and
`verl/utils/debug/metrics.py`. Where verl would log NaN (one valid token's std) we log 0; with no valid
token only `training/rollout_probs_diff_valid` = 0 is logged. Everything here is pure torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollstream.rl.correction_spec import IS_LEVELS, parse_is_threshold, parse_rs_options, parse_rs_thresholds
from rollstream.rl.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # log-space clamp: exp(±20) stays finite in fp32
PREFIX = "rollout_corr/"


# ---------------------------------------------------------------------------------------------
# importance weights
# ---------------------------------------------------------------------------------------------


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float | str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached truncated IS weights [B, T] (0 on padding) and verl's `rollout_is_…` metrics (unprefixed).

    log_ratio = log pi_old - log pi_rollout [B, T]; level token or sequence; threshold as parse_is_threshold.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} must be one of {IS_LEVELS} (or null)")
    upper, lower = parse_is_threshold(threshold)
    mask_f = mask.to(log_ratio.dtype)
    log_ratio = log_ratio.detach()
    if level == "token":
        stat = log_ratio  # [B, T]
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        stat = masked_sum(log_ratio, mask_f, dim=-1).unsqueeze(-1)  # [B, 1]
        raw = torch.exp(stat.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask_f
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, stat, mask_f, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).float(), mask_f))
    return weights, metrics


def _is_metrics(
    weights: torch.Tensor, raw: torch.Tensor, stat: torch.Tensor, mask: torch.Tensor, level: str,
    upper: float, lower: float | None,
) -> dict[str, float]:
    """verl's compute_is_metrics: applied-weight mean/max/min/std/ESS, raw-ratio fractions, per-sequence
    stats."""
    lo = 1.0 / upper if lower is None else lower
    valid = mask.bool()
    m: dict[str, float] = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(float(stat.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(stat.min()))
        m["rollout_is_ratio_fraction_high"] = float((stat > math.log(upper)).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((stat < math.log(lo)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).float(), mask))
        m["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lo).float(), mask))
        m["rollout_is_max"] = float(weights.masked_fill(~valid, float("-inf")).max())
        m["rollout_is_min"] = float(weights.masked_fill(~valid, float("inf")).min())
    clamped = weights.clamp(0.0, upper)
    mean = masked_mean(clamped, mask)
    m["rollout_is_std"] = (
        float((masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0).sqrt())
        if mask.sum() > 1
        else 0.0
    )
    m["rollout_is_eff_sample_size"] = float(1.0 / masked_mean((clamped / (mean + 1e-8)).square(), mask))
    seq = masked_mean(weights, mask, dim=-1)  # [B]
    raw_seq = masked_mean(raw, mask, dim=-1)  # [B]
    m["rollout_is_seq_mean"] = float(seq.mean())
    m["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = float(seq.max())
    m["rollout_is_seq_min"] = float(seq.min())
    m["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    m["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean())
    m["rollout_is_seq_fraction_low"] = float((raw_seq < lo).float().mean())
    return m


def normalize_is_weights(
    weights: torch.Tensor, mask: torch.Tensor, level: str, total: tuple[float, float] | None = None
) -> tuple[torch.Tensor, float]:
    """Weights divided by their mean (tokens' for token level, sequences' for sequence level) and that
    mean; `total` = (sum, count) summed over data-parallel ranks replaces this batch's own."""
    mask_f = mask.to(weights.dtype)
    if total is None:
        total = normalize_totals(weights, mask, level)
    mean = total[0] / total[1] if total[1] > 0 else 0.0
    if mean <= 1e-8:
        return weights, 1.0
    return weights / mean * mask_f, mean


def normalize_totals(weights: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[float, float]:
    """(sum, count) behind the batch-normalisation mean: over tokens, or over sequences with a token."""
    mask_f = mask.to(weights.dtype)
    if level == "token":
        return float((weights * mask_f).sum()), float(mask_f.sum())
    has_token = mask_f.sum(-1) > 0
    return float(masked_mean(weights, mask_f, dim=-1)[has_token].sum()), float(has_token.sum())


# ---------------------------------------------------------------------------------------------
# rejection sampling
# ---------------------------------------------------------------------------------------------


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token k1, k2, k3 [B, T] of a log-ratio (clamped to the safety bound)."""
    lr = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row max over valid tokens [B] (0 for a row without one)."""
    out = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold: float | str | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask [B, T] with rejected tokens / sequences zeroed, and verl's `rollout_rs_…` metrics."""
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    div = _divergences(log_ratio)
    mask_f = mask.to(log_ratio.dtype)
    valid = mask_f.bool()
    seq_valid = valid.any(-1)  # [B]
    keep = torch.ones_like(mask_f)
    metrics: dict[str, float] = {}
    for option in options:
        kind, k = option.rsplit("_", 1)
        lower, upper = bounds[option]
        lo_stat = math.log(lower) if lower is not None else None
        hi_stat = math.log(upper) if k == "k1" else upper
        per_token = div[k]
        if kind == "token":
            stat, seq_stat = per_token, None
        else:
            reduce = {
                "seq_sum": lambda v: masked_sum(v, mask_f, dim=-1),
                "seq_mean": lambda v: masked_mean(v, mask_f, dim=-1),
                "seq_max": lambda v: _seq_max(v, mask_f),
            }[kind]
            seq_stat = reduce(per_token)  # [B]
            stat = seq_stat.unsqueeze(-1).expand_as(mask_f)
        ok = stat <= hi_stat
        if lo_stat is not None:
            ok = ok & (stat >= lo_stat)
        metrics.update(_rs_metrics(option, stat, seq_stat, mask_f, seq_valid, hi_stat, lo_stat))
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean((~ok).to(mask_f.dtype), mask_f))
        rejected_seq = ((~ok) & valid).any(-1)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            float(rejected_seq[seq_valid].float().mean()) if seq_valid.any() else 0.0
        )
        keep = keep * ok.to(mask_f.dtype)
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1.0 - keep, mask_f))
    metrics["rollout_rs_seq_masked_fraction"] = float(((keep < 0.5) & valid).any(-1).float().mean())
    return (mask_f * keep).to(mask.dtype), metrics


def _rs_metrics(
    option: str,
    stat: torch.Tensor,
    seq_stat: torch.Tensor | None,
    mask: torch.Tensor,
    seq_valid: torch.Tensor,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """verl's compute_rs_metrics of one option (statistic mean/max/min/std, fractions out of bounds,
    per-sequence)."""
    p = f"rollout_rs_{option}"
    valid = mask.bool()
    seq = (seq_stat if seq_stat is not None else masked_mean(stat, mask, dim=-1))[seq_valid]
    lo = lower if lower is not None else 0.0
    m = {f"{p}_mean": float(masked_mean(stat, mask))}
    if seq_stat is not None and seq.numel():
        m[f"{p}_max"], m[f"{p}_min"] = float(seq.max()), float(seq.min())
        m[f"{p}_fraction_high"] = float((seq > upper).float().mean())
        m[f"{p}_fraction_low"] = float((seq < lo).float().mean()) if lower is not None else 0.0
    else:
        m[f"{p}_max"] = float(stat.masked_fill(~valid, float("-inf")).max())
        m[f"{p}_min"] = float(stat.masked_fill(~valid, float("inf")).min())
        m[f"{p}_fraction_high"] = float(masked_mean((stat > upper).float(), mask))
        m[f"{p}_fraction_low"] = float(masked_mean((stat < lo).float(), mask)) if lower is not None else 0.0
    clamped = stat.clamp(lo, upper)
    mean = masked_mean(clamped, mask)
    m[f"{p}_std"] = (
        float((masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0).sqrt())
        if mask.sum() > 1
        else 0.0
    )
    has = seq.numel() > 0
    m[f"{p}_seq_mean"] = float(seq.mean()) if has else 0.0
    m[f"{p}_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    m[f"{p}_seq_max"] = float(seq.max()) if has else 0.0
    m[f"{p}_seq_min"] = float(seq.min()) if has else 0.0
    m[f"{p}_seq_max_deviation"] = float(seq.abs().max()) if has else 0.0
    m[f"{p}_seq_fraction_high"] = float((seq > upper).float().mean()) if has else 0.0
    if lower is not None:
        m[f"{p}_seq_fraction_low"] = float((seq < lower).float().mean()) if has else 0.0
    return m


# ---------------------------------------------------------------------------------------------
# mismatch metrics (every update, whatever the options)
# ---------------------------------------------------------------------------------------------


def offpolicy_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's compute_offpolicy_metrics (unprefixed): KL(rollout || old) k1 and k3, both perplexities, their
    log difference and ratio, token and sequence chi^2. Shapes [B, T]; mask needs a valid token."""
    mask_f = mask.to(old_logp.dtype)
    old, roll = old_logp.detach(), rollout_logp.detach()
    lp_old = masked_mean(old, mask_f, dim=-1)  # [B]
    lp_roll = masked_mean(roll, mask_f, dim=-1)  # [B]
    log_ratio = old - roll
    diff = lp_roll - lp_old  # [B] log(ppl_old / ppl_rollout)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = masked_sum(log_ratio, mask_f, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-lp_old).mean()),
        "training_log_ppl": float((-lp_old).mean()),
        "kl": float(masked_mean(roll - old, mask_f)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask_f)),
        "rollout_ppl": float(torch.exp(-lp_roll).mean()),
        "rollout_log_ppl": float((-lp_roll).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(masked_mean(rho.square(), mask_f) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }


def probs_diff_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's calculate_debug_metrics: |p_old - p_rollout| max/mean/std over valid tokens and the Pearson
    correlation of the two probabilities, as `training/rollout_probs_diff_…` and
    `training/rollout_actor_probs_pearson_corr`; only `…_valid` = 0 when no token is valid."""
    valid = mask.bool()
    if not valid.any():
        return {"training/rollout_probs_diff_valid": 0.0}
    p_old = torch.masked_select(torch.exp(old_logp.detach().double()), valid)
    p_roll = torch.masked_select(torch.exp(rollout_logp.detach().double()), valid)
    diff = (p_old - p_roll).abs()
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": pearson(p_old, p_roll),
    }


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors; 0 when either is constant (verl would give NaN)."""
    dx, dy = x - x.mean(), y - y.mean()
    denom = float(torch.sqrt(dx.square().sum() * dy.square().sum()))
    return float((dx * dy).sum()) / denom if denom > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# all of it, as the learner calls it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Correction:
    """What one mini-batch's correction gives the loss: IS weights (None: none applied), the response mask
    after rejection [B, T], and the metrics under verl's names (prefixed)."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, float]


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> Correction:
    """IS weights (when rollout_is), rejection (when rollout_rs) and the mismatch metrics of one mini-batch
    ([B, T] each; old = the trainer's log-probs, rollout = the behaviour log-probs the sample carries)."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(f"shapes differ: old {tuple(old_logp.shape)}, rollout {tuple(rollout_logp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    metrics = probs_diff_metrics(old_logp, rollout_logp, mask)
    if not mask.bool().any():
        return Correction(None if rollout_is is None else torch.zeros_like(old_logp), mask, metrics)
    log_ratio = old_logp.detach() - rollout_logp.detach()
    raw: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = is_weights(log_ratio, mask, rollout_is, rollout_is_threshold)
        raw.update(is_metrics)
    out_mask = mask
    if rollout_rs is not None:
        out_mask, rs_metrics = rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold)
        raw.update(rs_metrics)
    raw.update(offpolicy_metrics(old_logp, rollout_logp, mask))
    metrics.update({PREFIX + k: v for k, v in raw.items()})
    return Correction(weights, out_mask, metrics)
