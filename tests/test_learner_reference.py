"""The learner's update is the plain one. Its micro-batches are row views of the one padded mini-batch, each
without its all-padding columns, its token-level advantages are taken on the mini-batch as padded, and rows
without advantage are left out; none of that may change the step. Here it is compared with a full-batch
step written out plainly: one forward over the whole padded batch, the clipped PPO loss (bypass mode,
token-mean), backward, gradient clipping, AdamW."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import padded_arrays

import consumers.trainer.learner as learner_module
from consumers.trainer.advantages import token_rewards
from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.batch import MiniBatch, Padded
from consumers.trainer.learner import Learner
from consumers.trainer.metrics import UPDATE_SKIPPED, EpochStats, epoch_metrics, merge_epochs
from rollstream.config import PipelineConfig, load_config
from rollstream.model import BasePolicy
from rollstream.rl.advantages import grpo_token_advantages, reinforce_pp_advantages
from rollstream.rl.rollout_correction import rollout_correction
from rollstream.testing.fakes import fake_rollout_sample
from schemas import RolloutSample

BASE = ["run.device=cpu", "model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "async_training.trigger_parameter_sync_step=1",
        "actor.optim.lr=0.001", "actor.optim.weight_decay=0.01", "actor.entropy_coeff=0",
        "actor.kl_loss_coef=0", "actor.loss_agg_mode=token-mean", "actor.micro_batch_size=5",
        "algorithm.rollout_correction.bypass_mode=true", "rollout.temperature=0.9"]


def mini_batch(seed: int) -> list[RolloutSample]:
    """4 groups x 4 rows, prompts of 3, 5, 7 and 9 tokens, responses of random lengths up to 3, 6, 9 and 12
    tokens (the micro-batches of 5 rows have different widths); groups 0 and 2 all got one reward, so their
    GRPO advantages are exactly 0."""
    return [
        fake_rollout_sample(f"g{seed}{i}", n=4, prompt_len=3 + 2 * i, response_len=3 + 3 * i, ragged=True,
                            seed=seed + i, vocab=50,
                            rewards=[float(i % 3 == 0)] * 4 if i % 2 == 0 else [1.0, 0.0, 0.5, 0.0])
        for i in range(4)
    ]


def plain_advantages(batch: MiniBatch, estimator: str, gamma: float) -> torch.Tensor:
    """The batch's advantages from its padded tensors: GRPO's (r - group mean) / (group std + 1e-6) per row
    [B], or the token-level estimator on the whole padded [B, W]."""
    t = padded_arrays(batch)
    rewards = torch.from_numpy(t["rewards"]).float()
    if estimator == "grpo":
        groups = rewards.reshape(-1, 4)
        return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)
    mask = torch.from_numpy(t["response_mask"]).float()
    per_token = token_rewards(rewards, mask, None)
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(per_token, mask, gamma=gamma)
    return grpo_token_advantages(per_token, mask, [4] * 4, gamma=gamma)


def plain_step(policy: BasePolicy, optimizer: torch.optim.Optimizer, batch: MiniBatch, adv: torch.Tensor,
               clip: float, clip_grad: float, temperature: float) -> tuple[float, float]:
    """One full-batch step: a forward over every row of the padded batch, the bypass-mode clipped PPO loss
    averaged over the response tokens, backward, the gradient norm clipped, AdamW; returns (the loss, the
    gradient norm before clipping)."""
    t = padded_arrays(batch)
    ids, mask = torch.from_numpy(t["input_ids"]), torch.from_numpy(t["attention_mask"])
    resp = torch.from_numpy(t["response_mask"]).float()
    behave = torch.from_numpy(t["rollout_log_probs"]).float()
    policy.train()
    logp, _ = policy.forward_logprobs_entropy(ids, mask, resp.shape[1], temperature)
    ratio = torch.exp((logp - behave).clamp(-20.0, 20.0))
    a = adv[:, None] if adv.dim() == 1 else adv
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - clip, 1.0 + clip))
    loss = (per_token * resp).sum() / resp.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(policy.parameters()), clip_grad)
    optimizer.step()
    return float(loss.detach()), float(norm)


def learner_and_plain_copy(
    cfg: PipelineConfig,
) -> tuple[Learner, BasePolicy, torch.optim.Optimizer, list[int]]:
    """A learner at global step 1 whose forwards record their row counts (the list returned), and a copy of
    its policy with a plain AdamW of the same settings, to take the plain steps on."""
    learner = Learner(cfg)
    policy = copy.deepcopy(learner.policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.actor.optim.lr,
                                  weight_decay=cfg.actor.optim.weight_decay)
    forwarded: list[int] = []
    forward = learner.policy.forward_logprobs_entropy

    def counting(ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        forwarded.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    learner.policy.forward_logprobs_entropy = counting  # type: ignore[method-assign]
    learner.begin_step(1)
    return learner, policy, optimizer, forwarded


@pytest.mark.parametrize(
    ("estimator", "rows"),
    [("grpo", "skip"), ("grpo", "train"), ("grpo_token", "train"), ("reinforce_plus_plus", "train")],
)
def test_update_equals_the_plain_full_batch_step(estimator: str, rows: str) -> None:
    """Two updates (the second from the moved weights and Adam state) in micro-batches of 5 of 16 rows give
    the parameters of the plain full-batch steps to 1e-6 (float32; lr 1e-3, so that is a thousandth of
    Adam's step, which float noise in a near-zero gradient can flip), the same loss and gradient norm; with
    skip, the rows of groups 0 and 2 are not forwarded."""
    cfg = load_config(
        None, [*BASE, f"algorithm.adv_estimator={estimator}", f"actor.zero_advantage_rows={rows}"]
    )
    learner, policy, optimizer, forwarded = learner_and_plain_copy(cfg)
    for seed in (1, 11):
        batch, _ = assemble_batch_from_rollout_samples(mini_batch(seed))
        lens = padded_arrays(batch)["response_mask"].sum(-1)
        assert lens.min() < lens.max() // 2  # responses of varied lengths
        metrics = learner.update(batch)
        adv = plain_advantages(batch, estimator, cfg.algorithm.gamma)
        loss, norm = plain_step(policy, optimizer, batch, adv, cfg.actor.clip_ratio,
                                cfg.actor.optim.clip_grad, cfg.rollout.temperature)
        assert metrics["actor/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), seed
        assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-5), seed
        for (name, got), want in zip(learner.policy.module.named_parameters(), policy.parameters(),
                                     strict=True):
            diff = float((got.detach() - want.detach()).abs().max())
            assert diff <= 1e-6, f"{name} after batch {seed}: {diff:.3g}"
    assert sum(forwarded) == (16 if rows == "skip" else 32)  # skip: 8 of each update's 16 rows


def test_micro_batches_are_row_views_of_the_mini_batch_at_their_own_widths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forward of each micro-batch reads the memory of the one padded mini-batch the update built (no
    copy), its rows cut to their widest prompt and response."""
    learner = Learner(load_config(None, BASE))
    batch, _ = assemble_batch_from_rollout_samples(mini_batch(3))
    built: list[Padded] = []  # every padded tensor set the update builds
    pad = MiniBatch.padded

    def padded(self: MiniBatch, *args: Any) -> Padded:
        built.append(pad(self, *args))
        return built[-1]

    monkeypatch.setattr(MiniBatch, "padded", padded)
    seen: list[tuple[int, tuple[int, ...], int]] = []
    forward = learner.policy.forward_logprobs_entropy

    def recording(ids: torch.Tensor, mask: torch.Tensor, width: int, *args: Any, **kwargs: Any) -> Any:
        seen.append((ids.untyped_storage().data_ptr(), tuple(ids.shape), width))
        return forward(ids, mask, width, *args, **kwargs)

    learner.policy.forward_logprobs_entropy = recording  # type: ignore[method-assign]
    learner.update(batch)
    assert len(built) == 1  # padded once
    mask = built[0].mask
    P = mask.shape[1] - built[0].width
    want = []
    for lo in range(0, 16, 5):
        rows = mask[lo : lo + 5]
        p, r = int(rows[:, :P].sum(-1).max()), int(rows[:, P:].sum(-1).max())
        want.append((built[0].ids.untyped_storage().data_ptr(), (len(rows), p + r), r))
    assert seen == want
    assert len({w for _, _, w in seen}) > 1  # the micro-batches' widths differ


def test_fused_adamw_by_default_and_an_unfused_optimizer_state_resumes_in_it() -> None:
    """The learner's AdamW is the fused kernel unless actor.optim.fused=false (the update above, compared
    with torch's plain for-loop AdamW, is the fused one's); an optimizer state saved by an unfused learner
    (a checkpoint of an earlier run) loads into a fused one, and its next step moves the weights as the
    unfused learner's own next step does."""
    assert Learner(load_config(None, BASE)).optimizer.defaults["fused"] is True
    unfused_cfg = load_config(None, [*BASE, "actor.optim.fused=false"])
    unfused = Learner(unfused_cfg)
    assert not unfused.optimizer.defaults["fused"]
    unfused.begin_step(1)
    unfused.update(assemble_batch_from_rollout_samples(mini_batch(1))[0])
    fused = Learner(load_config(None, BASE))
    weights = {k: v.clone() for k, v in unfused.whole_weights().items()}
    fused.load_checkpoint_state(weights, copy.deepcopy(unfused.optimizer.state_dict()))
    for learner in (unfused, fused):
        learner.begin_step(2)
        learner.update(assemble_batch_from_rollout_samples(mini_batch(11))[0])
    for (name, got), want in zip(fused.policy.module.named_parameters(), unfused.policy.parameters(),
                                 strict=True):
        diff = float((got.detach() - want.detach()).abs().max())
        assert diff <= 1e-6, f"{name}: {diff:.3g}"
    start = Learner(load_config(None, BASE)).policy.parameters()
    pairs = zip(fused.policy.parameters(), start, strict=True)
    moved = max(float((a - b).detach().abs().max()) for a, b in pairs)
    assert moved > 1e-4  # two steps of lr 1e-3 moved the weights (the comparison above is not vacuous)


@pytest.mark.parametrize("rows", ["skip", "train"])
def test_ppo_epochs_take_that_many_plain_steps_on_the_one_batch(rows: str) -> None:
    """actor.ppo_epochs=3: one update is three optimizer steps on its mini-batch, each the plain full-batch
    step from the weights the one before left (the ratio against the sampling log-probs, clipped; the
    advantages the batch's), to 1e-6; its loss and gradient norm are the three steps' means, and every
    epoch forwards the trained rows again."""
    cfg = load_config(None, [*BASE, "actor.ppo_epochs=3", f"actor.zero_advantage_rows={rows}"])
    learner, policy, optimizer, forwarded = learner_and_plain_copy(cfg)
    batch, _ = assemble_batch_from_rollout_samples(mini_batch(5))
    metrics = learner.update(batch)
    adv = plain_advantages(batch, "grpo", cfg.algorithm.gamma)
    steps = [plain_step(policy, optimizer, batch, adv, cfg.actor.clip_ratio, cfg.actor.optim.clip_grad,
                        cfg.rollout.temperature) for _ in range(3)]
    assert steps[0][0] != pytest.approx(steps[2][0], abs=1e-6)  # the later steps start from moved weights
    assert metrics["actor/loss"] == pytest.approx(sum(s[0] for s in steps) / 3, rel=1e-5, abs=1e-7)
    assert metrics["actor/grad_norm"] == pytest.approx(sum(s[1] for s in steps) / 3, rel=1e-5)
    assert metrics["actor/update_skipped"] == 0.0
    for (name, got), want in zip(learner.policy.module.named_parameters(), policy.parameters(), strict=True):
        diff = float((got.detach() - want.detach()).abs().max())
        assert diff <= 1e-6, f"{name} after 3 epochs: {diff:.3g}"
    assert sum(forwarded) == 3 * (8 if rows == "skip" else 16)


def test_an_update_of_several_epochs_keeps_the_rejection_of_the_weights_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bypass mode with rejection: the mask is taken once, from the policy's log-probs before the update, so
    the second epoch's losses mask the tokens the first's did, although the weights the first epoch left
    would reject others (a second update call would)."""
    cfg = load_config(None, [*BASE, "actor.ppo_epochs=2", "actor.optim.lr=0.05",
                             "algorithm.rollout_correction.rollout_rs=token_k1",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.5_2"])
    learner = Learner(cfg)
    learner.begin_step(1)
    batch, _ = assemble_batch_from_rollout_samples(mini_batch(5))
    t = padded_arrays(batch)
    ids, mask = torch.from_numpy(t["input_ids"]), torch.from_numpy(t["attention_mask"])
    resp = torch.from_numpy(t["response_mask"]).float()

    def rejection() -> torch.Tensor:
        """The mask the policy's weights now would reject to."""
        with torch.no_grad():
            now = learner.policy.log_probs(ids, mask, resp.shape[1], cfg.rollout.temperature)
        return rollout_correction(now, behave, resp, rollout_rs="token_k1", rollout_rs_threshold="0.5_2").mask

    # sampling log-probs: the policy's own, each token off by up to e^±1 (some rejected, most kept)
    with torch.no_grad():
        own = learner.policy.log_probs(ids, mask, resp.shape[1], cfg.rollout.temperature)
    noise = torch.rand(resp.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    behave = (own + noise) * resp
    rows = [(b, start, end) for b in batch.batches
            for start, end in zip(b.response_offsets()[:-1], b.response_offsets()[1:], strict=True)]
    for j, (b, start, end) in enumerate(rows):  # into the samples' own log-probs, which the update pads
        b.tokens["rollout_log_probs"][start:end] = behave[j, : end - start].numpy()

    before = rejection()
    masks: list[torch.Tensor] = []  # the mask argument of every micro-batch's loss, epoch after epoch
    loss = learner_module.ppo_loss

    def recording(*args: Any, **kwargs: Any) -> Any:
        masks.append(args[4].detach().clone())
        return loss(*args, **kwargs)

    monkeypatch.setattr(learner_module, "ppo_loss", recording)
    learner.update(batch)
    after = rejection()  # what a second update call would train on
    assert 0 < float(before.sum()) < float(resp.sum())  # some tokens rejected, some trained
    assert not torch.equal(after, before)
    half = len(masks) // 2
    assert half == 4  # 16 rows in micro-batches of 5, twice
    for first, second in zip(masks[:half], masks[half:], strict=True):
        assert torch.equal(first, second)
    rows = [m.shape[0] for m in masks[:half]]
    starts = [sum(rows[:k]) for k in range(half)]
    for m, start in zip(masks[:half], starts, strict=True):
        assert torch.equal(m, before[start:start + m.shape[0], :m.shape[1]].to(m.dtype))


def test_epochs_in_decoupled_mode_clip_against_the_pinned_proximal_policy() -> None:
    """Decoupled mode, one micro-batch: the first epoch reuses its forward as the proximal log-probs; the
    second forwards again and its ratio to the proximal policy moves off 1 (ppo_kl off 0 in its metrics)."""
    cfg = load_config(None, [*BASE, "actor.ppo_epochs=2", "actor.micro_batch_size=0", "actor.optim.lr=0.01",
                             "algorithm.rollout_correction.bypass_mode=false"])
    learner = Learner(cfg)
    learner.begin_step(1)
    batch, _ = assemble_batch_from_rollout_samples(mini_batch(5))
    seen: list[dict[str, float]] = []
    accumulate = learner._accumulate

    def recording(*args: Any) -> EpochStats:
        out = accumulate(*args)
        seen.append(epoch_metrics(out, left_out=False, norm_factor=None))  # the epoch's metrics
        return out

    learner._accumulate = recording  # type: ignore[method-assign]
    metrics = learner.update(batch)
    assert len(seen) == 2
    assert seen[0]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # the pinned weights' own forward
    assert abs(seen[1]["actor/ppo_kl"]) > 1e-5
    assert metrics["actor/ppo_kl"] == pytest.approx((seen[0]["actor/ppo_kl"] + seen[1]["actor/ppo_kl"]) / 2)
    assert metrics["actor/epochs_skipped"] == 0.0


def test_merge_epochs() -> None:
    """Timings add up; a metric of the first epoch alone (the mismatch ones) is its value; the others are the
    mean over the epochs that stepped; the update counts as skipped only when every epoch was."""
    first = {"timing_s/update_actor": 1.0, "actor/loss": 2.0, "training/rollout_probs_diff_mean": 0.3,
             UPDATE_SKIPPED: 0.0}
    nan = {"timing_s/update_actor": 0.5, "actor/loss": float("nan"), UPDATE_SKIPPED: 1.0}
    third = {"timing_s/update_actor": 1.5, "actor/loss": 4.0, UPDATE_SKIPPED: 0.0}
    merged = merge_epochs([first, nan, third])
    assert merged == {"timing_s/update_actor": 3.0, "actor/loss": 3.0, UPDATE_SKIPPED: 0.0,
                      "training/rollout_probs_diff_mean": 0.3, "actor/epochs_skipped": 1.0}
    assert merge_epochs([nan, nan])[UPDATE_SKIPPED] == 1.0
    assert merge_epochs([first]) == first
