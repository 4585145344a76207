"""Copy one run's rollouts (every producer's `rollouts:<p>` stream, into the same producer's stream) into a
new run namespace (raw fields), so a trainer can be replayed on exactly that data:

    rollstream replay trainer --from RUN --to NEWRUN --steps 3-6 [pipeline.yaml key=value …]
    rollstream replay trainer --from RUN --to NEWRUN [--start ID --end ID] [pipeline.yaml …]

Both read the source's whole log (its archive, then Redis). `--steps A-B` copies the entries global steps A..B
consumed (trained or dropped, read from `fates`; a fate's producer is its sample_id's `<producer>-` prefix) in
the order the trainer consumed them, keeping each stream's entry ids when that order is also id order; the
caller copies the checkpoint of step A-1 beside it and runs the trainer with `--burst` and
`trainer.total_training_steps=B`, which then retrains steps A..B on the same samples and exits. An id range
copies every entry in it (the trainer starts from step 1).
"""

from __future__ import annotations

import redis

from rollstream.bus import group_refs, iter_stream, parse_id, run_producers, setup_run
from rollstream.bus.ids import split_sample_id
from rollstream.keys import REPLAY_COPY_FIELD, REPLAYED_VERSIONS_FIELD, Keys
from schemas import decode_fate

BATCH = 500
MAX_SEQ = 2**64 - 1


class ReplayCopyError(RuntimeError):
    """The destination is not empty, or the source has nothing (or not everything) asked for."""


def parse_steps(text: str) -> tuple[int, int]:
    """`A-B` (or `A`) -> (A, B) with 1 <= A <= B."""
    first, _, last = text.partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ReplayCopyError(f"--steps {text!r}: expected A-B, e.g. 3-6") from None
    if not 1 <= a <= b:
        raise ReplayCopyError(f"--steps {text!r}: need 1 <= A <= B")
    return a, b


def _check_destination(r: redis.Redis, dst: Keys, src: Keys, producers: list[str]) -> None:
    if src.run == dst.run:
        raise ReplayCopyError("--from and --to name the same run")
    for stream in dst.rollouts_streams(producers):
        if r.exists(stream) and int(r.xlen(stream)) > 0:  # type: ignore[arg-type]
            raise ReplayCopyError(f"{stream} already has entries; pick a new run name")


def _producers(r: redis.Redis, src: Keys) -> list[str]:
    producers = run_producers(r, src)
    if not producers:
        raise ReplayCopyError(
            f"run {src.run!r} records no producers (never set up, or set up by a version with one shared "
            "rollouts stream)"
        )
    return producers


def copy_rollouts(
    r: redis.Redis, src: Keys, dst: Keys, start: str = "-", end: str = "+", out: redis.Redis | None = None
) -> int:
    """Set dst up (the source's producers, streams and groups) and XADD every entry of each producer's
    rollouts stream of src in [start, end] with its id to that producer's stream of dst, through `out`
    (default: r, the Redis src is read from); returns how many were copied. Refuses a dst whose rollouts
    streams already have entries."""
    out = r if out is None else out
    producers = _producers(r, src)
    _check_destination(out, dst, src, producers)
    setup_run(out, dst, producers)
    out.hset(dst.trainer, REPLAY_COPY_FIELD, src.run)
    copied = 0
    pipe = out.pipeline(transaction=False)
    for p in producers:
        for entry_id, fields in iter_stream(r, src.rollouts_of(p), start, end, page=BATCH):
            pipe.xadd(dst.rollouts_of(p), fields, id=entry_id)
            copied += 1
            if len(pipe) >= BATCH:
                pipe.execute()
    pipe.execute()
    if copied == 0:
        raise ReplayCopyError(f"no rollouts in the streams of {src.run!r} between {start} and {end}")
    return copied


def producer_of_sample(sample_id: str, producers: list[str]) -> str:
    """The producer a sample id names: `<producer>-<seq>` by the one canonical parser (rollstream/bus/ids.py),
    else (an older run's ids) the longest of the run's producer names it starts with followed by `-`;
    ReplayCopyError when none."""
    if (parsed := split_sample_id(sample_id)) is not None and parsed[0] in producers:
        return parsed[0]
    owners = [p for p in producers if sample_id.startswith(f"{p}-")]
    if not owners:
        raise ReplayCopyError(f"sample {sample_id!r} is of none of the run's producers {producers}")
    return max(owners, key=len)


def consumed_entry_ids(r: redis.Redis, src: Keys, first: int, last: int) -> list[tuple[str, str]]:
    """(producer, rollouts entry id) of what global steps first..last consumed, in consumption order (fates
    ids `<g>-<i>`)."""
    producers = _producers(r, src)
    by_step: dict[int, list[tuple[str, str]]] = {}
    for fid, fields in iter_stream(r, src.fates, f"{first}-0", f"{last}-{MAX_SEQ}"):
        fate = decode_fate(fields)
        ref = (producer_of_sample(fate.sample_id, producers), fate.source_id)
        by_step.setdefault(parse_id(fid)[0], []).append(ref)
    missing = [g for g in range(first, last + 1) if g not in by_step]
    if missing:
        raise ReplayCopyError(f"{src.fates} has no entries for steps {missing} (not committed, or trimmed)")
    return [i for g in range(first, last + 1) for i in by_step[g]]


def copy_steps(
    r: redis.Redis, src: Keys, dst: Keys, first: int, last: int, out: redis.Redis | None = None
) -> tuple[int, bool]:
    """Copy the rollouts steps first..last consumed into dst (through `out`, default r), each into its
    producer's stream, in consumption order; returns (copied, ids kept). Ids are kept when each stream's
    consumption order is id order (the usual case), else new ids are made."""
    out = r if out is None else out
    refs = consumed_entry_ids(r, src, first, last)
    producers = _producers(r, src)
    _check_destination(out, dst, src, producers)
    found: dict[tuple[str, str], dict[bytes, bytes]] = {}
    for p, ids in group_refs(refs).items():
        wanted = set(ids)
        lo, hi = min(ids, key=parse_id), max(ids, key=parse_id)  # archive + Redis
        found |= {(p, i): f for i, f in iter_stream(r, src.rollouts_of(p), lo, hi, page=BATCH) if i in wanted}
    gone = [ref for ref in refs if ref not in found]
    if gone:
        raise ReplayCopyError(
            f"{len(gone)} consumed entries are neither in their producer's rollouts stream nor in its "
            f"archive: {gone[:3]}"
        )
    keep_ids = all(
        all(parse_id(a) < parse_id(b) for a, b in zip(ids, ids[1:], strict=False))
        for ids in group_refs(refs).values()
    )
    setup_run(out, dst, producers)
    out.hset(dst.trainer, REPLAY_COPY_FIELD, src.run)
    pipe = out.pipeline(transaction=False)
    for p, i in refs:
        pipe.xadd(dst.rollouts_of(p), found[(p, i)], id=i if keep_ids else "*")  # type: ignore[arg-type]
        if len(pipe) >= BATCH:
            pipe.execute()
    pipe.execute()
    # the copied samples were made with versions the source published up to step `last`; the replayed
    # trainer must not take them for versions from the future (it republishes them as it goes)
    out.hset(dst.trainer, REPLAYED_VERSIONS_FIELD, last)
    return len(refs), keep_ids
