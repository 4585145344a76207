"""`rollstream watch` / bench learn: following records to a val/acc target, and the learn table."""

from __future__ import annotations

import threading
import time

import redis

from benchmarks.learn import ModeRun, format_table
from rollstream.keys import Keys
from rollstream.ops.progress import Curve, progress_line, read_new_records, watch_run
from schemas import SyncStepRecord, encode


def _record(r: redis.Redis, keys: Keys, step: int, **metrics: float) -> None:
    ev = SyncStepRecord(global_step=step, num_local_updates=1, metrics=metrics)
    r.xadd(keys.records, encode(ev), id=f"{step}-1")  # type: ignore[arg-type]


def test_read_new_records_is_incremental(r: redis.Redis, keys: Keys) -> None:
    _record(r, keys, 1, **{"val/acc": 0.1})
    _record(r, keys, 2)
    got, after = read_new_records(r, keys, "-")
    assert [g.global_step for g in got] == [1, 2] and after == "2-1"
    _record(r, keys, 3)
    got, after = read_new_records(r, keys, after)
    assert [g.global_step for g in got] == [3] and after == "3-1"
    assert read_new_records(r, keys, after)[0] == []


def test_watch_stops_when_the_target_is_reached_and_counts_samples(r: redis.Redis, keys: Keys) -> None:
    trained = "fully_async/count/trained_samples"
    _record(r, keys, 0, **{"val/acc": 0.05})
    _record(r, keys, 1, **{trained: 32, "critic/rewards/mean": 0.3})

    def later() -> None:
        time.sleep(0.6)
        _record(r, keys, 2, **{trained: 32, "val/acc": 0.96, "training/off_policy/staleness/mean": 1.5})

    threading.Thread(target=later).start()
    t0 = time.time()
    curve = watch_run(r, keys, target_acc=0.95, limit_s=30, poll_s=0.1, show=False)
    assert time.time() - t0 < 10
    assert curve.reached_s is not None and 0.5 < curve.reached_s < 10
    assert curve.reached_samples == 64 and curve.steps == [0, 1, 2]
    assert [round(p[2], 2) for p in curve.val_points()] == [0.05, 0.96]
    line = progress_line(curve, 2.0)
    assert (
        "step 2" in line
        and "val/acc 0.960 (best 0.960)" in line
        and "32 samples/s" in line
        and "staleness 1.50" in line
    )
    assert "0.32 samples/s" in progress_line(curve, 200.0)  # SmolLM2 on a CPU: 64 groups in 200 s, not "0"


def test_watch_gives_up_at_the_limit(r: redis.Redis, keys: Keys) -> None:
    _record(r, keys, 1, **{"val/acc": 0.5})
    t0 = time.time()
    curve = watch_run(r, keys, target_acc=0.95, limit_s=0.5, poll_s=0.1, show=False)
    assert curve.reached_s is None and curve.best("val/acc") == 0.5
    assert time.time() - t0 < 5


def test_learn_table_reports_ratios_and_missing_targets() -> None:
    def run(seed: int, mode: str, s: float | None, n: float | None) -> ModeRun:
        c = Curve(steps=[0], seconds=[0.0], samples=[0.0], metrics=[{"val/acc": 0.1}])
        if s is not None and n is not None:
            c.steps.append(1), c.seconds.append(s), c.samples.append(n), c.metrics.append({"val/acc": 0.92})
        return ModeRun(seed, mode, c, 1)

    table = format_table([run(0, "sync", 100, 3000), run(0, "async", 60, 3300), run(1, "sync", None, None),
                          run(1, "async", 80, 2000)], 0.9)
    rows = table.splitlines()
    assert rows[2].startswith("| 0 | 100 | 60 | 0.60 | 3000 | 3300 | 1.10 |")
    assert rows[3].startswith("| 1 | not reached | 80 | not reached |")
    assert "| 0 | not reached | not reached |" in format_table(
        [run(0, "sync", 100, 3000), run(0, "async", 60, 3300)], 0.95
    )
    assert (
        format_table([run(2, "async", 50, 900)], 0.9)
        .splitlines()[2]
        .startswith("| 2 | - | 50 | - | - | 900 | - |")
    )
