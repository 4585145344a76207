"""The vLLM engine (`rollout.engine=vllm`, producers/engines/vllm.py) on a tiny random Qwen2 built here, on
CPU: its log-probs are log_softmax(logits / T) at T != 1, weights published by the trainer load into the
running
engine (inline and file:// versions; greedy output then equals the built-in sampler's on the same weights),
a version that arrives mid-generation pauses, swaps and resumes the rows in flight with truthful swap points,
the tool agent loop runs through it token in, token out, and an engine that cannot start says why in one line.

One engine serves the whole module (start-up takes 10-40 s on 2 shared cores)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

pytest.importorskip("vllm")

from producers.agent import GenerationSettings, run_agent_loop  # noqa: E402
from producers.engines import EngineStartError  # noqa: E402
from producers.engines.vllm import VLLMPolicy, start_engine  # noqa: E402
from producers.weight_sync import WeightSync  # noqa: E402
from rollstream.config import PipelineConfig, load_config  # noqa: E402
from rollstream.model.hf import HFPolicy, make_tiny_hf_model  # noqa: E402
from rollstream.names import Keys  # noqa: E402
from rollstream.rollout import AGENT_TOOL, prepare_single_generation_data  # noqa: E402
from rollstream.tasks import Prompt  # noqa: E402
from rollstream.weights import publish_module_weights, publish_weights  # noqa: E402

PROMPTS = [[1, 5, 6, 7], [1, 9, 8], [1, 12, 13, 14, 15]]


def engine_config(model_dir: Path, *overrides: str) -> PipelineConfig:
    """A pipeline config with the vLLM engine on `model_dir` (CPU, float32)."""
    return load_config(None, ["model.backend=hf", f"model.hf_path={model_dir}", "rollout.engine=vllm",
                              "run.device=cpu", "rollout.vllm.max_model_len=128", *overrides])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (hidden 128, 4 heads: head size 32, which vLLM's CPU attention takes) with a BPE
    tokenizer and a chat template."""
    return Path(
        make_tiny_hf_model(
            tmp_path_factory.mktemp("vllm") / "qwen2",
            seed=0,
            arch="qwen2",
            tokenizer="bpe",
            chat_template=True,
            hidden_size=128,
        )
    )


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VLLMPolicy]:
    """One vLLM engine for the module."""
    yield VLLMPolicy.from_config(engine_config(model_dir), seed=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> HFPolicy:
    """The same checkpoint as the trainer loads it (transformers, float32)."""
    return HFPolicy.from_pretrained(model_dir, device="cpu")


def recompute(policy: HFPolicy, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs [R] of `response` after `prompt` under softmax(logits / temperature)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = policy.module(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def perturbed(policy: HFPolicy, scale: float) -> HFPolicy:
    """The policy with every MLP weight scaled (a 'newer version' that changes the outputs)."""
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if ".mlp." in name:
                p.mul_(scale)
    return policy


def test_logprobs_are_the_tempered_distribution_the_trainer_recomputes(
    engine: VLLMPolicy, reference: HFPolicy
) -> None:
    rows = engine.generate(PROMPTS, n=2, max_new_tokens=10, temperature=2.0)
    assert len(rows) == 6 and [r.prompt_ids for r in rows[::2]] == PROMPTS
    worst = 0.0
    for row in rows:
        assert 1 <= len(row.response_ids) == len(row.log_probs) <= 10
        ref = recompute(reference, row.prompt_ids, row.response_ids, 2.0)
        worst = max(worst, float((ref - torch.tensor(row.log_probs)).abs().max()))
    assert worst < 1e-4, worst  # measured 4.8e-7 in float32; vLLM's raw_logprobs (T = 1) is off by ~0.1
    raw = recompute(reference, rows[0].prompt_ids, rows[0].response_ids, 1.0)
    assert float((raw - torch.tensor(rows[0].log_probs)).abs().max()) > 1e-3  # T matters, and we use it


def test_published_versions_load_in_place(
    engine: VLLMPolicy, reference: HFPolicy, model_dir: Path, r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    sync = WeightSync(r, keys, None, "rollout_00", loader=engine.load_param_version)
    newer = perturbed(HFPolicy.from_pretrained(model_dir, device="cpu"), 3.0)
    before = engine.generate(PROMPTS, n=1, max_new_tokens=8, greedy=True)
    publish_weights(r, keys, 0, reference.state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    assert sync.refresh() and sync.version == 0
    # version 1 above the inline limit: a file://, read one tensor at a time
    publish_module_weights(r, keys, 1, newer.module, global_step=1, inline_max_bytes=0, file_dir=tmp_path)
    assert sync.refresh() and sync.version == 1 and sync.last_load_s > 0
    got = engine.generate(PROMPTS, n=1, max_new_tokens=8, greedy=True)
    want = newer.generate(PROMPTS, n=1, max_new_tokens=8, greedy=True)
    assert [g.response_ids for g in got] == [w.response_ids for w in want]
    assert [g.response_ids for g in got] != [b.response_ids for b in before]  # the swap changed the outputs
    # and back, through Redis chunks (a host that shares no disk with the trainer): the engine holds exactly
    # the published weights, not a blend
    publish_module_weights(r, keys, 2, reference.module, global_step=2, inline_max_bytes=0, transport="redis",
                           chunk_bytes=1 << 16)
    assert sync.refresh() and sync.version == 2
    again = engine.generate(PROMPTS, n=1, max_new_tokens=8, greedy=True)
    assert [a.response_ids for a in again] == [b.response_ids for b in before]


def test_a_version_mid_generation_pauses_swaps_and_resumes(
    engine: VLLMPolicy, reference: HFPolicy, model_dir: Path, r: redis.Redis, keys: Keys
) -> None:
    sync = WeightSync(r, keys, None, "rollout_00", loader=engine.load_param_version)
    publish_weights(r, keys, 0, reference.state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    assert sync.refresh()
    newer = perturbed(HFPolicy.from_pretrained(model_dir, device="cpu"), 3.0)
    calls: list[bool] = []

    def on_chunk() -> bool:  # the trainer publishes version 1 while the rows are being generated
        if not calls:
            publish_weights(r, keys, 1, newer.state_dict_bytes(), global_step=1, inline_max_bytes=1 << 30)
        calls.append(sync.refresh())
        return calls[-1]

    rows = engine.generate(
        PROMPTS, n=2, max_new_tokens=12, temperature=1.5, sync_every_tokens=3, on_chunk=on_chunk
    )
    assert calls[0] is True and sync.version == 1
    swapped = [row for row in rows if row.swap_points]
    assert swapped, "rows in flight at the swap record where the new weights took over"
    for row in swapped:
        (k,) = row.swap_points
        assert 0 < k < len(row.response_ids)
        old = recompute(reference, row.prompt_ids, row.response_ids[:k], 1.5)
        new = recompute(newer, row.prompt_ids + row.response_ids[:k], row.response_ids[k:], 1.5)
        assert float((old - torch.tensor(row.log_probs[:k])).abs().max()) < 1e-4  # sampled by version 0
        # by version 1, cache recomputed
        assert float((new - torch.tensor(row.log_probs[k:])).abs().max()) < 1e-4
    assert all(row.finished or len(row.response_ids) == 12 for row in rows)


class _CallAfterThreeChars:
    """A task whose 'tool call' is any 3 characters of text: every turn is cut and gets a tool result."""

    multi_turn = True

    def tool(self, text: str) -> str | None:
        return "=42]" if len(text) >= 3 else None

    def reward(self, prompt: Any, text: str) -> Any:  # unused by the loop
        raise NotImplementedError


def test_tool_agent_runs_token_in_token_out(
    engine: VLLMPolicy, reference: HFPolicy, r: redis.Redis, keys: Keys
) -> None:
    sync = WeightSync(r, keys, None, "rollout_00", loader=engine.load_param_version)
    publish_weights(r, keys, 0, reference.state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    assert sync.refresh()
    batch = prepare_single_generation_data(
        Prompt(uid="p", text="12+30=?", answer="42"), 2, True, engine.tokenizer
    )
    settings = GenerationSettings(max_new_tokens=6, temperature=1.0, max_turns=3, partial_rollout=False)
    trajs = run_agent_loop(engine, _CallAfterThreeChars(), batch, settings, sync)  # type: ignore[arg-type]
    assert batch.non_tensors["agent_name"][0] == AGENT_TOOL
    for t in trajs:
        assert t.num_turns >= 2 and 0 in t.response_mask  # tool tokens went in between turns, masked
        # the trainer's recompute over exactly these ids gives the engine's log-probs at every generated
        # token:
        # later turns were fed the earlier ids and the tool ids as ids, never text re-tokenized
        ref = recompute(reference, t.prompt_ids, t.response_ids, 1.0)
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        assert float((ref[mask] - torch.tensor(t.log_probs)[mask]).abs().max()) < 1e-4


def test_an_engine_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="not a directory") as missing:
        start_engine(engine_config(tmp_path / "nowhere"), seed=0)
    small_heads = make_tiny_hf_model(tmp_path / "heads8", arch="qwen2", hidden_size=32)  # 4 heads of 8
    with pytest.raises(EngineStartError, match="head size 8") as heads:
        start_engine(engine_config(Path(small_heads)), seed=0)
    for e in (missing, heads):
        assert "\n" not in str(e.value) and str(e.value).count("vLLM engine") == 1


def test_config_refuses_what_the_engine_cannot_honour(model_dir: Path) -> None:
    from rollstream.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine=vllm needs model.backend=hf"):
        load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.top_p=0.9 with rollout.engine=vllm"):
        engine_config(model_dir, "rollout.top_p=0.9")
