"""model.lora_rank: the trainer trains low-rank factors on frozen weights and publishes the factors alone;
every process computes with the merged weight round(W + B A * scale), so a producer samples with plain
products and computes exactly what the trainer does."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.learner import Learner
from rollstream.config import ConfigError, load_config
from rollstream.model import build_policy
from rollstream.model.lora import LoRALinear, apply_lora
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.tensors import (
    load_bytes_into,
    module_bytes,
    published_state,
    state_bytes,
    unique_state,
)

TINY = ["model.d_model=16", "model.n_layer=2", "model.n_head=2", "model.max_seq_len=32", "run.device=cpu",
        "actor.ppo_mini_batch_size=2", "data.train_batch_size=4", "actor.optim.lr=1e-2"]
LORA = [*TINY, "model.lora_rank=2", "model.lora_alpha=4"]


def _batch(seed: int = 0) -> object:
    samples = [
        fake_rollout_sample(f"s{i}", n=4, prompt_len=5, response_len=6, seed=seed + i) for i in range(2)
    ]
    return assemble_batch_from_rollout_samples(samples)[0]


def _logits(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = module(ids)
    return out[0] if isinstance(out, tuple) else out


def test_lora_starts_as_the_plain_model_and_a_version_is_its_factors_alone() -> None:
    cfg = load_config(None, TINY)
    plain = build_policy(cfg).module
    adapted = copy.deepcopy(plain)
    layers = apply_lora(adapted, 2, 4.0, "all-linear")
    def has_lora(m: nn.Module) -> bool:
        return any(isinstance(x, LoRALinear) for x in m.modules())

    assert layers == 8 and has_lora(adapted) and not has_lora(plain)  # 4 a block (the output head is not one)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora.A", ".lora.B")) for n in trainable)
    ids = torch.randint(0, 20, (3, 9))
    assert torch.equal(_logits(adapted, ids), _logits(plain, ids))  # B = 0: the function is unchanged
    for name, p in adapted.named_parameters():  # a trained adapter
        if name.endswith(".lora.B"):
            with torch.no_grad():
                p.normal_(0, 0.5)
    assert not torch.allclose(_logits(adapted, ids), _logits(plain, ids), atol=1e-3)
    assert set(published_state(adapted)) == trainable  # the factors; the base is every process's own
    producer = build_policy(load_config(None, LORA)).module  # its own A, its own copy of the base
    assert not torch.equal(_logits(producer, ids), _logits(adapted, ids))
    load_bytes_into(producer, module_bytes(adapted))  # what a producer loads from a published version
    assert torch.equal(_logits(producer, ids), _logits(adapted, ids))  # exactly what the trainer computes
    with pytest.raises(ValueError, match="unknown tensors"):
        load_bytes_into(copy.deepcopy(plain), module_bytes(adapted))  # a producer without LoRA
    fewer = {k: v for k, v in published_state(adapted).items() if not k.startswith("blocks.1.")}
    with pytest.raises(ValueError, match=r"lack tensors: \['blocks\.1\..*lora"):
        load_bytes_into(producer, state_bytes(fewer))
    assert published_state(plain).keys() == unique_state(plain).keys()


def test_target_modules_pick_layers_by_name_and_a_miss_names_the_value() -> None:
    module = build_policy(load_config(None, TINY)).module
    assert apply_lora(copy.deepcopy(module), 1, 1.0, ["proj"]) == 2
    with pytest.raises(ValueError, match="q_proj"):
        apply_lora(copy.deepcopy(module), 1, 1.0, ["q_proj"])
    with pytest.raises(ConfigError, match="target_modules='attention'"):
        load_config(None, [*LORA, "model.target_modules=attention"])
    with pytest.raises(ConfigError, match="lora_rank=2 with trainer.strategy=fsdp"):
        load_config(None, [*LORA, "trainer.strategy=fsdp"])
    # vLLM producers merge the factors into their own base weights (producers/engines/lora_merge.py)
    vllm = load_config(None, [*LORA, "rollout.name=vllm", "model.backend=hf", "model.hf_path=/x"])
    assert vllm.model.lora_rank == 2 and vllm.rollout.name == "vllm"
    with pytest.raises(ConfigError, match="lora_rank=2 with model.init_from='w.safetensors'"):
        load_config(None, [*LORA, "model.init_from=w.safetensors"])


def test_the_trainer_moves_only_the_adapter_and_resumes_it_from_a_checkpoint() -> None:
    cfg = load_config(None, LORA)
    a = Learner(cfg)
    params = [p for group in a.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in params) == sum(
        p.numel() for n, p in a.policy.module.named_parameters() if ".lora." in n
    )
    before = {k: v.clone() for k, v in a.whole_weights().items()}
    ids = torch.randint(0, 20, (2, 9))
    logits_before = _logits(a.policy.module, ids)
    published_before = {k: v.clone() for k, v in published_state(a.policy.module).items()}
    a.update(_batch())
    after = a.whole_weights()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.endswith(".lora.B") for k in moved)  # A's gradient is 0 while B = 0
    assert not torch.equal(_logits(a.policy.module, ids), logits_before)  # W' followed the step
    published = published_state(a.policy.module)
    assert set(published) == set(published_before) and moved <= set(published)  # factors, as trained

    b = Learner(cfg)  # resumed from a checkpoint's contents: base weights, factors and optimizer state
    b.load_checkpoint_state({k: v.clone() for k, v in after.items()}, copy.deepcopy(a.optimizer_state()))
    ma, mb = a.update(_batch(1)), b.update(_batch(1))
    assert ma["actor/pg_loss"] == mb["actor/pg_loss"]
    for name, t in b.whole_weights().items():
        assert torch.equal(t, a.whole_weights()[name]), name


def test_a_frozen_output_head_is_not_expanded_to_the_batch(tmp_path: Path) -> None:
    # torch expands a frozen weight to the batch for a non-contiguous input that requires grad (a [B, R, H]
    # slice of the hidden states): SmolLM2's head went from 0.14 s to 3.4 s a forward before FrozenLinear
    from torch.profiler import ProfilerActivity, profile

    from rollstream.testing.hf_tiny import make_tiny_hf_model

    model_dir = make_tiny_hf_model(tmp_path / "model", seed=0, arch="llama", tokenizer="char")
    cfg = load_config(None, ["model.backend=hf", f"model.hf_path={model_dir}", "run.device=cpu"])
    policy = build_policy(cfg)
    apply_lora(policy.module, 2, 4.0, "all-linear")
    vocab, hidden = policy.module.get_output_embeddings().weight.shape
    ids = torch.randint(3, 20, (4, 12))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        lp, _ = policy.forward_logprobs_entropy(ids, torch.ones_like(ids), 5)
        lp.sum().backward()
    expanded = [e.input_shapes for e in prof.events() if [4, hidden, vocab] in e.input_shapes]
    assert not expanded, expanded[:2]
    assert all(p.grad is None for n, p in policy.module.named_parameters() if ".lora." not in n)


def _lora_pair(dtype: torch.dtype) -> tuple[LoRALinear, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(24, 40).to(dtype).requires_grad_(False)
    layer = copy.deepcopy(plain)
    holder = nn.Sequential(layer)
    apply_lora(holder, 4, 8.0, "all-linear")
    with torch.no_grad():
        layer.lora.B.normal_(0, 0.3)
    assert isinstance(layer, LoRALinear)
    return layer, plain


def test_the_factors_get_lora_gradients_through_the_merged_weight() -> None:
    layer, plain = _lora_pair(torch.float32)
    f = layer.lora
    x = torch.randn(3, 5, 24, requires_grad=True)
    out = layer(x)
    merged = plain.weight + f.B @ f.A * f.scale
    assert torch.equal(out, nn.functional.linear(x, layer.merged_weight(), plain.bias))  # W' alone
    ref_a, ref_b = f.A.detach().clone().requires_grad_(), f.B.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ref = nn.functional.linear(x_ref, plain.weight, plain.bias) + (x_ref @ ref_a.T * f.scale) @ ref_b.T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.merged_weight(), merged.detach(), rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert f.A.grad is not None and f.B.grad is not None and ref_a.grad is not None and ref_b.grad is not None
    torch.testing.assert_close(f.A.grad, ref_a.grad, rtol=1e-4, atol=1e-5)  # LoRA's own gradients
    torch.testing.assert_close(f.B.grad, ref_b.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)  # the input's: once, through W'
    assert layer.weight.grad is None


def test_a_producer_samples_with_plain_products_and_sees_every_step_in_bfloat16() -> None:
    # bfloat16 rounds a small step's B A away from most weights: both sides compute with the same rounded W',
    # and a producer's forward is one product per layer (no factor products per token)
    from torch.profiler import ProfilerActivity, profile

    layer, _ = _lora_pair(torch.bfloat16)
    producer, _ = _lora_pair(torch.bfloat16)
    x = torch.randn(6, 24, dtype=torch.bfloat16)
    for step in range(3):
        with torch.no_grad():
            layer.lora.B.add_(1e-3 * (step + 1))  # an optimizer step's size
        producer.load_state_dict(layer.state_dict())
        with torch.no_grad():
            first = producer(x)  # merges the new factors once
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                y = producer(x)
        products = [e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::matmul")]
        assert products == ["aten::addmm"], products  # then a forward is the plain product, no factors
        assert torch.equal(y, first) and torch.equal(y, layer(x).detach())


def test_a_producer_loading_versions_from_files_in_turn_computes_each(tmp_path: Path) -> None:
    # the file reader writes straight into the parameters' memory: the merged weight must still follow
    from rollstream.weights.tensors import load_file_into

    cfg = load_config(None, LORA)
    trainer, producer = build_policy(cfg).module, build_policy(cfg).module
    ids = torch.randint(0, 20, (2, 9))
    for version in range(3):
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if name.endswith(".lora.B"):
                    p.normal_(0, 0.1 * (version + 1))
        path = tmp_path / f"v{version}.safetensors"
        path.write_bytes(module_bytes(trainer))
        load_file_into(producer, path)
        assert torch.equal(_logits(producer, ids), _logits(trainer, ids)), version


def test_the_merged_weight_is_float32_exact_under_autocast_shared_at_b_zero_and_dropped_on_a_move() -> None:
    layer, plain = _lora_pair(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = layer.merged_weight().clone()
    layer._merged = None
    assert torch.equal(under_autocast, layer.merged_weight())  # merged in float32 either way
    layer.double()
    assert layer._merged is None and layer.merged_weight().dtype == torch.float64  # a cast rebuilds it
    fresh, _ = _lora_pair(torch.float32)
    with torch.no_grad():
        fresh.lora.B.zero_()
    assert fresh.merged_weight().data_ptr() == fresh.weight.data_ptr()  # B = 0: W itself, no copy
    model = nn.ModuleDict({"proj": nn.Linear(4, 4), "lm_head": nn.Linear(4, 9)})
    with pytest.raises(ValueError, match="output head 'lm_head'"):
        apply_lora(model, 2, 4.0, ["lm_head", "proj"])
    assert apply_lora(model, 2, 4.0, "all-linear") == 1  # all-linear leaves the head out
