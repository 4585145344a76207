"""The vLLM engine (`rollout.name=vllm`, producers/engines/vllm.py) on a tiny random Qwen2 built here, on
CPU: its log-probs are log_softmax(logits / T) at T != 1, weights published by the trainer load into the
running
engine (inline and file:// versions; greedy output then equals the built-in sampler's on the same weights),
a version that arrives mid-generation pauses, swaps and resumes the rows in flight with truthful swap points,
the tool agent loop runs through it token in, token out, and an engine that cannot start says why in one line.

One engine serves the whole module (start-up takes 10-40 s on 2 shared cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

pytest.importorskip("vllm")

from conftest import REDIS_URL, one_version_rows, publish_during_steps  # noqa: E402

from producers.agent import GenerationSettings, run_agent_loop  # noqa: E402
from producers.engines import EngineError, EngineStartError  # noqa: E402
from producers.engines.lora_merge import LoRAMerger  # noqa: E402
from producers.engines.vllm import VLLMPolicy, start_engine, tied_layers  # noqa: E402
from producers.rollout import AGENT_TOOL, generation_request  # noqa: E402
from producers.weight_sync import SwapFailed, WeightSync  # noqa: E402
from producers.worker import Producer  # noqa: E402
from rollstream.bus import setup_run  # noqa: E402
from rollstream.config import PipelineConfig, load_config  # noqa: E402
from rollstream.keys import Keys, producer_names  # noqa: E402
from rollstream.model import build_policy  # noqa: E402
from rollstream.model.hf import HFPolicy  # noqa: E402
from rollstream.model.lora import LoRALinear, is_factor  # noqa: E402
from rollstream.pacing.budget import lease_outright  # noqa: E402
from rollstream.runtime.process import WorkerContext  # noqa: E402
from rollstream.tasks import Prompt  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402
from rollstream.weights.fingerprint import default_max_diff, policy_probe_logprobs, probe_ids  # noqa: E402
from rollstream.weights.store import publish_module_weights, publish_weights  # noqa: E402
from rollstream.weights.tensors import published_state, state_bytes  # noqa: E402
from schemas import decode  # noqa: E402

PROMPTS = [[1, 5, 6, 7], [1, 9, 8], [1, 12, 13, 14, 15]]


def engine_config(model_dir: Path, *overrides: str) -> PipelineConfig:
    """A pipeline config with the vLLM engine on `model_dir` (CPU, float32)."""
    return load_config(None, ["model.backend=hf", f"model.hf_path={model_dir}", "rollout.name=vllm",
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
    request = generation_request([Prompt(uid="p", text="12+30=?", answer="42")], 2, True, engine.tokenizer)
    settings = GenerationSettings(max_new_tokens=6, temperature=1.0, max_turns=3, partial_rollout=False)
    trajs = run_agent_loop(engine, _CallAfterThreeChars(), request, settings, sync)  # type: ignore[arg-type]
    assert request.agent == AGENT_TOOL
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

    with pytest.raises(ConfigError, match="rollout.name=vllm needs model.backend=hf"):
        load_config(None, ["rollout.name=vllm"])
    with pytest.raises(ConfigError, match="rollout.top_p=0.9 with rollout.name=vllm"):
        engine_config(model_dir, "rollout.top_p=0.9")
    with pytest.raises(ConfigError, match="rollout.top_k=50 with rollout.name=vllm"):
        engine_config(model_dir, "rollout.top_k=50")


# ---- every swap right, every swap checked (issue 39) -------------------------------------------------------


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (untied output head), head size 32."""
    return Path(make_tiny_hf_model(tmp_path_factory.mktemp("vllm") / "llama", seed=1, arch="llama",
                                   tokenizer="bpe", chat_template=True, hidden_size=128))


def every_tensor_changed(model_dir: Path, seed: int) -> HFPolicy:
    """The checkpoint with every tensor moved (embedding, output head, norms, attention, MLP): noise of half
    each tensor's spread (a constant tensor, e.g. a norm's ones, moves by 0.5)."""
    policy = HFPolicy.from_pretrained(model_dir, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.module.parameters():
            spread = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 1.0
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * spread)
    return policy


def probe_of(policy: HFPolicy) -> tuple[list[int], list[float]]:
    """The swap check's probe of a policy, as the trainer publishes it."""
    ids = probe_ids(policy.tokenizer.vocab_size)
    return ids, policy_probe_logprobs(policy, ids)


def checked_sync(engine: VLLMPolicy, r: redis.Redis, keys: Keys) -> WeightSync:
    """A producer's WeightSync on the engine with the swap check on (float32 bound)."""
    return WeightSync(r, keys, None, "rollout_00", loader=engine.load_param_version,
                      prober=engine.probe_logprobs, max_diff=default_max_diff("float32"))


def swap_every_tensor(
    engine: VLLMPolicy, path: Path, r: redis.Redis, keys: Keys, folder: Path
) -> dict[str, Any]:
    """Publish two versions with every tensor changed, then the checkpoint again, each through a checked
    WeightSync into `engine`; returns what a test asserts on (tied layers, swap-check figures, log-prob
    errors against transformers under the new and the old weights)."""
    model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    out: dict[str, Any] = {"tied": len(tied_layers(model)), "checks": [], "worst": [], "stale": []}
    sync = checked_sync(engine, r, keys)
    original = HFPolicy.from_pretrained(path, device="cpu")
    for version in (1, 2):  # two swaps in a row, each to weights with every tensor changed
        newer = every_tensor_changed(path, seed=version)
        publish_module_weights(r, keys, version, newer.module, global_step=version, inline_max_bytes=0,
                               file_dir=folder, probe=probe_of(newer))
        assert sync.refresh() and sync.version == version
        out["checks"].append(sync.last_check)
        rows = engine.generate(PROMPTS, n=2, max_new_tokens=10, temperature=2.0)
        worst = stale = 0.0
        for row in rows:
            got = torch.tensor(row.log_probs)
            new_lp = recompute(newer, row.prompt_ids, row.response_ids, 2.0)
            old_lp = recompute(original, row.prompt_ids, row.response_ids, 2.0)
            worst = max(worst, float((new_lp - got).abs().max()))
            stale = max(stale, float((old_lp - got).abs().max()))
        out["worst"].append(worst)
        out["stale"].append(stale)
    # and back to the checkpoint's weights (the module's shared engine serves other tests)
    publish_module_weights(r, keys, 3, original.module, global_step=3, inline_max_bytes=0, file_dir=folder,
                           probe=probe_of(original))
    assert sync.refresh()
    out["checks"].append(sync.last_check)
    return out


def check_swapped_every_tensor(out: dict[str, Any], tied: bool) -> None:
    """What a swap of every tensor must give, tied output head or not."""
    assert bool(out["tied"]) == tied, out
    for version, (checked, mean, _) in zip((1, 2, 3), out["checks"], strict=True):
        assert checked == version and mean < 1e-5, out  # measured ~1.2e-7 per probe token in float32
    assert max(out["worst"]) < 1e-4, out  # the engine's log-probs are the new weights' (~5e-7 measured)
    assert min(out["stale"]) > 1e-2, out  # and the swaps changed them


def test_a_swap_loads_every_tensor_with_a_tied_head(
    engine: VLLMPolicy, model_dir: Path, r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    check_swapped_every_tensor(swap_every_tensor(engine, model_dir, r, keys, tmp_path), tied=True)


def test_a_swap_loads_every_tensor_with_an_untied_head(untied_dir: Path, keys: Keys, tmp_path: Path) -> None:
    # a second engine in this process would tear down the first one's parallel state when it goes: its own
    # process (this file run as a script, below)
    done = subprocess.run(
        [sys.executable, __file__, str(untied_dir), REDIS_URL, keys.run, str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_swapped_every_tensor(json.loads(done.stdout.strip().splitlines()[-1]), tied=False)


def test_a_swap_that_fails_the_check_is_redone_then_refused(
    engine: VLLMPolicy, model_dir: Path, r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    sync = checked_sync(engine, r, keys)
    original = HFPolicy.from_pretrained(model_dir, device="cpu")
    publish_module_weights(r, keys, 0, original.module, global_step=0, inline_max_bytes=0, file_dir=tmp_path,
                           probe=probe_of(original))
    assert sync.refresh() and sync.version == 0
    # version 1's weights announced with a fingerprint they do not have (what an engine holding the wrong
    # weights looks like from the producer's side)
    newer = every_tensor_changed(model_dir, seed=7)
    publish_module_weights(r, keys, 1, newer.module, global_step=1, inline_max_bytes=0, file_dir=tmp_path,
                           probe=probe_of(original))
    loads: list[int] = []
    inner = sync.loader
    sync.loader = lambda rr, pv: (loads.append(pv.version), inner(rr, pv))[-1]  # type: ignore[func-returns-value]
    with pytest.raises(SwapFailed, match="param_version 1: .* after two loads"):
        sync.refresh()
    assert loads == [1, 1]  # loaded, checked, loaded again, checked again
    assert sync.version == 0 and r.get(keys.producer_version("rollout_00")) == b"0"  # never registered as 1
    assert sync.last_check is not None and sync.last_check[0] == 1 and sync.last_check[1] > 1e-2
    # back to the checkpoint's weights for the other tests
    publish_module_weights(r, keys, 2, original.module, global_step=2, inline_max_bytes=0, file_dir=tmp_path,
                           probe=probe_of(original))
    assert sync.refresh()


if __name__ == "__main__":  # the untied case's own process: model dir, redis URL, run name, a folder
    _dir, _url, _run, _folder = sys.argv[1:5]
    _engine = VLLMPolicy.from_config(engine_config(Path(_dir)), seed=0)
    _out = swap_every_tensor(_engine, Path(_dir), redis.Redis.from_url(_url), Keys(_run), Path(_folder))
    print(json.dumps(_out))


# ---- continuous generation (issue 39) ----------------------------------------------------------------------


def test_continuous_generation_admits_as_rows_finish_and_publishes_in_order(
    engine: VLLMPolicy, model_dir: Path, r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    cfg = engine_config(model_dir, "rollout.prompts_per_dispatch=3", "rollout.n=2", "rollout.temperature=1.5",
                        "data.max_response_length=12", "rollout.sync_every_tokens=2", f"run.name={keys.run}")
    setup_run(r, keys, producer_names(cfg.rollout.num_producers))
    original = HFPolicy.from_pretrained(model_dir, device="cpu")
    publish_module_weights(r, keys, 0, original.module, global_step=0, inline_max_bytes=0, file_dir=tmp_path,
                           probe=probe_of(original))
    lease_outright(r, keys, "rollout_00", 9)
    producer = Producer(WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=r), policy=engine)
    assert producer.continuous is not None
    newer = every_tensor_changed(model_dir, seed=3)
    occupancy = publish_during_steps(  # the trainer publishes version 1 at the engine's 8th step
        engine, 8, lambda: publish_module_weights(r, keys, 1, newer.module, global_step=1, inline_max_bytes=0,
                                                  file_dir=tmp_path, probe=probe_of(newer)))
    try:
        assert producer.run(max_dispatches=3) == 3  # 9 prompts, counted as 3 dispatches of 3
    finally:
        del engine.step
    samples = [decode(f) for _, f in r.xrange(keys.rollouts_of("rollout_00"))]
    assert [s.sample_id for s in samples] == [f"rollout_00-{k}" for k in range(9)]  # in seq order, once each
    assert int(r.get(keys.producer_published("rollout_00")) or 0) == 9
    # the engine kept 3 groups x 2 rows in flight most of the time
    assert max(occupancy) == 6 and occupancy.count(6) > len(occupancy) // 2
    assert producer.weights.version == 1 and producer.weights.last_check is not None
    assert producer.weights.last_check[1] < 1e-5  # the mid-run swap was checked
    swapped = [s for s in samples if s.param_version_start != s.param_version_end]
    assert swapped, "rows in flight at the swap carry both versions"
    assert all(s.param_version == 0 for s in swapped)  # stamped with the version admitted under
    assert samples[-1].param_version == 1  # groups admitted after the swap: version 1 throughout
    assert set(samples[-1].param_version_start) == {1}
    # every behaviour log-prob of a row generated by one version is that version's
    compared = 0
    for version, prompt, response, got in one_version_rows(samples):
        policy = original if version == 0 else newer
        assert float((recompute(policy, prompt, response, 1.5) - got).abs().max()) < 1e-4
        compared += 1
    assert compared >= 10
    # back to the checkpoint's weights for the other tests
    publish_module_weights(r, keys, 2, original.module, global_step=2, inline_max_bytes=0, file_dir=tmp_path,
                           probe=probe_of(original))
    assert producer.weights.refresh()


# ---- LoRA versions, merged into the engine's weights (issue 61) ------------------------------------------

LORA = ["model.lora_rank=4", "model.lora_alpha=8"]


def lora_trainer(model_dir: Path, seed: int | None, *overrides: str) -> HFPolicy:
    """The trainer's LoRA policy on the checkpoint (every linear layer but the head) with every factor
    redrawn from `seed` (A and B of every adapted layer; B A * scale moves each weight by ~0.04); with None,
    as built (B = 0: the checkpoint's function)."""
    policy = build_policy(engine_config(model_dir, *LORA, *overrides))
    assert isinstance(policy, HFPolicy)
    gen = torch.Generator().manual_seed(seed or 0)
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if seed is not None and is_factor(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return policy


def test_lora_versions_reach_the_engine_as_merged_weights_at_every_version(
    engine: VLLMPolicy, model_dir: Path, r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    dtype = engine.llm.llm_engine.model_config.dtype
    lora = VLLMPolicy(engine.llm, engine.tokenizer, LoRAMerger.from_checkpoint(model_dir, dtype, 4, 8.0))
    sync = checked_sync(lora, r, keys)
    original = HFPolicy.from_pretrained(model_dir, device="cpu")
    checks, worst, stale = [], [], []
    for version in (1, 2, 3):  # two versions with every factor changed, then B = 0 (the checkpoint again)
        trainer = lora_trainer(model_dir, seed=version if version < 3 else None)
        adapted = [m for m in trainer.module.modules() if isinstance(m, LoRALinear)]
        published = published_state(trainer.module)
        assert len(adapted) == 14 and set(published) == {n for n, _ in trainer.module.named_parameters()
                                                          if is_factor(n)} and len(published) == 28
        publish_module_weights(r, keys, version, trainer.module, global_step=version, inline_max_bytes=0,
                               file_dir=tmp_path, probe=probe_of(trainer))
        assert sync.refresh() and sync.version == version
        checks.append(sync.last_check)
        rows = lora.generate(PROMPTS, n=2, max_new_tokens=10, temperature=2.0)
        got = [torch.tensor(row.log_probs) for row in rows]
        worst.append(max(float((recompute(trainer, row.prompt_ids, row.response_ids, 2.0) - g).abs().max())
                         for row, g in zip(rows, got, strict=True)))
        stale.append(max(float((recompute(original, row.prompt_ids, row.response_ids, 2.0) - g).abs().max())
                         for row, g in zip(rows, got, strict=True)))
    print(f"\nLoRA on vLLM: swap checks {checks}, log-prob error {worst}, against the base {stale}")
    for version, (checked, mean, _) in zip((1, 2, 3), checks, strict=True):
        assert checked == version and mean < 1e-5, checks  # float32 bound: 1e-3
    assert max(worst) < 1e-4, worst  # the engine samples with the trainer's merged weights
    assert min(stale[:2]) > 1e-2 and stale[2] < 1e-4, stale  # every factor moved them; B = 0 is the base
    # a version of full weights, or one without some layer's factors, is refused before the engine is touched
    publish_module_weights(r, keys, 4, original.module, global_step=4, inline_max_bytes=0, file_dir=tmp_path)
    with pytest.raises(EngineError, match="not a LoRA factor"):
        sync.refresh()
    fewer = {n: t for n, t in published.items() if ".layers.1.mlp." not in n}
    publish_weights(r, keys, 5, state_bytes(fewer), global_step=5, inline_max_bytes=1 << 30)
    with pytest.raises(EngineError, match=r"missing \['model.layers.1.mlp.down_proj'"):
        sync.refresh()
    assert sync.version == 3
