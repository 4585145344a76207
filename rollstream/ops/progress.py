"""`rollstream watch`: follow a run's records until held-out accuracy reaches a target or time runs out.

A live progress line (tqdm) shows the global step, val/acc (and the best so far), the training reward,
samples trained per second, mean staleness and the time used. The records are read incrementally from
the records stream, so watching costs one XRANGE per poll whatever the run's length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from rollstream.bus import iter_stream
from rollstream.keys import Keys
from schemas import DecodeError, SyncStepRecord, decode

VAL_ACC = "val/acc"
REWARD = "critic/rewards/mean"
TRAINED = "fully_async/count/trained_samples"
STALENESS = "training/off_policy/staleness/mean"


@dataclass
class Curve:
    """What a watched run did so far: one point per record, seconds counted from the watch's `since`."""

    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # when the record was seen
    samples: list[float] = field(default_factory=list)  # samples trained up to and including the step
    metrics: list[dict[str, float]] = field(default_factory=list)
    reached_s: float | None = None  # first time val/acc >= target was seen
    reached_samples: float | None = None  # samples trained when it was reached

    def val_points(self) -> list[tuple[float, float, float]]:
        """(seconds, samples trained, val/acc) of every record carrying val/acc."""
        return [
            (t, n, m[VAL_ACC])
            for t, n, m in zip(self.seconds, self.samples, self.metrics, strict=True)
            if VAL_ACC in m
        ]

    def first_reaching(self, acc: float) -> tuple[float, float] | None:
        """(seconds, samples trained) of the first record with val/acc >= acc, or None."""
        return next(((t, n) for t, n, v in self.val_points() if v >= acc), None)

    def latest(self, name: str) -> float | None:
        """The newest value of a metric, or None when no record has it."""
        return next((m[name] for m in reversed(self.metrics) if name in m), None)

    def best(self, name: str) -> float | None:
        """The largest value of a metric over the records, or None."""
        values = [m[name] for m in self.metrics if name in m]
        return max(values) if values else None


def read_new_records(r: redis.Redis, keys: Keys, after: str) -> tuple[list[SyncStepRecord], str]:
    """Records after stream id `after` (exclusive; "-" for all) and the id to continue from."""
    out = []
    for entry_id, fields in iter_stream(r, keys.records, "-" if after == "-" else f"({after}"):
        after = entry_id
        try:
            ev = decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, SyncStepRecord):
            out.append(ev)
    return out, after


def progress_line(curve: Curve, elapsed_s: float) -> str:
    """The one-line summary the progress bar shows."""
    step = curve.steps[-1] if curve.steps else 0
    acc, best, reward = curve.latest(VAL_ACC), curve.best(VAL_ACC), curve.latest(REWARD)
    trained = curve.samples[-1] if curve.samples else 0.0
    rate = trained / max(elapsed_s, 1e-9)  # a real model's run trains well under 1 group a second
    stale = curve.latest(STALENESS)
    parts = [
        f"step {step}",
        f"val/acc {acc:.3f} (best {best:.3f})" if acc is not None and best is not None else "val/acc -",
        f"reward {reward:.3f}" if reward is not None else "reward -",
        f"{rate:.0f} samples/s" if rate >= 10 else f"{rate:.2f} samples/s",
        f"staleness {stale:.2f}" if stale is not None else "staleness -",
    ]
    return " | ".join(parts)


def watch_run(
    r: redis.Redis,
    keys: Keys,
    *,
    target_acc: float,
    limit_s: float,
    since: float | None = None,
    hold_s: float = 0.0,
    poll_s: float = 1.0,
    show: bool = True,
    check: Callable[[], None] | None = None,
) -> Curve:
    """Follow the records until val/acc >= target_acc has been seen (then `hold_s` more seconds) or
    `limit_s` seconds have passed since `since` (a time.time() value; default now). `check()` is called
    every poll and may raise to abort (e.g. a crashed worker). Returns the curve seen."""
    from tqdm import tqdm

    start = time.time() if since is None else since
    curve, after, trained = Curve(), "-", 0.0
    bar = tqdm(total=round(limit_s), unit="s", disable=not show, dynamic_ncols=True,
               bar_format="{l_bar}{bar:20}| {n:.0f}/{total:.0f}s")
    try:
        while True:
            records, after = read_new_records(r, keys, after)
            now = time.time() - start
            for rec in records:
                trained += rec.metrics.get(TRAINED, 0.0)
                curve.steps.append(rec.global_step)
                curve.seconds.append(now)
                curve.samples.append(trained)
                curve.metrics.append(rec.metrics)
                if curve.reached_s is None and rec.metrics.get(VAL_ACC, -1.0) >= target_acc:
                    curve.reached_s, curve.reached_samples = now, trained
            bar.n = min(round(now), bar.total)
            bar.set_description_str(progress_line(curve, now), refresh=False)
            bar.refresh()
            if curve.reached_s is not None and now >= curve.reached_s + hold_s:
                break
            if now >= limit_s:
                break
            if check is not None:
                check()
            time.sleep(poll_s)
    finally:
        bar.close()
    return curve
