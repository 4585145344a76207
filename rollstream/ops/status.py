"""`rollstream status`: one screen about a run, read from Redis (and supervisord when it is up).

Health, rates and lag are judged in ops/health.py: heartbeats, and whether global steps still complete
(`rollstream status --check` exits 1, naming why, unless every line is ok, finished or stopping).

A data-parallel trainer (`world_size` > 1 in the trainer hash) shows one line per rank, `trainer-r<k>`,
from that rank's own `heartbeat:r<k>`, and each rank's consumer in the `trainer` group (its pending
entries and how long it has been idle); a rank that never wrote a heartbeat is `missing`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from rollstream.bus import Archive, ArchiveError, run_archive, run_producers, text
from rollstream.bus.ids import count_or_none
from rollstream.keys import GLOBAL_STEP_FIELD, TRAINER_GROUP, Keys
from rollstream.ops.health import (
    LAG_COUNT_CAP,
    RATE_WINDOW_S,
    WorkerHealth,
    group_lag,
    pacing_health,
    progress_health,
    step_ends,
    trained_rate,
    trainer_stopping,
    worker_health,
)
from rollstream.pacing.budget import current_budget
from rollstream.pacing.counters import leases, published_report, rollout_counts
from rollstream.pacing.fence import fenced as fenced_producers
from rollstream.weights.store import latest_param_version, producer_version_report
from schemas import DecodeError, ProducerStats, SyncStepRecord, decode, decode_fate

#: Most recent entries read for the staleness histogram and the latest stats.
RECENT_ENTRIES = 1000
TRAINER_IDLE_KEY = "fully_async/trainer/idle_ratio"


@dataclass
class StreamInfo:
    """Length and memory of one stream in Redis, what the archive holds of it, and its consumer groups."""

    name: str
    length: int
    bytes: int
    groups: list[dict[str, Any]] = field(default_factory=list)
    archived: int | None = 0  # entries in the archive (None: the archive cannot be read here)
    archived_bytes: int | None = 0


@dataclass
class RunStatus:
    """Everything `rollstream status` shows."""

    run: str
    streams: list[StreamInfo]
    dead: int
    param_version: int | None
    trainer: dict[str, str]
    producer_versions: dict[str, int]
    staleness: dict[int, int]
    staleness_source: str
    samples_per_s: float  # trained, from committed steps over the wall clock (ops/health.py)
    steps_per_min: float
    producer_idle: dict[str, float]
    trainer_idle: float | None
    processes: list[dict[str, Any]] | None = None
    workers: list[WorkerHealth] = field(default_factory=list)
    trainer_consumers: list[dict[str, Any]] = field(default_factory=list)  # the trainer group's consumers
    leases: dict[str, tuple[int, int]] = field(default_factory=dict)  # producer -> (leased, published)
    # what a producer wrote to its own keys that is not a canonical value (ignored), one line each
    bad_inputs: list[str] = field(default_factory=list)
    fenced: dict[str, str] = field(default_factory=dict)  # producer -> why the trainer fenced it (a flood)
    expired: dict[str, int] = field(default_factory=dict)  # producer -> prompts taken back (lease expired)

    @property
    def healthy(self) -> bool:
        """True when no line is stalled, missing or stopped (what `status --check` tests)."""
        return all(w.healthy for w in self.workers)

    def problems(self) -> list[str]:
        """One line per unhealthy worker or progress line, naming why."""
        return [f"{w.name} {w.state}: {w.why}" for w in self.workers if not w.healthy]


def _archived(archive: Archive | None, key: str) -> tuple[int | None, int | None]:
    """(entries, bytes) the archive holds of a stream; (None, None) when it cannot be read here."""
    if archive is None:
        return 0, 0
    try:
        index = archive.index(key)
    except ArchiveError:
        return None, None
    return index.entries, index.bytes


def _stream_info(r: redis.Redis, key: str, short: str, archive: Archive | None = None) -> StreamInfo:
    archived, archived_bytes = _archived(archive, key)
    if not r.exists(key):
        return StreamInfo(short, 0, 0, archived=archived, archived_bytes=archived_bytes)
    length = int(r.xlen(key))
    mem: Any = r.memory_usage(key, samples=0)
    groups = []
    raw: Any = r.xinfo_groups(key)
    for g in raw:
        groups.append(
            {
                "group": text(g["name"]),
                "consumers": int(g["consumers"]),
                "pending": int(g["pending"]),
                "lag": group_lag(r, key, text(g["last-delivered-id"])),
                "last_delivered": text(g["last-delivered-id"]),
            }
        )
    return StreamInfo(short, length, int(mem or 0), groups, archived, archived_bytes)


def staleness_histogram(
    r: redis.Redis, keys: Keys, trainer_step: int | None, producers: Sequence[str] = ()
) -> tuple[dict[int, int], str]:
    """Histogram of recent staleness: from `fates` entries' staleness field, else estimated from the
    producers' recent rollouts as (next global step − param_version). Returns (counts, where they came
    from)."""
    rows: Any = r.xrevrange(keys.fates, count=RECENT_ENTRIES)
    counts: Counter[int] = Counter()
    for _, f in rows:
        try:
            counts[decode_fate(f).staleness] += 1
        except DecodeError:
            continue
    if counts:
        return dict(sorted(counts.items())), f"fates (last {len(rows)})"
    streams = keys.rollouts_streams(producers)
    rows = [row for stream in streams for row in r.xrevrange(stream, count=RECENT_ENTRIES) or []]
    next_step = (trainer_step or 0) + 1
    for _, f in rows:
        v = count_or_none(f.get(b"param_version"))  # a producer's header: anything not a count is skipped
        if v is not None:
            counts[next_step - v] += 1
    return dict(sorted(counts.items())), f"rollouts (last {len(rows)}, vs next step {next_step})"


def latest_idle(
    r: redis.Redis, keys: Keys, names: Sequence[str] = ()
) -> tuple[dict[str, float], float | None]:
    """(producer -> idle ratio from the latest ProducerStats on its stats stream, trainer idle ratio from the
    latest record)."""
    producers: dict[str, float] = {}
    for name, stream in zip(names, keys.stats_streams(names), strict=True):
        rows: Any = r.xrevrange(stream, count=RECENT_ENTRIES) or []
        for _, f in rows:  # newest first: the first of the stream's own producer's stats that decodes
            if f.get(b"type") != b"producer" or f.get(b"producer") != name.encode():
                continue  # stats in another producer's name: its writer's lie (the aggregator refuses them)
            try:
                ev = decode(f)
            except DecodeError:
                continue
            if isinstance(ev, ProducerStats):
                producers[name] = ev.idle_ratio
                break
    trainer = None
    last: Any = r.xrevrange(keys.records, count=1)
    if last:
        try:
            rec = decode(last[0][1])
            if isinstance(rec, SyncStepRecord):
                trainer = rec.metrics.get(TRAINER_IDLE_KEY)
        except DecodeError:
            pass
    return dict(sorted(producers.items())), trainer


def collect_status(
    r: redis.Redis,
    keys: Keys,
    processes: list[dict[str, Any]] | None = None,
    stall_after_s: float = 120.0,
    total_steps: int | None = None,
    stopped: bool = False,
    max_outstanding: int | None = None,
) -> RunStatus:
    """Read everything the status screen shows; heartbeats older than `stall_after_s` count as stalled, and
    so does a run with no global step completed within it (unless finished, stopping, or `stopped`); with
    `max_outstanding` (the run's pacing bound) the pacing counters are checked too (`pacing_health`)."""
    names = run_producers(r, keys)
    all_streams = keys.all_streams(names)
    shorts = [k.removeprefix(keys.prefix) for k in all_streams]
    archive = run_archive(r, keys.fates)
    streams = [_stream_info(r, k, s, archive) for k, s in zip(all_streams, shorts, strict=True)]
    trainer_raw: Any = r.hgetall(keys.trainer)
    trainer = {text(k): text(v) for k, v in trainer_raw.items()}
    step = count_or_none(trainer.get(GLOBAL_STEP_FIELD, ""))  # -1 (none yet) or garbage: None
    pv = latest_param_version(r, keys) if r.exists(keys.params) else None
    hist, source = staleness_histogram(r, keys, step, names)
    now = time.time()
    ends = step_ends(r, keys)
    sps, spm = trained_rate(ends, now)
    last_step_at = ends[0].created_at if ends else None
    workers = [] if stopped else worker_health(trainer, stall_after_s, total_steps, now)
    workers.append(progress_health(trainer, stall_after_s, total_steps, trainer_stopping(processes), stopped,
                                   last_step_at, now))
    if max_outstanding is not None and current_budget(r, keys)[0] >= 0:
        counts = rollout_counts(r, keys, [])
        outstanding = counts.dispatched - counts.consumed
        workers.append(pacing_health(outstanding, current_budget(r, keys)[1], max_outstanding))
    pidle, tidle = latest_idle(r, keys, names)
    versions, bad_versions = producer_version_report(r, keys)
    held: dict[str, tuple[int, int]] = {}
    bad = [f"{p}: {why}" for p, why in sorted(bad_versions.items())]
    for p, n in sorted(leases(r, keys).items()):
        done, why = published_report(r, keys, p)
        held[p] = (n, min(done, n))  # more published than leased reads as the lease
        if why is not None:
            bad.append(f"{p}: {why}")
    return RunStatus(
        run=keys.run,
        streams=streams,
        dead=sum(s.length for s in streams if s.name in ("dead", "dead:aggregator")),
        param_version=pv.version if pv else None,
        trainer=trainer,
        producer_versions=versions,
        staleness=hist,
        staleness_source=source,
        samples_per_s=sps,
        steps_per_min=spm,
        producer_idle=pidle,
        trainer_idle=tidle,
        processes=processes,
        workers=workers,
        trainer_consumers=trainer_consumers(r, keys, names),
        leases=held,
        bad_inputs=bad,
        fenced=fenced_producers(r, keys),
        expired={p: n for p in held if (n := int(cast(Any, r.bitcount(keys.revoked_bits(p))))) > 0},
    )


def trainer_consumers(r: redis.Redis, keys: Keys, producers: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The `trainer` group's consumers (one per data-parallel rank) across the producers' rollouts streams:
    name, pending entries (summed over the streams), idle seconds (the least)."""
    out: dict[str, dict[str, Any]] = {}
    for stream in keys.rollouts_streams(producers):
        try:
            rows: Any = r.xinfo_consumers(stream, TRAINER_GROUP)
        except redis.ResponseError:  # no stream or no group yet
            continue
        for c in rows:
            name, idle_s = text(c["name"]), int(c["idle"]) / 1000
            row = out.setdefault(name, {"name": name, "pending": 0, "idle_s": idle_s})
            row["pending"] += int(c["pending"])
            row["idle_s"] = min(row["idle_s"], idle_s)
    return list(out.values())


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _lag(n: int) -> str:
    return f">={n}" if n >= LAG_COUNT_CAP else str(n)


def format_status(st: RunStatus, redis_url: str) -> str:
    """The status screen as text (redis_url must already be masked)."""
    out = [f"run {st.run}   redis {redis_url}"]
    step = st.trainer.get(GLOBAL_STEP_FIELD, "-")
    out.append(
        f"param_version {st.param_version if st.param_version is not None else '-'}   "
        f"trainer global_step {step}   dead letters {st.dead}"
    )
    for w in st.workers:
        age = f"{w.age_s:.1f}s ago" if w.age_s is not None else "never"
        flag = "" if w.healthy else f"   <-- {w.state.upper()}: {w.why}"
        if w.name == "pacing":
            out.append(f"pacing counters: {w.state}{flag}")
            continue
        what = "last completed (or start)" if w.name == "global steps" else "heartbeat"
        out.append(f"{w.name} {what} {age} (limit {w.limit_s:g}s): {w.state}{flag}")
    if len(st.trainer_consumers) > 1 or any(c["name"] != "trainer" for c in st.trainer_consumers):
        out.append(
            "trainer consumers: "
            + ", ".join(
                f"{c['name']} pending {c['pending']} idle {c['idle_s']:.1f}s" for c in st.trainer_consumers
            )
        )
    out.append("")
    out.append(
        f"{'stream':<16}{'in redis':>10}{'memory':>12}{'archived':>10}{'on disk':>12}   groups (pending / "
        "lag)"
    )
    for s in st.streams:
        groups = ", ".join(f"{g['group']} {g['pending']} / {_lag(g['lag'])}" for g in s.groups)
        archived = "?" if s.archived is None else str(s.archived)
        on_disk = "?" if s.archived_bytes is None else _bytes(s.archived_bytes)
        out.append(f"{s.name:<16}{s.length:>10}{_bytes(s.bytes):>12}{archived:>10}{on_disk:>12}   {groups}")
    out.append("")
    pv = ", ".join(f"{k}={v}" for k, v in sorted(st.producer_versions.items())) or "-"
    out.append(f"producer versions: {pv}")
    held = ", ".join(f"{p} {n} ({n - done} not published)" for p, (n, done) in st.leases.items()) or "-"
    out.append(f"leased prompts: {held}")
    if st.expired:
        out.append("leases expired (prompts taken back, rollout.lease_timeout_s): "
                   + ", ".join(f"{p} {n}" for p, n in sorted(st.expired.items())))
    out += [f"ignored producer input: {line}" for line in st.bad_inputs]
    out += [f"FENCED producer {p}: {why} (its user is off; the run goes on without it)"
            for p, why in sorted(st.fenced.items())]
    out.append(
        f"trained (committed steps, last {RATE_WINDOW_S:.0f}s+ of wall clock): {st.samples_per_s:.2f} "
        f"samples/s, {st.steps_per_min:.2f} global steps/min"
    )
    pidle = ", ".join(f"{k} {v:.2f}" for k, v in st.producer_idle.items()) or "-"
    tidle = f"{st.trainer_idle:.2f}" if st.trainer_idle is not None else "-"
    out.append(f"idle ratio: trainer {tidle}; producers {pidle}")
    out.append(f"staleness from {st.staleness_source}:")
    total = sum(st.staleness.values())
    if not total:
        out.append("  (no samples)")
    for k, c in st.staleness.items():
        bar = "#" * max(1, round(40 * c / total))
        out.append(f"  {k:>3} {c:>6} {bar}")
    if st.processes is not None:
        out.append("")
        out.append("supervisord:")
        for p in st.processes:
            out.append(f"  {p['name']:<12} {p['statename']:<9} {p['description']}")
    return "\n".join(out)
