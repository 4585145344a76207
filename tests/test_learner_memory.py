"""The trainer's memory knobs change no number: a local update accumulated over micro-batches
(`actor.micro_batch_size`) equals the whole-mini-batch update, for every loss aggregation, with the entropy
bonus and the KL term on, on the tiny GPT and on an HF model with gradient checkpointing and chunked
log-probs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.batch import MiniBatch, micro_slices
from consumers.trainer.learner import Learner
from rollstream.config import ConfigError, load_config
from rollstream.testing.fakes import fake_rollout_sample
from schemas import RolloutSample

BASE = ["run.device=cpu", "model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "async_training.trigger_parameter_sync_step=1",
        "actor.optim.lr=0.01", "actor.entropy_coeff=0.01", "actor.kl_loss_coef=0.1",
        "rollout.temperature=0.9"]


def batches(seed: int) -> list[list[RolloutSample]]:
    """Two mini-batches of 4 samples x 4 ragged responses with prompts of different lengths (padding on
    both sides), token ids inside every test model's vocabulary."""
    return [
        [fake_rollout_sample(f"s{b}{i}", n=4, prompt_len=3 + 2 * i, response_len=6, ragged=True,
                             seed=seed + 10 * b + i, vocab=50) for i in range(4)]
        for b in range(2)
    ]


def mini_batch(samples: list[RolloutSample]) -> MiniBatch:
    """The samples as the trainer hands them to the learner: one mini-batch (which the update pads once)."""
    return assemble_batch_from_rollout_samples(samples)[0]


def capture_grads(learner: Learner) -> list[list[torch.Tensor]]:
    """Record the (clipped) gradients each optimizer step applies."""
    seen: list[list[torch.Tensor]] = []
    step = learner.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        seen.append([p.grad.detach().float().clone() for p in learner.policy.parameters()])  # type: ignore[union-attr]
        return step(*args, **kwargs)

    learner.optimizer.step = recording_step  # type: ignore[method-assign]
    return seen


COMPARED = (
    "actor/loss",
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "rollout_corr/rollout_is_mean",
    "training/rollout_probs_diff_mean",
)


def assert_same_updates(plain: list[str], knobs: list[str]) -> None:
    """Two local updates of one global step (the second off the proximal policy) give the same metrics and
    gradients both ways. After each update the second learner takes the first's weights and Adam state, so
    Adam (which turns float noise in a near-zero gradient into a full step) cannot compound differences."""
    a, b = Learner(load_config(None, plain)), Learner(load_config(None, knobs))
    grads_a, grads_b = capture_grads(a), capture_grads(b)
    a.begin_step(1)
    b.begin_step(1)
    for i, samples in enumerate(batches(seed=1)):
        ma, mb = a.update(mini_batch(samples)), b.update(mini_batch(samples))
        for k in COMPARED:
            assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-6), (i, k)
        assert len(grads_a) == len(grads_b) == i + 1
        for ga, gb in zip(grads_a[i], grads_b[i], strict=True):
            assert torch.allclose(gb, ga, rtol=1e-4, atol=1e-7), i
        b.policy.module.load_state_dict(a.policy.module.state_dict())
        b.optimizer.load_state_dict(a.optimizer.state_dict())
    assert ma["actor/ppo_kl"] != 0.0  # the second update really was off the proximal weights
    assert any(float(g.abs().max()) > 1e-4 for g in grads_a[-1])


def test_micro_slices_cover_the_rows_once() -> None:
    assert micro_slices(16, 0) == [slice(0, 16)]
    assert micro_slices(16, 5) == [slice(0, 5), slice(5, 10), slice(10, 15), slice(15, 16)]
    assert micro_slices(4, 8) == [slice(0, 4)]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("adv", ["grpo", "grpo_token", "reinforce_plus_plus"])
def test_micro_batches_equal_the_whole_mini_batch(agg: str, adv: str) -> None:
    cfg = [*BASE, f"actor.loss_agg_mode={agg}", f"algorithm.adv_estimator={adv}"]
    assert_same_updates(cfg, [*cfg, "actor.micro_batch_size=5"])  # 16 rows: 5, 5, 5, 1
    assert_same_updates(cfg, [*cfg, "actor.micro_batch_size=1"])


def test_hf_micro_batches_checkpointing_and_chunks_equal_the_plain_update(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rollstream.testing.hf_tiny import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "qwen2", arch="qwen2")
    cfg = [*BASE, "model.backend=hf", f"model.hf_path={model}"]
    assert_same_updates(
        [*cfg, "actor.logprob_chunk_size=0"],
        [*cfg, "actor.micro_batch_size=3", "actor.gradient_checkpointing=true", "actor.logprob_chunk_size=7"],
    )


def test_first_update_takes_the_proximal_log_probs_from_its_own_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's first update on one micro-batch does not run the frozen proximal copy (the weights are the
    same and nothing is random): its metrics and gradients equal the update that does. Later updates of the
    step, several micro-batches, or dropout use the copy."""
    cfg = [*BASE, "algorithm.rollout_correction.bypass_mode=false"]
    a, b = Learner(load_config(None, cfg)), Learner(load_config(None, cfg))
    assert b.prox is not None
    prox_calls: list[int] = []
    prox_forward = b.prox.forward_logprobs_entropy

    def counted(*args: Any, **kwargs: Any) -> Any:
        prox_calls.append(1)
        return prox_forward(*args, **kwargs)

    monkeypatch.setattr(b.prox, "forward_logprobs_entropy", counted)
    monkeypatch.setattr(a, "_reuses_forward", lambda micro: False)  # a: always the frozen copy
    grads_a, grads_b = capture_grads(a), capture_grads(b)
    first, second = batches(seed=5)
    a.begin_step(1)
    b.begin_step(1)
    ma, mb = a.update(mini_batch(first)), b.update(mini_batch(first))
    assert prox_calls == []  # the first update: its own forward
    for k in COMPARED:
        assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-7), k
    for ga, gb in zip(grads_a[0], grads_b[0], strict=True):
        assert torch.allclose(gb, ga, rtol=1e-5, atol=1e-8)
    b.update(mini_batch(second))
    assert prox_calls == [1]  # the second update of the step: the weights moved, the copy is the proximal
    drop = b.policy.module.get_submodule("drop")
    assert isinstance(drop, torch.nn.Dropout)
    drop.p = 0.1  # dropout makes train and eval forwards differ: the copy again
    b.begin_step(2)
    b.update(mini_batch(first))
    assert prox_calls == [1, 1]
    drop.p = 0.0
    b.begin_step(3)
    b.actor.micro_batch_size = 8
    b.update(mini_batch(first))  # 16 rows in two micro-batches: the copy, once for each
    assert prox_calls == [1, 1, 1, 1]


def uniform_groups_batches(seed: int, all_uniform: bool) -> list[list[RolloutSample]]:
    """Two mini-batches of 4 groups x 4 ragged responses where groups 0 and 2 (every group of the second
    mini-batch when all_uniform) got one reward each: their GRPO advantages are exactly 0."""
    out = []
    for b in range(2):
        samples = []
        for i in range(4):
            uniform = (all_uniform and b == 1) or i % 2 == 0
            rewards = [float(i % 3 == 0)] * 4 if uniform else [1.0, 0.0, 0.5, 0.0]
            samples.append(fake_rollout_sample(f"u{b}{i}", n=4, prompt_len=3 + 2 * i, response_len=6,
                                               ragged=True, seed=seed + 10 * b + i, vocab=50,
                                               rewards=rewards))
        out.append(samples)
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_leaving_zero_advantage_rows_out_changes_no_step(agg: str) -> None:
    """actor.zero_advantage_rows=skip: the rows of groups that all got one reward are not forwarded, and the
    two updates (the second one off the moved weights) apply the same gradients, loss and weights as the
    update that trains every row; a mini-batch of groups all alike forwards nothing but still takes AdamW's
    step."""
    cfg = [*BASE, "actor.entropy_coeff=0", "actor.kl_loss_coef=0", f"actor.loss_agg_mode={agg}",
           "actor.micro_batch_size=6", "algorithm.rollout_correction.bypass_mode=true"]
    for all_uniform in (False, True):
        a = Learner(load_config(None, cfg))
        b = Learner(load_config(None, [*cfg, "actor.zero_advantage_rows=skip"]))
        grads_a, grads_b = capture_grads(a), capture_grads(b)
        forwarded: list[int] = []
        forward = b.policy.forward_logprobs_entropy

        def counting(ids: torch.Tensor, *args: Any, _seen: list[int] = forwarded, _f: Any = forward,
                     **kwargs: Any) -> Any:
            _seen.append(ids.shape[0])
            return _f(ids, *args, **kwargs)

        b.policy.forward_logprobs_entropy = counting  # type: ignore[method-assign]
        a.begin_step(1)
        b.begin_step(1)
        for i, samples in enumerate(uniform_groups_batches(seed=5, all_uniform=all_uniform)):
            before = [p.detach().clone() for p in b.policy.parameters()]
            ma, mb = a.update(mini_batch(samples)), b.update(mini_batch(samples))
            for k in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
                assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-7), (all_uniform, i, k)
            assert mb["actor/trained_row_fraction"] == (0.0 if all_uniform and i == 1 else 0.5)
            for ga, gb in zip(grads_a[i], grads_b[i], strict=True):
                assert torch.allclose(gb, ga, rtol=1e-4, atol=1e-7), (all_uniform, i)
            moved = any(not torch.equal(x, p) for x, p in zip(before, b.policy.parameters(), strict=True))
            assert moved  # on zero gradients too (all_uniform's second update): AdamW's momentum
            b.policy.module.load_state_dict(a.policy.module.state_dict())  # Adam turns float noise in a
            b.optimizer.load_state_dict(a.optimizer.state_dict())  # near-zero gradient into a full step
        assert sum(forwarded) == (8 if all_uniform else 16)  # 8 of each update's 16 rows (or none)
        assert any(float(g.abs().max()) > 1e-4 for g in grads_a[0])
        if all_uniform:  # zero gradients, not missing ones (AdamW skips a parameter without a gradient)
            assert all(float(g.abs().max()) == 0.0 for g in grads_b[-1])


def test_dropping_zero_advantage_rows_trains_the_groups_with_reward_variance_alone() -> None:
    """actor.zero_advantage_rows=drop: the update equals the plain update of the batch without the groups
    that all got one reward (DAPO's dynamic sampling, no refill): the same loss and gradients."""
    cfg = [*BASE, "actor.entropy_coeff=0", "actor.kl_loss_coef=0", "actor.micro_batch_size=6",
           "algorithm.rollout_correction.bypass_mode=true"]
    a = Learner(load_config(None, cfg))
    b = Learner(load_config(None, [*cfg, "actor.zero_advantage_rows=drop"]))
    grads_a, grads_b = capture_grads(a), capture_grads(b)
    samples = uniform_groups_batches(seed=7, all_uniform=False)[0]
    varied = samples[1::2]  # groups 1 and 3: their rewards differ
    ma, mb = a.update(mini_batch(varied)), b.update(mini_batch(samples))
    for k in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-7), k
    for ga, gb in zip(grads_a[0], grads_b[0], strict=True):
        assert torch.allclose(gb, ga, rtol=1e-4, atol=1e-7)
    assert any(float(g.abs().max()) > 1e-4 for g in grads_a[0])


@pytest.mark.parametrize(
    ("knob", "named"),
    [("actor.entropy_coeff=0.01", "actor.entropy_coeff"), ("actor.kl_loss_coef=0.1", "actor.kl_loss_coef"),
     ("algorithm.adv_estimator=grpo_token", "algorithm.adv_estimator"),
     ("algorithm.rollout_correction.bypass_mode=false", "bypass_mode"),
     ("trainer.nproc_per_node=2", "world size 2")],
)
def test_zero_advantage_rows_are_trained_when_something_else_sees_them(knob: str, named: str) -> None:
    """An entropy bonus, a KL term, token-level advantages, a correction over the batch or DDP give a
    zero-advantage row a part in the step: skip and drop are refused, naming the setting."""
    ok = ["actor.entropy_coeff=0", "actor.kl_loss_coef=0", "algorithm.rollout_correction.bypass_mode=true"]
    assert load_config(None, [*ok, "actor.zero_advantage_rows=drop"]).actor.zero_advantage_rows == "drop"
    with pytest.raises(ConfigError, match=rf"actor.zero_advantage_rows=skip needs .*{named}"):
        load_config(None, [*ok, "actor.zero_advantage_rows=skip", knob])
