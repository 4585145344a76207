"""Tests of the tiny policy: tokenizer, GPT KV cache, generation, behaviour log-probs, weight bytes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch

from rollstream.model import (
    GPT,
    CharTokenizer,
    Completion,
    GPTConfig,
    TinyPolicy,
    Tokenizer,
    build_batch,
    load_policy,
)
from rollstream.model.base import left_pad
from rollstream.model.gpt import positions_from_mask

TOK = CharTokenizer()
CFG = GPTConfig(vocab_size=TOK.vocab_size)
PROMPTS = ["1+2=", "12+34=", "7", "(3*4)-5=?"]  # different lengths -> left padding


def make_policy(seed: int = 0, position: str = "learned") -> TinyPolicy:
    """A default-size CPU policy (learned or rotary positions)."""
    return TinyPolicy.from_config(dataclasses.replace(CFG, position=position), seed=seed, device="cpu")


def encoded(prompts: list[str] = PROMPTS) -> list[list[int]]:
    """Prompts as ids with bos."""
    return [TOK.encode(p, add_bos=True) for p in prompts]


def max_logprob_error(
    policy: TinyPolicy,
    trajs: list[Completion],
    upto: int | None = None,
    start: int = 0,
    temperature: float = 1.0,
) -> float:
    """Largest |stored - fresh forward| over response tokens start..upto of every trajectory."""
    ids, mask, R = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs], TOK.pad_id)
    with torch.no_grad():
        fresh = policy.log_probs(ids, mask, R, temperature)
    err = 0.0
    for i, t in enumerate(trajs):
        for j in range(start, len(t.response_ids) if upto is None else min(upto, len(t.response_ids))):
            err = max(err, abs(fresh[i, j].item() - t.log_probs[j]))
    return err


# ---- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_ids() -> None:
    text = "0123456789+-*/=()<>?:.,; abcxyz[]|"
    ids = TOK.encode(text, add_bos=True)
    assert ids[0] == TOK.bos_id == 1 and TOK.pad_id == 0 and TOK.eos_id == 2
    assert TOK.decode(ids) == text
    assert TOK.decode([*ids, TOK.eos_id, TOK.pad_id], skip_special=False) == "<bos>" + text + "<eos><pad>"
    assert TOK.vocab_size == 3 + 25 + 26 + 3
    assert TOK.encode("0") == [3]
    assert isinstance(TOK, Tokenizer)


def test_tokenizer_unknown_char_names_it() -> None:
    with pytest.raises(ValueError, match="'A'"):
        TOK.encode("1+A")
    with pytest.raises(ValueError, match="token id 999"):
        TOK.decode([999])


# ---- GPT -------------------------------------------------------------------------------------------


def test_default_size_is_about_100k_params() -> None:
    n = sum(p.numel() for p in make_policy().parameters())
    assert 80_000 < n < 130_000


@pytest.mark.parametrize("position", ["learned", "rope", "learned+rope"])
def test_kv_cache_decode_equals_full_forward(position: str) -> None:
    model = make_policy(position=position).module
    assert isinstance(model, GPT)
    ids = torch.tensor([enc + [5] * (10 - len(enc)) for enc in encoded()])  # [4,10]
    ids[2, :3] = TOK.pad_id  # left padding on one row
    mask = (torch.arange(10)[None, :] >= torch.tensor([0, 0, 3, 0])[:, None]).long()
    with torch.no_grad():
        full = model(ids, 0, None, positions_from_mask(mask), mask)  # [4,10,V]
        cache = model.new_cache(4, 10)
        step = model(ids[:, :6], 0, cache, positions_from_mask(mask[:, :6]), mask[:, :6])
        parts = [step]
        for t in range(6, 10):
            pos = positions_from_mask(mask[:, : t + 1])[:, -1:]
            parts.append(model(ids[:, t : t + 1], cache.length, cache, pos, mask[:, : t + 1]))
    cached = torch.cat(parts, 1)
    real = mask.bool()
    assert torch.allclose(cached[real], full[real], atol=1e-5)
    assert torch.isfinite(cached).all()


def test_position_limit_is_enforced() -> None:
    policy = make_policy()
    with pytest.raises(ValueError, match="max_seq_len"):
        policy.generate([[1] * 60], n=1, max_new_tokens=8)


# ---- generation ------------------------------------------------------------------------------------


def test_generate_shapes_and_order() -> None:
    policy = make_policy()
    prompts = encoded()
    trajs = policy.generate(prompts, n=3, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    assert len(trajs) == len(prompts) * 3
    for i, t in enumerate(trajs):
        assert t.prompt_ids == prompts[i // 3]  # prompt-major, interleaved
        assert 1 <= len(t.response_ids) == len(t.log_probs) <= 12
        assert t.finished == (t.response_ids[-1] == TOK.eos_id)
        assert TOK.eos_id not in t.response_ids[:-1]
        assert t.finished or len(t.response_ids) == 12
        assert all(lp <= 0.0 for lp in t.log_probs)
    assert policy.generate([], n=2, max_new_tokens=4) == []


def test_generate_is_deterministic_with_seed_and_generator() -> None:
    def run(gen_seed: int) -> list[list[int]]:
        trajs = make_policy(0).generate(encoded(), 4, 10, generator=torch.Generator().manual_seed(gen_seed))
        return [t.response_ids for t in trajs]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_equal_prompts_are_prefilled_once_and_sample_as_one_prompts_n_rows() -> None:
    policy = make_policy()
    prefilled: list[int] = []
    prefill = policy._prefill_prompts

    def counting(prompts: list[list[int]], max_new_tokens: int) -> Any:
        prefilled.append(len(prompts))
        return prefill(prompts, max_new_tokens)

    policy._prefill_prompts = counting  # type: ignore[method-assign]
    a, b = encoded()[:2]
    rows = policy.generate([a, a, a, b, b], 1, 8, generator=torch.Generator().manual_seed(0))
    assert prefilled == [2]  # what the agent loops pass: a group's rows as equal prompts
    assert [r.prompt_ids for r in rows] == [a, a, a, b, b]
    assert len({tuple(r.response_ids) for r in rows[:3]}) == 3  # each row samples its own tokens
    greedy = policy.generate([a, a, b], 1, 8, greedy=True)
    alone = [policy.generate([p], 1, 8, greedy=True)[0] for p in (a, b)]
    assert [r.response_ids for r in greedy] == [alone[0].response_ids] * 2 + [alone[1].response_ids]


@pytest.mark.parametrize("position", ["learned", "rope", "learned+rope"])
def test_behaviour_logprobs_match_fresh_forward(position: str) -> None:
    policy = make_policy(position=position)
    trajs = policy.generate(encoded(), n=8, max_new_tokens=20, generator=torch.Generator().manual_seed(0))
    assert any(t.finished for t in trajs) and not all(t.finished for t in trajs)  # rows dropped mid-batch
    assert max_logprob_error(policy, trajs) < 1e-4


def test_logprobs_are_the_tempered_policy_regardless_of_top_p() -> None:
    policy = make_policy()
    gen = torch.Generator().manual_seed(3)
    trajs = policy.generate(encoded(), n=4, max_new_tokens=16, temperature=0.7, top_p=0.9, generator=gen)
    assert max_logprob_error(policy, trajs, temperature=0.7) < 1e-4


def test_greedy_is_deterministic_and_tiny_top_p_is_greedy() -> None:
    policy = make_policy()
    a = policy.generate(encoded(), 2, 12, greedy=True, generator=torch.Generator().manual_seed(0))
    b = policy.generate(encoded(), 2, 12, greedy=True)
    c = policy.generate(encoded(), 2, 12, top_p=1e-6, generator=torch.Generator().manual_seed(9))
    assert [t.response_ids for t in a] == [t.response_ids for t in b] == [t.response_ids for t in c]
    assert a[0].response_ids == a[1].response_ids
    assert max_logprob_error(policy, a) < 1e-4


def test_top_k_samples_only_the_k_most_likely_and_keeps_the_whole_distributions_logprobs() -> None:
    policy = make_policy()
    one = policy.generate(encoded(), 2, 12, top_k=1, generator=torch.Generator().manual_seed(5))
    greedy = policy.generate(encoded(), 2, 12, greedy=True)
    assert [t.response_ids for t in one] == [t.response_ids for t in greedy]
    gen = torch.Generator().manual_seed(1)
    trajs = policy.generate(encoded(), 8, 12, temperature=1.3, top_k=3, generator=gen)
    assert max_logprob_error(policy, trajs, temperature=1.3) < 1e-4  # log-probs of the untruncated policy
    for t in trajs:  # every sampled token was among the 3 most likely at its position
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = policy.module(ids)[0, len(t.prompt_ids) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(tok in row for tok, row in zip(t.response_ids, top3.tolist(), strict=True))
    with pytest.raises(ValueError, match="top_k=0"):
        policy.generate(encoded(), 1, 4, top_k=0)


def test_sample_rows_draws_each_token_at_its_probability_and_never_a_zero_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inverse-CDF sampler: unnormalised rows are drawn in proportion (200k draws within 0.5 points),
    zero-probability tokens (a top-k/top-p cut, the vocabulary's tail) never, and a uniform at the top of
    [0, 1) still lands on the last token with mass, not on the zeros after it."""
    from rollstream.model.sampling import sample_rows

    probs = torch.tensor([[0.2, 0.0, 1.2, 0.6, 0.0, 0.0]]).repeat(200_000, 1)  # sums to 2
    freq = torch.bincount(sample_rows(probs, torch.Generator().manual_seed(0)), minlength=6) / 200_000
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0, 0.0]), atol=0.005)
    assert freq[1] == freq[4] == freq[5] == 0
    top = torch.tensor([1.0 - 2.0**-24])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: top.expand(3, 1).clone())
    rows = torch.tensor([[0.3, 0.7, 0.0, 0.0], [1e-8, 3.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert sample_rows(rows, None).tolist() == [1, 1, 3]


def test_on_chunk_without_swap_changes_nothing() -> None:
    policy = make_policy()
    calls: list[int] = []

    def on_chunk() -> bool:
        calls.append(1)
        return False

    a = policy.generate(encoded(), 2, 12, generator=torch.Generator().manual_seed(0))
    b = policy.generate(
        encoded(), 2, 12, generator=torch.Generator().manual_seed(0), sync_every_tokens=4, on_chunk=on_chunk
    )
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert [t.log_probs for t in a] == [t.log_probs for t in b]
    assert 1 <= len(calls) <= 2 and all(not t.swap_points for t in b)


def test_on_chunk_swap_reprefills_under_new_weights() -> None:
    policy = make_policy(0)
    old_bytes = policy.state_dict_bytes()
    new_bytes = make_policy(1).state_dict_bytes()
    swaps: list[int] = []

    def on_chunk() -> bool:
        if not swaps:
            policy.load_state_dict_bytes(new_bytes)  # what a producer does on a new param version
            swaps.append(1)
            return True
        return False

    trajs = policy.generate(
        encoded(), 6, 16, generator=torch.Generator().manual_seed(0), sync_every_tokens=5, on_chunk=on_chunk
    )
    alive = [t for t in trajs if len(t.response_ids) > 5]
    assert alive and all(t.swap_points == [5] for t in alive)
    assert all(not t.swap_points for t in trajs if len(t.response_ids) <= 5)
    assert max_logprob_error(policy, trajs, start=5) < 1e-4  # after the swap: exact under NEW weights
    assert max_logprob_error(policy, trajs, upto=5) > 1e-2  # before it: not the new weights' numbers
    policy.load_state_dict_bytes(old_bytes)
    assert max_logprob_error(policy, trajs, upto=5) < 1e-4  # ... but the old ones'
    assert max_logprob_error(policy, alive, start=5) > 1e-2


# ---- scoring and weights ---------------------------------------------------------------------------


def test_log_probs_train_mode_has_grad_and_entropy() -> None:
    policy = make_policy().train()
    trajs = policy.generate(encoded(), 2, 8, generator=torch.Generator().manual_seed(0))
    assert policy.module.training  # generate restores the mode
    ids, mask, R = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs], TOK.pad_id)
    logp, ent = policy.forward_logprobs_entropy(ids, mask, R)
    assert logp.shape == ent.shape == (len(trajs), R)
    assert logp.requires_grad
    logp.sum().backward()
    assert all(p.grad is not None for p in policy.parameters())
    vocab = torch.log(torch.tensor(float(TOK.vocab_size)))
    assert ((ent > 0) & (ent <= vocab + 1e-4)).all()


def test_state_dict_bytes_round_trip() -> None:
    a, b = make_policy(0), make_policy(1)
    assert a.state_dict_bytes() == make_policy(0).state_dict_bytes()  # seed -> weights
    assert a.state_dict_bytes() != b.state_dict_bytes()
    b.load_state_dict_bytes(a.state_dict_bytes())
    ta = a.generate(encoded(), 3, 10, generator=torch.Generator().manual_seed(4))
    tb = b.generate(encoded(), 3, 10, generator=torch.Generator().manual_seed(4))
    assert [t.response_ids for t in ta] == [t.response_ids for t in tb]
    assert [t.log_probs for t in ta] == [t.log_probs for t in tb]


def test_load_refuses_foreign_weights() -> None:
    other = TinyPolicy.from_config(GPTConfig(vocab_size=TOK.vocab_size, n_layer=1), seed=0, device="cpu")
    with pytest.raises(ValueError, match="lack"):
        make_policy().load_state_dict_bytes(other.state_dict_bytes())
    with pytest.raises(ValueError, match="unknown"):
        other.load_state_dict_bytes(make_policy().state_dict_bytes())


def test_load_policy_factory() -> None:
    policy = load_policy("tiny", cfg=CFG, seed=0, device="cpu")
    assert isinstance(policy, TinyPolicy) and policy.device == torch.device("cpu")
    with pytest.raises(ValueError, match="backend"):
        load_policy("nope")


def test_import_has_no_transformers_side_effect() -> None:
    code = "import sys, rollstream.model, rollstream.model.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_behaviour_log_probs_at_temperature_equal_the_trainers_recompute(temperature: float) -> None:
    """Stored log-probs are those of softmax(logits / T), the distribution actually sampled from."""
    import torch

    from rollstream.model import build_batch

    pol = make_policy()
    trajs = pol.generate(encoded(), n=8, max_new_tokens=8, temperature=temperature,
                         generator=torch.Generator().manual_seed(0))
    ids, mask, R = build_batch([tr.prompt_ids for tr in trajs], [tr.response_ids for tr in trajs], TOK.pad_id)
    with torch.no_grad():
        at_t = pol.log_probs(ids, mask, R, temperature=temperature)
        at_1 = pol.log_probs(ids, mask, R)
    err = max(abs(at_t[i, j].item() - lp) for i, tr in enumerate(trajs) for j, lp in enumerate(tr.log_probs))
    off = max(abs(at_1[i, j].item() - lp) for i, tr in enumerate(trajs) for j, lp in enumerate(tr.log_probs))
    assert err < 1e-5
    assert off > 1e-2  # the temperature-1 recompute would be wrong: the test can tell the two apart


def test_log_probs_refuse_a_non_positive_temperature() -> None:
    pol = make_policy()
    ids, mask, R = build_batch([TOK.encode("12>", add_bos=True)], [TOK.encode("21")], TOK.pad_id)
    with pytest.raises(ValueError, match="temperature"):
        pol.log_probs(ids, mask, R, temperature=0.0)


def test_rope_positions_come_from_the_mask_so_left_padding_changes_nothing() -> None:
    policy = make_policy(position="rope")
    assert policy.module.pos_emb is None
    alone = TOK.encode("12345>", add_bos=True)
    ids, mask = left_pad([alone, TOK.encode("1>", add_bos=True)], TOK.pad_id)  # row 0 unpadded, row 1 padded
    # row 0 padded
    padded_ids, padded_mask = left_pad([alone, TOK.encode("123456789>", add_bos=True)], TOK.pad_id)
    with torch.no_grad():
        a = policy.module(ids, 0, None, positions_from_mask(mask), mask)[0]
        b = policy.module(padded_ids, 0, None, positions_from_mask(padded_mask), padded_mask)[0, -len(alone):]
    assert torch.allclose(a, b, atol=1e-5)


def test_rope_and_learned_positions_differ_and_bad_shapes_are_refused() -> None:
    rope, learned = make_policy(position="rope"), make_policy()
    assert (
        sum(p.numel() for p in learned.parameters()) - sum(p.numel() for p in rope.parameters())
        == CFG.max_seq_len * CFG.d_model
    )
    both = make_policy(position="learned+rope")  # the learned table plus a rotation (no parameters)
    assert sum(p.numel() for p in both.parameters()) == sum(p.numel() for p in learned.parameters())
    both.module.load_state_dict(learned.module.state_dict())
    ids = torch.tensor([TOK.encode("12345>", add_bos=True)])
    with torch.no_grad():  # same weights, different scores: the rotation is applied on top of the embeddings
        assert not torch.allclose(both.module(ids), learned.module(ids), atol=1e-4)
    with pytest.raises(ValueError, match="position="):
        GPTConfig(vocab_size=10, position="alibi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="position='learned\\+rope' needs an even head size"):
        GPTConfig(vocab_size=10, d_model=12, n_head=4, position="learned+rope")
    with pytest.raises(ValueError, match="even head size"):
        GPTConfig(vocab_size=10, d_model=12, n_head=4, position="rope")


def test_building_a_policy_leaves_the_global_rng_and_dynamo_alone() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from rollstream.model.gpt import GPTConfig\n"
        "from rollstream.model.tiny import TinyPolicy\n"
        "cfg = GPTConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2)\n"
        "torch.manual_seed(5); before = torch.get_rng_state()\n"
        "a = TinyPolicy.from_config(cfg, seed=3, device='cpu')\n"
        "assert torch.equal(before, torch.get_rng_state()), 'the global RNG moved'\n"
        "b = TinyPolicy.from_config(cfg, seed=3, device='cpu')\n"
        "pairs = zip(a.module.state_dict().values(), b.module.state_dict().values())\n"
        "assert all(torch.equal(x, y) for x, y in pairs)\n"
        "assert 'torch._dynamo' not in sys.modules, 'building a policy imported torch._dynamo'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
