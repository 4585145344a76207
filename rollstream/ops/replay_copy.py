"""Copy one run's rollouts into a new run namespace (raw fields), so a trainer can be replayed on exactly
that data:

    rollstream replay trainer --from RUN --to NEWRUN --steps 3-6 [pipeline.yaml key=value …]
    rollstream replay trainer --from RUN --to NEWRUN [--start ID --end ID] [pipeline.yaml …]

Both read the source's whole log (its archive, then Redis). `--steps A-B` copies the entries global steps A..B
consumed (trained or dropped, read from `fates`) in the
order the trainer consumed them, keeping their entry ids when that order is also id order; the caller
copies the checkpoint of step A-1 beside it and runs the trainer with `--burst` and
`trainer.total_global_steps=B`, which then retrains steps A..B on the same samples and exits. An id
range copies every entry in it (the trainer starts from step 1).
"""

from __future__ import annotations

import redis

from rollstream.bus import iter_stream, parse_id, setup_run
from rollstream.names import REPLAY_COPY_FIELD, REPLAYED_VERSIONS_FIELD, Keys
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


def _check_destination(r: redis.Redis, src: Keys, dst: Keys) -> None:
    if src.run == dst.run:
        raise ReplayCopyError("--from and --to name the same run")
    if r.exists(dst.rollouts) and int(r.xlen(dst.rollouts)) > 0:  # type: ignore[arg-type]
        raise ReplayCopyError(f"{dst.rollouts} already has entries; pick a new run name")


def copy_rollouts(
    r: redis.Redis, src: Keys, dst: Keys, start: str = "-", end: str = "+", out: redis.Redis | None = None
) -> int:
    """Set dst up (streams and groups) and XADD every rollouts entry of src in [start, end] with its id,
    through `out` (default: r, the Redis src is read from); returns how many were copied. Refuses a dst
    whose rollouts stream already has entries."""
    out = r if out is None else out
    _check_destination(out, src, dst)
    setup_run(out, dst)
    out.hset(dst.trainer, REPLAY_COPY_FIELD, src.run)
    copied = 0
    pipe = out.pipeline(transaction=False)
    for entry_id, fields in iter_stream(r, src.rollouts, start, end, page=BATCH):
        pipe.xadd(dst.rollouts, fields, id=entry_id)
        copied += 1
        if len(pipe) >= BATCH:
            pipe.execute()
    pipe.execute()
    if copied == 0:
        raise ReplayCopyError(f"no rollouts in {src.rollouts} between {start} and {end}")
    return copied


def consumed_entry_ids(r: redis.Redis, src: Keys, first: int, last: int) -> list[str]:
    """Rollouts entry ids global steps first..last consumed, in consumption order (fates ids `<g>-<i>`)."""
    by_step: dict[int, list[str]] = {}
    for fid, fields in iter_stream(r, src.fates, f"{first}-0", f"{last}-{MAX_SEQ}"):
        by_step.setdefault(parse_id(fid)[0], []).append(decode_fate(fields).source_id)
    missing = [g for g in range(first, last + 1) if g not in by_step]
    if missing:
        raise ReplayCopyError(f"{src.fates} has no entries for steps {missing} (not committed, or trimmed)")
    return [i for g in range(first, last + 1) for i in by_step[g]]


def copy_steps(
    r: redis.Redis, src: Keys, dst: Keys, first: int, last: int, out: redis.Redis | None = None
) -> tuple[int, bool]:
    """Copy the rollouts steps first..last consumed into dst (through `out`, default r) in consumption
    order; returns (copied, ids kept). Ids are kept when consumption order is id order (the usual case),
    else new ids are made."""
    out = r if out is None else out
    ids = consumed_entry_ids(r, src, first, last)
    _check_destination(out, src, dst)
    wanted = set(ids)
    lo, hi = min(ids, key=parse_id), max(ids, key=parse_id)
    # archive + Redis
    found = {i: f for i, f in iter_stream(r, src.rollouts, lo, hi, page=BATCH) if i in wanted}
    gone = [i for i in ids if i not in found]
    if gone:
        raise ReplayCopyError(
            f"{len(gone)} consumed entries are neither in {src.rollouts} nor in its archive: {gone[:3]}"
        )
    keep_ids = all(parse_id(a) < parse_id(b) for a, b in zip(ids, ids[1:], strict=False))
    setup_run(out, dst)
    out.hset(dst.trainer, REPLAY_COPY_FIELD, src.run)
    pipe = out.pipeline(transaction=False)
    for i in ids:
        pipe.xadd(dst.rollouts, found[i], id=i if keep_ids else "*")
        if len(pipe) >= BATCH:
            pipe.execute()
    pipe.execute()
    # the copied samples were made with versions the source published up to step `last`; the replayed
    # trainer must not take them for versions from the future (it republishes them as it goes)
    out.hset(dst.trainer, REPLAYED_VERSIONS_FIELD, last)
    return len(ids), keep_ids
