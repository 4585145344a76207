"""bench bus_entry_batching runs at a tiny size against real Redis: the raw cycle at 1 and K samples per
entry, the codec's CPU, and the ours/raw bound each layout allows; its keys are deleted after."""

from __future__ import annotations

import json

import pytest
import redis

from benchmarks.bus_entry_batching import main
from rollstream.keys import Keys


def test_reports_both_layouts_and_a_bound_below_one(
    r: redis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--sizes", "2K,24K", "--k", "4", "--reps", "1", "--mb-per-trial", "0.2", "--calls", "50"]
    assert main([*argv, "--redis-url", redis_url, "--prefix", keys.run]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == ["2K", "24K"]
    for row in report.values():
        assert row["raw_us_1_per_entry"] > 0 and row["raw_us_4_per_entry"] > 0 and row["codec_us"] > 0
        # the bound is raw(1) over raw(K) plus the codec: below 1 whenever the codec costs anything
        one = row["raw_us_1_per_entry"] / (row["raw_us_1_per_entry"] + row["codec_us"])
        assert row["bound_ours_over_raw_1_per_entry"] == pytest.approx(one) and one < 1
        assert 0 < row["bound_ours_over_raw_4_per_entry"]
    assert report["24K"]["wire_bytes"] > report["2K"]["wire_bytes"]
    assert not list(r.scan_iter(match=Keys(f"{keys.run}-*").pattern()))


@pytest.mark.parametrize(
    ("argv", "message"), [(["--k", "1"], "--k must be >= 2, got 1"), (["--sizes", "12"], "bad --sizes")]
)
def test_bad_arguments_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
