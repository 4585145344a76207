"""Producer data preparation without Redis: the generation request, shard names, the tool-call cut."""

from __future__ import annotations

import pytest

from producers.agent import tool_cut
from producers.rollout import (
    AGENT_SINGLE_TURN,
    AGENT_TOOL,
    GenerationRequest,
    failed_trajectories,
    generation_request,
    prepare_single_generation_data,
)
from producers.worker import producer_index
from rollstream.model import CharTokenizer
from rollstream.tasks import Prompt, make_task

TOK = CharTokenizer()


@pytest.mark.parametrize(("multi_turn", "agent"), [(True, AGENT_TOOL), (False, AGENT_SINGLE_TURN)])
def test_generation_request(multi_turn: bool, agent: str) -> None:
    prompt = Prompt(uid="p-1", text="123>", answer="321")
    req = generation_request([prompt], 3, multi_turn, TOK)
    assert req.agent == agent  # one agent loop per request, chosen by multi-turn as verl's
    assert len(req) == 3
    row = [TOK.bos_id, *TOK.encode("123>")]
    assert req.rows == [row] * 3
    trajs = failed_trajectories(req, 0, 0.0)  # the request shares one list per prompt; each trajectory
    assert len({id(t.prompt_ids) for t in trajs} | {id(r) for r in req.rows}) == 4  # owns its own copy


def test_generation_request_rows_are_prompt_major_and_unpadded() -> None:
    req = generation_request([Prompt("a", "12>", "21"), Prompt("b", "12345>", "54321")], 2, False, TOK)
    assert req.rows == [[TOK.bos_id, *TOK.encode("12>")]] * 2 + [[TOK.bos_id, *TOK.encode("12345>")]] * 2
    failed = failed_trajectories(req, 7, 0.5)
    assert [t.prompt_ids for t in failed] == req.rows
    assert all(not t.response_ids and not t.finished for t in failed)
    assert all(t.version_start == t.version_end == 7 for t in failed)
    assert failed[0].prompt_ids is not req.rows[0]


def test_generation_request_names_a_known_agent() -> None:
    with pytest.raises(ValueError, match="unknown agent"):
        GenerationRequest([[1, 2]], agent="react_agent")


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


def test_prepare_single_generation_data_repeats_one_prompt_n_times() -> None:
    """verl's seed name: one prompt's request, its row n times; a dispatch's request is these in order."""
    prompt = Prompt(uid="p-1", text="123>", answer="321")
    single = prepare_single_generation_data(prompt, 4, False, TOK)
    assert single.rows == [[TOK.bos_id, *TOK.encode("123>")]] * 4
    assert single.agent == AGENT_SINGLE_TURN
    assert prepare_single_generation_data(prompt, 2, True, TOK).agent == AGENT_TOOL
    other = Prompt(uid="p-2", text="45>", answer="54")
    both = generation_request([prompt, other], 4, False, TOK)
    assert both.rows == single.rows + prepare_single_generation_data(other, 4, False, TOK).rows
    with pytest.raises(ValueError, match="rollout.n must be >= 1, got 0"):
        prepare_single_generation_data(prompt, 0, False, TOK)
