"""RL math against hand-computed values (CPU, no Redis)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from rollstream.model.logprobs import logprobs_entropy
from rollstream.rl.advantages import grpo_advantages
from rollstream.rl.masked import agg_loss, masked_mean, masked_sum
from rollstream.rl.metrics import length_metrics, reward_metrics, staleness_metrics
from rollstream.rl.ppo import low_var_kl, ppo_loss
from rollstream.rl.rollout_correction import is_weights

approx = pytest.approx


# --- advantages -------------------------------------------------------------------------------


def test_grpo_advantages_population_std_gives_unit_values() -> None:
    # mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = ±1
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), n=4, unbiased=False)
    assert adv.tolist() == approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_grpo_advantages_default_is_verl_unbiased_std() -> None:
    # sample std = sqrt(1/3) -> 0.5 / 0.57735 = 0.866025
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), n=4)
    assert adv.tolist() == approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)


def test_grpo_advantages_2d_input_and_all_equal_group_is_zero() -> None:
    adv = grpo_advantages(torch.tensor([[1.0, 0.0], [3.0, 3.0]]), n=2)
    # group 0: std (unbiased) = sqrt(0.5) = 0.7071 -> ±0.5/0.7071; group 1: all equal -> 0
    assert adv.shape == (4,)
    assert adv.tolist() == approx([0.707106, -0.707106, 0.0, 0.0], abs=1e-5)


def test_grpo_advantages_without_std_norm_and_singleton_groups() -> None:
    adv = grpo_advantages(torch.tensor([2.0, 0.0, 1.0, 1.0]), n=2, norm_by_std=False)
    assert adv.tolist() == approx([1.0, -1.0, 0.0, 0.0])
    # verl: a singleton group has mean 0 and std 1, so the raw reward survives
    assert grpo_advantages(torch.tensor([0.5, 2.0]), n=1).tolist() == approx([0.5, 2.0], abs=1e-5)


def test_grpo_advantages_by_the_mean_weigh_a_rare_right_answer_as_a_log_likelihood() -> None:
    one_right = torch.tensor([1.0] + [0.0] * 7)
    # one right in 8: 7 for it, -1 for each wrong one (the std would give 2.47 and -0.35)
    assert grpo_advantages(one_right, n=8, norm_by_mean=True).tolist() == approx([7.0] + [-1.0] * 7, abs=1e-4)
    # one wrong in 8: -1 for it, 1/7 for each right one; an all-zero group stays 0
    adv = grpo_advantages(torch.stack([1 - one_right, torch.zeros(8)]), n=8, norm_by_mean=True)
    assert adv.tolist() == approx([-1.0] + [1 / 7] * 7 + [0.0] * 8, abs=1e-4)
    # a credit every answer earns shifts nothing: 0.25 for all, 1 for the right one, is 7 / -1 again
    adv = grpo_advantages(0.25 + 0.75 * one_right, n=8, norm_by_mean=True)
    assert adv.tolist() == approx([7.0] + [-1.0] * 7, abs=1e-4)


def test_grpo_advantages_rejects_ragged_groups() -> None:
    with pytest.raises(ValueError, match="groups of n=3"):
        grpo_advantages(torch.zeros(4), n=3)


# --- masked reductions and aggregation ----------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean() -> None:
    assert masked_sum(LOSS, MASK).item() == 7.0
    assert masked_mean(LOSS, MASK).item() == approx(7 / 3)
    assert masked_mean(LOSS, MASK, dim=-1).tolist() == approx([1.5, 4.0])
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0  # empty mask: 0, never NaN


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 7 / 3), ("seq-mean-token-sum", (3 + 4) / 2), ("seq-mean-token-mean", (1.5 + 4) / 2)],
)
def test_agg_loss_modes(mode: str, expected: float) -> None:
    assert agg_loss(LOSS, MASK, mode).item() == approx(expected)  # type: ignore[arg-type]


def test_agg_loss_empty_row() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert agg_loss(LOSS, mask, "seq-mean-token-sum").item() == approx(3 / 2)  # divides by B
    assert agg_loss(LOSS, mask, "seq-mean-token-mean").item() == approx(1.5)  # skips empty rows
    with pytest.raises(ValueError):
        agg_loss(LOSS, mask, "bogus")  # type: ignore[arg-type]


# --- PPO ----------------------------------------------------------------------------------------
# One sequence, three tokens, A = +1, clip 0.2, cap C = 5:
#   token  pi_theta  pi_prox  pi_behave  ratio  w_raw  w   clipped?  loss
#   0      0.4       0.4      0.4        1.0    1      1   no        -1.0 * 1 = -1.0
#   1      0.6       0.4      0.2        1.5    2      2   yes       -1.2 * 2 = -2.4
#   2      0.2       0.4      0.04       0.5    10     5   no        -0.5 * 5 = -2.5

P_THETA = torch.tensor([[0.4, 0.6, 0.2]])
P_PROX = torch.tensor([[0.4, 0.4, 0.4]])
P_BEHAVE = torch.tensor([[0.4, 0.2, 0.04]])
ONES = torch.ones(1, 3)


def _logs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return P_THETA.log().requires_grad_(True), P_PROX.log().requires_grad_(True), P_BEHAVE.log()


def _tis(prox: torch.Tensor, behave: torch.Tensor, cap: float | str = 5.0) -> torch.Tensor:
    """The default config's token-level truncated weight min(pi_prox / pi_behave, cap) [B, T]."""
    weights, m = is_weights(prox.detach() - behave, ONES, "token", cap)
    return weights


def test_ppo_decoupled_by_hand() -> None:
    logp, prox, behave = _logs()
    loss, m = ppo_loss(
        logp, prox, behave, torch.tensor([1.0]), ONES, clip_eps=0.2, is_weights=_tis(prox, behave)
    )
    assert loss.item() == approx(-5.9 / 3)
    assert m["actor/pg_loss"] == approx(-5.9 / 3)
    assert m["actor/pg_clipfrac"] == approx(1 / 3)
    assert m["actor/ppo_kl"] == approx((0 - math.log(1.5) - math.log(0.5)) / 3)
    assert all(isinstance(v, float) for v in m.values())


def test_ppo_decoupled_negative_advantage_by_hand() -> None:
    # A = -1: token 0: 1*1; token 1: max(1.5, 1.2)=1.5 (unclipped) *2; token 2: max(0.5, 0.8)=0.8 (clipped) *5
    logp, prox, behave = _logs()
    loss, m = ppo_loss(
        logp, prox, behave, torch.tensor([[-1.0, -1.0, -1.0]]), ONES, is_weights=_tis(prox, behave)
    )
    assert loss.item() == approx((1 + 3 + 4) / 3)
    assert m["actor/pg_clipfrac"] == approx(1 / 3)


def test_ppo_bypass_by_hand() -> None:
    # prox := behave: ratios 1, 3, 5 -> losses -1, -1.2 (clipped), -1.2 (clipped); no weight
    logp, _, behave = _logs()
    loss, m = ppo_loss(logp, None, behave, torch.tensor([1.0]), ONES, mode="bypass")
    assert loss.item() == approx(-3.4 / 3)
    assert m["actor/pg_clipfrac"] == approx(2 / 3)
    # weights are never applied in bypass mode (the ratio is against the behaviour policy already)
    again, _ = ppo_loss(logp, None, behave, torch.tensor([1.0]), ONES, mode="bypass", is_weights=ONES * 7)
    assert again.item() == approx(-3.4 / 3)
    assert m["actor/ppo_kl"] == approx((math.log(0.2 / 0.6) + math.log(0.04 / 0.2)) / 3)


def test_ppo_uncapped_weight_mask_and_clip_high() -> None:
    logp, prox, behave = _logs()
    loss, m = ppo_loss(logp, prox, behave, torch.tensor([1.0]), ONES, is_weights=_tis(prox, behave, 1e9))
    assert loss.item() == approx((-1.0 - 2.4 - 5.0) / 3)
    # clip_eps_high = 0.6 lets ratio 1.5 through: token 1 loss -1.5 * 2
    w = _tis(prox, behave)
    loss, m = ppo_loss(logp, prox, behave, torch.tensor([1.0]), ONES, clip_eps_high=0.6, is_weights=w)
    assert loss.item() == approx((-1.0 - 3.0 - 2.5) / 3)
    assert m["actor/pg_clipfrac"] == 0.0
    # masking token 2 out: mean over tokens 0 and 1
    loss, m = ppo_loss(logp, prox, behave, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]), is_weights=w)
    assert loss.item() == approx((-1.0 - 2.4) / 2)


def test_ppo_gradient_flows_only_through_logp() -> None:
    logp, prox, behave = _logs()
    behave.requires_grad_(True)
    adv = torch.tensor([1.0], requires_grad=True)
    loss, _ = ppo_loss(logp, prox, behave, adv, ONES, is_weights=_tis(prox, behave.detach()))
    loss.backward()
    assert prox.grad is None and behave.grad is None and adv.grad is None
    # d/dlogp of -A*w*ratio/3: token 0: -1/3; token 1 clipped: 0; token 2: -0.5*5/3
    assert logp.grad is not None
    assert logp.grad[0].tolist() == approx([-1 / 3, 0.0, -2.5 / 3])


def test_ppo_rejects_missing_prox_in_decoupled_mode() -> None:
    logp, _, behave = _logs()
    with pytest.raises(ValueError, match="prox_logp"):
        ppo_loss(logp, None, behave, torch.tensor([1.0]), ONES)


# --- KL, entropy, log-probs ---------------------------------------------------------------------


def test_low_var_kl() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k3: r = ref/pi = 0.5 -> r - log r - 1 = 0.5 + 0.693147 - 1
    assert low_var_kl(logp, ref).item() == approx(0.5 + math.log(2) - 1)
    # ref far more likely than pi: exp(15) - 15 - 1 is clamped to 10
    assert low_var_kl(torch.tensor([-15.0]), torch.tensor([0.0])).item() == 10.0


def test_entropy_and_logprobs_from_logits() -> None:
    _, ent = logprobs_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
    assert ent.flatten().tolist() == approx([math.log(4)] * 6)
    _, ent = logprobs_entropy(torch.tensor([[0.0, -1e4]]), torch.tensor([0]))
    assert ent.item() == approx(0.0, abs=1e-6)
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs 0.25, 0.75
    logp, _ = logprobs_entropy(logits, torch.tensor([[1]]))
    assert logp.item() == approx(math.log(0.75))
    hot, _ = logprobs_entropy(logits * 2.0, torch.tensor([[1]]), temperature=2.0)  # tempered back to the same
    assert hot.item() == approx(math.log(0.75))


# --- metrics helpers ----------------------------------------------------------------------------


def test_metric_helpers() -> None:
    assert reward_metrics(torch.tensor([1.0, 0.0, 0.5])) == approx(
        {"critic/rewards/mean": 0.5, "critic/rewards/max": 1.0, "critic/rewards/min": 0.0}
    )
    assert length_metrics(torch.tensor([[1, 1, 1], [1, 0, 0]]), max_response_length=3) == approx(
        {
            "response_length/mean": 2.0,
            "response_length/max": 3.0,
            "response_length/min": 1.0,
            "response_length/clip_ratio": 0.5,
        }
    )
    # a batch trimmed to its longest response (4 of 8 allowed tokens) is not clipped
    trimmed = torch.ones(5, 4)
    assert length_metrics(trimmed, max_response_length=8)["response_length/clip_ratio"] == 0.0
    assert length_metrics(trimmed, max_response_length=4)["response_length/clip_ratio"] == 1.0
    with pytest.raises(ValueError, match="max_response_length"):
        length_metrics(trimmed, max_response_length=0)
    assert staleness_metrics([1, 2, 3, 2]) == {
        "training/off_policy/staleness/mean": 2.0,
        "training/off_policy/staleness/max": 3.0,
        "training/off_policy/staleness/min": 1.0,
    }
    assert staleness_metrics([]) == {}


# --- import hygiene -----------------------------------------------------------------------------


def test_the_package_and_the_correction_grammar_import_no_torch() -> None:
    """`rollstream.rl` imports none of its modules, so the config reads the rollout-correction grammar
    without torch."""
    code = ("import sys, rollstream.rl, rollstream.rl.correction_spec, rollstream.config; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
