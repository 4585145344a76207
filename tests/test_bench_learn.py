"""The in-process learning probe runs the pipeline's Learner and prints per-position accuracy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_learn_probe_trains_and_reports_per_length_and_position() -> None:
    tiny = ["model.d_model=32", "model.n_layer=1", "model.n_head=2", "data.reverse.max_digits=4",
            "data.val_size=16",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "run.device=cpu",
            "algorithm.adv_estimator=grpo_token", "rollout.temperature=2.0"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollstream.cli",
            "bench",
            "learn_probe",
            "pipeline.yaml",
            *tiny,
            "--limit-s",
            "60",
            "--eval-every",
            "2",
            "--target",  # val/acc >= 0: it stops after its first evaluation (step 2) instead of at the limit
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert lines, proc.stdout
    assert "val/acc" in lines[-1] and "pos-acc [3:" in lines[-1] and "4:" in lines[-1]


def test_bench_learn_runs_both_modes_as_users_run_them_and_writes_curves(tmp_path: Path) -> None:
    tiny = [
        "model.d_model=32",
        "model.n_layer=1",
        "model.n_head=2",
        "data.reverse.max_digits=3",
        "data.val_size=8",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
        "rollout.num_producers=1",
        "trainer.test_freq=1",
        "run.device=cpu",
    ]
    proc = subprocess.run([sys.executable, "-m", "rollstream.cli", "bench", "learn", "pipeline.yaml", *tiny,
                           "--seeds", "3", "--target", "0", "--report", "0", "--limit-s", "90",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 3 |")]
    cells = [c.strip() for c in rows[0].split("|")] if len(rows) == 1 else []
    assert cells[2].isdigit() and cells[3].isdigit(), rows  # both modes saw a val/acc >= 0 (seconds to it)
    assert (tmp_path / "learn-s3.png").stat().st_size > 1000
    for mode in ("sync", "async"):
        resolved = (tmp_path / f"learn-{mode}-s3" / "pipeline.resolved.yaml").read_text()
        assert ("sync_mode: true" in resolved) == (mode == "sync")


def test_copy_sources_names_the_prompt_digit_each_answer_position_copies() -> None:
    from benchmarks.learn_probe import copy_sources

    pairs = [("12345", "54321"), ("90817", "71809"), ("3456", "6543")]  # correct reversals
    assert copy_sources(pairs) == "4:3210 5:43210"
    wrong = [("12345", "54421"), ("90817", "71109")]  # position 2 copies digit 3, not 2
    assert copy_sources(wrong) == "5:43310"
    assert copy_sources([("123", "3")]) == "3:2--"


def test_position_hits_count_the_stop_only_where_the_model_stopped() -> None:
    from benchmarks.learn_probe import position_hits

    assert position_hits("321", "321", finished=True) == [True, True, True, True]
    assert position_hits("321", "32", finished=True) == [True, True, False, False]  # stopped one digit early
    assert position_hits("321", "3214", finished=False) == [True, True, True, False]  # ran past the answer
    assert position_hits("321", "321", finished=False) == [True, True, True, False]  # cut by the length limit
    assert position_hits("321", "", finished=True) == [False, False, False, False]


def test_lagged_sampler_holds_the_weights_of_lag_updates_ago() -> None:
    import torch

    from benchmarks.learn_probe import LaggedSampler
    from consumers.trainer.learner import Learner
    from rollstream.config import load_config

    cfg = load_config(str(ROOT / "pipeline.yaml"), ["model.d_model=16", "model.n_layer=1", "model.n_head=2",
                                                    "run.device=cpu"])
    policy = Learner(cfg).policy
    first = next(iter(policy.module.parameters()))
    same = LaggedSampler(cfg, policy, 0)
    lagged = LaggedSampler(cfg, policy, 1)
    seen = []
    for step in range(1, 5):
        assert same.before_step() is policy and same.version == step - 1
        sampler = lagged.before_step()
        weights = next(iter(sampler.module.parameters())).detach().clone()
        seen.append(first.detach().clone())
        assert lagged.version == max(0, step - 2)
        assert torch.equal(weights, seen[max(0, step - 2)])  # one update behind; the first two steps: v0
        with torch.no_grad():
            first.add_(1.0)  # stands in for the step's update


def test_learn_probe_stops_at_the_target() -> None:
    tiny = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "data.reverse.max_digits=3",
            "data.val_size=8",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "run.device=cpu"]
    proc = subprocess.run([sys.executable, "-m", "rollstream.cli", "bench", "learn_probe", "pipeline.yaml",
                           *tiny, "--limit-s", "60", "--eval-every", "2", "--lag", "1", "--target", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("target 0.0 reached at step 2,"), proc.stdout[-500:]


def test_learn_probe_refuses_a_negative_lag() -> None:
    proc = subprocess.run([sys.executable, "-m", "rollstream.cli", "bench", "learn_probe", "--lag", "-1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--lag must be >= 0 (updates behind), got -1" in proc.stderr
