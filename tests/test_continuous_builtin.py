"""Continuous generation on the built-in engine (`rollout.continuous`: producers/continuous.py driving
rollstream/model/rows.py), a producer against a real Redis on a tiny GPT built here: groups admitted as rows
finish and published once each in seq order, versions stamped as the per-dispatch loop stamps them, the tool
agent's turns, and the combinations refused."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from conftest import one_version_rows, publish_during_steps
from test_rows import vary

from producers.agent import GenerationSettings, run_agent_loop
from producers.rollout import AGENT_TOOL, GenerationRequest, generation_request
from producers.worker import Producer
from rollstream.bus import setup_run
from rollstream.config import ConfigError, PipelineConfig, load_config
from rollstream.keys import Keys, producer_names
from rollstream.model import BasePolicy, build_policy
from rollstream.pacing.budget import lease_outright
from rollstream.runtime.process import WorkerContext
from rollstream.tasks import Prompt, RewardResult, build_task
from rollstream.weights.fingerprint import policy_probe
from rollstream.weights.store import publish_module_weights
from schemas import RolloutSample, decode

PIPELINE = Path(__file__).resolve().parents[1] / "pipeline.yaml"
TINY = ["run.device=cpu", "model.d_model=32", "model.n_layer=2", "model.n_head=2", "model.max_seq_len=64",
        "rollout.continuous=true", "rollout.stats_every_s=60"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(keys: Keys, *overrides: str) -> PipelineConfig:
    """pipeline.yaml with a tiny GPT and continuous generation, on the test's namespace."""
    return load_config(PIPELINE, [*TINY, f"run.name={keys.run}", *overrides])


def publish(r: redis.Redis, keys: Keys, version: int, policy: BasePolicy) -> None:
    """Play the trainer: publish `policy`'s weights as `version`, with the swap check's probe."""
    publish_module_weights(r, keys, version, policy.module, global_step=version, inline_max_bytes=1 << 30,
                           probe=policy_probe(policy))


def published(r: redis.Redis, keys: Keys) -> list[RolloutSample]:
    """rollout_00's samples in stream order."""
    return [decode(f) for _, f in r.xrange(keys.rollouts_of("rollout_00"))]  # type: ignore[misc]


def recompute(policy: BasePolicy, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs [R] of `response` after `prompt` at `temperature`."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return policy.log_probs(ids, torch.ones_like(ids), len(response), temperature)[0]


def test_groups_enter_as_rows_finish_and_publish_once_each_in_seq_order(r: redis.Redis, keys: Keys) -> None:
    cfg = config(keys, "rollout.prompts_per_dispatch=3", "rollout.n=2", "rollout.temperature=1.5",
                 "data.max_response_length=12", "rollout.sync_every_tokens=2")
    setup_run(r, keys, producer_names(cfg.rollout.num_producers))
    v0, v1 = vary(build_policy(cfg), seed=2), vary(build_policy(cfg), seed=3)
    publish(r, keys, 0, v0)
    lease_outright(r, keys, "rollout_00", 9)
    producer = Producer(WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=r), policy=build_policy(cfg))
    assert producer.continuous is not None
    engine: Any = producer.continuous.engine
    # the trainer publishes version 1 at the engine's 8th step
    occupancy = publish_during_steps(engine, 8, lambda: publish(r, keys, 1, v1))
    try:
        assert producer.run(max_dispatches=3) == 3  # 9 prompts, counted as 3 dispatches of 3
    finally:
        del engine.step
    samples = published(r, keys)
    assert [s.sample_id for s in samples] == [f"rollout_00-{k}" for k in range(9)]  # in seq order, once each
    assert int(r.get(keys.producer_published("rollout_00")) or 0) == 9
    # a group entered once 2 rows were free: 5-6 rows in flight until the 9 prompts were in, then the tail
    tail = next(k for k, rows in enumerate(occupancy) if rows < 5)
    assert max(occupancy) == 6 and min(occupancy[:tail]) == 5 and tail > len(occupancy) // 2
    assert occupancy[tail:] == sorted(occupancy[tail:], reverse=True)
    assert producer.weights.version == 1 and producer.weights.last_check is not None
    assert producer.weights.last_check[1] < 1e-5  # the mid-run swap was checked
    swapped = [s for s in samples if s.param_version_start != s.param_version_end]
    assert swapped, "rows in flight at the swap carry both versions"
    assert all(s.param_version == 0 for s in swapped)  # stamped with the version admitted under
    assert samples[-1].param_version == 1 and set(samples[-1].param_version_start) == {1}
    compared = 0  # every behaviour log-prob of a row one version generated is that version's
    for version, prompt, response, got in one_version_rows(samples):
        policy = v0 if version == 0 else v1
        assert float((recompute(policy, prompt, response, 1.5) - got).abs().max()) < 1e-4
        compared += 1
    assert compared >= 10


class MarkTool:
    """A tool task on the reverse task's prompts whose tool answers `[=1]` after any turn that ends with
    `mark` (a character the test's model writes at different points of different rows)."""

    name = "mark-tool"
    multi_turn = True

    def __init__(self, base: Any, mark: str) -> None:
        self.base = base
        self.mark = mark

    def make_prompt(self, rng: random.Random) -> Prompt:
        """The reverse task's prompt."""
        return self.base.make_prompt(rng)  # type: ignore[no-any-return]

    def reward(self, prompt: Prompt, response_text: str) -> RewardResult:
        """1 for a response holding a tool result, else 0."""
        return RewardResult(score=float("[=1]" in response_text), exact=False)

    def tool(self, call_text: str) -> str | None:
        """`[=1]` when the text ends with the mark."""
        return "[=1]" if call_text.endswith(self.mark) else None


class Fixed:
    """The weights never change (a VersionSource at version 0)."""

    version = 0

    def refresh(self) -> bool:
        """Nothing newer."""
        return False


def test_the_tool_agents_turns_decode_what_the_per_dispatch_agent_loop_does(
    r: redis.Redis, keys: Keys
) -> None:
    cfg = config(keys, "rollout.prompts_per_dispatch=2", "rollout.n=2", "data.max_response_length=8",
                 "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=3")
    setup_run(r, keys, producer_names(cfg.rollout.num_producers))
    policy = vary(build_policy(cfg), seed=1)
    publish(r, keys, 0, policy)
    base = build_task(cfg)
    prompts = [base.make_prompt(random.Random(k)) for k in range(6)]
    first = policy.generate(generation_request(prompts, 1, True, policy.tokenizer).rows, 1, 8, greedy=True)
    texts = [policy.tokenizer.decode(c.response_ids) for c in first]
    ends = {ch: {t.find(ch) for t in texts} for t in texts for ch in t}
    task = MarkTool(base, max(ends, key=lambda ch: len(ends[ch])))  # calls at different points of the rows
    lease_outright(r, keys, "rollout_00", 6)
    producer = Producer(WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=r), policy=policy, task=task)
    assert producer.continuous is not None
    producer.continuous.settings = dataclasses.replace(producer.settings, temperature=0.0)  # greedy
    assert producer.run(max_dispatches=3) == 3
    samples = published(r, keys)
    assert [s.sample_id for s in samples] == [f"rollout_00-{k}" for k in range(6)]

    greedy = GenerationSettings(max_new_tokens=8, temperature=0.0, partial_rollout=False, max_turns=3)
    rows = []
    for s in samples:
        b = s.full_batch
        po, plen = b.prompt_offsets(), b.row_prompt_lens()
        rows += [[int(t) for t in b.prompt_ids[po[i] : po[i] + plen[i]]] for i in range(len(b))]
    want = run_agent_loop(policy, task, GenerationRequest(rows, AGENT_TOOL), greedy, Fixed())
    turns = []
    for s, k in zip(samples, range(0, len(want), 2), strict=True):
        b = s.full_batch
        ro = b.response_offsets()
        mask = b.tokens.get("response_mask")
        for i in range(2):
            ref = want[k + i]
            assert [int(t) for t in b.response_ids[ro[i] : ro[i + 1]]] == ref.response_ids
            if mask is not None:
                assert [int(m) for m in mask[ro[i] : ro[i + 1]]] == ref.response_mask
            out = s.agent_loop_output_list[i]
            assert (out["num_turns"], out["finished"]) == (ref.num_turns, ref.finished)
            turns.append(ref.num_turns)
    assert min(turns) == 1 and max(turns) == 3  # rows ended after different numbers of turns
    assert any(s.tool_calls and max(s.tool_calls) > 0 for s in samples)


def test_continuous_combinations_that_cannot_work_are_refused(r: redis.Redis, keys: Keys) -> None:
    with pytest.raises(ConfigError, match="rollout.vllm.continuous"):
        config(keys, "rollout.name=vllm", "model.backend=hf", "model.hf_path=/nowhere")
    with pytest.raises(ConfigError, match="latency_model"):
        config(keys, "bench.latency_model.enable=true")
    cfg = config(keys)
    ctx = WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=r)
    with pytest.raises(ValueError, match="generate function"):
        Producer(ctx, generate=lambda request, version: [])
