"""The policy-gradient update of one local step (decoupled PPO / bypass, GRPO advantages).

  begin_step(g)  at the first local update of global step g: freeze a copy of the weights (version g-1)
                 as the proximal policy; it is pinned for the step's K local updates (decoupled mode)
  update(batch)  one mini-batch -> advantages -> prox/ref log-probs (no grad) -> forward -> loss ->
                 backward -> clip -> AdamW step; returns the update's metrics

Data parallel (consumers/trainer/distributed.py): each rank updates on its share of the mini-batch (whole
samples, so a GRPO group never straddles ranks and its statistics are the group's own). The loss is
normalised by counts summed over every rank (tokens for token-mean, rows for the seq-means: one small
all-reduce per update, `dp_loss_scale`), so after DDP averages the gradients the step equals one process
training the whole mini-batch. Metrics (`actor/loss`, `actor/pg_loss`, …) stay the rank's own means;
the aggregator weights them by each rank's sample_count.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load

from consumers.trainer.distributed import DataParallel, RankInfo, state_bytes
from rollstream.config import PipelineConfig
from rollstream.factory import build_policy
from rollstream.model import BasePolicy
from rollstream.model.base import resolve_device
from rollstream.rl import (
    agg_loss,
    dp_loss_scale,
    grpo_advantages,
    grpo_token_advantages,
    kl_penalty,
    length_metrics,
    loss_denominators,
    ppo_loss,
    reward_metrics,
)
from rollstream.warmstart import load_init
from schemas import DataProto

log = logging.getLogger(__name__)


def trim_padding(ids: torch.Tensor, mask: torch.Tensor, R: int) -> tuple[int, int]:
    """(first column, response width) after dropping all-pad prompt columns on the left and all-pad
    response columns on the right of a [B, P+R] batch."""
    P = ids.shape[1] - R
    prompt_cols = mask[:, :P].any(0).nonzero()
    first = int(prompt_cols[0]) if len(prompt_cols) else P - 1
    resp_cols = mask[:, P:].any(0).nonzero()
    width = int(resp_cols[-1]) + 1 if len(resp_cols) else 1
    return min(first, P - 1), width


def group_advantages(rewards: torch.Tensor, group_sizes: list[int], norm_by_std: bool = True) -> torch.Tensor:
    """GRPO advantages [B] for contiguous groups of the given sizes (std-normalised unless norm_by_std=False)."""
    if len(set(group_sizes)) == 1:
        return grpo_advantages(rewards, n=group_sizes[0], norm_by_std=norm_by_std)
    parts, start = [], 0
    for n in group_sizes:
        parts.append(grpo_advantages(rewards[start : start + n], n=n, norm_by_std=norm_by_std))
        start += n
    return torch.cat(parts)


def token_rewards(rewards: torch.Tensor, resp_mask: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
    """Per-token rewards [B, R]: the sample's `token_level_scores` when it has them, else each response's
    reward on its last response token (verl's placement of an outcome score)."""
    if scores is not None:
        return scores * resp_mask
    last = (resp_mask.cumsum(-1) == resp_mask.sum(-1, keepdim=True)) & (resp_mask > 0)  # [B, R]
    first_last = last & (last.cumsum(-1) == 1)
    return first_last.to(rewards.dtype) * rewards[:, None]


def entropy_coef_at(coef: float, decay_steps: int, global_step: int) -> float:
    """Entropy bonus weight at `global_step` (1-based): `coef`, decayed linearly to 0 over `decay_steps` when > 0."""
    if decay_steps <= 0:
        return coef
    return coef * max(0.0, 1.0 - (global_step - 1) / decay_steps)


class Learner:
    """The trainable policy, its AdamW optimizer, and the frozen proximal / reference copies."""

    def __init__(self, cfg: PipelineConfig, dp: DataParallel | None = None) -> None:
        """Build the policy (version-0 weights from the seed) and its optimizer; `dp` is this rank's
        data-parallel group (None: a world of one on the run's device)."""
        self.cfg = cfg
        self.actor = cfg.actor
        self.dp = dp if dp is not None else DataParallel(RankInfo(), resolve_device(cfg.run.device))
        device = str(self.dp.device)
        self.policy: BasePolicy = build_policy(cfg, device=device)
        if cfg.model.init_from:
            load_init(self.policy, cfg.model.init_from)  # version 0 = the warm start, not the seeded init
            log.info("initial weights from %s", cfg.model.init_from)
        self.device = self.policy.device
        self.global_step = 1  # the global step being trained (set by begin_step)
        self.prox: BasePolicy | None = None
        if self.actor.off_policy_mode == "decoupled":
            self.prox = build_policy(cfg, device=device)
            self.prox.eval()
            self.dp.shard_frozen(self.prox.module)
        self.ref: BasePolicy | None = None
        if self.actor.kl_coef > 0:
            self.ref = build_policy(cfg, device=device)  # the version-0 weights, from the same seed
            self.ref.module.load_state_dict(self.policy.module.state_dict())
            self.ref.eval()
            self.dp.shard_frozen(self.ref.module)
        # DDP wrapper (world > 1) or the module sharded in place (fsdp): before the optimizer sees the params
        self.train_module = self.dp.wrap(self.policy.module)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=self.actor.lr, weight_decay=self.actor.weight_decay
        )

    def weights_bytes(self) -> bytes:
        """The policy's weights as safetensors bytes; under fsdp a collective (every rank calls it, rank 0
        gets the bytes, the others b"")."""
        if not self.dp.sharded:
            return self.policy.state_dict_bytes()
        state = self.dp.full_state_dict(self.policy.module)
        return state_bytes(state) if self.dp.is_main else b""

    def checkpoint_state(self) -> tuple[bytes, dict[str, Any]]:
        """(weights bytes, index-keyed optimizer state_dict) for the checkpoint; under fsdp a collective
        whose result is rank 0's alone."""
        return self.weights_bytes(), self.dp.full_optimizer_state(self.policy.module, self.optimizer)

    def load_checkpoint_state(self, weights: bytes, optimizer_state: dict[str, Any]) -> None:
        """Restore weights and optimizer state read from a checkpoint (every rank, the same values)."""
        if self.dp.sharded:
            self.dp.load_full_state(self.policy.module, self.optimizer, st_load(weights), optimizer_state)
            return
        self.policy.load_state_dict_bytes(weights)
        self.optimizer.load_state_dict(optimizer_state)

    def begin_step(self, global_step: int = 1) -> None:
        """Pin the current weights as the proximal policy for global step `global_step`'s local updates."""
        self.global_step = global_step
        if self.prox is not None:
            self.prox.module.load_state_dict(self.policy.module.state_dict())

    def update(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step on a mini-batch; returns its actor/critic/length/timing metrics."""
        t = batch.tensors
        ids = torch.from_numpy(np.ascontiguousarray(t["input_ids"])).long()  # [B, P+R]
        mask = torch.from_numpy(np.ascontiguousarray(t["attention_mask"])).long()  # [B, P+R]
        R = int(t["responses"].shape[1])
        resp_mask = torch.from_numpy(np.ascontiguousarray(t["response_mask"])).float()  # [B, R]
        behave = torch.from_numpy(np.ascontiguousarray(t["rollout_log_probs"])).float()  # [B, R]
        rewards = torch.from_numpy(np.ascontiguousarray(t["rewards"])).float()  # [B]
        scores = t.get("token_level_scores")
        tok_scores = torch.from_numpy(np.ascontiguousarray(scores)).float() if scores is not None else None  # [B, R]
        first, width = trim_padding(ids, mask, R)
        P = ids.shape[1] - R
        ids, mask = ids[:, first : P + width], mask[:, first : P + width]
        resp_mask, behave = resp_mask[:, :width], behave[:, :width]
        dev = self.device
        ids, mask, resp_mask, behave = ids.to(dev), mask.to(dev), resp_mask.to(dev), behave.to(dev)

        # 1. GRPO advantages per sample group: [B] (outcome) or [B, R] (token-level credit)
        groups = list(batch.meta_info["group_sizes"])
        if self.actor.adv_estimator == "grpo_token":
            per_token = token_rewards(rewards, resp_mask.cpu(), tok_scores[:, :width] if tok_scores is not None else None)
            adv = grpo_token_advantages(
                per_token, resp_mask.cpu(), groups, norm_by_std=self.actor.norm_adv_by_std, gamma=self.actor.gamma
            ).to(dev)
        else:
            adv = group_advantages(rewards, groups, self.actor.norm_adv_by_std).to(dev)

        # 2. proximal / reference log-probs (frozen, no grad)
        t0 = time.perf_counter()
        temp = self.cfg.rollout.temperature  # log-probs of the distribution producers sampled from
        with torch.no_grad():
            prox_logp = self.prox.log_probs(ids, mask, width, temp) if self.prox is not None else None
            ref_logp = self.ref.log_probs(ids, mask, width, temp) if self.ref is not None else None
        t_old = time.perf_counter() - t0

        # 3. forward, loss (normalised over every rank's rows), backward (DDP averages), step
        t0 = time.perf_counter()
        mode = self.actor.loss_agg_mode
        scale = dp_loss_scale(resp_mask, mode, self.dp.all_reduce_sum(loss_denominators(resp_mask)), self.dp.world_size)
        self.policy.train()
        with self.dp.forward_through(self.policy, self.train_module):
            logp, entropy = self.policy.forward_logprobs_entropy(ids, mask, width, temp)  # [B, R] each
        loss, metrics = ppo_loss(
            logp, prox_logp, behave, adv, resp_mask,
            clip_eps=self.actor.clip_ratio, clip_eps_high=self.actor.clip_ratio_high,
            behave_imp_cap=self.actor.behave_imp_cap, mode=self.actor.off_policy_mode,
            loss_agg_mode=self.actor.loss_agg_mode,
        )
        ent = agg_loss(entropy, resp_mask, self.actor.loss_agg_mode)
        ent_coef = entropy_coef_at(self.actor.entropy_coef, self.actor.entropy_decay_steps, self.global_step)
        if ent_coef > 0:
            loss = loss - ent_coef * ent
            metrics["actor/entropy_coef"] = ent_coef
        if ref_logp is not None:
            kl = agg_loss(kl_penalty(logp, ref_logp, "low_var_kl"), resp_mask, self.actor.loss_agg_mode)
            loss = loss + self.actor.kl_coef * kl
            metrics["actor/kl_loss"] = float(kl.detach())
            metrics["actor/kl_coef"] = self.actor.kl_coef
        self.optimizer.zero_grad(set_to_none=True)
        (loss * scale if scale != 1.0 else loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(self.policy.parameters()), self.actor.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under fsdp
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        t_update = time.perf_counter() - t0

        # 4. metrics
        row_tokens = mask.sum(-1).double()  # [B]
        metrics.update({
            "actor/loss": float(loss.detach()),
            "actor/entropy": float(ent.detach()),
            "actor/grad_norm": grad_norm,
            "actor/lr": float(self.optimizer.param_groups[0]["lr"]),
            "critic/rewards/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "critic/advantages/mean": float(adv.mean()) if adv.dim() == 1 else float((adv * resp_mask).sum() / resp_mask.sum()),
            "perf/total_num_tokens": float(row_tokens.sum()),
            "global_seqlen/min": float(row_tokens.min()),
            "global_seqlen/max": float(row_tokens.max()),
            "global_seqlen/minmax_diff": float(row_tokens.max() - row_tokens.min()),
            "timing_s/update_actor": t_update,
        })
        if self.prox is not None or self.ref is not None:
            metrics["timing_s/old_log_prob"] = t_old
        metrics.update(reward_metrics(rewards))
        metrics.update(length_metrics(resp_mask.cpu(), self.cfg.data.max_response_length))
        return metrics
