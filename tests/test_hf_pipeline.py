"""`rollstream run model.backend=hf model.hf_path=DIR` end to end, for a tiny random Llama (char
tokenizer, reverse task) and a tiny random Qwen2 (byte-level BPE with a chat template, the arith task in
multi-turn tool mode, and reasoning-gym arithmetic with the calculator tool), built and saved in the test (no
downloads).

Each run goes through supervisord with an embedded Redis, weights above the inline limit (0 bytes here:
every version goes through the streamed file:// path), micro-batches, gradient checkpointing and chunked
log-probs on, for 3 global steps. Then: every producer generates with version 3, the behaviour log-probs
producers stored for version-0 samples equal the trainer's recompute within 1e-5, `rollstream stop`
exits every program 0, and the audit of the log (read back from the AOF) finds every sample trained or
dropped once, steps 1..3 and records written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

pytest.importorskip("transformers")

from rollstream.keys import Keys  # noqa: E402
from rollstream.ops.audit import audit_run  # noqa: E402
from rollstream.ops.embedded_redis import EmbeddedRedis  # noqa: E402
from rollstream.ops.run_target import open_run  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402
from rollstream.weights.store import producer_versions  # noqa: E402
from scripts.runcheck import behaviour_logprob_error, swap_checks, throughput, wait_for_steps  # noqa: E402

STEPS = 3
SMALL = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=4", "rollout.num_producers=2", "rollout.prompts_per_dispatch=2", "rollout.stats_every_s=1",
    "data.val_size=4", "trainer.test_freq=2", f"trainer.total_training_steps={STEPS}", "run.device=cpu",
    "rollout.temperature=0.7", "bus.weights_inline_max_bytes=0", "actor.micro_batch_size=3",
    "actor.gradient_checkpointing=true", "actor.logprob_chunk_size=5", "bus.block_ms=200",
]
CASES = {
    "llama": dict(
        model=dict(arch="llama", tokenizer="char"),
        overrides=["data.max_response_length=6", "data.reverse.max_digits=3"],
    ),
    "llama-lora": dict(  # the trainer trains rank-4 factors; producers load them onto their own base
        model=dict(arch="llama", tokenizer="char"),
        overrides=["data.max_response_length=6", "data.reverse.max_digits=3", "model.lora_rank=4",
                   "model.lora_alpha=8", "actor.optim.lr=1e-2"],
    ),
    "qwen2": dict(
        model=dict(arch="qwen2", tokenizer="bpe", chat_template=True),
        overrides=[
            "data.task=arith",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.max_turns=2",
            "data.max_response_length=8",
        ],
    ),
    "qwen2-calculator": dict(  # reasoning-gym arithmetic with the calculator as the template's tool turn
        model=dict(arch="qwen2", tokenizer="bpe", chat_template=True, max_positions=256),
        overrides=[
            "data.task=rg:basic_arithmetic", "data.tool=calculator", "data.instruction=",
            "data.task_args.min_terms=2", "data.task_args.max_terms=2", "data.task_args.max_digits=2",
            "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=3", "data.max_response_length=8",
        ],
    ),
}


def rollstream(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_hf_model_through_the_whole_pipeline(arch: str, tmp_path: Path) -> None:
    case = CASES[arch]
    model_dir = make_tiny_hf_model(tmp_path / "model", seed=0, **case["model"])  # type: ignore[arg-type]
    args = ["pipeline.yaml", "model.backend=hf", f"model.hf_path={model_dir}", *SMALL, *case["overrides"],
            f"run.dir={tmp_path}", f"run.name=hf-{arch}"]
    run_dir = tmp_path / f"hf-{arch}"
    try:
        started = rollstream("run", *args, timeout_s=60)
        assert started.returncode == 0, started.stdout + started.stderr
        target = open_run(None, run_dir=str(run_dir))
        try:
            wait_for_steps(target, STEPS, timeout_s=120)
        except Exception:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
            )
            raise AssertionError(logs) from None
        r = target.connect()
        error, tokens = behaviour_logprob_error(r, target.keys, target.cfg, version=0)
        rates = throughput(r, target.keys)
        r.close()
    finally:
        stopped = rollstream("stop", *args, timeout_s=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    for name in ("rollout_00", "rollout_01", "trainer", "aggregator", "redis"):
        assert f"{name:<12} exit 0" in stopped.stdout, stopped.stdout
    print(f"\n{arch}: behaviour vs recompute max |diff| {error:.2e} over {tokens} tokens; "
          f"{rates.samples_per_s:.1f} samples/s, {rates.tokens_per_s:.0f} tokens/s")
    assert tokens > 0 and error < 1e-5, (error, tokens)
    assert rates.samples == (STEPS - 1) * 4 and rates.samples_per_s > 0 and rates.tokens_per_s > 0
    weights = sorted(p.name for p in (run_dir / "weights").glob("weights-*.safetensors"))
    assert weights and weights[-1] == f"weights-{STEPS:08d}.safetensors"  # the file path carried the weights
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records if rec["step"] > 0] == list(range(1, STEPS + 1))
    # validation with chat-rendered prompts ran in the trainer
    assert any("val/acc" in rec for rec in records)

    with EmbeddedRedis(run_dir) as srv:  # the run's log, read back from its AOF
        r = redis.Redis.from_url(srv.url)
        keys = Keys(f"hf-{arch}")
        rep = audit_run(r, keys)
        assert rep.trained and not rep.lost and not rep.duplicated, rep.problems()
        assert rep.published == rep.trained | rep.dropped | rep.dead | rep.pending
        assert len(rep.trained) == STEPS * 4  # each global step trains train_batch_size samples
        assert rep.steps_consecutive and rep.steps == list(range(1, STEPS + 1)), rep.steps
        assert rep.records_consecutive and rep.records[-1] == STEPS, rep.records
        assert producer_versions(r, keys) == {"rollout_00": STEPS, "rollout_01": STEPS}
        # every version the trainer published carried its probe, and each producer's swap to it was checked:
        # the built-in engine computes what the trainer does (0, or ~1e-8 where the two processes' thread
        # counts sum in another order). A stats window reports only its newest check (versions change every
        # ~0.2 s here), so the versions loaded come from the producers' logs, written after a passed check.
        checks = swap_checks(r, keys)
        assert len({v for _, v in checks}) >= 2 and max(checks.values()) < 1e-6, checks
        loaded = {int(line.rsplit("loaded param_version ", 1)[1].split()[0])
                  for name in ("rollout_00", "rollout_01")
                  for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines()
                  if "loaded param_version " in line}
        assert loaded >= set(range(STEPS + 1)), loaded
    if "lora" in arch:  # a version is the factors alone, trained: producers hold the base themselves
        from safetensors.torch import load_file

        last = load_file(str(run_dir / "weights" / weights[-1]))
        assert last and all(k.endswith((".lora.A", ".lora.B")) for k in last), sorted(last)[:4]
        assert {"model.layers.0.self_attn.q_proj.lora.B", "model.layers.1.mlp.down_proj.lora.A"} <= set(last)
        assert any(bool(t.abs().sum() > 0) for k, t in last.items() if k.endswith(".lora.B"))  # B left 0


@pytest.fixture(autouse=True)
def _no_leftover_supervisord(tmp_path: Path) -> Iterator[None]:
    yield
    for pid_file in tmp_path.glob("hf-*/supervisord.pid"):  # a failed stop: leave no supervisord behind
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
