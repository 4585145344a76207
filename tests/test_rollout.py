"""Producer data preparation without Redis: the generation batch, shard names, the tool-call cut."""

from __future__ import annotations

import numpy as np
import pytest

from producers.agent import tool_cut
from producers.worker import producer_index
from rollstream.model import CharTokenizer
from rollstream.rollout import (
    AGENT_SINGLE_TURN,
    AGENT_TOOL,
    concat_generation_data,
    prepare_single_generation_data,
    prompt_rows,
)
from rollstream.tasks import Prompt, make_task

TOK = CharTokenizer()


@pytest.mark.parametrize(("multi_turn", "agent"), [(True, AGENT_TOOL), (False, AGENT_SINGLE_TURN)])
def test_prepare_single_generation_data(multi_turn: bool, agent: str) -> None:
    prompt = Prompt(uid="p-1", text="123>", answer="321")
    data = prepare_single_generation_data(prompt, 3, multi_turn, TOK, sample_id="rollout_00-abc")
    assert list(data.non_tensors["agent_name"]) == [agent] * 3  # per row, as verl's non_tensor_batch
    assert "agent_name" not in data.meta_info
    assert len(data) == 3
    row = [TOK.bos_id, *TOK.encode("123>")]
    assert data.tensors["input_ids"].tolist() == [row] * 3
    assert list(data.non_tensors["uid"]) == ["rollout_00-abc"] * 3  # one GRPO group
    assert list(data.non_tensors["raw_prompt"]) == ["123>"] * 3
    assert list(prepare_single_generation_data(prompt, 2, False, TOK).non_tensors["uid"]) == ["p-1"] * 2


def test_concat_left_pads_and_interleaves() -> None:
    a = prepare_single_generation_data(Prompt("a", "12>", "21"), 2, False, TOK, sample_id="A")
    b = prepare_single_generation_data(Prompt("b", "12345>", "54321"), 2, False, TOK, sample_id="B")
    both = concat_generation_data([a, b], TOK.pad_id)
    assert list(both.non_tensors["uid"]) == ["A", "A", "B", "B"]  # prompt-major, n rows each
    ids, mask = both.tensors["input_ids"], both.tensors["attention_mask"]
    assert ids.shape == (4, 7)
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1] and mask[3].tolist() == [1] * 7
    assert (ids[mask == 0] == TOK.pad_id).all()
    assert np.array_equal(ids[0, 3:], a.tensors["input_ids"][0])
    # the agent loops read each row's prompt unpadded, as prepared (no unpadding of input_ids)
    assert (
        prompt_rows(both)
        == [[TOK.bos_id, *TOK.encode("12>")]] * 2 + [[TOK.bos_id, *TOK.encode("12345>")]] * 2
    )
    del both.non_tensors["raw_prompt_ids"]
    assert (
        prompt_rows(both)
        == [[TOK.bos_id, *TOK.encode("12>")]] * 2 + [[TOK.bos_id, *TOK.encode("12345>")]] * 2
    )


def test_producer_index_from_name() -> None:
    assert producer_index("rollout_02", 3) == 2
    assert producer_index("producers", 2) == 0
    with pytest.raises(ValueError, match="num_producers=2"):
        producer_index("rollout_02", 2)


def test_tool_cut_after_first_complete_call() -> None:
    task = make_task("arith")
    assert tool_cut(task, TOK, TOK.encode("ab[calc:1+2]9[calc:3]")) == len("ab[calc:1+2]")
    assert tool_cut(task, TOK, TOK.encode("[calc:1+2")) is None
    assert tool_cut(task, TOK, TOK.encode("12") + [TOK.eos_id] + TOK.encode("[calc:1]")) is None
