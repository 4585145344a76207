"""Who waits for whom: seconds a version split into the trainer's phases, and the producers' idle share.

    rollstream bench waits RUN_DIR [RUN_DIR ...] [--from-step 1] [--to-step N]

Reads each run's `records.jsonl` (one record per parameter-sync step, as the aggregator wrote it) and prints
one markdown row per run, averaged over its training steps in [--from-step, --to-step]:

  s / version      the trainer's step time (`timing_s/step`: collect, update, validate, publish, checkpoint)
  trainer waits    seconds a step the trainer waited for its samples (`timing_s/gen`): the producers' turn
  update           `timing_s/update_actor`
  validate         `timing_s/validate` (trainer-side held-out validation, every trainer.test_freq steps)
  other            the rest: assembly, publish, checkpoint, the commit and grant
  producers idle   the producers' idle share of the same span (`producer/idle_ratio`, waiting for a lease or a
                   new version), weighted by step time over the steps that report it ("-": none do): the
                   trainer's turn
  staleness        mean of `training/off_policy/staleness/mean` (trained step minus sampling version)

A synchronous run's step is the producers' generation (trainer waits) plus the trainer's own work; an
asynchronous one overlaps them, so whichever side waits less sets its pace. `rollstream bench learn` prints
this table after its time table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollstream.ops.plot import records_from_jsonl


@dataclass(frozen=True)
class Waits:
    """One run's averages over its training steps (seconds a version, shares of the step)."""

    name: str
    versions: int
    step_s: float
    trainer_wait_s: float
    update_s: float
    validate_s: float
    other_s: float
    producer_idle: float | None
    staleness: float

    def row(self) -> str:
        """This run as a markdown table row (the header is HEADER)."""
        idle = "-" if self.producer_idle is None else f"{self.producer_idle:.0%}"
        return (f"| {self.name} | {self.versions} | {self.step_s:.1f} | {self.trainer_wait_s:.1f} "
                f"| {self.update_s:.1f} | {self.validate_s:.1f} | {self.other_s:.1f} "
                f"| {idle} | {self.staleness:.2f} |")


#: The table's header (markdown), one column per Waits field.
HEADER = ("| run | versions | s / version | trainer waits | update | validate | other | producers idle "
          "| staleness |\n|---|---|---|---|---|---|---|---|---|")


def run_waits(
    run_dir: Path, from_step: int = 1, to_step: int | None = None, name: str | None = None
) -> Waits:
    """The averages of run_dir's records.jsonl over its training steps in [from_step, to_step]; ValueError
    naming the run when it has no training step there."""
    records = [(g, m) for g, m in records_from_jsonl(run_dir / "records.jsonl")
               if g >= max(1, from_step) and (to_step is None or g <= to_step) and "timing_s/step" in m]
    if not records:
        last = "the last" if to_step is None else f"step {to_step}"
        raise ValueError(f"{run_dir}: no training step in records.jsonl from step {from_step} to {last}")
    n = len(records)

    def total(key: str) -> float:
        return sum(m.get(key, 0.0) for _, m in records)

    keys = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/validate")
    step, wait, update, val = (total(k) for k in keys)
    # over the steps with a producer window only: a step without one says nothing of the producers
    windowed = [(m["producer/idle_ratio"], m["timing_s/step"])
                for _, m in records if "producer/idle_ratio" in m]
    windowed_s = sum(s for _, s in windowed)
    idle = sum(r * s for r, s in windowed) / windowed_s if windowed_s else None
    stale = [m["training/off_policy/staleness/mean"] for _, m in records
             if "training/off_policy/staleness/mean" in m]
    return Waits(name or run_dir.name, n, step / n, wait / n, update / n, val / n,
                 (step - wait - update - val) / n, idle, sum(stale) / len(stale) if stale else float("nan"))


def format_waits(rows: Sequence[Waits]) -> str:
    """The markdown table of rows (HEADER first)."""
    return "\n".join([HEADER, *(w.row() for w in rows)])


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table for the run folders given."""
    p = argparse.ArgumentParser(prog="rollstream bench waits", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with its records.jsonl)")
    p.add_argument("--from-step", type=int, default=1, help="first training step averaged")
    p.add_argument("--to-step", type=int, default=None, help="last training step averaged (default: last)")
    args = p.parse_args(argv)
    try:
        rows = [run_waits(d, args.from_step, args.to_step) for d in args.runs]
    except (OSError, ValueError) as e:
        print(f"rollstream bench waits: {e}", file=sys.stderr)
        return 2
    print(format_waits(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
