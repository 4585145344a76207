"""The bus benchmark runs end to end at a tiny size against real Redis and reports sane numbers
(no ratios)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from benchmarks.bus import main, parse_size
from rollstream.keys import Keys

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--quick", "--sizes", "2K,24K", "--mb-per-trial", "0.1", "--reps", "2"]


def test_json_report_has_every_size_with_positive_rates(
    r: redis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY, "--json", "--redis-url", redis_url, "--prefix", keys.run]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["sizes"]
    assert [row["target_bytes"] for row in rows] == [2048, 24576]
    for row in rows:
        # the fake sample is calibrated to the requested size on the wire
        assert 0.8 < row["wire_bytes"] / row["target_bytes"] < 1.25
        assert row["samples_per_trial"] >= row["batch"] >= 1
        assert len(row["trials"]["ours"]) == len(row["trials"]["raw"]) == len(row["trials"]["pickle"]) == 2
        for name in (
            "ours_samples_per_s",
            "pickle_samples_per_s",
            "pickle_over_raw",
            "ours_mb_per_s",
            "raw_mb_per_s",
            "ours_over_raw",
            "encode_ours_us",
            "encode_pickle_us",
            "decode_ours_us",
            "decode_pickle_us",
            "decode_assemble_us",
        ):
            assert row[name] > 0, name
    assert report["machine"]["cpus"] >= 1
    # every benchmark namespace (prefix-<uuid>) was deleted again
    assert not list(r.scan_iter(match=Keys(f"{keys.run}-*").pattern()))


def test_markdown_table_from_the_command(redis_url: str, keys: Keys) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "bench", "bus", *TINY, "--redis-url", redis_url,
         "--prefix", keys.run, "--packer", "python"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| layout | bytes per response token per row")
    assert [ln.split("|")[1].strip() for ln in lines[2:3]] == ["schema 5"]
    table = lines[3:]
    head = "| size | batch | ours samples/s | ours MB/s | raw MB/s | ours/raw | pickle/raw"
    assert table[0].startswith(head)
    assert [ln.split("|")[1].strip() for ln in table[2:]] == ["2 KB", "24 KB"]
    assert "PythonRespSerializer" in out.stdout


def test_token_equal_mode_moves_the_same_samples_as_raw(
    r: redis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tokens: one row per shape with our and raw rates; bytes per response token within the 9 of the
    design (int32 id + float32 log-prob), the prompt once per group."""
    argv = ["--quick", "--tokens", "2x8x32,2x8x64", "--mb-per-trial", "0.05", "--reps", "1"]
    assert main([*argv, "--json", "--redis-url", redis_url, "--prefix", keys.run]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sizes"] == [] and [row["shape"] for row in report["shapes"]] == ["2x8x32", "2x8x64"]
    for row in report["shapes"]:
        for name in ("ours_samples_per_s", "raw_samples_per_s", "decode_ours_us", "decode_pickle_us"):
            assert row[name] > 0, name
    bpt = report["bytes_per_token"]
    assert 8 <= bpt["per_response_token_per_row"] <= 9
    assert bpt["per_prompt_token_per_group"] <= 4
    assert not list(r.scan_iter(match=Keys(f"{keys.run}-*").pattern()))
    assert main(["--tokens", "8x0x2"]) == 2
    assert "bad --tokens" in capsys.readouterr().err


def test_bad_sizes_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "12"]) == 2
    assert "bad --sizes" in capsys.readouterr().err
    assert parse_size("4M") == 4 << 20 and parse_size("16k") == 16 << 10


def test_phases_mode_cuts_one_entry_into_its_phases(
    r: redis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--phases: per size, µs per sample of encode, XADD, XREADGROUP, decode, XACK (and gc) against raw's."""
    assert main([*TINY, "--phases", "--json", "--redis-url", redis_url, "--prefix", keys.run]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sizes"] == [] and [row["size"] for row in report["phases"]] == ["2 KB", "24 KB"]
    for row in report["phases"]:
        for name in ("encode", "xadd", "xreadgroup", "decode", "xack"):
            assert row[f"ours_{name}_us"] > 0, name
        assert row["ours_gc_us"] >= 0 and row["raw_total_us"] > 0 and row["ours_over_raw"] > 0
    assert main([*TINY, "--phases", "--redis-url", redis_url, "--prefix", keys.run]) == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| size")]
    assert table == [table[0]] and "| decode |" in table[0]
    assert not list(r.scan_iter(match=Keys(f"{keys.run}-*").pattern()))


def test_e2e_mode_runs_each_tree_in_its_own_processes(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench bus_e2e: one producer and one consumer process per trial, importing the tree given (here this
    one), a row per size and tree with its wire bytes and samples/s."""
    from benchmarks.bus_e2e import main as e2e

    assert (
        e2e(["--trees", str(ROOT), "--reps", "1", "--sizes", "small", "--scale", "0.005", "--url", redis_url])
        == 0
    )
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| small")]
    assert len(rows) == 1 and rows[0].split("|")[2].strip() == str(ROOT)
    assert int(rows[0].split("|")[3].replace(",", "")) < 4000  # ragged: ~2.2 KB, the padded int64 form ~22 KB
    assert float(rows[0].split("|")[4].split("(")[0].replace(",", "")) > 0
    assert e2e(["--sizes", "huge"]) == 2
