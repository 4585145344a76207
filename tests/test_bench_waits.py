"""`rollstream bench waits`: who waits for whom, read back from a run's records.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import waits


def _write_records(run: Path, steps: list[dict[str, float]]) -> Path:
    """records.jsonl as the aggregator's sink writes it (flat, "step" first): record 0 (validation only), then
    one record per step."""
    run.mkdir(parents=True)
    lines = [{"step": 0, "val/acc": 0.2, "training/global_step": 0.0}]
    lines += [{"step": g, "training/global_step": float(g), **m} for g, m in enumerate(steps, start=1)]
    (run / "records.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_a_sync_step_splits_into_generation_update_validation_and_the_rest(tmp_path: Path) -> None:
    run = _write_records(tmp_path / "learn-sync-s0", [
        {"timing_s/step": 20.0, "timing_s/gen": 6.0, "timing_s/update_actor": 12.0,
         "producer/idle_ratio": 0.7, "training/off_policy/staleness/mean": 1.0},
        {"timing_s/step": 30.0, "timing_s/gen": 6.0, "timing_s/update_actor": 12.0, "timing_s/validate": 10.0,
         "producer/idle_ratio": 0.8, "training/off_policy/staleness/mean": 1.0},
    ])
    w = waits.run_waits(run)
    assert (w.versions, w.step_s, w.trainer_wait_s, w.update_s, w.validate_s) == (2, 25.0, 6.0, 12.0, 5.0)
    assert w.other_s == pytest.approx(2.0)  # (20 + 30 - 12 - 24 - 10) / 2
    assert w.producer_idle == pytest.approx((0.7 * 20 + 0.8 * 30) / 50)  # weighted by step time
    assert w.staleness == 1.0
    # --from-step leaves the first step out
    assert waits.run_waits(run, from_step=2).step_s == 30.0


def test_the_cli_prints_one_row_a_run_and_names_a_run_without_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write_records(tmp_path / "learn-async-s0", [
        {"timing_s/step": 12.0, "timing_s/gen": 0.5, "timing_s/update_actor": 9.0,
         "producer/idle_ratio": 0.35,
         "training/off_policy/staleness/mean": 2.0},
    ])
    assert waits.main([str(a)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| run | versions | s / version | trainer waits")
    assert out[2] == "| learn-async-s0 | 1 | 12.0 | 0.5 | 9.0 | 0.0 | 2.5 | 35% | 2.00 |"

    # a step without a producer window leaves the idle share to the others; none at all prints "-"
    quiet = _write_records(tmp_path / "learn-quiet", [
        {"timing_s/step": 10.0, "timing_s/gen": 1.0, "timing_s/update_actor": 8.0,
         "producer/idle_ratio": 0.5},
        {"timing_s/step": 10.0, "timing_s/gen": 1.0, "timing_s/update_actor": 8.0},
    ])
    assert waits.run_waits(quiet).producer_idle == 0.5
    assert waits.run_waits(quiet, from_step=2).row().endswith("| - | nan |")

    empty = _write_records(tmp_path / "learn-none", [])
    assert waits.main([str(empty)]) == 2
    assert "learn-none" in capsys.readouterr().err
    assert waits.main([str(tmp_path / "missing")]) == 2
