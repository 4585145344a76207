"""actor.optim.master_weights: a bfloat16 module trained through float32 copies the optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.learner import Learner
from rollstream.config import ConfigError, load_config
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.tensors import unique_state

TINY = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32", "run.device=cpu",
        "actor.ppo_mini_batch_size=2", "data.train_batch_size=4", "actor.optim.lr=1e-5",
        "model.dtype=bfloat16"]


def _batch() -> object:
    samples = [fake_rollout_sample(f"s{i}", n=4, prompt_len=5, response_len=6, seed=i) for i in range(2)]
    return assemble_batch_from_rollout_samples(samples)[0]


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Fraction of weight elements that changed."""
    changed = sum(int((after[k].float() != v.float()).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values())


def test_an_update_too_small_for_bfloat16_lands_in_the_float32_copies() -> None:
    plain = Learner(load_config(None, TINY))
    before = {k: v.clone() for k, v in plain.whole_weights().items()}
    plain.update(_batch())
    # AdamW's first step moves each weight by ~lr = 1e-5: bfloat16 (8 mantissa bits) rounds most of it away
    assert _moved(before, plain.whole_weights()) < 0.2

    mixed = Learner(load_config(None, [*TINY, "actor.optim.master_weights=true"]))
    assert {p.dtype for p in mixed.policy.parameters()} == {torch.bfloat16}
    before = {k: v.clone() for k, v in mixed.whole_weights().items()}
    assert {v.dtype for v in before.values()} == {torch.float32}  # what a checkpoint keeps
    mixed.update(_batch())
    after = mixed.whole_weights()
    assert _moved(before, after) > 0.8
    assert max(float((after[k] - v).abs().max()) for k, v in before.items()) < 1e-4
    for name, t in unique_state(mixed.policy.module).items():  # the module: the copies, rounded
        assert torch.equal(t, after[name].to(torch.bfloat16)), name


def test_master_weights_survive_a_checkpoint_round_trip() -> None:
    cfg = load_config(None, [*TINY, "actor.optim.master_weights=true"])
    a = Learner(cfg)
    a.update(_batch())
    weights = {k: v.clone() for k, v in a.whole_weights().items()}
    b = Learner(cfg)
    b.load_checkpoint_state(weights, copy.deepcopy(a.optimizer_state()))  # as read from a file
    for name, t in b.whole_weights().items():
        assert t.dtype == torch.float32 and torch.equal(t, weights[name]), name
    ma, mb = a.update(_batch()), b.update(_batch())
    assert ma["actor/grad_norm"] == mb["actor/grad_norm"] and ma["actor/pg_loss"] == mb["actor/pg_loss"]
    for name, t in b.whole_weights().items():
        assert torch.equal(t, a.whole_weights()[name]), name


@pytest.mark.parametrize("extra", [["model.dtype=float32"], ["trainer.nproc_per_node=2"]])
def test_master_weights_need_a_low_precision_module_and_one_process(extra: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"actor\.optim\.master_weights"):
        load_config(None, [*TINY, "actor.optim.master_weights=true", *extra])


@pytest.mark.parametrize("native", [True, False])
def test_dtype_fast_is_bfloat16_only_where_the_cpu_multiplies_it_faster(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """model.dtype=fast: bfloat16 weights with float32 copies where this CPU multiplies bfloat16 faster;
    float32 weights elsewhere (here: bfloat16 measured slower), and master_weights then keeps no copies."""
    monkeypatch.setattr(
        "rollstream.model.base.fast_cpu_dtype", lambda: torch.bfloat16 if native else torch.float32
    )
    fast = [a for a in TINY if not a.startswith("model.dtype")] + ["model.dtype=fast"]
    learner = Learner(load_config(None, [*fast, "actor.optim.master_weights=true"]))
    want = torch.bfloat16 if native else torch.float32
    assert {p.dtype for p in learner.policy.parameters()} == {want}
    assert (learner.master is not None) == native
    before = {k: v.clone() for k, v in learner.whole_weights().items()}
    assert {v.dtype for v in before.values()} == {torch.float32}
    learner.update(_batch())
    assert _moved(before, learner.whole_weights()) > 0.8  # lr 1e-5 lands either way
