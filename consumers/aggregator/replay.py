"""Rebuild a run's records from its log: `metrics` and every producer's `stats:<p>` merged in id order,
through the same Fold, into a new run.

`rollstream replay records --from RUN --to NEWRUN [CONFIG] [OVERRIDES…]` runs this module's `main` (`python -m
consumers.aggregator.replay`, so the runtime imports no worker). The result equals the
live records field for field (records take the step_end's created_at). Entries the live aggregator
dead-lettered (listed on `dead` with their stream as source) are skipped, as are entries that do not
decode or are of the wrong kind for their stream, so replay folds exactly what the live fold placed. A
record Redis refuses (its step is not above the last one written) is logged and skipped, never fatal.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import redis

from consumers.aggregator.fold import Completed, Fold, id_key, stats_ref
from consumers.aggregator.worker import TRAINER_EVENTS
from rollstream.bus import ArchiveError, iter_stream, run_producers
from rollstream.bus.outbox import pending_dead, record_id
from rollstream.cli.exits import run_command
from rollstream.cli.targets import log_target
from rollstream.keys import Keys
from rollstream.ops.log_server import replay_destination
from rollstream.topology.cluster import require_one_slot
from schemas import DeadLetter, DecodeError, ProducerStats, decode, encode

log = logging.getLogger(__name__)


def dead_lettered(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> set[tuple[str, str]]:
    """(source stream, entry id) of every entry the live workers dead-lettered from metrics or a producer's
    stats."""
    sources = {keys.metrics, *keys.stats_streams(producers)}
    out = set()
    for fields in chain(  # (dead: older runs; the outbox: what the trainer had not moved yet)
        (f for _, f in iter_stream(r, keys.dead_aggregator)), pending_dead(r, keys),
        (f for _, f in iter_stream(r, keys.dead)),
    ):
        try:
            ev = decode(fields)
        except DecodeError:
            continue
        if isinstance(ev, DeadLetter) and ev.source in sources:
            out.add((ev.source, ev.source_id))
    return out


def _merged(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> Iterator[tuple[str, str, Any]]:
    """(stream, id, fields) of metrics and the producers' stats entries merged in id order (stats first on a
    tie)."""
    streams = [*keys.stats_streams(producers), keys.metrics]
    its = {stream: iter_stream(r, stream) for stream in streams}
    heads = {stream: head for stream, it in its.items() if (head := next(it, None)) is not None}
    while heads:
        stream = min(heads, key=lambda s: id_key(heads[s][0]))  # dicts keep order: stats wins a tie
        entry_id, fields = heads.pop(stream)
        yield stream, entry_id, fields
        if (head := next(its[stream], None)) is not None:
            heads[stream] = head


def fold_log(r: redis.Redis, keys: Keys, total_gpus: int = 1) -> Iterator[Completed]:
    """Every record the log of `keys` folds into, in completion order."""
    fold = Fold(total_gpus)
    producers = run_producers(r, keys)
    skip = dead_lettered(r, keys, producers)
    for stream, entry_id, fields in _merged(r, keys, producers):
        if (stream, entry_id) in skip:
            continue
        try:
            event = decode(fields)
        except DecodeError as e:
            log.warning("%s entry %s skipped: %s", stream, entry_id, e)
            continue
        if stream != keys.metrics:
            producer = keys.stream_producer(stream)
            if isinstance(event, ProducerStats) and event.producer == producer:
                yield from fold.feed(stats_ref(producer, entry_id), event)
        elif isinstance(event, TRAINER_EVENTS):
            yield from fold.feed(entry_id, event)
    for g, missing in fold.pending().items():
        log.warning("step %d left out: %s", g, missing)


def replay_records(
    r: redis.Redis, src_keys: Keys, dst_keys: Keys, total_gpus: int = 1, out: redis.Redis | None = None
) -> int:
    """Fold src's metrics and stats log into dst's records stream (which must be empty), written through
    `out` (default: r, the Redis src is read from); returns records written."""
    rc: Any = r if out is None else out
    if rc.exists(dst_keys.records) and rc.xlen(dst_keys.records) > 0:
        raise ValueError(f"{dst_keys.records} already holds records; replay into a new run name")
    written = 0
    pipe = rc.pipeline(transaction=False)

    def flush() -> int:
        ok = 0
        for res in pipe.execute(raise_on_error=False):
            if isinstance(res, redis.ResponseError):
                log.error("record not written: %s", res)  # e.g. a step not above the last one written
            elif isinstance(res, Exception):
                raise res
            else:
                ok += 1
        return ok

    for c in fold_log(r, src_keys, total_gpus):
        pipe.xadd(dst_keys.records, encode(c.record), id=record_id(c.record.global_step))
        if len(pipe) >= 256:
            written += flush()
    return written + flush()


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollstream replay records` (the CLI runs this module with them)."""
    p = argparse.ArgumentParser(prog="rollstream replay records", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src", required=True, help="run name whose metrics log is replayed")
    p.add_argument("--to", dest="dst", required=True, help="new run name that receives the records")
    p.add_argument("config", nargs="?", help="path to pipeline.yaml (default ./pipeline.yaml when present)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. run.name=demo")
    p.add_argument("--run-dir", help="a run dir made by `rollstream run` (uses its pipeline.resolved.yaml)")
    p.add_argument("--redis-url", default=None, help="Redis URL (the override run.redis_url=URL)")
    p.add_argument("--total-gpus", type=int, default=None,
                   help="GPUs behind perf/throughput (default aggregator.total_gpus, as the live run)")
    return p


def _replay(args: argparse.Namespace) -> int:
    """Replay the records a parsed command line asks for into the run's Redis (a stopped run: served
    read-only, the copy into the new run's own embedded Redis); exit 2 on a refused replay."""
    if args.redis_url:
        args.overrides = [*args.overrides, f"run.redis_url={args.redis_url}"]
    t = log_target(args)
    out = args.stack.enter_context(replay_destination(t, args.dst))
    total_gpus = t.cfg.aggregator.total_gpus if args.total_gpus is None else args.total_gpus
    try:
        require_one_slot(t.redis_url, [args.src, args.dst], "rollstream replay records")
        n = replay_records(t.connect(), Keys(args.src), Keys(args.dst), total_gpus=total_gpus, out=out)
    except (ValueError, ArchiveError) as e:
        print(f"rollstream replay records: {e}", file=sys.stderr)
        return 2
    print(f"replayed {n} records from run {args.src!r} into {Keys(args.dst).records}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`rollstream replay records`: refold a run's metrics log into a new run's records; prints how many
    were written. Exit 2 when the destination already has records or the config is invalid, 3 when Redis
    cannot be reached (as every rollstream command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_intermixed_args(argv[1:] if argv[:1] == ["--"] else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run_command(_replay, args)


if __name__ == "__main__":
    sys.exit(main())
