"""scripts/gpu_check.sh: refuses to pretend without a GPU, and with --allow-cpu runs the same
pipeline check on the CPU (small settings here, LoRA rank 4), printing the rates, the swap check and a clean
audit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--hidden-size",
    "32",
    "--layers",
    "2",
    "--steps",
    "2",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.prompts_per_dispatch=2",
    "actor.micro_batch_size=3",
    "data.max_response_length=6",
    "data.reverse.max_digits=3",
]


def gpu_check(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The script as a user runs it, with this interpreter."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("ROLLSTREAM_GPU_CHECK_ALLOW_CPU", None)
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dir", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: the check would run on it")
def test_without_a_gpu_it_refuses_unless_allowed(tmp_path: Path) -> None:
    refused = gpu_check(*SMALL, tmp_path=tmp_path)
    assert refused.returncode == 2 and "--allow-cpu" in refused.stderr

    ran = gpu_check("--allow-cpu", "--lora-rank", "4", *SMALL, tmp_path=tmp_path)  # the LoRA path
    out = ran.stdout
    assert ran.returncode == 0, out + ran.stderr[-3000:]
    assert "CPU fallback" in out and "not GPU figures" in out and "LoRA rank 4" in out
    assert "samples/s" in out and "tokens/s" in out and "max |diff|" in out
    assert (
        "trained 8 " in out
        and "lost 0" in out
        and "duplicated 0" in out
        and out.rstrip().endswith("gpu_check: OK")
    )
