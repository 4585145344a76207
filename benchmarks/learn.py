"""Learning benchmark: held-out exact match against wall-clock and samples, synchronous vs asynchronous.

    rollstream bench learn [pipeline.yaml] [key=value ...] [--seeds 0 1 2] [--target 0.9] [--report 0.9 0.95]
                           [--limit-s 300] [--modes sync async] [--out-dir runs/bench-learn] [--json]

Per seed: one supervised warm start of the tiny GPT (scripts/warm_start.py's, ends under 10 % exact match;
none for a pretrained model), shared by both modes, then the config run as a user runs it (`rollstream
run`: embedded Redis, producers, trainer, aggregator under supervisord) once per mode:

  sync   async_training.staleness_threshold=0 trainer.sync_mode=true: the trainer collects the whole
         global batch before training and producers get budget only for the next version, so generation
         and training strictly alternate (synchronous RL on the same code);
  async  the config as it is (streaming trainer, staleness_threshold from the config).

Each run is watched (`rollstream watch`'s reader) until val/acc >= --target or --limit-s, the clock starting
before `rollstream run` (process start-up included, warm start excluded: it is shared). Writes per seed
`learn-s<seed>.png` (val/acc vs seconds and vs samples trained, both modes) and prints a markdown table of
time and samples to each --report level (first validation at or above it), with the async/sync ratios, then
who waits for whom in each run (`rollstream bench waits`: the trainer's phases and the producers' idle share).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.waits import Waits, format_waits, run_waits
from rollstream.config import load_config
from rollstream.ops.progress import Curve, watch_run
from rollstream.ops.run_target import open_run

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ["async_training.staleness_threshold=0", "trainer.sync_mode=true"],
    "async": [],
}


@dataclass
class ModeRun:
    """One seed x mode: its curve and where the target was reached."""

    seed: int
    mode: str
    curve: Curve
    steps: int

    def summary(self) -> dict[str, Any]:
        """Plain figures for the table and --json."""
        return {
            "seed": self.seed, "mode": self.mode, "time_to_target_s": self.curve.reached_s,
            "samples_to_target": self.curve.reached_samples, "best_val_acc": self.curve.best("val/acc"),
            "final_val_acc": self.curve.latest("val/acc"), "global_steps": self.steps,
            "samples": self.curve.samples[-1] if self.curve.samples else 0.0,
            "val_points": self.curve.val_points(),
        }


def _rs(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the rollstream CLI of this interpreter; raise with its output on failure."""
    proc = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", *args], capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"rollstream {' '.join(args[:1])} failed ({proc.returncode}): {proc.stderr[-2000:]}"
        )
    return proc


def warm_start_file(config: str, overrides: list[str], out: Path) -> None:
    """The supervised warm start of scripts/warm_start.py for these settings, written to `out`."""
    cmd = [sys.executable, str(ROOT / "scripts" / "warm_start.py"), config, *overrides, "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)


def run_one(
    config: str, overrides: list[str], *, target: float, limit_s: float, hold_s: float
) -> tuple[Curve, int]:
    """`rollstream run` the config, watch it to the target or the limit, stop it; (curve, global steps)."""
    run_dir = load_config(config, overrides).run_dir()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    start = time.time()
    _rs("run", config, *overrides)
    t = open_run(config, overrides)  # after the run made its secrets
    try:
        curve = watch_run(t.connect(), t.keys, target_acc=target, limit_s=limit_s, since=start, hold_s=hold_s,
                          poll_s=0.5, show=False)
    finally:
        subprocess.run(
            [sys.executable, "-m", "rollstream.cli", "stop", config, *overrides],
            capture_output=True,
            cwd=ROOT,
        )
    return curve, (curve.steps[-1] if curve.steps else 0)


def plot_val_curves(
    curves: Sequence[tuple[str, Sequence[tuple[float, float, float]]]],
    target: float,
    out: Path,
    title: str,
    xlabels: tuple[str, str] = ("wall-clock seconds (from `rollstream run`)", "samples trained"),
    start_levels: str | None = None,
) -> Path:
    """val/acc against seconds and against samples trained, one line per (label, [(s, samples, acc)]), in one
    PNG with the target as a dotted line; with `start_levels` (its legend text) each curve's first value as a
    dashed line of its colour (e.g. a warm start's reading before RL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for k, (label, pts) in enumerate(curves):
        a.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", label=label)
        b.plot([p[1] for p in pts], [p[2] for p in pts], marker=".", label=label)
        if start_levels and pts:
            for ax in (a, b):
                ax.axhline(pts[0][2], color=f"C{k}", linestyle="--", linewidth=0.8,
                           label=f"{label}: {start_levels}")
    for ax, xlabel in zip((a, b), xlabels, strict=True):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy exact match (val/acc)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_seed(runs: Sequence[ModeRun], target: float, out: Path) -> Path:
    """val/acc vs seconds and vs samples trained, one line per mode, in one PNG."""
    curves = [(run.mode, run.curve.val_points()) for run in runs]
    return plot_val_curves(curves, target, out, f"seed {runs[0].seed}: " + " vs ".join(r.mode for r in runs))


def _fmt(x: float | None, spec: str) -> str:
    return "not reached" if x is None else format(x, spec)


def _cell(x: float | None, spec: str, ran: bool) -> str:
    """A figure, "not reached", or "-" where the mode (or, for a ratio, one of the two) was not run."""
    return _fmt(x, spec) if ran else "-"


def format_table(runs: Sequence[ModeRun], acc: float) -> str:
    """Markdown: per seed, time and samples to val/acc >= `acc` per mode and the async/sync ratios."""
    pct = f"{acc:.0%}"
    lines = [
        f"| seed | sync: s to {pct} | async: s to {pct} | time ratio async/sync | sync: samples to {pct} "
        f"| async: samples to {pct} | samples ratio async/sync | best val/acc sync / async |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_seed: dict[int, dict[str, ModeRun]] = {}
    for r in runs:
        by_seed.setdefault(r.seed, {})[r.mode] = r
    for seed, modes in sorted(by_seed.items()):
        s, a = modes.get("sync"), modes.get("async")
        sr, ar = (s.curve.first_reaching(acc) if s else None), (a.curve.first_reaching(acc) if a else None)
        st, sn = sr if sr else (None, None)
        at, an = ar if ar else (None, None)
        tr = at / st if st and at else None
        nr = an / sn if sn and an else None
        best = " / ".join(_fmt(m.curve.best("val/acc"), ".3f") if m else "-" for m in (s, a))
        both = s is not None and a is not None
        lines.append(f"| {seed} | {_cell(st, '.0f', s is not None)} | {_cell(at, '.0f', a is not None)} "
                     f"| {_cell(tr, '.2f', both)} | {_cell(sn, '.0f', s is not None)} "
                     f"| {_cell(an, '.0f', a is not None)} | {_cell(nr, '.2f', both)} | {best} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run every seed x mode, write the plots, print the table (or JSON)."""
    p = argparse.ArgumentParser(prog="rollstream bench learn", description=__doc__.splitlines()[0])
    p.add_argument(
        "config", nargs="?", default="pipeline.yaml", help="pipeline.yaml (default ./pipeline.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides for every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed values")
    p.add_argument(
        "--modes", nargs="+", choices=sorted(MODES), default=["sync", "async"], help="modes to run"
    )
    p.add_argument("--target", type=float, default=0.9, help="val/acc at which a run stops (reached)")
    p.add_argument(
        "--report", type=float, nargs="+", default=None, help="val/acc levels tabulated (default: --target)"
    )
    p.add_argument("--limit-s", type=float, default=300.0, help="seconds per run before giving up")
    p.add_argument("--hold-s", type=float, default=0.0, help="keep running S seconds after the target")
    p.add_argument("--out-dir", default="runs/bench-learn", help="run dirs, warm starts and PNGs go here")
    p.add_argument(
        "--json", action="store_true", help="print the per-run figures as JSON instead of the table"
    )
    args = p.parse_args(argv)
    if "=" in args.config and not Path(args.config).is_file():
        args.overrides, args.config = [args.config, *args.overrides], "pipeline.yaml"
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cfg = load_config(args.config, args.overrides)  # refuse a bad config before starting anything
    runs: list[ModeRun] = []
    waits: list[Waits] = []
    for seed in args.seeds:
        base = [*args.overrides, f"run.seed={seed}", f"run.dir={out_dir}"]
        init = []
        if cfg.model.backend == "tiny":  # a pretrained model (backend=hf) starts as it is
            warm = out_dir / f"warm-s{seed}.safetensors"
            warm_start_file(args.config, base, warm)
            init = [f"model.init_from={warm}"]
        seed_runs = []
        for mode in args.modes:
            ov = [*base, f"run.name=learn-{mode}-s{seed}", *init, *MODES[mode]]
            curve, steps = run_one(
                args.config, ov, target=args.target, limit_s=args.limit_s, hold_s=args.hold_s
            )
            run = ModeRun(seed, mode, curve, steps)
            seed_runs.append(run)
            try:
                waits.append(run_waits(out_dir / f"learn-{mode}-s{seed}"))
            except (OSError, ValueError) as e:  # no step recorded: the table says nothing of this run
                print(f"no wait profile: {e}", file=sys.stderr)
            print(f"seed {seed} {mode}: {args.target:.0%} after {_fmt(curve.reached_s, '.0f')} s / "
                  f"{_fmt(curve.reached_samples, '.0f')} samples; best {_fmt(curve.best('val/acc'), '.3f')} "
                  f"at step {steps}", file=sys.stderr, flush=True)
        runs += seed_runs
        png = plot_seed(seed_runs, args.target, out_dir / f"learn-s{seed}.png")
        print(f"wrote {png}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.summary() for r in runs], indent=1))
    else:
        print("\n\n".join(format_table(runs, acc) for acc in (args.report or [args.target])))
        if waits:
            print("\nWho waits for whom (seconds a version, averaged over each run's steps):\n")
            print(format_waits(waits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
