"""`algorithm:` (verl's names): the advantage estimator and its discount, rollout correction of
behaviour/trainer mismatch, DAPO's dynamic sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollstream.config.base import Section
from rollstream.rl.correction_spec import parse_is_threshold, parse_rs_options, parse_rs_thresholds


class RolloutCorrectionConfig(Section):
    """Rollout correction (verl's algorithm.rollout_correction): IS weights and rejection of tokens or
    sequences whose rollout log-probs disagree with the trainer's (rollstream/rl/rollout_correction.py)."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        "token",
        description="IS weight pi_old/pi_rollout per token or per sequence (product); null = none (verl's "
                    "default)",
    )
    rollout_is_threshold: float | str = Field(
        5.0,
        description="IS bound: a number U truncates weights to <= U (TIS); 'L_U' zeroes weights outside [L, "
                    "U] (IcePop)",
    )
    rollout_is_batch_normalize: bool = Field(
        False, description="Divide IS weights by their mean over the mini-batch (every data-parallel rank's)"
    )
    rollout_rs: str | None = Field(
        None,
        description="Rejection: comma-separated token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3} "
                    "(geometric), "
        "seq_max_k{2,3} (veto); null = none",
    )
    rollout_rs_threshold: float | str | None = Field(
        None,
        description="Rejection bound(s), one or one per option: k1 takes ratio bounds 'L_U' (U alone: L = "
                    "1/U), k2/k3 an upper bound",
    )

    bypass_mode: bool = Field(
        False,
        description="false: proximal log-probs pinned per global step are the PPO old policy (decoupled); "
        "true: the behaviour (rollout) log-probs are",
    )

    @model_validator(mode="after")
    def _parse(self) -> RolloutCorrectionConfig:
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        return self



class FilterGroupsConfig(Section):
    """DAPO dynamic sampling (as verl's algorithm.filter_groups): groups without reward variance are not
    trained."""

    enable: bool = Field(
        False,
        description="Evict groups whose trajectories all got the same reward (no GRPO signal) and refill the "
        "batch",
    )




class AlgorithmConfig(Section):
    """How advantages are computed and off-policy samples corrected (verl's `algorithm:`)."""

    adv_estimator: Literal["grpo", "grpo_token", "reinforce_plus_plus"] = Field(
        "grpo",
        description="grpo = one outcome advantage per response; grpo_token = token-level credit "
        "(return-to-go vs the group's same position); reinforce_plus_plus = token returns whitened "
        "over the whole mini-batch (verl's name)",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="grpo_token / reinforce_plus_plus: discount of later token rewards in a token's return "
        "(1 = return-to-go, 0 = its own reward)",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True,
        description="GRPO: divide group-centred rewards by the group std (False = Dr. GRPO, centring only)",
    )
    norm_adv_by_mean: bool = Field(
        False,
        description="Divide group-centred rewards by the group's mean reward above its lowest (grpo) or "
        "mean |return| per position (grpo_token), not the std: the gradient of log P(right), so "
        "rarely-right problems weigh as much as solved ones",
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Rollout correction: IS weights, rejection, mismatch metrics (the default: "
        "min(pi_prox/pi_behave, 5))",
    )
    filter_groups: FilterGroupsConfig = Field(
        default_factory=FilterGroupsConfig,
        description="Dynamic sampling: zero-variance groups evicted, budget given back",
    )
