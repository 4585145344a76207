"""`rollstream bench`: every module of benchmarks/ with a main(argv) is found by name and listed with its
description, an unknown name says which exist, and the benchmarks that had only scripts (generation,
aggregator) run through it at a tiny size (figures not asserted, only that they measured something)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import redis

from rollstream.cli.main import main
from rollstream.keys import Keys

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = [
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.max_seq_len=32",
    "run.device=cpu",
]


def modules_with_main() -> set[str]:
    """benchmarks/*.py defining a top-level main, read from the source (not __main__, which runs them)."""
    return {
        p.stem for p in (ROOT / "benchmarks").glob("*.py")
        if not p.name.startswith("_")
        and any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(p.read_text()).body)
    }


@pytest.mark.parametrize("argv", [["bench", "--list"], ["bench"]])
def test_list_shows_every_benchmark_with_its_description(
    argv: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 0
    lines = capfd.readouterr().out.splitlines()
    names = [ln.split()[0] for ln in lines]
    assert set(names) == {m.rstrip("_") for m in modules_with_main()}
    assert {"bus", "async", "learn", "learn_probe", "soak", "generation", "aggregator", "dp"} <= set(names)
    # helpers and a producer entry point
    assert not {"latency", "latency_producer", "bus_tokens"} & set(names)
    described = dict(ln.split(None, 1) for ln in lines)
    assert described["async"].startswith("Async vs sync benchmark:")
    assert described["generation"].startswith("Generation benchmark:")


def test_unknown_benchmark_exits_1_naming_the_known_ones(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nosuch"]) == 1
    err = capfd.readouterr().err
    assert "no benchmark 'nosuch'" in err and "generation" in err and "aggregator" in err


def test_generation_runs_through_the_cli(
    r: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    before = set(r.scan_iter(match="rs:{bench-gen-*"))
    argv = [
        "bench",
        "generation",
        "pipeline.yaml",
        *TINY_MODEL,
        "--dispatches",
        "1",
        "--json",
        "--redis-url",
        redis_url,
    ]
    assert main(argv) == 0
    res = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert res["dispatches"] == 1 and res["samples"] > 0 and res["tokens"] > 0 and res["gen_tokens_per_s"] > 0
    assert set(r.scan_iter(match="rs:{bench-gen-*")) == before  # the throwaway namespace is deleted


def test_generation_compares_per_dispatch_and_continuous_built_in_generation(
    r: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "generation", "pipeline.yaml", *TINY_MODEL, "rollout.n=4",
            "rollout.prompts_per_dispatch=4", "--dispatches", "2", "--warmup", "1",
            "--engines", "builtin", "builtin-continuous", "--json", "--redis-url", redis_url]
    assert main(argv) == 0
    res = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    for name in ("builtin", "builtin-continuous"):
        got = res[name]
        assert got["samples"] == 8 and got["tokens"] > 0 and got["cpu_tokens_per_s"] > 0
        assert 0 < got["engine_occupancy"] <= 1 and 0 < got["engine_live_share"] <= 1
        assert 1 <= got["response_len_p50"] <= got["response_len_p90"] <= got["max_new_tokens"]


def test_aggregator_runs_through_the_cli_and_the_worker_folds_records(
    r: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench",
        "aggregator",
        "--steps",
        "5",
        "--local-updates",
        "1",
        "--producers",
        "1",
        "--metrics",
        "5",
        "--redis-url",
        redis_url,
    ]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "pure fold (decoded events)" in out and "decode + fold" in out
    assert "worker through Redis" in out and "(5 records," in out  # every step folded, nothing dead-lettered
    assert not list(r.scan_iter(match=Keys("bench-agg-*").pattern()))


def test_dp_runs_one_and_two_ranks_through_the_cli(
    r: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """`rollstream bench dp`: the same recorded samples trained by 1 and 2 gloo ranks (figures not
    asserted)."""
    argv = [
        "bench",
        "dp",
        "pipeline.yaml",
        *TINY_MODEL,
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--json",
        "--redis-url",
        redis_url,
    ]
    assert main(argv) == 0
    rows = json.loads(capfd.readouterr().out)
    assert [row["ranks"] for row in rows] == [1, 2] and all(
        row["steps"] == 2 and row["samples_per_s"] > 0 for row in rows
    )
    # one rank has nothing to reduce
    assert rows[0]["grad_allreduce_ms"] == 0 and rows[1]["grad_allreduce_ms"] > 0
    assert not list(r.scan_iter(match=Keys("bench-dp-*").pattern()))


def test_decode_held_runs_through_the_cli_in_both_modes(capfd: pytest.CaptureFixture[str]) -> None:
    """Both allocator modes decode at a tiny size and report µs and faults per sample."""
    assert main(["bench", "decode_held", "--sizes", "16K", "--batch", "2", "--batches", "2", "--reps", "1",
                 "--json"]) == 0  # fmt: skip
    (row,) = json.loads(capfd.readouterr().out)
    assert row["size"] == 16 * 1024 and row["batch"] == 2
    assert row["plain_us"] > 0 and row["tuned_us"] > 0 and row["plain_faults"] >= 0


def test_watches_runs_through_the_cli_and_leaves_nothing(
    r: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "watches", "--producers", "2", "--entries", "4", "--calls", "3"]
    argv += ["--redis-url", redis_url]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "2 producers, 4 rollouts each of " in out
    assert "LeaseExpiry finished_counts: " in out and "FloodFence measure: " in out
    assert "us of Redis time per second" in out
    assert not list(r.scan_iter(match=Keys("bench-watches-*").pattern()))
