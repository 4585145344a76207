"""bench codec_cpu at tiny sizes against real Redis: encode/decode and pickle timed hot, and both decodes
held the way a trainer holds a read batch, each entry its own buffers; its keys are deleted after."""

from __future__ import annotations

import json

import pytest
import redis

from benchmarks.codec_cpu import held_us, main


def test_reports_hot_and_held_figures_per_size(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = set(r.scan_iter(match="codec-cpu-*"))
    argv = ["--sizes", "2K,24K", "--calls", "20", "--rounds", "2", "--held-mb", "0.5"]
    assert main([*argv, "--redis-url", redis_url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == ["2048", "24576"]
    for row in report.values():
        for name in ("encode_us", "decode_us", "pickle_loads_us", "decode_held_us", "pickle_loads_held_us"):
            assert row[name] > 0, name
        # whole read batches, at least four of them, each entry read back as its own bytes
        assert row["held_entries"] % row["held_batch"] == 0 and row["held_entries"] >= 4 * row["held_batch"]
        assert row["decode_pickle_over_ours_held"] == row["pickle_loads_held_us"] / row["decode_held_us"]
    assert set(r.scan_iter(match="codec-cpu-*")) == before
    quick = ["--sizes", "2K", "--calls", "20", "--rounds", "1", "--held-mb", "0"]
    assert main([*quick, "--redis-url", redis_url]) == 0
    assert "decode_held_us" not in json.loads(capsys.readouterr().out)["2048"]


def test_held_us_holds_each_batch_until_the_next_replaces_it() -> None:
    alive: list[int] = []

    class Tracked:
        def __init__(self, x: int) -> None:
            self.x = x
            alive.append(x)

        def __del__(self) -> None:
            alive.remove(self.x)

    seen: list[list[int]] = []

    def decode(x: int) -> Tracked:
        seen.append(sorted(alive))
        return Tracked(x)

    assert held_us(decode, list(range(6)), 3, 1) > 0
    # while the second batch decodes, the first batch's three results are still held
    assert seen[3:] == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert alive == []
