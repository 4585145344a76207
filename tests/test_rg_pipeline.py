"""A reasoning-gym task end to end through `rollstream run`: a tiny random Qwen2 (byte-level BPE, chat
template) on `rg:basic_arithmetic`, 2 global steps with validation. Every published reward is the dataset's
verifier on the response's extracted answer, every prompt carries the instruction and the chat template, no
trained prompt is a held-out one, and the records carry `val/acc` from the held-out split.
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

pytest.importorskip("transformers")
pytest.importorskip("reasoning_gym")

from rollstream.bus import iter_stream, run_producers  # noqa: E402
from rollstream.ops.run_target import open_run  # noqa: E402
from rollstream.tasks import build_prompt_source, build_task  # noqa: E402
from rollstream.tasks.reasoning_gym import extract_answer  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402
from schemas import RolloutSample, decode  # noqa: E402
from scripts.runcheck import wait_for_steps  # noqa: E402

STEPS = 2
INSTRUCTION = "Answer with the number only."
ARGS = [
    "model.backend=hf", "data.task=rg:basic_arithmetic", "data.task_args.min_terms=2",
    "data.task_args.max_terms=2", "data.task_args.min_digits=1", "data.task_args.max_digits=2",
    f"data.instruction={INSTRUCTION}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
    "async_training.trigger_parameter_sync_step=2", "rollout.n=4", "rollout.num_producers=1",
    "rollout.prompts_per_dispatch=2",
    "rollout.stats_every_s=1", "data.val_size=8", "data.val_recent_size=4", "trainer.test_freq=1",
    f"trainer.total_training_steps={STEPS}", "run.device=cpu", "rollout.temperature=1.0",
    "data.max_response_length=6", "bus.block_ms=200",
]


def rollstream(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s)


def test_reasoning_gym_task_through_the_pipeline(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path / "model", seed=0, arch="qwen2", tokenizer="bpe",
                                   chat_template=True)
    args = ["pipeline.yaml", f"model.hf_path={model_dir}", *ARGS, f"run.dir={tmp_path}", "run.name=rg"]
    run_dir = tmp_path / "rg"
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
        samples = [
            ev for stream in target.keys.rollouts_streams(run_producers(r, target.keys))
            for _, fields in iter_stream(r, stream) if isinstance(ev := decode(fields), RolloutSample)
        ]
        r.close()
    finally:
        stopped = rollstream("stop", *args, timeout_s=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    task = build_task(target.cfg)
    held_out = {p.text for p in build_prompt_source(target.cfg, task).val_prompts()}
    assert len(held_out) == 8 and len(samples) >= STEPS * 4
    rows = 0
    for s in samples:
        nt = s.full_batch.non_tensors
        rewards = s.full_batch.rows["rewards"]
        for prompt, text, truth, reward in zip(nt["raw_prompt"], nt["response_text"], nt["ground_truth"],
                                               rewards, strict=True):
            assert prompt.endswith(f"\n{INSTRUCTION}") and prompt not in held_out
            verdict = task.dataset.score_answer(extract_answer(text, "last_number"), {"answer": truth})
            assert float(reward) == pytest.approx(verdict), (prompt, text, truth)
            rows += 1
        ids = s.full_batch.prompt_ids.tolist()
        assert ids[: len(task_chat_prefix(model_dir))] == task_chat_prefix(model_dir)  # chat-rendered
    assert rows == len(samples) * 4
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == list(range(STEPS + 1))  # record 0 validates version 0
    assert all("val/acc" in rec for rec in records)  # greedy accuracy on the held-out split
    assert all("val/recent_train_acc" in rec for rec in records[1:])  # and on the newest trained prompts


def task_chat_prefix(model_dir: Path) -> list[int]:
    """The ids the tiny model's chat template puts before a user message's text: bos, `<|user|>`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [int(tok.bos_token_id), int(tok.convert_tokens_to_ids("<|user|>"))]


@pytest.fixture(autouse=True)
def _no_leftover_supervisord(tmp_path: Path) -> Iterator[None]:
    yield
    for pid_file in tmp_path.glob("rg/supervisord.pid"):  # a failed stop: leave no supervisord behind
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
