"""`rollstream run … rollout.name=vllm` end to end on CPU: two producers, each with its own vLLM engine, for
a tiny random Llama (char tokenizer, reverse task; once more with LoRA, whose versions the producers merge
into the weights their engines reload) and a tiny random Qwen2 (BPE with a chat template, the arith task
through the tool agent loop), built in the test (hidden 128, 4 heads: a head size vLLM's CPU attention
takes). After 3 global steps: the audit is clean, both producers generate with the last version, each swapped
weights in place (no restart), and the producers' behaviour log-probs agree with the trainer's recompute.

In the Qwen2 run one producer is SIGKILLed while it generates (its in-process engine dies with it):
supervisord restarts it, it releases what it took and never published, and the audit stays clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

pytest.importorskip("vllm")

from rollstream.keys import Keys  # noqa: E402
from rollstream.ops.audit import audit_run  # noqa: E402
from rollstream.ops.embedded_redis import EmbeddedRedis  # noqa: E402
from rollstream.ops.run_target import open_run  # noqa: E402
from rollstream.ops.supervise import rpc  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402
from rollstream.weights.store import latest_param_version, producer_versions  # noqa: E402
from scripts.runcheck import (  # noqa: E402
    behaviour_logprob_error,
    producer_stats,
    swap_checks,
    wait_for_steps,
)

STEPS = 6
SMALL = [
    "rollout.name=vllm", "rollout.vllm.max_model_len=128", "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2", "async_training.trigger_parameter_sync_step=2", "rollout.n=4",
    "rollout.num_producers=2",
    "rollout.prompts_per_dispatch=2", "rollout.stats_every_s=1", "data.val_size=4", "trainer.test_freq=0",
    f"trainer.total_training_steps={STEPS}", "run.device=cpu", "rollout.temperature=0.7", "bus.block_ms=200",
    "rollout.sync_every_tokens=2",
]
CASES = {
    # on-policy (every sample trained by the step right after its version, no swap mid-generation), so the
    # trainer's mismatch metrics measure the engine's kernels against the trainer's and nothing else
    "llama": dict(
        model=dict(arch="llama", tokenizer="char"),
        overrides=[
            "data.max_response_length=6",
            "data.reverse.max_digits=3",
            "async_training.staleness_threshold=0",
            "async_training.partial_rollout=false",
        ],
        kill=False,
    ),
    # the llama run with LoRA: each version is the factors alone, merged by the producers into the weights
    # their engines reload (producers/engines/lora_merge.py); on-policy too
    "llama-lora": dict(
        model=dict(arch="llama", tokenizer="char"),
        overrides=[
            "data.max_response_length=6",
            "data.reverse.max_digits=3",
            "async_training.staleness_threshold=0",
            "async_training.partial_rollout=false",
            "model.lora_rank=4",
            "model.lora_alpha=8",
        ],
        kill=False,
    ),
    "qwen2": dict(
        model=dict(arch="qwen2", tokenizer="bpe", chat_template=True),
        overrides=[
            "data.task=arith",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.max_turns=2",
            "data.max_response_length=8",
        ],
        kill=True,
    ),
}


def rollstream(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s)


def _logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
    )


def _kill_while_generating(run_dir: Path, name: str, timeout_s: float = 120) -> int:
    """SIGKILL `name` once its engine is up and it has published (so it is mid-loop); returns the pid
    killed."""
    log = run_dir / "logs" / f"{name}.log"
    deadline = time.monotonic() + timeout_s
    while "loaded param_version" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, _logs(run_dir)
        time.sleep(0.2)
    time.sleep(1.0)
    pid = int(rpc(run_dir).supervisor.getProcessInfo(name)["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_back_up(run_dir: Path, name: str, timeout_s: float = 180) -> None:
    """Wait until the restarted `name` has started its engine and loaded a version (a stop that lands
    earlier, inside the new process's first milliseconds, ends it by SIGTERM before its handlers exist)."""
    log = run_dir / "logs" / f"{name}.log"
    deadline = time.monotonic() + timeout_s
    while True:
        starts = log.read_text().split("waiting for a param version")
        if len(starts) >= 3 and "loaded param_version" in starts[-1]:
            return
        assert time.monotonic() < deadline, _logs(run_dir)
        time.sleep(0.2)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_vllm_producers_through_the_whole_pipeline(arch: str, tmp_path: Path) -> None:
    case = CASES[arch]
    model_dir = make_tiny_hf_model(tmp_path / "model", seed=0, hidden_size=128, **case["model"])  # type: ignore[arg-type]
    model_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    args = ["pipeline.yaml", "model.backend=hf", f"model.hf_path={model_dir}", *SMALL, *case["overrides"],
            f"run.dir={tmp_path}", f"run.name=vllm-{arch}"]
    run_dir = tmp_path / f"vllm-{arch}"
    killed = 0
    try:
        # returns once both engines have loaded version 0; the kill case returns at once, so that the kill
        # lands while the producers generate, not after a tiny run already finished
        ready = ["--ready-timeout", "0"] if case["kill"] else []
        started = rollstream("run", *args, *ready, timeout_s=400)
        assert started.returncode == 0, started.stdout + started.stderr
        if case["kill"]:
            killed = _kill_while_generating(run_dir, "rollout_00")
        target = open_run(None, run_dir=str(run_dir))
        try:
            wait_for_steps(target, STEPS, timeout_s=300)
        except Exception:
            raise AssertionError(_logs(run_dir)) from None
        r = target.connect()
        error, tokens = behaviour_logprob_error(r, target.keys, target.cfg, version=0)
        r.close()
        if killed:  # the tiny run may be over by the time of the kill: stop once the producer is back
            _wait_back_up(run_dir, "rollout_00")
    finally:
        stopped = rollstream("stop", *args, timeout_s=120)
    assert stopped.returncode == 0 or killed, stopped.stdout + stopped.stderr
    for name in ("rollout_00", "rollout_01", "trainer", "aggregator", "redis"):
        assert f"{name:<12} exit 0" in stopped.stdout, stopped.stdout
    if killed:  # the one crash is ours, and the producer came back
        assert "rollout_00" in stopped.stdout and "SIGKILL" in stopped.stdout, stopped.stdout
        assert (run_dir / "logs" / "rollout_00.log").read_text().count("vLLM engine for") >= 2
    print(f"\nvllm {arch}: behaviour vs trainer recompute max |diff| {error:.2e} over {tokens} tokens")
    assert tokens > 0 and error < 1e-4, (error, tokens)  # the engine's CPU kernels vs transformers, float32
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records if rec["step"] > 0] == list(range(1, STEPS + 1))
    trained = [rec for rec in records if rec["step"] > 0]
    assert all(rec.get("training/rollout_probs_diff_valid") == 1.0 for rec in trained), trained  # every step
    worst = max(rec["training/rollout_probs_diff_max"] for rec in trained)
    print(f"vllm {arch}: training/rollout_probs_diff_max over the run {worst:.2e}")
    if arch.startswith("llama"):  # on-policy: only the engine's numerics differ (measured ~1e-7 in float32)
        assert worst < 1e-4, worst
    # every swap was checked: the records carry each producer's newest check, within the float32 bound, at
    # version 3 or later by the last record (a record holds the stats emitted before its step ended: with a
    # batch of staleness the producers' newest check there can be two versions behind)
    checked = [rec for rec in trained if "producer/swap_check/logprob_diff" in rec]
    assert checked and max(rec["producer/swap_check/version"] for rec in checked) >= 3, checked
    assert all(rec["producer/swap_check/logprob_diff"] < 1e-3 for rec in checked), checked

    with EmbeddedRedis(run_dir) as srv:  # the run's log, read back from its AOF
        r = redis.Redis.from_url(srv.url)
        keys = Keys(f"vllm-{arch}")
        rep = audit_run(r, keys)
        assert rep.trained and not rep.lost and not rep.duplicated, rep.problems()
        assert rep.published == rep.trained | rep.dropped | rep.dead | rep.pending
        assert rep.steps_consecutive and rep.steps == list(range(1, STEPS + 1)), rep.steps
        assert producer_versions(r, keys) == {"rollout_00": STEPS, "rollout_01": STEPS}
        if arch.endswith("lora"):  # each version was the factors alone (~64 KB against the ~1.4 MB model)
            pv = latest_param_version(r, keys)
            assert pv is not None and pv.version == STEPS and pv.bytes * 10 < model_bytes, (pv, model_bytes)
        # every version the trainer published carried its probe, and each producer's swap to it was checked
        # within the bound. A stats window reports only its newest check (versions change faster than
        # rollout.stats_every_s here), so the versions loaded come from the producers' logs, written after a
        # passed check (producers/weight_sync.py)
        checks = swap_checks(r, keys)
        assert len({v for (_, v) in checks}) >= 2, checks
        assert max(checks.values()) < 1e-4, checks  # measured ~1e-7 per probe token (float32, CPU)
        loaded = {int(line.rsplit("loaded param_version ", 1)[1].split()[0])
                  for name in ("rollout_00", "rollout_01")
                  for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines()
                  if "loaded param_version " in line}
        assert loaded >= set(range(STEPS + 1)), loaded
        swaps = {name: 0.0 for name in ("rollout_00", "rollout_01")}
        for ev in producer_stats(r, keys):
            swaps[ev.producer] += ev.metrics.get("producer/weight_swaps", 0.0)
        # new versions went into the running engines (a killed producer may come back on the last one)
        assert all(n >= 1 for name, n in swaps.items() if not (killed and name == "rollout_00")), swaps


@pytest.fixture(autouse=True)
def _no_leftover_supervisord(tmp_path: Path) -> Iterator[None]:
    yield
    for pid_file in tmp_path.glob("vllm-*/supervisord.pid"):  # a failed stop: leave no supervisord behind
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass


def test_an_engine_that_cannot_start_ends_the_run_loudly(tmp_path: Path) -> None:
    # head size 8 (hidden 32, 4 heads): vLLM's CPU attention refuses it, so no producer can ever start
    model_dir = make_tiny_hf_model(tmp_path / "model", seed=0, hidden_size=32, arch="qwen2", tokenizer="bpe",
                                   chat_template=True)
    args = ["pipeline.yaml", "model.backend=hf", f"model.hf_path={model_dir}", *SMALL, f"run.dir={tmp_path}",
            "run.name=vllm-nostart"]
    run_dir = tmp_path / "vllm-nostart"
    try:
        started = rollstream("run", *args, timeout_s=300)
        assert started.returncode != 0, started.stdout + started.stderr
        assert "head size 8" in started.stderr and "rollout_0" in started.stderr, started.stderr
        time.sleep(3)  # no restart loop: the producers stay EXITED with status 2 (EXIT_CONFIG)
        states = {p["name"]: p for p in rpc(run_dir).supervisor.getAllProcessInfo()}
        for name in ("rollout_00", "rollout_01"):
            if states[name]["statename"] != "EXITED":  # the second producer may still be starting its import
                continue
            assert states[name]["exitstatus"] == 2, states[name]
        log = (run_dir / "logs" / "rollout_00.log").read_text()
        assert log.count("vLLM engine for") == 1, log[-2000:]  # started once, never restarted
        check = rollstream("status", *args, "--check", timeout_s=60)
        assert check.returncode == 1 and "head size 8" in check.stderr, check.stdout + check.stderr
    finally:
        rollstream("stop", *args, timeout_s=120)
