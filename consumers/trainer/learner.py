# Over 400 lines on purpose: one local update (its tensors, loss and optimizer step) read top to bottom.
"""The policy-gradient update of one local step (decoupled PPO / bypass, GRPO advantages).

  begin_step(g)  at the first local update of global step g: freeze a copy of the weights (version g-1)
                 as the proximal policy; it is pinned for the step's K local updates (decoupled mode)
  update(batch)  one mini-batch, the samples' ragged rows -> outcome advantages [B] from their rewards ->
                 the trained rows (zero-advantage ones left out) padded once into one tensor set
                 (consumers/trainer/batch.py; token-level advantages [B, W] are taken over it) ->
                 micro-batches: row views of actor.micro_batch_size rows, each without its all-padding
                 columns -> prox/ref log-probs (no grad, per micro-batch, written into its rows of the
                 [B, W]) -> rollout correction over the mini-batch (IS weights, rejection, mismatch metrics:
                 rollstream/rl/rollout_correction.py) -> actor.ppo_epochs times (once by default): per
                 micro-batch forward -> loss x its share -> backward (gradients accumulate) -> clip -> AdamW
                 step; returns its metrics (consumers/trainer/metrics.py: built from what it measured)

Memory knobs: `actor.micro_batch_size` (the accumulated update equals the whole-mini-batch one: each
micro-batch's loss is scaled by its share of what the loss aggregation divides by), `actor.
gradient_checkpointing` (HF backend), `actor.logprob_chunk_size` (the output head a chunk at a time),
`model.dtype` (set by build_policy).

Data parallel (consumers/trainer/distributed.py): each rank updates on its share of the mini-batch (whole
samples, so a GRPO group never straddles ranks and its statistics are the group's own). What the loss
aggregation divides by is summed over every rank (one small all-reduce per update), and each micro-batch's
loss is scaled by its count x world_size / that sum, so after DDP averages the gradients the step equals
one process training the whole mini-batch (verl's global-token normalisation); gradients are all-reduced
once per epoch (one optimizer step), at its last micro-batch. Metrics (`actor/loss`, `actor/pg_loss`, …)
stay the rank's own means; the aggregator weights them by each rank's sample_count.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

import torch
from torch.autograd.graph import increment_version

from consumers.trainer.advantages import minibatch_advantages
from consumers.trainer.batch import MiniBatch, Padded, Prepared
from consumers.trainer.distributed import DataParallel, RankInfo
from consumers.trainer.master import MasterWeights
from consumers.trainer.metrics import EpochStats, UpdateStats, update_metrics
from rollstream.config import PipelineConfig
from rollstream.model import BasePolicy, build_policy
from rollstream.model.base import resolve_device
from rollstream.rl.masked import AggMode, agg_count, agg_loss
from rollstream.rl.ppo import entropy_coef_at, low_var_kl, ppo_loss
from rollstream.rl.rollout_correction import (
    Correction,
    normalize_is_weights,
    normalize_totals,
    rollout_correction,
)
from rollstream.weights.fingerprint import policy_probe
from rollstream.weights.store import Probe
from rollstream.weights.tensors import load_init, load_tensors_into, unique_state

log = logging.getLogger(__name__)


class Learner:
    """The trainable policy, its AdamW optimizer, and the frozen proximal / reference copies."""

    def __init__(self, cfg: PipelineConfig, dp: DataParallel | None = None) -> None:
        """Build the policy (version-0 weights from the seed) and its optimizer; `dp` is this rank's
        data-parallel group (None: a world of one on the run's device)."""
        self.cfg = cfg
        self.actor = cfg.actor
        self.algorithm = cfg.algorithm
        #: the PPO old policy: the proximal (pinned per global step) or the behaviour log-probs
        self.off_policy_mode: Literal["decoupled", "bypass"] = (
            "bypass" if cfg.algorithm.rollout_correction.bypass_mode else "decoupled"
        )
        self.dp = dp if dp is not None else DataParallel(RankInfo(), resolve_device(cfg.run.device))
        device = str(self.dp.device)
        self.policy: BasePolicy = build_policy(cfg, device=device)
        if cfg.model.init_from:
            load_init(self.policy, cfg.model.init_from)  # version 0 = the warm start, not the seeded init
            log.info("initial weights from %s", cfg.model.init_from)
        self.device = self.policy.device
        self.policy.logprob_chunk_size = self.actor.logprob_chunk_size
        if self.actor.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.global_step = 1  # the global step being trained (set by begin_step)
        self.prox: BasePolicy | None = None
        # the policy's own train-mode forward gives the proximal log-probs: begin_step pinned its weights, no
        # optimizer step since, and nothing in the forward is random (no dropout)
        self._prox_is_policy = False
        if self.off_policy_mode == "decoupled":
            self.prox = build_policy(cfg, device=device)
            self.prox.logprob_chunk_size = self.actor.logprob_chunk_size
            self.prox.eval()
            self.dp.shard_frozen(self.prox.module)
        self.ref: BasePolicy | None = None
        if self.actor.kl_loss_coef > 0:
            self.ref = build_policy(cfg, device=device)  # the version-0 weights, from the same seed
            self.ref.module.load_state_dict(self.policy.module.state_dict())
            self.ref.logprob_chunk_size = self.actor.logprob_chunk_size
            self.ref.eval()
            self.dp.shard_frozen(self.ref.module)
        # DDP wrapper (world > 1) or the module sharded in place (fsdp): before the optimizer sees the params
        self.train_module = self.dp.wrap(self.policy.module)
        #: float32 copies the optimizer steps when the module is low-precision (actor.optim.master_weights)
        low = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.policy.module.parameters())
        self.master = MasterWeights(self.policy.module) if self.actor.optim.master_weights and low else None
        #: what the optimizer steps and gradient clipping sees: the float32 copies, or the trainable
        #: parameters (with LoRA the factors alone)
        self.trained = (
            self.master.parameters() if self.master is not None
            else [p for p in self.policy.parameters() if p.requires_grad]
        )
        if cfg.model.lora_rank:
            trained = sum(p.numel() for p in self.trained)
            log.info("LoRA rank %d: %d trained numbers", cfg.model.lora_rank, trained)
        fused = self.actor.optim.fused
        self.optimizer = torch.optim.AdamW(
            self.trained, lr=self.actor.optim.lr, weight_decay=self.actor.optim.weight_decay,
            fused=self.dp.fused_adamw(fused),
        )

    def probe(self) -> Probe:
        """The swap check's probe of the current weights (rollstream/weights/fingerprint.py): the fixed probe
        ids and the policy's log-probs of them; every rank calls it (a forward, a collective under fsdp)."""
        return policy_probe(self.policy)

    def whole_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights, tied tensors once: the module's own tensors (no copy) unless sharded; under
        fsdp gathered whole on the CPU, a collective (every rank calls it; rank 0 gets them, the others
        {}): DataParallel.whole_weights."""
        return self.dp.whole_weights(self.policy.module, self._own_weights)

    def _own_weights(self) -> dict[str, torch.Tensor]:
        """The module's own tensors, tied ones once (the float32 copies' values with master weights)."""
        state = unique_state(self.policy.module)
        return self.master.state(state) if self.master is not None else state

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state_dict, index-keyed; under fsdp whole (a collective; rank 0's alone)."""
        return self.dp.full_optimizer_state(self.policy.module, self.optimizer)

    def load_checkpoint_state(
        self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
    ) -> None:
        """Restore weights and optimizer state read from a checkpoint (every rank, the same values; under fsdp
        into the shards: DataParallel.load_full_state)."""
        module, optimizer = self.policy.module, self.optimizer
        self.dp.load_full_state(module, optimizer, weights, optimizer_state,
                                lambda: self._load_own(weights, optimizer_state))

    def _load_own(self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        """load_checkpoint_state of a module that is not sharded."""
        load_tensors_into(self.policy.module, weights)
        if self.master is not None:
            self.master.load(weights)
        self.optimizer.load_state_dict(optimizer_state)
        self._prox_is_policy = False

    def _dp_count(self, total: float) -> tuple[float, int]:
        """(what the loss aggregation divides by, summed over every rank's share of the mini-batch; the
        number of ranks whose gradients DDP averages): (total, 1) in a world of one."""
        return self.dp.all_reduce_sum([total])[0], self.dp.world_size

    def begin_step(self, global_step: int = 1) -> None:
        """Pin the current weights as the proximal policy for global step `global_step`'s local updates."""
        self.global_step = global_step
        if self.prox is not None:
            self.prox.module.load_state_dict(self.policy.module.state_dict())
            self._prox_is_policy = self.policy.train_is_eval()  # once a step, not every update

    def _reuses_forward(self, micro: list[Padded]) -> bool:
        """Whether this update takes the proximal log-probs from its own forward instead of the frozen copy's:
        the step's first update without dropout (`_prox_is_policy`) on one micro-batch (the correction needs
        the whole mini-batch's log-probs before any loss). The numbers are the copy's; one forward is saved
        (the harder config's probe: 0.28 -> 0.226 s a step)."""
        return self._prox_is_policy and len(micro) == 1

    def _before_update(
        self, mini: Padded, micro: list[Padded], temp: float
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, float]:
        """The log-probs taken before the update's losses: the frozen ones (`_frozen_logprobs`) and, when the
        update reuses its forward, that forward (train mode, with grad; its detached log-probs are the
        proximal ones). Returns (proximal or old log-probs, reference log-probs: each laid out as the
        trained rows [kept, W] or None, the forward's (log-probs, entropy) or None, seconds spent on the
        frozen copies); leaves the policy in train mode."""
        reuse = self._reuses_forward(micro)
        t0 = time.perf_counter()
        old, ref = self._frozen_logprobs(mini, micro, temp, skip_prox=reuse)
        t_old = time.perf_counter() - t0
        self.policy.train()
        if not reuse:
            return old, ref, None, t_old
        m = micro[0]
        with self.dp.forward_through(self.policy, self.train_module):
            ahead = self.policy.forward_logprobs_entropy(m.ids, m.mask, m.width, temp, groups=m.groups)
        old = torch.zeros_like(mini.behave)
        m.view(old).copy_(ahead[0].detach())
        return old, ref, ahead, t_old

    def _frozen_logprobs(
        self, mini: Padded, micro: list[Padded], temp: float, skip_prox: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Without grad, laid out as the trained rows [kept, W] (each micro-batch's [b, w] written into its
        view as computed): the log-probs rollout correction compares with the behaviour's (the proximal
        policy's unless `skip_prox`; in bypass mode with rejection the policy's own before the update; else
        none) and the reference policy's (when kl_loss_coef > 0); None for one not taken (or no rows)."""
        old = None if skip_prox else self.prox
        if old is None and self.algorithm.rollout_correction.rollout_rs is not None:
            old = self.policy
            self.policy.eval()  # as the frozen copies run (update() puts it back in train mode)
        old_logp = torch.zeros_like(mini.behave) if old is not None and micro else None
        ref_logp = torch.zeros_like(mini.behave) if self.ref is not None and micro else None
        with torch.no_grad():
            for m in micro:
                if old is not None and old_logp is not None:
                    m.view(old_logp).copy_(old.log_probs(m.ids, m.mask, m.width, temp, groups=m.groups))
                if self.ref is not None and ref_logp is not None:
                    m.view(ref_logp).copy_(self.ref.log_probs(m.ids, m.mask, m.width, temp, groups=m.groups))
        return old_logp, ref_logp

    def _step(self, loss: float) -> tuple[float, bool]:
        """Clip the accumulated gradients and take the optimizer step (on the float32 copies, then refreshing
        the module, with master weights), unless the loss or the norm is non-finite on any rank; returns
        (grad norm, skipped)."""
        if self.master is not None:
            self.master.grads_to_master()
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.actor.optim.clip_grad)
        # a DTensor under fsdp
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # every rank must agree, else their weights part: one rank's non-finite loss skips the step on all
        bad_loss = self.dp.all_reduce_sum([0.0 if math.isfinite(loss) else 1.0])[0] > 0
        skipped = bad_loss or not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            if self.master is not None:
                self.master.to_module()
            else:  # fused AdamW writes without bumping the versions (LoRA's merged weight keys on them)
                increment_version(self.trained)
            self._prox_is_policy = False
        else:
            log.warning("non-finite loss %s or grad norm %s: optimizer step skipped", loss, grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _zero_missing_grads(self) -> None:
        """Zero gradients for the parameters no backward reached (every row left out): the whole batch's
        backward would have given them 0, and AdamW's moments still move on a zero gradient."""
        for p in self.policy.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _correct(
        self, old_logp: torch.Tensor, behave: torch.Tensor, resp_mask: torch.Tensor
    ) -> tuple[Correction, float | None]:
        """Rollout correction of a mini-batch [B, T] with the configured options (IS weights only in decoupled
        mode: in bypass mode the PPO ratio is against the behaviour policy already); batch normalisation
        uses every data-parallel rank's weights. Returns it and the normalisation factor (None: none)."""
        rc = self.algorithm.rollout_correction
        level = rc.rollout_is if self.off_policy_mode == "decoupled" else None
        out = rollout_correction(
            old_logp,
            behave,
            resp_mask,
            rollout_is=level,
            rollout_is_threshold=rc.rollout_is_threshold,
            rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold,
        )
        if out.weights is None or level is None or not rc.rollout_is_batch_normalize:
            return out, None
        weight_sum, count = self.dp.all_reduce_sum(list(normalize_totals(out.weights, resp_mask, level)))
        weights, factor = normalize_is_weights(out.weights, resp_mask, level, (weight_sum, count))
        return Correction(weights, out.mask, out.metrics), factor

    def _trained(self, batch: MiniBatch) -> tuple[Padded, torch.Tensor, float]:
        """The update's trained rows padded once, their advantages on the device and the advantages' mean
        (`minibatch_advantages`). Outcome advantages [B] come from the rows' rewards before any padding, so
        the rows actor.zero_advantage_rows skip / drop leave out (those whose advantage is exactly 0; the
        config checked that nothing else in the step sees them) are never padded; token-level ones [B, W]
        are taken over the padded rows (every row: the config trains them all)."""
        algorithm, reduce = self.algorithm, self.dp.all_reduce_sum
        if algorithm.adv_estimator != "grpo":
            mini = batch.padded(None, self.device)
            adv, mean = minibatch_advantages(algorithm, mini.resp_mask, batch.group_sizes, batch.rewards,
                                             mini.scores, reduce)
            return mini, adv.to(self.device), mean
        adv, mean = minibatch_advantages(algorithm, None, batch.group_sizes, batch.rewards, None, reduce)
        keep = None if self.actor.zero_advantage_rows == "train" else adv != 0
        if keep is not None and bool(keep.all()):
            keep = None
        mini = batch.padded(keep, self.device)
        return mini, (adv if keep is None else adv[keep]).to(self.device), mean

    def _accumulate(
        self, p: Prepared, first: bool, ahead: tuple[torch.Tensor, torch.Tensor] | None
    ) -> EpochStats:
        """One epoch's gradients: per micro-batch, forward (or the forward `ahead`, run before the update: the
        first epoch only), loss scaled by the micro-batch's share of what the aggregation divides by,
        backward (gradients accumulate). Returns what the epoch measured (its loss, ppo_loss's values, and in
        the `first` epoch the mismatch metrics: the sampler against the policy before this update); `update`
        then takes the optimizer step (`_step`)."""
        mode: AggMode = self.actor.loss_agg_mode
        ent_coef = entropy_coef_at(self.actor.entropy_coeff, self.actor.entropy_decay_steps, self.global_step)
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.policy.module.zero_grad(set_to_none=True)  # the module's gradients, moved at the step
        micro_pg: list[tuple[dict[str, float], float, float]] = []  # ppo_loss's, share, token share
        loss = ent = kl = t_update = 0.0
        # bypass without rejection: the mismatch metrics' trainer log-probs [kept, W], as the micro-batches
        # compute them
        now = torch.zeros_like(p.mini.behave) if first and p.correction is None and p.micro else None
        for i, m in enumerate(p.micro):
            # [b, w] views of the [kept, W] (w: the micro-batch's own widest response)
            m_resp, m_behave, m_adv = m.view(p.loss_mask), m.behave, m.view(p.adv)
            m_w = m.view(p.is_w) if p.is_w is not None else None
            prox_logp = m.view(p.old) if self.prox is not None and p.old is not None else None
            ref_logp = m.view(p.ref) if p.ref is not None else None
            count = agg_count(m_resp, mode)
            share = count / p.total if p.total > 0 else 0.0  # of this rank's loss
            ent_share = count / p.trained_total if p.trained_total > 0 else 0.0  # of the trained rows' mean
            grad_share = count * p.ranks / p.every_total if p.every_total > 0 else 0.0  # of every rank's
            tok_share = float(m_resp.sum()) / p.tokens if p.tokens > 0 else 0.0

            t0 = time.perf_counter()
            # DDP's gradient hooks live on its wrapper; gradients are all-reduced at the last micro-batch only
            with (
                self.dp.forward_through(self.policy, self.train_module),
                self.dp.accumulating(self.train_module, last=i + 1 == len(p.micro)),
            ):
                # [b, w] each: the forward run ahead (one micro-batch) or this micro-batch's own
                logp, entropy = ahead or self.policy.forward_logprobs_entropy(m.ids, m.mask, m.width, p.temp,
                                                                             groups=m.groups)
                if now is not None:
                    m.view(now).copy_(logp.detach())
                m_loss, pg_metrics = ppo_loss(
                    logp,
                    prox_logp,
                    m_behave,
                    m_adv,
                    m_resp,
                    clip_eps=self.actor.clip_ratio,
                    clip_eps_high=self.actor.clip_ratio_high,
                    is_weights=m_w,
                    mode=self.off_policy_mode,
                    loss_agg_mode=mode,
                )
                m_ent = agg_loss(entropy, m_resp, mode)
                if ent_coef > 0:
                    m_loss = m_loss - ent_coef * m_ent
                if ref_logp is not None:
                    m_kl = agg_loss(low_var_kl(logp, ref_logp), m_resp, mode)
                    m_loss = m_loss + self.actor.kl_loss_coef * m_kl
                    kl += float(m_kl.detach()) * share
                (m_loss * grad_share).backward()
            t_update += time.perf_counter() - t0
            loss += float(m_loss.detach()) * share
            ent += float(m_ent.detach()) * ent_share
            micro_pg.append((pg_metrics, share, tok_share))
        # the mismatch metrics against the policy's log-probs as it trained on them first
        mismatch = None
        if first:
            trained_corr = p.correction or (
                rollout_correction(now, p.mini.behave, p.mini.resp_mask) if now is not None else None
            )
            mismatch = trained_corr.metrics if trained_corr is not None else {}
        if p.left_out:
            self._zero_missing_grads()  # as the whole batch's backward leaves them: 0, so AdamW still steps
        return EpochStats(micro_pg, loss, ent, ent_coef, kl if self.ref is not None else None,
                          self.actor.kl_loss_coef, t_update, mismatch)

    def update(self, batch: MiniBatch) -> dict[str, float]:
        """One local update on a mini-batch (the samples' rows the assembly took): actor.ppo_epochs optimizer
        steps (one by default) on its trained rows, padded once, in micro-batches that are row views of
        actor.micro_batch_size of them; returns its actor/critic/length/timing metrics, built from what it
        measured by consumers/trainer/metrics.py update_metrics."""
        # 1. advantages: GRPO per sample group [B] (outcome), from the rows' rewards; the rows trained
        #    (zero-advantage ones left out) padded once [kept, P+W] (W: their widest response), per-token
        #    advantages [B, W] taken over that; their micro-batches: row views, each without its all-padding
        #    columns
        t0 = time.perf_counter()
        mini, adv, adv_mean = self._trained(batch)
        t_pad = time.perf_counter() - t0
        micro = mini.micro_batches(self.actor.micro_batch_size)
        resp_mask, behave = mini.resp_mask, mini.behave  # [kept, W]

        # 2. the trainer's log-probs before this update (no grad), per micro-batch: proximal (decoupled; in
        #    bypass mode with rejection, the policy itself) and reference (KL); then rollout correction over
        #    the mini-batch: IS weights [kept, W] or None, the response mask after rejection, verl's metrics.
        #    Taken once: every epoch's ratio, rejection and KL are against these
        temp = self.cfg.rollout.temperature  # log-probs of the distribution producers sampled from
        #    (the step's first update on one micro-batch: the proximal log-probs are its own forward's)
        t0 = time.perf_counter()
        old, ref, ahead, t_old = self._before_update(mini, micro, temp)
        t_before = time.perf_counter() - t0 - t_old
        correction, norm_factor = self._correct(old, behave, resp_mask) if old is not None else (None, None)
        loss_mask = correction.mask.to(resp_mask.dtype) if correction is not None else resp_mask  # [kept, W]
        mode: AggMode = self.actor.loss_agg_mode
        # rows left out count in what the loss divides by, as if trained (skip: loss_mask is resp_mask there,
        # no correction; each row's loss tokens as one column [B, 1] count as its mask's row does), or not
        # (drop: the groups with reward variance are the batch); the metrics' means are over the trained rows
        skip = self.actor.zero_advantage_rows == "skip"
        total = agg_count(batch.response_tokens[:, None] if skip else loss_mask, mode)
        every_total, ranks = self._dp_count(total)
        kept = len(mini)
        prepared = Prepared(
            mini=mini, micro=micro, adv=adv, old=old, ref=ref, correction=correction, loss_mask=loss_mask,
            total=total, trained_total=agg_count(loss_mask, mode), tokens=float(loss_mask.sum()),
            every_total=every_total, ranks=ranks, left_out=kept < len(batch), temp=temp,
        )

        # 3. per epoch: per micro-batch forward, loss x its share, backward (gradients accumulate); then
        #    clip and the optimizer step
        epochs = []
        for epoch in range(self.actor.ppo_epochs):
            stats = self._accumulate(prepared, epoch == 0, ahead if epoch == 0 else None)
            t0 = time.perf_counter()
            stats.grad_norm, stats.skipped = self._step(stats.loss)
            stats.step_s = time.perf_counter() - t0
            epochs.append(stats)

        # 4. metrics: what the update measured, named in one place (consumers/trainer/metrics.py)
        return update_metrics(UpdateStats(
            epochs=epochs, rows=len(batch), kept=kept, pad_s=t_pad, before_s=t_before,
            old_logprob_s=t_old if self.prox is not None or self.ref is not None else None,
            norm_factor=norm_factor, lr=float(self.optimizer.param_groups[0]["lr"]), rewards=batch.rewards,
            adv_mean=adv_mean, row_tokens=batch.row_tokens, response_tokens=batch.response_tokens,
            max_response_length=self.cfg.data.max_response_length,
        ))
