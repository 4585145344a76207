"""Audit a run from its log: did every published sample end exactly once, and are the steps consecutive?

Every sample_id on the rollouts streams (one `rollouts:<p>` per producer, as setup_run recorded them in the
`producers` set) must end exactly once as trained, dropped-as-stale or evicted (an entry in `fates`) or
dead-lettered (an entry on `dead` whose source is that rollouts stream); the only other legitimate state is
still unacked in the trainer group of its stream (pending, or not yet delivered). A redelivered or duplicate
XADD of an id that already ended is acked without a second fate, so ids, not entries, are what is counted.
`step_end` events on `metrics` must be global steps 1..N, once each, and `records` must hold 1..M, after an
optional record 0 (the validation of version 0, taken before any training when trainer.test_freq > 0).

Only the trainer writes `metrics` (ACL), so a (global step, local step, rank) with more than one
`local_update` is a re-emission by the trainer itself: a step retrained after a restart from an older
checkpoint, or an XADD retried after a lost reply. The fold keeps the latest copy; the audit lists them in
`reemitted` (not a problem).

Nothing destroyed: a writer can still delete entries of a stream it may append to (XADD's own MAXLEN/MINID
options; Redis ACLs cannot restrict arguments), and what it deleted leaves no entry to classify. Each
stream's `entries-added` (XINFO STREAM) counts every XADD ever accepted and no trim can lower it; every
entry is either still in Redis or was moved to the archive by retention, so `entries-added` greater than
the entries the log holds means that many entries were destroyed (`destroyed`, a problem). Which samples
they were is known too: a producer's prompts are numbered (sample id `<producer>-<seq>`, rollstream/pacing.py)
and its published count moves with each publish, so every id below both its count and its lease (which
only the trainer writes) must be on the log; one that is neither there nor ended is `destroyed_ids`.

Reads the whole log through `iter_stream`: what retention moved to the run's archive, then what Redis
holds, each entry once; an archive that cannot be read here stops the audit (ArchiveError), never a
silent gap.
`rollstream audit` prints `format_report` and exits 1 when `problems()` is not empty.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from rollstream.bus.ids import parse_id, text
from rollstream.bus.publish import run_producers
from rollstream.bus.streams import PAGE, iter_stream
from rollstream.names import TRAINER_GROUP, Keys
from rollstream.pacing import leased_sample_id, leases, published_count
from schemas import EVICTED, SKIPPED, TRAINED, DeadLetter, DecodeError, StepMetrics, decode, decode_fate


@dataclass
class AuditReport:
    """What the log says happened to every published sample, and to the global steps."""

    published: set[str] = field(default_factory=set)
    trained: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    evicted: dict[str, str] = field(default_factory=dict)  # sample_id -> reason (filter_groups)
    skipped: set[str] = field(default_factory=set)  # in a local update whose optimizer step was skipped
    dead: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)  # still unacked in the trainer group: legitimately open
    lost: set[str] = field(default_factory=set)  # published, acked, and no fate anywhere
    duplicated: set[str] = field(default_factory=set)  # ended more than once
    unknown: set[str] = field(default_factory=set)  # a fate for an id not (or no longer) on rollouts
    duplicate_entries: int = 0  # rollouts entries repeating an id (redeliveries / duplicate XADDs)
    steps: list[int] = field(default_factory=list)  # step_end global steps, in log order
    # (g, k) of rank 0, (g, k, rank) of another data-parallel rank -> copies, when more than one
    reemitted: dict[tuple[int, ...], int] = field(default_factory=dict)
    records: list[int] = field(default_factory=list)  # global steps with a record
    # stream -> entries XADDed that neither Redis nor the archive holds (deleted by a writer's own trim)
    destroyed: dict[str, int] = field(default_factory=dict)
    # leased ids their producer published that are neither on the log nor ended (destroyed before a read)
    destroyed_ids: set[str] = field(default_factory=set)
    # producer -> param_version -> samples it published dispatched under that version (rollouts headers)
    producer_versions: dict[str, Counter[int]] = field(default_factory=dict)

    @property
    def records_consecutive(self) -> bool:
        """records are 1..M once each, optionally preceded by record 0 (validation before training)."""
        steps = self.records[1:] if self.records[:1] == [0] else self.records
        return steps == list(range(1, len(steps) + 1))

    @property
    def steps_consecutive(self) -> bool:
        """step_end events are exactly 1..N once each (N = the last step)."""
        return self.steps == list(range(1, len(self.steps) + 1))

    def problems(self) -> list[str]:
        """Human-readable violations (empty when the run is clean)."""
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} published samples lost: {sorted(self.lost)[:5]}")
        if self.destroyed_ids:
            out.append(
                f"{len(self.destroyed_ids)} published samples are not on the log (destroyed before the "
                f"trainer read them): {sorted(self.destroyed_ids)[:5]}"
            )
        for stream, n in sorted(self.destroyed.items()):
            out.append(
                f"{n} entries of {stream} destroyed (XADDed, held neither by Redis nor by the archive)"
            )
        if self.duplicated:
            out.append(f"{len(self.duplicated)} samples ended more than once: {sorted(self.duplicated)[:5]}")
        if not self.steps_consecutive:
            out.append(f"step_end global steps are not 1..N once each: {self.steps}")
        if not self.records_consecutive:
            out.append(f"records are not steps [0,] 1..M: {self.records}")
        return out

    def summary(self) -> str:
        """One line of counts."""
        return (
            f"published {len(self.published)}  trained {len(self.trained)}  dropped {len(self.dropped)}  "
            f"evicted {len(self.evicted)}  "
            f"dead {len(self.dead)}  pending {len(self.pending)}  lost {len(self.lost)}  "
            f"duplicated {len(self.duplicated)}  steps {len(self.steps)}  records {len(self.records)}  "
            f"re-emitted local updates {len(self.reemitted)}"
        )


def unacked_entry_ids(r: redis.Redis, stream: str) -> set[str]:
    """Entries of a rollouts stream its trainer group has not acked: its pending list plus those never
    delivered."""
    rc: Any = r
    if not rc.exists(stream):
        return set()
    groups = {text(g["name"]): g for g in rc.xinfo_groups(stream)}
    if TRAINER_GROUP not in groups:
        return {i for i, _ in iter_stream(r, stream)}
    last = parse_id(groups[TRAINER_GROUP]["last-delivered-id"])
    pending: set[str] = set()
    start = "-"
    while True:
        rows = rc.xpending_range(stream, TRAINER_GROUP, start, "+", PAGE)
        pending |= {text(p["message_id"]) for p in rows}
        if len(rows) < PAGE:
            break
        start = "(" + text(rows[-1]["message_id"])
    undelivered = {i for i, _ in iter_stream(r, stream, f"({last[0]}-{last[1]}")}
    return pending | undelivered


def entries_added(r: redis.Redis, stream: str) -> int | None:
    """How many entries were ever XADDed to `stream` (XINFO STREAM `entries-added`: no trim lowers it);
    None when the stream does not exist in Redis."""
    rc: Any = r
    try:
        info = rc.xinfo_stream(stream)
    except redis.ResponseError:
        return None
    return int(info["entries-added"])


def destroyed_entries(r: redis.Redis, streams: list[str], held: dict[str, int]) -> dict[str, int]:
    """stream -> entries XADDed beyond those the log holds (`held`: distinct ids in archive and Redis)."""
    out = {}
    for stream in streams:
        added = entries_added(r, stream)
        if added is not None and added > held.get(stream, 0):
            out[stream] = added - held.get(stream, 0)
    return out


def audit_run(r: redis.Redis, keys: Keys) -> AuditReport:
    """Read every producer's rollouts and stats, fates, dead, the trainer group's pending lists, metrics and
    records; classify."""
    rep = AuditReport()
    producers = run_producers(r, keys)
    rollouts = keys.rollouts_streams(producers)
    held = Counter[str]()  # entries each stream holds (Redis + archive), against what was ever added
    entry_sample = _read_rollouts(r, rollouts, rep, held)
    ends = _read_ends(r, keys, set(rollouts), rep, held, entry_sample)
    rep.duplicated = {sid for sid, n in ends.items() if n > 1}
    rep.unknown = set(ends) - rep.published
    open_ids = {
        entry_sample[(stream, i)]
        for stream in rollouts
        for i in unacked_entry_ids(r, stream)
        if (stream, i) in entry_sample
    }
    for sid in rep.published - set(ends):
        (rep.pending if sid in open_ids else rep.lost).add(sid)
    rep.destroyed_ids = published_ids(r, keys) - rep.published - set(ends)
    _read_trainer_events(r, keys, rep, held)
    rep.records = [parse_id(i)[0] for i, _ in iter_stream(r, keys.records)]
    held[keys.records] = len(rep.records)
    for stream in (*keys.stats_streams(producers), keys.dead_aggregator):
        held[stream] = sum(1 for _ in iter_stream(r, stream))
    checked = [
        *rollouts,
        keys.fates,
        keys.dead,
        keys.dead_aggregator,
        keys.metrics,
        keys.records,
        *keys.stats_streams(producers),
    ]
    rep.destroyed = destroyed_entries(r, checked, dict(held))
    return rep


def published_ids(r: redis.Redis, keys: Keys) -> set[str]:
    """Every sample id a producer has published as it says (its published count), within its lease."""
    out: set[str] = set()
    for producer, leased in leases(r, keys).items():
        n = min(leased, published_count(r, keys, producer))
        out.update(leased_sample_id(producer, seq) for seq in range(n))
    return out


def _read_rollouts(
    r: redis.Redis, streams: list[str], rep: AuditReport, held: Counter[str]
) -> dict[tuple[str, str], str]:
    """Fill the published sample ids, duplicate entries and versions per producer from every rollouts
    stream; returns (stream, entry id) -> sample id."""
    entry_sample: dict[tuple[str, str], str] = {}
    per_id = Counter[str]()
    for stream in streams:
        for entry_id, f in iter_stream(r, stream):
            held[stream] += 1
            sid = text(f.get(b"sample_id", b"entry:" + entry_id.encode()))
            entry_sample[(stream, entry_id)] = sid
            per_id[sid] += 1
            if per_id[sid] == 1 and (version := f.get(b"param_version", b"")).isdigit():
                rep.producer_versions.setdefault(text(f.get(b"producer", b"?")), Counter())[int(version)] += 1
    rep.published = set(per_id)
    rep.duplicate_entries = sum(n - 1 for n in per_id.values())
    return entry_sample


def _read_ends(
    r: redis.Redis,
    keys: Keys,
    rollouts: set[str],
    rep: AuditReport,
    held: Counter[str],
    entry_sample: dict[tuple[str, str], str],
) -> Counter[str]:
    """Fill the fates (trained, skipped, dropped, evicted) and the dead-lettered rollouts; returns how many
    ends each sample id has."""
    ends = Counter[str]()
    for _, f in iter_stream(r, keys.fates):
        held[keys.fates] += 1
        fate = decode_fate(f)
        sid = fate.sample_id
        if fate.fate == EVICTED:
            rep.evicted[sid] = fate.reason
        else:
            {TRAINED: rep.trained, SKIPPED: rep.skipped}.get(fate.fate, rep.dropped).add(sid)
        ends[sid] += 1
    dead_sources: set[tuple[str, str]] = set()
    for _, f in iter_stream(r, keys.dead):
        held[keys.dead] += 1
        try:
            ev = decode(f)
        except DecodeError:
            continue
        if not isinstance(ev, DeadLetter) or ev.source not in rollouts:
            continue
        if (ev.source, ev.source_id) in dead_sources:
            continue
        dead_sources.add((ev.source, ev.source_id))
        sid = entry_sample.get((ev.source, ev.source_id)) or text(
            ev.fields.get("sample_id", f"entry:{ev.source_id}".encode())
        )
        rep.dead.add(sid)
        ends[sid] += 1
    return ends


def _read_trainer_events(r: redis.Redis, keys: Keys, rep: AuditReport, held: Counter[str]) -> None:
    """Fill the completed steps and the local updates emitted more than once, from `metrics`."""
    updates = Counter[tuple[int, ...]]()
    for _, f in iter_stream(r, keys.metrics):
        held[keys.metrics] += 1
        try:
            ev = decode(f)
        except DecodeError:
            continue
        if isinstance(ev, StepMetrics) and ev.type == "step_end":
            rep.steps.append(ev.global_step)
        elif isinstance(ev, StepMetrics):
            key = (
                (ev.global_step, ev.local_step) if ev.rank == 0 else (ev.global_step, ev.local_step, ev.rank)
            )
            updates[key] += 1
    rep.reemitted = {gk: n for gk, n in sorted(updates.items()) if n > 1}


def _versions(counts: Counter[int]) -> str:
    """`0-7` (or `3`) for the versions a producer's samples were dispatched under."""
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low}-{high}"


def _reasons(evicted: dict[str, str]) -> str:
    """` (filter_groups 3)`: evictions per reason, or '' when none."""
    counts = Counter(evicted.values())
    return " (" + ", ".join(f"{why or '?'} {n}" for why, n in sorted(counts.items())) + ")" if counts else ""


def format_report(rep: AuditReport) -> str:
    """The audit as a few lines for an operator (what `rollstream audit` prints)."""
    once = rep.duplicated
    out = [
        f"published {len(rep.published)} samples ({rep.duplicate_entries} repeated entries)",
        f"trained once {len(rep.trained - once)}  dropped once {len(rep.dropped - once)}  "
        f"evicted once {len(set(rep.evicted) - once)}{_reasons(rep.evicted)}  "
        + (f"skipped once {len(rep.skipped - once)}  " if rep.skipped else "")
        + f"dead-lettered once {len(rep.dead - once)}  still pending {len(rep.pending)}",
        f"ended more than once {len(once)}  missing (acked, no fate) {len(rep.lost)}"
        + (f"  fates of ids no longer on rollouts {len(rep.unknown)}" if rep.unknown else ""),
        f"global steps ended {len(rep.steps)}  records {len(rep.records)}  "
        f"re-emitted local updates {len(rep.reemitted)}",
    ]
    producers = [
        f"{name} {sum(c.values())} samples, versions {_versions(c)}"
        for name, c in sorted(rep.producer_versions.items())
    ]
    out.append("producers: " + ("; ".join(producers) or "-"))
    problems = rep.problems()
    out.append("problems: none" if not problems else "problems:")
    out += [f"  {p}" for p in problems]
    return "\n".join(out)
