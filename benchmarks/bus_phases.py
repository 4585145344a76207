"""Where the time of one entry goes (`rollstream bench bus --phases`): the bus benchmark's cycle cut into
phases with in-process timers, µs per sample, ours and raw interleaved at each size.

ours: encode (`schemas.encode` of the batch's samples), XADD (the pipelined publish of those fields, as
`Publisher.publish_many` sends them), XREADGROUP (a `GroupReader.poll`, less its decoding), decode (the
poll's `stats.decode_s`: `schemas.decode` to a validated RolloutSample, header and size checks included),
XACK (`GroupReader.ack`). raw: XADD, then XREADGROUP + XACK of one opaque field of the same size. "gc" is
the time the cyclic garbage collector ran during ours (it lands inside the other phases, which include it).
The medians of each phase over the repetitions are printed; they need not add up to one trial's total.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import redis

from benchmarks.bus_trials import (
    CONSUMER,
    PRODUCER,
    Settings,
    _batches,
    fresh_stream,
    human_size,
    make_sample,
    trial_inputs,
    trial_raw,
)
from rollstream.bus import GroupReader, Message
from rollstream.keys import TRAINER_GROUP
from schemas import RolloutSample, encode

PHASES = ("encode", "xadd", "xreadgroup", "decode", "xack")


class _GcClock:
    """Seconds the cyclic garbage collector runs while installed (a gc.callbacks hook)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        """gc.callbacks hook: start/stop the clock."""
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._t0

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def phase_trial(
    r: redis.Redis, sample: RolloutSample, n_samples: int, batch: int, prefix: str
) -> dict[str, float]:
    """Seconds per phase (and gc) of n_samples through publish -> poll -> decode -> ack, batch by batch."""
    out = dict.fromkeys((*PHASES, "gc"), 0.0)
    with fresh_stream(r, prefix) as keys, _GcClock() as clock:
        reader = GroupReader(
            r, keys.rollouts_of(PRODUCER), TRAINER_GROUP, CONSUMER, dead_stream=keys.dead, count=batch
        )
        reader.poll(block_ms=0)  # own-pending scan and first XAUTOCLAIM, once per reader
        got = 0
        for b in _batches(n_samples, batch):
            t0 = time.perf_counter()
            entries = [encode(sample) for _ in range(b)]
            t1 = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for fields in entries:
                pipe.xadd(keys.rollouts_of(PRODUCER), fields, nomkstream=True)  # type: ignore[arg-type]
            pipe.execute()
            t2 = time.perf_counter()
            decode0 = reader.stats.decode_s
            msgs: list[Message] = []
            while len(msgs) < b:
                msgs.extend(reader.poll(block_ms=1000))
            t3 = time.perf_counter()
            reader.ack([m.id for m in msgs])
            t4 = time.perf_counter()
            decode_s = reader.stats.decode_s - decode0
            for name, s in zip(
                PHASES, (t1 - t0, t2 - t1, t3 - t2 - decode_s, decode_s, t4 - t3), strict=True
            ):
                out[name] += s
            got += len(msgs)
        out["gc"] = clock.total_s
    if got != n_samples or reader.stats.dead:
        raise RuntimeError(f"phases: decoded {got}/{n_samples} samples, {reader.stats.dead} dead-lettered")
    return out


def measure_phases(r: redis.Redis, target_bytes: int, s: Settings) -> dict[str, Any]:
    """Interleaved ours (by phase) and raw trials at one size; µs per sample, medians over repetitions."""
    sample = make_sample(target_bytes)
    wire, payload, batch, n = trial_inputs(sample, s.mb_per_trial, s.batch)
    ours: list[dict[str, float]] = []
    raw: list[dict[str, float]] = []
    if s.warmup:
        phase_trial(r, sample, min(n, 2 * batch), batch, s.prefix)
        trial_raw(r, payload, min(n, 2 * batch), batch, s.prefix)
    for rep in range(s.reps):
        for which in ("ours", "raw") if rep % 2 == 0 else ("raw", "ours"):
            if which == "ours":
                ours.append(phase_trial(r, sample, n, batch, s.prefix))
            else:
                t = trial_raw(r, payload, n, batch, s.prefix)
                raw.append({"xadd": t.publish_s, "xreadgroup_xack": t.consume_s, "total": t.total_s})
    us = 1e6 / n
    row: dict[str, Any] = {
        "size": human_size(wire),
        "wire_bytes": wire,
        "batch": batch,
        "samples_per_trial": n,
    }
    for name in (*PHASES, "gc"):
        row[f"ours_{name}_us"] = statistics.median(t[name] for t in ours) * us
    row["ours_total_us"] = statistics.median(sum(t[p] for p in PHASES) for t in ours) * us
    for name in ("xadd", "xreadgroup_xack", "total"):
        row[f"raw_{name}_us"] = statistics.median(t[name] for t in raw) * us
    row["ours_over_raw"] = row["raw_total_us"] / row["ours_total_us"]
    return row


def format_phases(rows: list[dict[str, Any]]) -> str:
    """Markdown table of measure_phases rows."""
    lines = [
        "| size | batch | ours: encode | XADD | XREADGROUP | decode | XACK | total (gc in it) "
        "| raw: XADD | XREADGROUP + XACK | total | ours/raw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in rows:
        lines.append(
            f"| {w['size']} | {w['batch']} | {w['ours_encode_us']:,.0f} | {w['ours_xadd_us']:,.0f} "
            f"| {w['ours_xreadgroup_us']:,.0f} | {w['ours_decode_us']:,.0f} | {w['ours_xack_us']:,.0f} "
            f"| {w['ours_total_us']:,.0f} ({w['ours_gc_us']:,.0f}) | {w['raw_xadd_us']:,.0f} "
            f"| {w['raw_xreadgroup_xack_us']:,.0f} | {w['raw_total_us']:,.0f} | {w['ours_over_raw']:.2f} |"
        )
    return "\n".join(lines) + "\n"
