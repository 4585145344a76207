"""Tests of HFPolicy against a tiny random Llama saved to a temp dir (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rollstream.model import (  # noqa: E402
    CharTokenizer,
    Completion,
    PromptGroups,
    Tokenizer,
    build_batch,
    load_policy,
)
from rollstream.model.hf import HFPolicy  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402

PROMPTS = ["1+2=", "12+34=", "7", "(3*4)-5=?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF model + tokenizer on disk."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_hf"), seed=0)


def load(path: Path) -> HFPolicy:
    """Load on CPU."""
    return HFPolicy.from_pretrained(path, device="cpu")


def encoded(policy: HFPolicy) -> list[list[int]]:
    """Prompts as ids with bos."""
    return [policy.tokenizer.encode(p, add_bos=True) for p in PROMPTS]


def max_logprob_error(policy: HFPolicy, trajs: list[Completion], start: int = 0) -> float:
    """Largest |stored - fresh forward| over response tokens from `start` on."""
    ids, mask, R = build_batch(
        [t.prompt_ids for t in trajs], [t.response_ids for t in trajs], policy.tokenizer.pad_id
    )
    with torch.no_grad():
        fresh = policy.log_probs(ids, mask, R)
    return max(
        (
            abs(fresh[i, j].item() - t.log_probs[j])
            for i, t in enumerate(trajs)
            for j in range(start, len(t.log_probs))
        ),
        default=0.0,
    )


def test_tokenizer_matches_char_tokenizer(model_dir: Path) -> None:
    tok = load(model_dir).tokenizer
    assert isinstance(tok, Tokenizer)
    char = CharTokenizer()
    text = "(12+34)=46; ok [a|b]"
    assert tok.encode(text, add_bos=True) == char.encode(text, add_bos=True)
    assert tok.decode(char.encode(text, add_bos=True) + [char.eos_id]) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, char.vocab_size)


def test_generate_and_logprobs_agree(model_dir: Path) -> None:
    policy = load(model_dir)
    gen = torch.Generator().manual_seed(0)
    trajs = policy.generate(encoded(policy), n=6, max_new_tokens=24, generator=gen)
    assert len(trajs) == 24 and all(t.prompt_ids == encoded(policy)[i // 6] for i, t in enumerate(trajs))
    assert any(t.finished for t in trajs) and not all(t.finished for t in trajs)
    assert max_logprob_error(policy, trajs) < 1e-4
    again = policy.generate(
        encoded(policy), n=6, max_new_tokens=24, generator=torch.Generator().manual_seed(0)
    )
    assert [t.response_ids for t in again] == [t.response_ids for t in trajs]


def test_swap_mid_generation(model_dir: Path, tmp_path: Path) -> None:
    policy = load(model_dir)
    new_bytes = load(make_tiny_hf_model(tmp_path / "other", seed=1)).state_dict_bytes()
    swapped: list[int] = []

    def on_chunk() -> bool:
        if swapped:
            return False
        policy.load_state_dict_bytes(new_bytes)
        swapped.append(1)
        return True

    gen = torch.Generator().manual_seed(0)
    trajs = policy.generate(encoded(policy), 4, 16, generator=gen, sync_every_tokens=6, on_chunk=on_chunk)
    assert all(t.swap_points == [6] for t in trajs if len(t.response_ids) > 6)
    assert max_logprob_error(policy, trajs, start=6) < 1e-4


def test_state_dict_bytes_round_trip(model_dir: Path, tmp_path: Path) -> None:
    a = load(model_dir)
    b = load_policy("hf", path=make_tiny_hf_model(tmp_path / "b", seed=1), device="cpu")
    assert a.state_dict_bytes() != b.state_dict_bytes()
    b.load_state_dict_bytes(a.state_dict_bytes())
    assert a.state_dict_bytes() == b.state_dict_bytes()
    ta = a.generate(encoded(a), 2, 10, generator=torch.Generator().manual_seed(5))
    tb = b.generate(encoded(a), 2, 10, generator=torch.Generator().manual_seed(5))
    assert [t.response_ids for t in ta] == [t.response_ids for t in tb]
    assert [t.log_probs for t in ta] == [t.log_probs for t in tb]


def _grads(policy: HFPolicy) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in policy.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prefix", ["", "(calc) answer: "])
def test_rows_sharing_a_prompt_score_as_the_full_forward(model_dir: Path, prefix: str) -> None:
    """GRPO's n samples of a prompt run the prompt once, and a prefix all prompts share (a system turn) runs
    once: log-probs, entropy and every gradient equal the full forward's (which runs each row's prompt
    again), for both output paths (logits, chunked head)."""
    from rollstream.model.base import SHARED_PREFIX_MIN, common_prefix_len

    policy = load(model_dir)
    gen = torch.Generator().manual_seed(1)
    prompts = [policy.tokenizer.encode(prefix + p, add_bos=True) for p in PROMPTS]
    C = common_prefix_len(prompts)
    C = C if C >= SHARED_PREFIX_MIN else 0
    assert C == (len(prefix) + 1 if prefix else 0)
    trajs = policy.generate(prompts, n=4, max_new_tokens=12, generator=gen)
    ids, mask, R = build_batch(
        [t.prompt_ids for t in trajs], [t.response_ids for t in trajs], policy.tokenizer.pad_id
    )
    # each prompt's 4 rows, as the ragged form numbers them and the trainer passes them
    groups = PromptGroups.from_labels([i // 4 for i in range(len(trajs))], common_prefix_len(prompts))
    calls: list[int] = []
    hook = policy.module.model.embed_tokens.register_forward_hook(lambda m, a, o: calls.append(a[0].numel()))
    policy.logprob_chunk_size = 5
    with torch.no_grad():
        policy.forward_logprobs_entropy(ids, mask, R, groups=groups)  # the chunked head's one-time check
    results = []
    for shared, chunk in [(True, 0), (False, 0), (True, 5)]:
        policy._checkpointing = not shared  # the full forward, as under gradient checkpointing
        policy.logprob_chunk_size = chunk
        policy.module.zero_grad()
        calls.clear()
        lp, ent = policy.forward_logprobs_entropy(ids, mask, R, groups=groups)
        ((lp + 0.1 * ent) * mask[:, -R:]).sum().backward()
        results.append((lp.detach(), ent.detach(), _grads(policy), sum(calls)))
    hook.remove()
    full = results[1]
    assert full[3] == ids.numel()  # every row's prompt and response went through the model
    for lp, ent, grads, tokens in (results[0], results[2]):
        # the shared prefix once, each prompt's own tokens once, then the responses
        assert tokens == C + len(PROMPTS) * (ids.shape[1] - R - C) + len(trajs) * R
        m = mask[:, -R:].bool()
        assert torch.allclose(lp[m], full[0][m], atol=1e-5) and torch.allclose(ent[m], full[1][m], atol=1e-5)
        assert grads.keys() == full[2].keys()
        for k, g in grads.items():
            assert torch.allclose(g, full[2][k], atol=1e-5, rtol=1e-4), k


def test_n_samples_share_their_prompt_prefill(model_dir: Path) -> None:
    """Sampling n rows from one prefill per prompt gives each row what a prompt repeated n times gives."""
    policy = load(model_dir)
    prompts = encoded(policy)
    shared = policy.generate(prompts, n=3, max_new_tokens=16, greedy=True)
    repeated = policy.generate([p for p in prompts for _ in range(3)], n=1, max_new_tokens=16, greedy=True)
    assert [t.response_ids for t in shared] == [t.response_ids for t in repeated]
    pairs = [
        (a, b)
        for s, r in zip(shared, repeated, strict=True)
        for a, b in zip(s.log_probs, r.log_probs, strict=True)
    ]
    assert max(abs(a - b) for a, b in pairs) < 1e-5


def test_a_prefix_every_prompt_shares_is_computed_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts that start alike (a chat template's system turn) prefill that prefix once: the responses are
    those of whole-prompt prefills, the stored log-probs are a fresh forward's, and a swap mid-generation
    (which re-prefills prefix, padding hole and suffix) still scores right."""
    import rollstream.model.base as base

    policy = load(model_dir)
    prompts = [policy.tokenizer.encode("(calc) answer: " + p, add_bos=True) for p in PROMPTS]
    assert base.common_prefix_len(prompts) == len("(calc) answer: ") + 1
    runs = {}
    for share in (True, False):
        monkeypatch.setattr(base, "SHARED_PREFIX_MIN", 4 if share else 10**9)
        greedy = policy.generate(prompts, n=2, max_new_tokens=16, greedy=True)
        sampled = policy.generate(prompts, n=3, max_new_tokens=16, generator=torch.Generator().manual_seed(0))
        runs[share] = (greedy, sampled)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert [t.response_ids for t in a] == [t.response_ids for t in b]
        pairs = [
            (x, y) for s, r in zip(a, b, strict=True) for x, y in zip(s.log_probs, r.log_probs, strict=True)
        ]
        assert max(abs(x - y) for x, y in pairs) < 1e-5
    assert max_logprob_error(policy, runs[True][1]) < 1e-4

    monkeypatch.setattr(base, "SHARED_PREFIX_MIN", 4)
    other = load(model_dir)
    other.module.load_state_dict({k: v + 0.01 for k, v in other.module.state_dict().items()})
    new_bytes, swapped = other.state_dict_bytes(), []

    def on_chunk() -> bool:
        swapped.append(1)
        if len(swapped) == 1:
            policy.load_state_dict_bytes(new_bytes)
            return True
        return False

    trajs = policy.generate(prompts, 3, 16, generator=torch.Generator().manual_seed(1), sync_every_tokens=5,
                            on_chunk=on_chunk)
    assert any(t.swap_points == [5] for t in trajs)
    assert max_logprob_error(policy, trajs, start=5) < 1e-4


def test_common_prefix_len_leaves_each_row_a_token() -> None:
    from rollstream.model.base import common_prefix_len

    assert common_prefix_len([[1, 2, 3], [1, 2, 4]]) == 2
    assert common_prefix_len([[1, 2, 3], [1, 2, 3]]) == 2  # identical rows: the last token is each row's own
    assert common_prefix_len([[1, 2], [5, 2]]) == 0
    assert common_prefix_len([[7], [7, 8]]) == 0
    assert common_prefix_len([]) == 0


def test_finished_rows_leave_the_batch_together_and_each_row_is_its_own(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that finish stay in the batch (decoded, ignored) until an eighth of it has finished, so the KV
    cache is compacted fewer times than rows finish at distinct steps; every row still gets, greedy, the
    tokens and log-probs it gets decoded alone, and its stored log-probs are the trainer's. (The random
    model never says eos: the token its greedy rows first reach at the most distinct steps stands in.)"""
    policy = load(model_dir)
    prompts = [policy.tokenizer.encode(p, add_bos=True) for p in [*PROMPTS, "9*9=", "((1))", "42", "x", "0"]]
    free = [t.response_ids for t in policy.generate(prompts, n=1, max_new_tokens=40, greedy=True)]
    firsts = {tok: {ids.index(tok) for ids in free if tok in ids} for ids in free for tok in ids}
    eos = max(firsts, key=lambda tok: len(firsts[tok]))
    monkeypatch.setattr(type(policy.tokenizer), "eos_id", property(lambda self: eos))
    compactions = []
    select = policy._select_cache

    def counting(cache: object, rows: torch.Tensor) -> object:
        compactions.append(len(rows))
        return select(cache, rows)

    monkeypatch.setattr(policy, "_select_cache", counting)
    batch = policy.generate(prompts, n=1, max_new_tokens=40, greedy=True)
    monkeypatch.setattr(policy, "_select_cache", select)
    finish_steps = {len(t.response_ids) for t in batch if t.finished}
    assert len(finish_steps) >= 3, [len(t.response_ids) for t in batch]  # rows finish at distinct steps
    assert len(compactions) < len(finish_steps)
    for prompt, row in zip(prompts, batch, strict=True):
        alone = policy.generate([prompt], n=1, max_new_tokens=40, greedy=True)[0]
        assert row.response_ids == alone.response_ids
        assert max(abs(a - b) for a, b in zip(row.log_probs, alone.log_probs, strict=True)) < 1e-5
    assert max_logprob_error(policy, batch) < 1e-4
