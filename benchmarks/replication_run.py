"""What WAIT costs a whole run: the tiny pipeline under `rollstream run`, 0, 1 and 2 replicas, interleaved.

Run: `rollstream bench replication_run [--rounds N] [--window-s S] [config] [key=value ...]`. Each round
starts the same tiny run (pipeline.yaml with the tests' tiny GPT overrides, embedded Redis with AOF as
`rollstream run` starts it) three ways, in turn: replicas 0 (one server, no WAIT), replicas 1 with
wait_replicas 1, replicas 2 with wait_replicas 2 (each with 3 Sentinels). Rounds repeat the three (0, 1, 2,
0, 1, 2, ...), so what else loads the box falls on all three alike. A run is measured over a fixed window of
`--window-s` seconds once its records stream holds `--warmup-records` entries, then stopped with
`rollstream stop` and its folder (Redis data included) removed.

Figures of a run, from its log: each global step g publishes params version g (an entry-id time on the Redis
clock) before its commit, so the interval params v(g-1) -> v(g) is one whole step cycle, WAITed commit and
budget grant included; samples/s = samples trained (step_end sample_count) over the window's steps divided
by the window's params span; `timing_s/step` (the trainer's own step time: waiting for samples, training,
publishing weights; not the commit) and `timing_s/gen` (its wait for samples) are the step_end metrics'
medians. Per configuration the medians over rounds, and the ratios against replicas 0 (per round, then the
median), are printed. The producers report no publish latency: `rollstream bench replication` measures one
publish with WAIT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollstream.testing.runs import TINY

ROOT = Path(__file__).resolve().parents[1]

#: The tests' tiny GPT run (rollstream.testing.runs), long enough never to finish inside a window.
RUN = [*TINY, "trainer.total_training_steps=100000"]

#: The three configurations: name -> overrides.
CONFIGS: dict[str, list[str]] = {
    "0": ["run.redis.replicas=0", "run.redis.wait_replicas=0"],
    "1": ["run.redis.replicas=1", "run.redis.wait_replicas=1"],
    "2": ["run.redis.replicas=2", "run.redis.wait_replicas=2"],
}


@dataclass
class RunFigures:
    """One run's figures over its window."""

    config: str
    round: int
    steps: int  # step cycles measured (params intervals inside the window)
    samples: int  # trained in those steps
    span_s: float  # first to last params entry of the window (Redis clock)
    samples_per_s: float
    cycle_ms: float  # median params v(g-1) -> v(g)
    step_ms: float  # median timing_s/step
    gen_ms: float  # median timing_s/gen (waiting for samples)


def figures(
    config: str, rnd: int, params_ms: dict[int, int], step_ends: dict[int, tuple[int, float, float]]
) -> RunFigures:
    """A run's figures from its params entry times (version -> Redis ms) and step_end events of the window
    (global step -> (sample_count, timing_s/step, timing_s/gen)). Only steps g whose params v(g-1) and v(g)
    are both in the window count."""
    pairs = sorted(g for g in params_ms if g - 1 in params_ms)
    if not pairs:
        raise ValueError(f"replicas {config}, round {rnd}: no two consecutive params versions in the window")
    cycles = [params_ms[g] - params_ms[g - 1] for g in pairs]
    span_s = (params_ms[pairs[-1]] - params_ms[pairs[0] - 1]) / 1000
    samples = sum(step_ends[g][0] for g in pairs if g in step_ends)
    timed = [step_ends[g] for g in pairs if g in step_ends]
    return RunFigures(
        config=config,
        round=rnd,
        steps=len(pairs),
        samples=samples,
        span_s=span_s,
        samples_per_s=samples / span_s if span_s > 0 else 0.0,
        cycle_ms=float(statistics.median(cycles)),
        step_ms=1000 * statistics.median(s for _, s, _ in timed) if timed else float("nan"),
        gen_ms=1000 * statistics.median(w for _, _, w in timed) if timed else float("nan"),
    )


FIELDS = ("samples_per_s", "cycle_ms", "step_ms", "gen_ms")


def summarize(runs: Sequence[RunFigures]) -> dict[str, dict[str, float]]:
    """Per configuration: the median over rounds of each figure, and `<figure>/ratio`, the median over rounds
    of the figure divided by replicas 0's in the same round."""
    base = {r.round: r for r in runs if r.config == "0"}
    out: dict[str, dict[str, float]] = {}
    for config in CONFIGS:
        mine = [r for r in runs if r.config == config]
        if not mine:
            continue
        row: dict[str, float] = {"rounds": float(len(mine))}
        for f in FIELDS:
            row[f] = float(statistics.median(getattr(r, f) for r in mine))
            ratios = [getattr(r, f) / getattr(base[r.round], f) for r in mine
                      if r.round in base and getattr(base[r.round], f)]
            row[f"{f}/ratio"] = float(statistics.median(ratios)) if ratios else float("nan")
        out[config] = row
    return out


def format_report(runs: Sequence[RunFigures], summary: dict[str, dict[str, float]]) -> str:
    """Every run, then the medians and ratios per configuration."""
    lines = [f"{'replicas':>8} {'round':>5} {'steps':>5} {'samples/s':>9} {'cycle ms':>8} {'step ms':>8} "
             f"{'gen ms':>7}"]
    for r in runs:
        lines.append(f"{r.config:>8} {r.round:>5} {r.steps:>5} {r.samples_per_s:9.2f} {r.cycle_ms:8.1f} "
                     f"{r.step_ms:8.1f} {r.gen_ms:7.1f}")
    lines += ["", "median over rounds (x replicas 0, median of per-round ratios):"]
    for config, row in summary.items():
        label = "no WAIT" if config == "0" else f"WAIT {config}"
        parts = [f"{row[f]:.2f} ({row[f + '/ratio']:.2f}x)" for f in FIELDS]
        lines.append(f"{config} replicas ({label}): samples/s {parts[0]}, step cycle ms {parts[1]}, "
                     f"timing_s/step ms {parts[2]}, timing_s/gen ms {parts[3]}")
    return "\n".join(lines)


def _cli(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`rollstream ARGV` as a user runs it (this tree's modules first on the path)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env=env)


def _params_times(r: Any, stream: str) -> dict[int, int]:
    """params version -> its entry's Redis milliseconds."""
    return {int(f[b"version"]): int(i.split(b"-")[0]) for i, f in r.xrange(stream)}


def _step_ends(r: Any, stream: str) -> dict[int, tuple[int, float, float]]:
    """global step -> (sample_count, timing_s/step, timing_s/gen summed over its local updates)."""
    from schemas import StepMetrics, decode

    gen: dict[int, float] = {}
    out: dict[int, tuple[int, float]] = {}
    for _, fields in r.xrange(stream):
        ev = decode(fields)
        if not isinstance(ev, StepMetrics):
            continue
        if ev.type == "local_update":
            gen[ev.global_step] = gen.get(ev.global_step, 0.0) + ev.metrics.get("timing_s/gen", 0.0)
        else:
            out[ev.global_step] = (ev.sample_count, ev.metrics.get("timing_s/step", 0.0))
    return {g: (n, s, gen.get(g, 0.0)) for g, (n, s) in out.items()}


def measure(config: str, rnd: int, base_args: Sequence[str], window_s: float, warmup_records: int,
            timeout_s: float) -> RunFigures:
    """Start one run, measure `window_s` seconds of it, stop it and remove its folder."""
    from rollstream.ops.run_target import open_run

    tmp = Path(tempfile.mkdtemp(prefix="rollstream-bench-wait-"))
    args = [*base_args, *CONFIGS[config], f"run.dir={tmp}", f"run.name=wait{config}"]
    run_dir = tmp / f"wait{config}"
    try:
        started = _cli("run", *args, "--wait-records", str(warmup_records), "--wait-timeout", str(timeout_s),
                       timeout_s=timeout_s + 60)
        if started.returncode != 0:
            raise RuntimeError(f"replicas {config}: rollstream run failed\n{started.stdout}{started.stderr}")
        target = open_run(None, run_dir=str(run_dir))
        r = target.connect()
        try:
            sec, us = r.time()
            t0 = sec * 1000 + us // 1000
            time.sleep(window_s)
            sec, us = r.time()
            t1 = sec * 1000 + us // 1000
            params = {v: t for v, t in _params_times(r, target.keys.params).items() if t0 <= t <= t1}
            step_ends = _step_ends(r, target.keys.metrics)
        finally:
            r.close()
        return figures(config, rnd, params, step_ends)
    finally:
        stopped = _cli("stop", "--run-dir", str(run_dir), timeout_s=200) if run_dir.exists() else None
        if stopped is not None and stopped.returncode not in (0, 1):
            print(f"replicas {config}: rollstream stop exited {stopped.returncode}\n{stopped.stdout}"
                  f"{stopped.stderr}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The benchmark's arguments (config path optional; key=value overrides after it)."""
    p = argparse.ArgumentParser(prog="rollstream bench replication_run", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "pipeline.yaml"), help="pipeline config to start")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides applied after the tiny ones")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three configurations (0, 1, 2 each)")
    p.add_argument("--window-s", type=float, default=45.0, help="seconds measured per run after warm-up")
    p.add_argument("--warmup-records", type=int, default=2, help="records a run holds before its window")
    p.add_argument("--configs", default="0,1,2", help="replica counts to run, comma-separated (of 0,1,2)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a run may take to reach its warm-up")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if "=" in args.config and not Path(args.config).is_file():
        args.config, args.overrides = str(ROOT / "pipeline.yaml"), [args.config, *args.overrides]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or args.rounds < 1 or args.window_s <= 0:
        p.error(f"--configs takes 0, 1, 2 (got {unknown}); --rounds >= 1; --window-s > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the configurations interleaved, round by round, and print each run and the summary."""
    args = parse_args(argv)
    base = [args.config, *RUN, *args.overrides]
    runs: list[RunFigures] = []
    for rnd in range(1, args.rounds + 1):
        for config in args.configs:
            fig = measure(config, rnd, base, args.window_s, args.warmup_records, args.timeout)
            if not args.json:
                print(f"round {rnd}, replicas {config}: {fig.steps} steps, {fig.samples_per_s:.2f} "
                      f"samples/s, cycle {fig.cycle_ms:.0f} ms, step {fig.step_ms:.0f} ms", flush=True)
            runs.append(fig)
    summary = summarize(runs)
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "summary": summary}))
    else:
        print(format_report(runs, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
