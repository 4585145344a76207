"""Token-level credit: char scores from the task, token_level_scores on the wire, grpo_token advantages."""

from __future__ import annotations

import pytest
import torch

from consumers.trainer.advantages import token_rewards
from producers.rollout import token_scores
from rollstream.model import CharTokenizer
from rollstream.rl.advantages import (
    grpo_advantages,
    grpo_token_advantages,
    reinforce_pp_advantages,
    returns_to_go,
)
from rollstream.tasks import Prompt, ReverseTask, RewardResult

TOK = CharTokenizer()


def test_reverse_char_scores_split_the_score_over_matching_characters() -> None:
    task, p = ReverseTask(), Prompt(uid="u", text="1234>", answer="4321")
    r = task.reward(p, "4301")  # positions 0, 1, 3 match
    assert r.char_scores == pytest.approx((0.25, 0.25, 0.0, 0.25))
    assert sum(r.char_scores or ()) == pytest.approx(r.score)
    long = task.reward(p, "432100")  # too long: 4/6; the 2 extra characters carry the loss (1 - 4/6)
    assert long.char_scores == pytest.approx((0.25,) * 4 + (-1 / 6, -1 / 6))
    assert sum(long.char_scores or ()) == pytest.approx(long.score)
    with pytest.raises(ValueError, match="char_scores sum"):
        RewardResult(score=0.5, exact=False, char_scores=(0.1,))


def test_token_scores_follow_the_characters_and_fall_back_to_the_last_token() -> None:
    ids = TOK.encode("43") + [TOK.eos_id]
    r = RewardResult(score=0.5, exact=False, char_scores=(0.25, 0.25))
    assert token_scores(TOK, ids, [1, 1, 1], r).tolist() == [0.25, 0.25, 0.0]  # eos decodes to nothing
    outcome = RewardResult(score=0.7, exact=False)
    assert token_scores(TOK, ids, [1, 1, 1], outcome).tolist() == pytest.approx([0.0, 0.0, 0.7])
    misaligned = RewardResult(score=0.5, exact=False, char_scores=(0.5,))  # 1 char for 2 text tokens
    assert token_scores(TOK, ids, [1, 1, 1], misaligned).tolist() == pytest.approx([0.0, 0.0, 0.5])


def test_returns_to_go_and_outcome_placement() -> None:
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    assert returns_to_go(torch.tensor([[1.0, 0, 2, 9], [3, 1, 7, 0]]), mask).tolist() == [
        [3, 2, 2, 0],
        [4, 1, 0, 0],
    ]
    placed = token_rewards(torch.tensor([0.5, 2.0]), mask, None)
    assert placed.tolist() == [[0, 0, 0.5, 0], [0, 2.0, 0, 0]]


def test_grpo_token_credits_each_position_against_the_group_at_that_position() -> None:
    # two groups of 3; position 0 is right in every response of group 0, so it carries no signal there
    rewards = torch.tensor([
        [1.0, 1, 0], [1, 0, 0], [1, 1, 1],  # group 0
        [0, 0, 0], [0, 1, 0], [0, 0, 0],  # group 1
    ])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv = grpo_token_advantages(rewards, mask, [3, 3], norm_by_std=False)
    g = returns_to_go(rewards, mask)
    assert torch.allclose(adv[0:3, 0], g[0:3, 0] - g[0:3, 0].mean())
    assert torch.allclose(adv[0:3, 2], torch.tensor([-1 / 3, -1 / 3, 2 / 3]))
    assert adv[4, 2] == 0 and adv[3, 2] == 0  # a position held by one response of its group: no baseline, 0
    assert adv[5, 1] == 0 and adv[5, 2] == 0  # off the mask
    normed = grpo_token_advantages(rewards, mask, [3, 3])
    assert torch.allclose(normed[0:3, 2], (g[0:3, 2] - g[0:3, 2].mean()) / (g[0:3, 2].std() + 1e-6))


def test_grpo_token_with_outcome_rewards_only_equals_grpo_at_the_first_token() -> None:
    rewards = torch.tensor([0.2, 0.9, 0.4, 0.4])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv = grpo_token_advantages(token_rewards(rewards, mask, None), mask, [4])
    assert torch.allclose(adv[:, 0], grpo_advantages(rewards, n=4), atol=1e-5)


def test_grpo_token_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="group sizes"):
        grpo_token_advantages(torch.zeros(4, 3), torch.ones(4, 3), [3])
    with pytest.raises(ValueError, match="same"):
        grpo_token_advantages(torch.zeros(4, 3), torch.ones(4, 2), [4])


def test_discounted_returns() -> None:
    mask = torch.tensor([[1.0, 1, 1, 0]])
    r = torch.tensor([[1.0, 2, 4, 8]])
    assert returns_to_go(r, mask, gamma=0.5).tolist() == [[1 + 1 + 1, 2 + 2, 4, 0]]
    assert returns_to_go(r, mask, gamma=0.0).tolist() == [[1, 2, 4, 0]]
    with pytest.raises(ValueError, match="gamma"):
        returns_to_go(r, mask, gamma=1.5)


def test_reinforce_plus_plus_whitens_returns_over_the_whole_batch_by_hand() -> None:
    # two groups of two; group 2 gets position 1 wrong in both rows, which group-level credit cannot see
    rewards = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.0], [0.5, 0.0]])
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 1], [1, 0]])  # the last row has no position 1
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.0)
    vals = [0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.5]  # the 7 masked returns (gamma 0: each token's own reward)
    mean = sum(vals) / 7
    std = (sum((v - mean) ** 2 for v in vals) / 6) ** 0.5  # Bessel, as verl's masked_whiten
    assert adv[2, 1].item() == pytest.approx((0.0 - mean) / std, rel=1e-5)  # negative: the batch does better
    assert adv[0, 0].item() == pytest.approx((0.5 - mean) / std, rel=1e-5)
    assert adv[3, 1].item() == 0.0  # off the mask
    # the group's own baseline gives it nothing
    assert grpo_token_advantages(rewards, mask, [2, 2], gamma=0.0)[2, 1].item() == 0.0
    gamma_one = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    assert gamma_one[0, 0].item() > gamma_one[0, 1].item()  # return-to-go: the first token carries both


def test_reinforce_plus_plus_over_ranks_equals_one_process() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = reinforce_pp_advantages(rewards, mask, gamma=0.5)

    def stats(r: torch.Tensor, m: torch.Tensor) -> list[float]:
        ret = returns_to_go(r, m, 0.5)
        return [float(ret.sum()), float((ret**2).sum()), float(m.sum())]

    halves = [(rewards[:3], mask[:3]), (rewards[3:], mask[3:])]
    every = [stats(*h) for h in halves]
    summed = [sum(col) for col in zip(*every, strict=True)]  # what the all-reduce returns on each rank
    ranks = [reinforce_pp_advantages(r, m, gamma=0.5, reduce=lambda _: summed) for r, m in halves]
    assert torch.allclose(torch.cat(ranks), whole, atol=1e-6)
    assert reinforce_pp_advantages(rewards, torch.zeros_like(mask)).abs().sum().item() == 0.0


def test_grpo_token_norm_by_mean_weighs_rarely_right_positions_like_supervised_learning() -> None:
    # one group of 4, gamma 0 (each token its own 0/0.25 credit): position 0 right once, position 1 right
    # three times, position 2 a too-long answer's -0.1 penalty against three stops (0)
    rewards = torch.tensor([[0.25, 0.25, -0.1], [0, 0.25, 0], [0, 0.25, 0], [0, 0, 0]])
    mask = torch.ones(4, 3)
    adv = grpo_token_advantages(rewards, mask, [4], gamma=0.0, norm_by_mean=True)
    # (r - mean) / mean: +3 for the one right token, -1 for each wrong one, as d log P(right)
    assert torch.allclose(adv[:, 0], torch.tensor([3.0, -1, -1, -1]), atol=1e-4)
    assert torch.allclose(adv[:, 1], torch.tensor([1 / 3, 1 / 3, 1 / 3, -1]), atol=1e-4)
    # the rarely-right position outweighs the nearly-solved one (the std makes them equal)
    assert float(adv[:, 0].abs().sum()) > 2 * float(adv[:, 1].abs().sum())
    std = grpo_token_advantages(rewards, mask, [4], gamma=0.0)
    assert abs(float(std[:, 0].abs().sum()) - float(std[:, 1].abs().sum())) < 1e-4
    # mean |return| 0.025 is floored at max |return| / n = 0.025: the penalty is centred, never blown up
    assert torch.allclose(adv[:, 2], torch.tensor([-3.0, 1, 1, 1]), atol=1e-4)
    assert adv.abs().max() <= 4


def test_norm_adv_by_mean_is_an_actor_option_off_by_default() -> None:
    from rollstream.config import load_config

    assert load_config(None, []).algorithm.norm_adv_by_mean is False
    assert load_config(None, ["algorithm.norm_adv_by_mean=true"]).algorithm.norm_adv_by_mean is True
