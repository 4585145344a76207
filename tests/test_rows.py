"""The built-in engine's running batch (rollstream/model/rows.py) on tiny models built here: rows admitted
mid-batch decode, under greedy decoding, the tokens and log-probs per-row generation gives; rows that finish
leave while the others decode on; a weight swap re-prefills the rows in flight under the new weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollstream.model import BasePolicy, CharTokenizer, Completion, GPTConfig, TinyPolicy
from rollstream.model.rows import TRIM_MIN, RowBatch

#: six prompts sharing a 5-token prefix (bos + "sum ")
PROMPTS = ["sum 12+3=", "sum 7*8=", "sum 100-1=", "sum 5=", "sum 99*9=", "sum 3-1="]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class EosTokenizer(CharTokenizer):
    """The char tokenizer with another id as its eos: one a random model's greedy rows do produce, so they end
    at different lengths."""

    def __init__(self, eos: int) -> None:
        super().__init__()
        self._eos = eos

    @property
    def eos_id(self) -> int:
        """The chosen eos id."""
        return self._eos


def tiny(position: str, eos: int | None = None, seed: int = 0) -> TinyPolicy:
    """A random tiny GPT (char vocabulary) on the CPU whose greedy rows vary (its matrices drawn with std 0.5:
    at the usual 0.02 every row repeats one token, which a broken cache would decode too), with eos moved to
    `eos` when given."""
    tok = CharTokenizer() if eos is None else EosTokenizer(eos)
    cfg = GPTConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layer=2, n_head=4, max_seq_len=64,
                    position=position)  # type: ignore[arg-type]
    return vary(TinyPolicy.from_config(cfg, seed=seed, device="cpu", tokenizer=tok), seed)


def vary(policy: BasePolicy, seed: int) -> Any:
    """`policy` with its matrices redrawn from `seed` with std 0.5 (its greedy rows then vary); returned."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in policy.module.parameters():
            if w.dim() == 2:
                w.normal_(0.0, 0.5, generator=gen)
    return policy


def tiny_hf(tmp: Path) -> BasePolicy:
    """A random tiny Llama with a BPE tokenizer and a chat template (prompts share its prefix)."""
    pytest.importorskip("transformers")
    from rollstream.model.hf import HFPolicy
    from rollstream.testing.hf_tiny import make_tiny_hf_model

    path = make_tiny_hf_model(tmp, arch="llama", tokenizer="bpe", chat_template=True, hidden_size=64)
    return HFPolicy.from_pretrained(path, device="cpu")


def ids_of(policy: BasePolicy, text: str) -> list[int]:
    """A prompt's ids as producers encode it (the chat template when the tokenizer has one)."""
    from rollstream.model.chat import encode_prompt

    return encode_prompt(policy.tokenizer, text)


def common_eos(policy: TinyPolicy, prompts: list[list[int]], budget: int) -> int:
    """The token that, as eos, ends greedy rows of these prompts at the most different lengths."""
    rows = [r.response_ids for r in policy.generate(prompts, 1, budget, greedy=True)]
    ends = {t: {r.index(t) if t in r else budget for r in rows} for r in rows for t in r}
    return max(ends, key=lambda t: len(ends[t]))


def run_admitting(
    batch: RowBatch, rows: list[Completion], budgets: list[int], admit_at: list[int]
) -> list[int]:
    """Step `batch` until every row is done, submitting row i (greedy) before step `admit_at[i]`; returns the
    rows in flight at each step."""
    occupancy, step = [], 0
    while step <= max(admit_at) or batch.in_flight:
        for i, at in enumerate(admit_at):
            if at == step:
                batch.submit(rows[i], budgets[i], 0.0)
        occupancy.append(batch.in_flight)
        batch.step()
        step += 1
    return occupancy


@pytest.mark.parametrize(("position", "compact_at"), [("learned", 0.125), ("rope", 0.125), ("rope", 1.0)])
def test_greedy_rows_admitted_mid_batch_decode_what_per_row_generation_does(
    position: str, compact_at: float
) -> None:
    budget = 14
    plain = tiny(position)
    prompts = [plain.tokenizer.encode(p, add_bos=True) for p in PROMPTS]
    policy = tiny(position, eos=common_eos(plain, prompts, budget))
    budgets = [budget, 6, budget, 9, budget, 3]
    want = [policy.generate([p], 1, b, greedy=True)[0] for p, b in zip(prompts, budgets, strict=True)]
    lengths = {len(w.response_ids) for w in want}
    assert len(lengths) >= 3 and any(w.finished for w in want) and not all(w.finished for w in want)

    batch = RowBatch(policy, compact_at=compact_at)  # 1.0: new rows always go into finished rows' slots
    rows = [Completion(prompt_ids=list(p)) for p in prompts]
    occupancy = run_admitting(batch, rows, budgets, admit_at=[0, 0, 2, 3, 3, 7])
    for got, ref in zip(rows, want, strict=True):
        assert got.response_ids == ref.response_ids and got.finished == ref.finished
        assert max(abs(a - b) for a, b in zip(got.log_probs, ref.log_probs, strict=True)) < 1e-5
    assert max(occupancy) >= 4  # rows really shared the batch, and left it as they finished
    assert occupancy[-1] < max(occupancy) and batch.in_flight == 0
    assert batch.clock.busy_s > 0 and 0 < batch.clock.row_s <= batch.clock.busy_s * max(occupancy)


@pytest.mark.parametrize("compact_at", [0.125, 1.0])
def test_a_long_running_batch_keeps_only_the_columns_its_rows_use(compact_at: float) -> None:
    policy = tiny("rope")
    prompts = [policy.tokenizer.encode(PROMPTS[k % len(PROMPTS)], add_bos=True) for k in range(24)]
    budgets = [6 + k % 5 for k in range(24)]
    want = [policy.generate([p], 1, b, greedy=True)[0] for p, b in zip(prompts, budgets, strict=True)]
    batch = RowBatch(policy, compact_at=compact_at)
    rows = [Completion(prompt_ids=list(p)) for p in prompts]
    widths = []
    for step in range(24 * 3 + 12):  # a row every 3 steps: ~3 in flight, 84 steps in all
        if step % 3 == 0 and step // 3 < len(rows):
            batch.submit(rows[step // 3], budgets[step // 3], 0.0)
        batch.step()
        widths.append(batch.columns)
    assert batch.in_flight == 0
    for got, ref in zip(rows, want, strict=True):
        assert got.response_ids == ref.response_ids
    longest = max(len(p) for p in prompts) + max(budgets)
    assert max(widths) <= longest + 3 + TRIM_MIN  # never the 84 steps' worth of columns


def test_an_hf_model_with_a_shared_chat_prefix_admits_rows_mid_batch(tmp_path: Path) -> None:
    policy = tiny_hf(tmp_path / "llama")
    prompts = [ids_of(policy, p) for p in PROMPTS]
    budgets = [12, 5, 9, 15, 7, 11]
    want = [policy.generate([p], 1, b, greedy=True)[0] for p, b in zip(prompts, budgets, strict=True)]
    batch = RowBatch(policy, compact_at=1.0)  # new rows go into finished rows' slots
    rows = [Completion(prompt_ids=list(p)) for p in prompts]
    run_admitting(batch, rows, budgets, admit_at=[0, 2, 2, 2, 7, 8])  # 3 rows prefilled together at step 2
    for got, ref in zip(rows, want, strict=True):
        assert got.response_ids == ref.response_ids
        assert max(abs(a - b) for a, b in zip(got.log_probs, ref.log_probs, strict=True)) < 1e-5


def test_a_group_shares_one_prefill_and_rows_sample_apart() -> None:
    policy = tiny("learned")
    prompt = policy.tokenizer.encode(PROMPTS[0], add_bos=True)
    batch = RowBatch(policy, torch.Generator().manual_seed(0))
    rows = [Completion(prompt_ids=list(prompt)) for _ in range(8)]
    for row in rows:
        batch.submit(row, 10, 1.5)
    while batch.in_flight:
        batch.step()
    assert len({tuple(r.response_ids) for r in rows}) > 1  # one prompt, 8 samples
    for row in rows:  # each log-prob is the tempered distribution's, as generate reports it
        ref = policy.log_probs(*_batch(row), len(row.response_ids), temperature=1.5)[0]
        assert torch.allclose(ref, torch.tensor(row.log_probs), atol=1e-5)


def _batch(row: Completion) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([row.prompt_ids + row.response_ids])
    return ids, torch.ones_like(ids)


def test_a_swap_re_prefills_the_rows_in_flight_under_the_new_weights() -> None:
    old, new = tiny("rope", seed=0), tiny("rope", seed=1)
    prompts = [old.tokenizer.encode(p, add_bos=True) for p in PROMPTS[:3]]
    batch = RowBatch(old)
    rows = [Completion(prompt_ids=list(p)) for p in prompts]
    for row in rows:
        batch.submit(row, 12, 0.0)
    for _ in range(5):
        batch.step()
    old.module.load_state_dict(new.module.state_dict())  # what a weight load does to the policy
    batch.resume(True)
    while batch.in_flight:
        batch.step()
    for row, p in zip(rows, prompts, strict=True):
        assert row.swap_points == [5]
        before = old_generate(tiny("rope", seed=0), p, 5)
        after = new.generate([p + before], 1, 7, greedy=True)[0].response_ids
        assert row.response_ids == before + after


def old_generate(policy: TinyPolicy, prompt: list[int], tokens: int) -> list[int]:
    """Greedy tokens of one row under `policy`."""
    return policy.generate([prompt], 1, tokens, greedy=True)[0].response_ids


def test_submit_refuses_rows_the_model_cannot_hold_and_abort_empties_the_batch() -> None:
    policy = tiny("learned")
    batch = RowBatch(policy)
    prompt = policy.tokenizer.encode("1+1=", add_bos=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        batch.submit(Completion(prompt_ids=prompt), 64, 1.0)
    with pytest.raises(ValueError, match="a token left"):
        batch.submit(Completion(prompt_ids=prompt, response_ids=[5, 6]), 2, 1.0)
    row = Completion(prompt_ids=prompt)
    batch.submit(row, 8, 1.0)
    batch.step()
    assert batch.in_flight == 1 and len(row.response_ids) == 1
    batch.abort()
    assert batch.in_flight == 0 and batch.step() == []
