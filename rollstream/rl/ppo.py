"""Policy-gradient losses: decoupled PPO (AReaL / verl non-bypass) and its bypass variant.

Three policies meet in an off-policy update:
  pi_behave  the weights that sampled the tokens (log-probs carried by the rollout sample)
  pi_prox    the trainer's weights at the start of the global step (recomputed once, pinned for K updates)
  pi_theta   the weights being optimised now (the only tensor that carries gradient)

decoupled: ratio = pi_theta / pi_prox is clipped as in PPO, and each token's loss is multiplied by the
           detached importance weight the caller passes (`is_weights`: verl's rollout correction,
           rollstream/rl/rollout_correction.py; the default config's is token-level min(pi_prox / pi_behave,
           5)).
bypass:    pi_prox := pi_behave (verl's `use_rollout_log_probs`); no extra forward pass; the ratio itself
           corrects for the behaviour policy, so `is_weights` is not applied.
"""

from __future__ import annotations

from typing import Literal

import torch

from rollstream.rl.masked import AggMode, agg_loss, masked_mean

PPOMode = Literal["decoupled", "bypass"]

_LOG_RATIO_CLAMP = 20.0  # exp(±20) stays finite in fp32; padding tokens may hold any log-prob
_LOW_VAR_KL_CLAMP = 10.0  # verl clamps the k3 estimate to [-10, 10]


# ---------------------------------------------------------------------------------------------
# KL to the reference policy
# ---------------------------------------------------------------------------------------------


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate [B, T] from sampled-token log-probs [B, T]: Schulman's k3,
    exp(ref - logp) - (ref - logp) - 1 (always >= 0), with the log-ratio clamped to [-20, 20] and the
    estimate to [-10, 10] as verl's `low_var_kl` does."""
    log_ratio = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log(pi_ref / pi_theta)
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    return k3.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


# ---------------------------------------------------------------------------------------------
# PPO surrogate pieces
# ---------------------------------------------------------------------------------------------


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO per-token loss max(-A r, -A clip(r, 1-lo, 1+hi)) [B, T] and where the clip was active [B, T]."""
    loss_unclipped = -adv * ratio  # [B, T]
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    return torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    behave_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_weights: torch.Tensor | None = None,
    mode: PPOMode = "decoupled",
    loss_agg_mode: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled (or bypass) clipped PPO loss (scalar) and its `actor/…` metrics as python floats.

    Shapes: logp, prox_logp, behave_logp, mask [B, T]; advantages [B] (broadcast over tokens)
    or [B, T]. Only `logp` carries gradient; everything else is detached here. `prox_logp` may be
    None in bypass mode. `clip_eps_high` defaults to `clip_eps` (set it higher for DAPO clip-higher).
    `is_weights` [B, T] (detached; decoupled mode only) multiplies each token's loss; None = no weight.
    """
    if mode not in ("decoupled", "bypass"):
        raise ValueError(f"unknown PPO mode {mode!r}")
    behave = behave_logp.detach()  # [B, T]
    if mode == "bypass":
        prox = behave
    elif prox_logp is None:
        raise ValueError("decoupled PPO needs prox_logp (or use mode='bypass')")
    else:
        prox = prox_logp.detach()  # [B, T]
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # [B, 1]
    adv = adv.expand_as(logp)  # [B, T]
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high

    # 1. trust region against the proximal policy
    log_ratio = (logp - prox).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    pg_losses, clipped = clipped_surrogate(ratio, adv, clip_eps, clip_high)  # [B, T]

    # 2. off-policy correction from behaviour to proximal policy (the rollout-correction weights)
    if mode == "decoupled" and is_weights is not None:
        pg_losses = pg_losses * is_weights.detach().to(pg_losses.dtype)  # [B, T]

    # 3. reduce to a scalar
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    metrics = {
        "actor/pg_loss": float(loss.detach()),
        "actor/pg_clipfrac": float(masked_mean(clipped.to(logp.dtype), mask)),
        "actor/pg_clipfrac_lower": 0.0,  # verl's share of dual-clipped tokens: no dual clip here
        "actor/ppo_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }
    return loss, metrics


def entropy_coef_at(coef: float, decay_steps: int, global_step: int) -> float:
    """Entropy bonus weight at `global_step` (1-based): `coef`, decayed linearly to 0 over `decay_steps` when
    > 0."""
    if decay_steps <= 0:
        return coef
    return coef * max(0.0, 1.0 - (global_step - 1) / decay_steps)
