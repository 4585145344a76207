"""Held-out val/acc of several demo.sh runs against wall-clock and against samples trained, in one PNG.

    .venv/bin/python scripts/plot_demo_runs.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each RUN_DIR is a copy of a finished `runs/demo/` holding `records.jsonl`, `logs/trainer*.log` and `demo.log`
(demo.sh's output, with its progress line). Seconds count from demo.sh's start (model build included): the
progress line's elapsed seconds when validation 0 first shows, against the trainer log's time of that
validation, place the start; every validation is then placed by its trainer-log time. Samples are
RolloutSamples trained (a prompt's group each): global step x 16 (the SmolLM2 config's train_batch_size).
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path

_VALIDATION = re.compile(r"^(\S+ \S+) INFO trainer \S+: validation of version (\d+)", re.M)
_FIRST_VAL = re.compile(r"val/acc \d\.\d+ \(best[^\n]*?(\d+)/\d+s")


def curve(run_dir: Path, batch: int) -> list[tuple[float, int, float]]:
    """(seconds since demo.sh started, samples trained, val/acc) of each validation of one run."""
    log = next((run_dir / "logs").glob("trainer*.log")).read_text()
    when = {
        int(m.group(2)): datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for m in _VALIDATION.finditer(log)
    }
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
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in argv[1:]:
        label, run_dir = spec.split("=", 1)
        points = curve(Path(run_dir), batch=16)
        print(label, [(round(s), n, v) for s, n, v in points])
        by_time.plot([p[0] for p in points], [p[2] for p in points], marker=".", label=label)
        by_samples.plot([p[1] for p in points], [p[2] for p in points], marker=".", label=label)
    for ax, xlabel in ((by_time, "seconds since demo.sh started (model build included)"),
                       (by_samples, "samples trained (16 per step, 8 responses each)")):
        ax.axhline(0.6, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy val/acc (200)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, reasoning-gym basic_arithmetic (+ - *, 2 terms, 1-2 digits)")
    fig.tight_layout()
    fig.savefig(argv[0], dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
