"""Audit a run from its log: did every published sample end exactly once, and are the steps consecutive?

Every sample_id on the rollouts streams (one `rollouts:<p>` per producer, as setup_run recorded them in the
`producers` set) must end exactly once as trained, dropped-as-stale or evicted (an entry in `fates`) or
dead-lettered (an entry on `dead` whose source is that rollouts stream); the only other legitimate state is
still unacked in the trainer group of its stream (pending, or not yet delivered). A redelivered or duplicate
XADD of an id that already ended is acked without a second fate, so ids, not entries, are what is counted.
A dead letter that refuses a copy (schemas.REFUSED_COPY_REASONS: outside the lease, lease expired, already
ended by a dead letter) ends its id only when nothing else does: an id dead-lettered and then re-published
and refused ended once, and so did one published outside the lease and later trained inside it; both are
notes (`refused`), never "ended more than once".
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
the entries the log holds means that many entries were destroyed (`destroyed`, a problem); an entry the
flood fence dropped (rollstream/pacing/fence.py: its copy on `dead`, reason `fenced: …`) is held there.
Which samples they were is known too: a producer's prompts are numbered (sample id `<producer>-<seq>`,
rollstream/pacing/) and its published count moves with each publish, so every id below both its count and
its lease (which only the trainer writes) must be on the log; one that is neither there nor ended is
`destroyed_ids`.

Reads the whole log through `iter_stream`: what retention moved to the run's archive, then what Redis
holds, each entry once; an archive that cannot be read here stops the audit (ArchiveError), never a
silent gap.
`rollstream audit` prints `format_report` and exits 1 when `problems()` is not empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from rollstream.bus.ids import count_or_none, parse_id, shown, text
from rollstream.bus.publish import run_producers
from rollstream.bus.streams import iter_stream
from rollstream.keys import Keys
from rollstream.ops.log_cut import Cut, read_cut
from rollstream.pacing.budget import leased_sample_id
from rollstream.pacing.fence import FENCE_DROPPED
from schemas import EVICTED, SKIPPED, TRAINED, DeadLetter, DecodeError, StepMetrics, decode, decode_fate
from schemas.events import refused_copy

T = TypeVar("T")


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
    # producer -> entries it published under another producer's sample id (dead-lettered; counted as its own)
    misnamed: dict[str, int] = field(default_factory=dict)
    # what a producer wrote to its own keys that is not a canonical value (ignored), one line each
    bad_inputs: list[str] = field(default_factory=list)
    # refusal (schemas.REFUSED_COPY_REASONS) -> copies refused of ids that ended otherwise (not an end)
    refused: Counter[str] = field(default_factory=Counter)

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

    def notes(self) -> list[str]:
        """What a producer did that the run handled (dead-lettered, or ignored), naming that producer: not a
        problem of the log, but the operator should know."""
        out = [
            f"{name} published {n} entries under another producer's sample ids (dead-lettered)"
            for name, n in sorted(self.misnamed.items())
        ]
        out += [
            f"{n} re-published copies refused ({why}) of sample ids that ended once otherwise"
            for why, n in sorted(self.refused.items())
        ]
        return out + [f"ignored producer input: {line}" for line in self.bad_inputs]

    def summary(self) -> str:
        """One line of counts."""
        return (
            f"published {len(self.published)}  trained {len(self.trained)}  dropped {len(self.dropped)}  "
            f"evicted {len(self.evicted)}  "
            f"dead {len(self.dead)}  pending {len(self.pending)}  lost {len(self.lost)}  "
            f"duplicated {len(self.duplicated)}  steps {len(self.steps)}  records {len(self.records)}  "
            f"re-emitted local updates {len(self.reemitted)}"
        )


def audit_run(r: redis.Redis, keys: Keys) -> AuditReport:
    """Classify the log as of one consistent cut: first (one MULTI) each stream's entries-added and last id,
    the trainer group's state, the leases and published counts (`read_cut`); then fates and dead letters;
    then the streams, each entry judged only if it existed at the cut. So what arrives while the audit reads
    (a live run) is neither missing nor destroyed."""
    rep = AuditReport()
    producers = run_producers(r, keys)
    rollouts = keys.rollouts_streams(producers)
    checked = [
        *rollouts,
        keys.fates,
        keys.dead,
        keys.dead_aggregator,
        keys.metrics,
        keys.records,
        *keys.stats_streams(producers),
    ]
    cut = read_cut(r, keys, producers, checked)
    rep.bad_inputs = list(cut.bad_inputs)
    held = Counter[str]()  # entries each stream held at the cut (Redis + archive), against entries-added
    ends, letters, dropped = _read_ends(r, keys, set(rollouts), rep, held, cut)
    entry_sample, later = _read_rollouts(r, keys, rollouts, producers, rep, held, cut)
    _count_dead(rep, ends, letters, entry_sample, keys, producers)
    rep.duplicated = {sid for sid, n in ends.items() if n > 1}
    rep.unknown = set(ends) - rep.published - later
    open_ids = {sid for (stream, i), sid in entry_sample.items() if cut.unacked(stream, i)}
    for sid in rep.published - set(ends):
        (rep.pending if sid in open_ids else rep.lost).add(sid)
    rep.destroyed_ids = published_ids(cut) - rep.published - set(ends)
    _read_trainer_events(r, keys, rep, held, cut)
    rep.records = []
    for i, _ in iter_stream(r, keys.records):
        if cut.within(keys.records, i):
            rep.records.append(parse_id(i)[0])
    held[keys.records] = len(rep.records)
    for stream in (*keys.stats_streams(producers), keys.dead_aggregator):
        held[stream] = sum(1 for i, _ in iter_stream(r, stream) if cut.within(stream, i))
    held.update(dropped)  # dropped by the fence: their copies are on `dead`
    rep.destroyed = {s: n - held[s] for s, n in cut.added.items() if n > held[s]}
    return rep


def published_ids(cut: Cut) -> set[str]:
    """Every sample id a producer had published at the cut as it says (its published count), within its
    lease (which only the trainer writes)."""
    out: set[str] = set()
    for producer, leased in cut.leases.items():
        n = min(leased, cut.published.get(producer, 0))
        out.update(leased_sample_id(producer, seq) for seq in range(n))
    return out


def audit_key(sid: str, stream_producer: str, entry_id: str, producers: list[str]) -> str:
    """The id the audit counts an entry of `stream_producer`'s rollouts under: its sample_id, unless that
    names another of the run's producers (an impersonation, dead-lettered by the trainer): then the entry
    itself, under the producer that wrote it, so another producer's sample is never blamed."""
    if not stream_producer or sid.startswith(f"{stream_producer}-"):
        return sid
    if any(sid.startswith(f"{p}-") for p in producers if p != stream_producer):
        return f"{stream_producer} entry {entry_id} (sample_id {shown(sid)})"
    return sid


def _read_rollouts(
    r: redis.Redis, keys: Keys, streams: list[str], producers: list[str], rep: AuditReport,
    held: Counter[str], cut: Cut,
) -> tuple[dict[tuple[str, str], str], set[str]]:
    """Fill the published sample ids (as of the cut), duplicate entries, entries in another producer's name
    and versions per producer from every rollouts stream; returns ((stream, entry id) -> audit id, the
    audit ids of entries added after the cut)."""
    entry_sample: dict[tuple[str, str], str] = {}
    later: set[str] = set()
    per_id = Counter[str]()
    for stream in streams:
        owner = keys.stream_producer(stream)
        for entry_id, f in iter_stream(r, stream):
            claimed = text(f.get(b"sample_id", b"entry:" + entry_id.encode()))
            sid = audit_key(claimed, owner, entry_id, producers)
            if not cut.within(stream, entry_id):
                later.add(sid)
                continue
            held[stream] += 1
            entry_sample[(stream, entry_id)] = sid
            per_id[sid] += 1
            if sid.startswith(f"{owner} entry "):
                rep.misnamed[owner] = rep.misnamed.get(owner, 0) + 1
            # a header is the producer's input: the version is counted only when it is a canonical count
            if per_id[sid] == 1 and (version := count_or_none(f.get(b"param_version"))) is not None:
                name = owner or text(f.get(b"producer", b"?"))
                rep.producer_versions.setdefault(name, Counter())[version] += 1
    rep.published = set(per_id)
    rep.duplicate_entries = sum(n - 1 for n in per_id.values())
    return entry_sample, later


def _read_ends(
    r: redis.Redis, keys: Keys, rollouts: set[str], rep: AuditReport, held: Counter[str], cut: Cut
) -> tuple[Counter[str], list[DeadLetter], Counter[str]]:
    """Fill the fates (trained, skipped, dropped, evicted); returns how many fates each sample id has, the
    dead-lettered rollouts (counted once the rollouts are read: `_count_dead`) and, per stream, the entries
    of the cut the flood fence dropped (their copies on `dead`)."""
    ends = Counter[str]()
    for fate in _decoded(r, keys.fates, decode_fate, held, cut):
        sid = fate.sample_id
        if fate.fate == EVICTED:
            rep.evicted[sid] = fate.reason
        else:
            {TRAINED: rep.trained, SKIPPED: rep.skipped}.get(fate.fate, rep.dropped).add(sid)
        ends[sid] += 1
    letters, dropped = [], set()
    for ev in _decoded(r, keys.dead, decode, held, cut):
        if not isinstance(ev, DeadLetter):
            continue
        if ev.reason.startswith(f"{FENCE_DROPPED}:") and cut.within(ev.source, ev.source_id):
            dropped.add((ev.source, ev.source_id))
        if ev.source in rollouts:
            letters.append(ev)
    return ends, letters, Counter(source for source, _ in dropped)


def _decoded(
    r: redis.Redis, stream: str, decoder: Callable[[Any], T], held: Counter[str], cut: Cut
) -> Iterator[T]:
    """The entries of `stream` decoded by `decoder`, in log order, counting in `held` those within the
    audit's cut; an entry that does not decode is skipped (the trainer dead-lettered it)."""
    for entry_id, fields in iter_stream(r, stream):
        held[stream] += cut.within(stream, entry_id)
        try:
            yield decoder(fields)
        except DecodeError:
            continue


def _count_dead(
    rep: AuditReport, ends: Counter[str], letters: list[DeadLetter], entry_sample: dict[tuple[str, str], str],
    keys: Keys, producers: list[str],
) -> None:
    """Each dead-lettered rollouts entry ends its sample once (a letter repeated for one entry counts once),
    under the audit id of the entry (`audit_key`), or of its dead copy's sample_id when the entry is gone. A
    refused copy (`refused_copy`) ends its id only when no fate and no other dead letter does; else it is
    counted in `refused` by its reason."""
    seen: set[tuple[str, str]] = set()
    refusals: dict[str, str] = {}  # audit id -> the first refusal of it
    extra = Counter[str]()  # refusal -> copies beyond the first of one id
    for ev in letters:
        if (ev.source, ev.source_id) in seen:
            continue
        seen.add((ev.source, ev.source_id))
        sid = entry_sample.get((ev.source, ev.source_id)) or audit_key(
            text(ev.fields.get("sample_id", f"entry:{ev.source_id}".encode())),
            keys.stream_producer(ev.source), ev.source_id, producers,
        )
        if (why := refused_copy(ev.reason)) is not None:
            if sid in refusals:
                extra[why] += 1
            else:
                refusals[sid] = why
            continue
        rep.dead.add(sid)
        ends[sid] += 1
    for sid, why in refusals.items():
        if ends[sid]:
            rep.refused[why] += 1
        else:  # its one end
            rep.dead.add(sid)
            ends[sid] += 1
    rep.refused.update(extra)


def _read_trainer_events(r: redis.Redis, keys: Keys, rep: AuditReport, held: Counter[str], cut: Cut) -> None:
    """Fill the completed steps and the local updates emitted more than once, from `metrics` (as of the
    cut)."""
    updates = Counter[tuple[int, ...]]()
    for entry_id, f in iter_stream(r, keys.metrics):
        if not cut.within(keys.metrics, entry_id):
            break  # in id order: the rest came after the cut
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
    out += [f"note: {line}" for line in rep.notes()]
    problems = rep.problems()
    out.append("problems: none" if not problems else "problems:")
    out += [f"  {p}" for p in problems]
    return "\n".join(out)
