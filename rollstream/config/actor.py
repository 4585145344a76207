"""`actor:` (verl's names): the policy-gradient update and its optimizer (`actor.optim`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.config.base import Section


class OptimConfig(Section):
    """The actor's AdamW optimizer (verl's actor.optim)."""

    lr: float = Field(3e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    clip_grad: float = Field(1.0, gt=0, description="Max global grad norm")
    master_weights: bool = Field(
        False,
        description="Mixed precision with model.dtype bfloat16/float16 weights: float32 master copies take "
                    "the AdamW step and are checkpointed, the module (forward, backward, published weights) "
                    "is refreshed from them; one trainer process. With model.dtype fast it applies where the "
                    "weights came out bfloat16 (float32 weights need no copies)",
    )
    fused: bool | None = Field(
        None,
        description="AdamW's fused kernel, one pass over every parameter (SmolLM2's 134.5M float32 on one "
                    "CPU core: 0.64 -> 0.15 s a step); null = on unless the trainer shards (fsdp)",
    )


class ActorConfig(Section):
    """The policy-gradient update."""

    ppo_mini_batch_size: int = Field(
        8, ge=1, description="Samples per local update (one optimizer step per epoch, actor.ppo_epochs)"
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Optimizer steps per local update on its one mini-batch (verl's ppo_epochs): every "
        "epoch's clipped PPO ratio is against the same log-probs, fixed for the update (the behaviour's in "
        "bypass mode, the proximal copy's in decoupled mode), so later epochs stay within the trust region",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="The AdamW optimizer")
    clip_ratio: float = Field(
        0.2, gt=0, description="PPO clip epsilon (low side, and high side unless clip_ratio_high)"
    )
    clip_ratio_high: float | None = Field(
        None, gt=0, description="PPO clip epsilon, high side (DAPO clip-higher)"
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean", description="How token losses are aggregated"
    )
    kl_loss_coef: float = Field(
        0.0, ge=0, description="Weight of the KL loss (low_var_kl) to the frozen reference policy (0 = off)"
    )
    entropy_coeff: float = Field(
        0.0, ge=0, description="Entropy bonus weight (at global step 1 when entropy_decay_steps > 0)"
    )
    entropy_decay_steps: int = Field(
        0,
        ge=0,
        description="Decay the entropy bonus linearly to 0 over this many global steps (0 = constant)",
    )
    micro_batch_size: int = Field(
        0,
        ge=0,
        description="Trajectories per forward/backward inside a local update, gradients accumulated (0 = all "
        "at once)",
    )
    zero_advantage_rows: Literal["train", "skip", "drop"] = Field(
        "train",
        description="Rows whose GRPO advantage is exactly 0 (a group that all got one reward): train = "
        "forwarded like any; skip = not forwarded but counted in what the loss divides by (the same update, "
        "cheaper); drop = neither (the update of the groups with reward variance alone: DAPO's dynamic "
        "sampling without a refill). skip/drop need outcome grpo, no entropy bonus or KL, bypass mode "
        "without rejection and one trainer process",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute decoder-layer activations in backward instead of keeping them "
        "(model.backend=hf)",
    )
    logprob_chunk_size: int = Field(
        1024,
        ge=0,
        description="Tokens per output-head chunk when computing log-probs/entropy (0 = all at once; "
        "backend=hf)",
    )
