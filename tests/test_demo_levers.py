"""Demo levers: Dr. GRPO advantages, the warm start (format / stopped reversal) and model.init_from."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from consumers.trainer.advantages import group_advantages, minibatch_advantages
from consumers.trainer.learner import Learner
from rollstream.config import load_config
from rollstream.rl.ppo import entropy_coef_at
from rollstream.tasks.warmstart import format_targets, greedy_scores, warm_start
from rollstream.weights.tensors import load_init, save_policy

TINY = ["model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32", "run.device=cpu",
        "data.val_size=32"]


def test_dr_grpo_advantages_keep_reward_scale_and_std_norm_rescales() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.2, 0.4])
    plain = group_advantages(rewards, [4, 4], norm_by_std=False)
    assert torch.allclose(plain, torch.tensor([0.75, -0.25, -0.25, -0.25, -0.05, -0.05, -0.05, 0.15]))
    normed = group_advantages(rewards, [4, 4])
    # std normalisation makes the small-spread second group as loud as the first; centring alone does not
    assert abs(float(normed[7]) - float(normed[0])) < 1e-4
    assert float(plain[7]) < float(plain[0]) / 4


def test_outcome_advantages_are_divided_by_the_group_mean_when_asked() -> None:
    rewards, mask = torch.tensor([1.0] + [0.0] * 7), torch.ones(8, 3)
    for flag, right in (("false", 2.4749), ("true", 7.0)):
        algorithm = load_config(None, TINY + [f"algorithm.norm_adv_by_mean={flag}"]).algorithm
        adv, _ = minibatch_advantages(algorithm, mask, [8], rewards, None, lambda x: x)
        assert abs(float(adv[0]) - right) < 1e-3, (flag, adv)


def test_entropy_bonus_decays_linearly_to_zero_and_stays_constant_without_decay() -> None:
    assert entropy_coef_at(0.1, 0, 5000) == 0.1
    assert entropy_coef_at(0.1, 100, 1) == 0.1
    assert abs(entropy_coef_at(0.1, 100, 51) - 0.05) < 1e-12
    assert entropy_coef_at(0.1, 100, 101) == 0.0 == entropy_coef_at(0.1, 100, 10_000)


def test_learner_reports_the_decayed_entropy_coef() -> None:
    from consumers.trainer.assembly import assemble_batch_from_rollout_samples
    from rollstream.testing.fakes import fake_rollout_sample

    learner = Learner(load_config(None, TINY + ["actor.entropy_coeff=0.2", "actor.entropy_decay_steps=10"]))
    batch, _ = assemble_batch_from_rollout_samples([fake_rollout_sample(f"s{i}", n=4) for i in range(2)])
    learner.begin_step(6)
    assert abs(learner.update(batch)["actor/entropy_coef"] - 0.1) < 1e-9
    learner.begin_step(11)
    assert "actor/entropy_coef" not in learner.update(batch)


def test_format_targets_are_random_digits_of_the_answer_length() -> None:
    rng = random.Random(0)
    outs = [format_targets("12345", rng) for _ in range(50)]
    assert all(len(o) == 5 and o.isdigit() for o in outs)
    assert sum(o == "54321" for o in outs) == 0 and len(set(outs)) > 45


def test_format_warm_start_learns_the_format_but_not_the_reversal() -> None:
    torch.manual_seed(0)
    cfg = load_config(None, TINY + ["data.max_response_length=7"])
    policy, report = warm_start(cfg, mode="format", max_steps=120, batch_size=32, lr=1e-2)
    assert report.format_ok > 0.5  # digits only, right length, eos
    assert report.val_acc < 0.1  # nothing about the reversal was taught
    assert greedy_scores(policy, cfg)[0] == report.val_acc


def test_reverse_warm_start_stops_below_the_exact_match_cap() -> None:
    cfg = load_config(None, TINY + ["data.max_response_length=7", "model.d_model=64"])
    _, report = warm_start(cfg, mode="reverse", max_steps=400, batch_size=64, lr=3e-3,
                           stop_at_acc=0.03, max_acc=0.1, eval_every=10)
    assert report.steps < 400  # it stopped on the probe, not on the step budget
    assert report.val_acc < 0.2  # probe < 10%; the held-out split is a different 32 prompts
    assert report.val_reward_mean > 0.2  # but it did learn part of the reversal


def test_trainer_starts_from_init_from_weights(tmp_path: Path) -> None:
    cfg = load_config(None, TINY)
    other = load_config(None, TINY + ["run.seed=7"])
    donor = Learner(other).policy
    path = tmp_path / "warm.safetensors"
    save_policy(donor, path)
    fresh = Learner(cfg).policy
    started = Learner(load_config(None, TINY + [f"model.init_from={path}", "actor.kl_loss_coef=0.1"]))
    assert started.policy.state_dict_bytes() == donor.state_dict_bytes() != fresh.state_dict_bytes()
    assert started.ref is not None and started.ref.state_dict_bytes() == donor.state_dict_bytes()
    load_init(fresh, path)
    assert fresh.state_dict_bytes() == donor.state_dict_bytes()
