"""Held-out val/acc of several demo.sh runs against wall-clock and against samples trained, in one PNG.

    .venv/bin/python scripts/plot_demo_runs.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]
        [--target 0.6] [--title TEXT] [--start-level TEXT]

`--start-level TEXT` draws each run's version-0 reading as a dashed line labelled TEXT (a warm start's level).

Each RUN_DIR is a copy of a finished `runs/demo/` holding `records.jsonl`, `logs/trainer*.log` and `demo.log`
(demo.sh's output, with its progress line). Seconds count from demo.sh's start (model build included): the
progress line's elapsed seconds when validation 0 first shows, against the trainer log's time of that
validation, place the start; every validation is then placed by its trainer-log time. A run folder of
`rollstream bench learn` (no demo.log) counts from its supervisord's first log line: bench learn's own clock
starts about 2 s before it, at `rollstream run`. Samples are
RolloutSamples trained (a prompt's group each): global step x the run's `data.train_batch_size` (from its
`pipeline.resolved.yaml`).
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path

import yaml

from benchmarks.learn import plot_val_curves

TITLE = "SmolLM2-135M-Instruct, reasoning-gym basic_arithmetic (+ - *, 2 terms, 1-2 digits)"
_VALIDATION = re.compile(r"^(\S+ \S+) INFO trainer \S+: validation of version (\d+)", re.M)
_FIRST_VAL = re.compile(r"val/acc \d\.\d+ \(best[^\n]*?(\d+)/\d+s")
_LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


def curve(run_dir: Path) -> list[tuple[float, int, float]]:
    """(seconds since demo.sh started, samples trained, val/acc) of each validation of one run."""
    batch = int(yaml.safe_load((run_dir / "pipeline.resolved.yaml").read_text())["data"]["train_batch_size"])
    log = next((run_dir / "logs").glob("trainer*.log")).read_text()
    when = {int(m.group(2)): datetime.strptime(m.group(1), _LOG_TIME).timestamp()
            for m in _VALIDATION.finditer(log)}
    if not (run_dir / "demo.log").exists():  # a bench learn run: its supervisord's start
        first_line = (run_dir / "logs" / "supervisord.log").read_text()[:23]
        start = datetime.strptime(first_line, _LOG_TIME).timestamp()
    else:
        watch = (run_dir / "demo.log").read_text().replace("\r", "\n")
        first = _FIRST_VAL.search(watch)
        if first is None or 0 not in when:
            raise SystemExit(f"{run_dir}: no validation of version 0 in demo.log and the trainer log")
        start = when[0] - int(first.group(1))
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line]
    return [
        (when[int(r["step"])] - start, int(r["step"]) * batch, float(r["val/acc"]))
        for r in records
        if "val/acc" in r and int(r["step"]) in when
    ]


def main(argv: list[str]) -> int:
    """Plot the runs named on the command line; prints each curve."""
    options = {"--target": "0.6", "--title": TITLE, "--start-level": ""}
    for name in options:
        if name in argv:
            at = argv.index(name)
            options[name] = argv[at + 1]
            del argv[at : at + 2]
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    curves = []
    for spec in argv[1:]:
        label, run_dir = spec.split("=", 1)
        points = curve(Path(run_dir))
        print(label, [(round(s), n, v) for s, n, v in points])
        curves.append((label, points))
    demo = any((Path(spec.split("=", 1)[1]) / "demo.log").exists() for spec in argv[1:])
    clock = "seconds since the run's start"
    if demo:
        clock = "seconds since demo.sh started (model build included)"
    xlabels = (clock, "samples trained (one prompt's group)")
    plot_val_curves(curves, float(options["--target"]), Path(argv[0]), options["--title"], xlabels,
                    options["--start-level"] or None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
