"""`rollstream plot`: reward and accuracy curves vs global_step from the records stream (or the run dir's
records.jsonl when Redis is gone), as a PNG drawn with matplotlib's Agg backend."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from rollstream.bus import iter_stream
from rollstream.keys import Keys
from schemas import DecodeError, SyncStepRecord, decode

#: Curves drawn when present, in this order; val/acc falls back to val/reward_mean.
TRAIN_REWARD = "critic/rewards/mean"
VAL_KEYS = ("val/acc", "val/reward_mean")


def records_from_redis(r: redis.Redis, keys: Keys) -> list[tuple[int, dict[str, float]]]:
    """(global_step, metrics) of every record on the records stream."""
    out = []
    for _, fields in iter_stream(r, keys.records):
        try:
            ev = decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, SyncStepRecord):
            out.append((ev.global_step, ev.metrics))
    return out


def records_from_jsonl(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(global_step, metrics) of each line of records.jsonl (a record object or a flat metrics map)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        metrics = row.get("metrics", row)
        step = row.get("global_step", metrics.get("training/global_step"))
        if step is not None:
            out.append((int(step), {k: v for k, v in metrics.items() if isinstance(v, int | float)}))
    return out


def curves(records: list[tuple[int, dict[str, float]]]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) for the train reward, validation accuracy (or reward) and any producer-side
    reward mean found in the records."""
    names: list[str] = []
    seen = {k for _, m in records for k in m}
    if TRAIN_REWARD in seen:
        names.append(TRAIN_REWARD)
    val = next((k for k in VAL_KEYS if k in seen), None)
    if val:
        names.append(val)
    names += sorted(k for k in seen if "producer" in k and "reward" in k and k.endswith("mean"))
    out: dict[str, tuple[list[int], list[float]]] = {}
    for name in names:
        pts = sorted((s, float(m[name])) for s, m in records if name in m)
        out[name] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def plot_curves(series: dict[str, tuple[list[int], list[float]]], out: Path, title: str) -> Path:
    """Draw the curves into a PNG at out; ValueError when there is nothing to draw."""
    if not series:
        raise ValueError("no reward or accuracy metrics in the records yet")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (steps, values) in series.items():
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
    ax.set_xlabel("global_step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
