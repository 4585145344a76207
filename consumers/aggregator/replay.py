"""Rebuild a run's records from its metrics log: XRANGE in order, through the same Fold, into a new run.

`rollstream replay records --from RUN --to NEWRUN [--redis-url URL]` calls `main`. The result equals the
live records field for field (records take the step_end's created_at). Entries that do not decode are
skipped, as the live reader dead-letters them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from consumers.aggregator.fold import Completed, Fold
from consumers.aggregator.worker import record_id
from rollstream.bus import connect, read_password
from rollstream.names import Keys
from rollstream.worker import REDIS_URL_ENV
from schemas import DecodeError, decode, encode

log = logging.getLogger(__name__)

READ_CHUNK = 512  # metrics entries per XRANGE
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def fold_log(r: redis.Redis, keys: Keys, total_gpus: int = 1) -> Iterator[Completed]:
    """Every record the metrics log of `keys` folds into, in completion order."""
    rc: Any = r
    fold = Fold(total_gpus)
    cursor = "-"
    while True:
        entries = rc.xrange(keys.metrics, min=cursor, max="+", count=READ_CHUNK)
        for raw_id, fields in entries:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
            cursor = "(" + entry_id
            try:
                event = decode(fields)
            except DecodeError as e:
                log.warning("metrics entry %s skipped: %s", entry_id, e)
                continue
            yield from fold.feed(entry_id, event)
        if len(entries) < READ_CHUNK:
            break
    for g, missing in fold.pending().items():
        log.warning("step %d left out: %s", g, missing)


def replay_records(r: redis.Redis, src_keys: Keys, dst_keys: Keys, total_gpus: int = 1) -> int:
    """Fold src's metrics log into dst's records stream (which must be empty); returns records written."""
    rc: Any = r
    if rc.exists(dst_keys.records) and rc.xlen(dst_keys.records) > 0:
        raise ValueError(f"{dst_keys.records} already holds records; replay into a new run name")
    written = 0
    pipe = rc.pipeline(transaction=False)
    for c in fold_log(r, src_keys, total_gpus):
        pipe.xadd(dst_keys.records, encode(c.record), id=record_id(c.record.global_step))
        written += 1
        if len(pipe) >= 256:
            pipe.execute()
    pipe.execute()
    return written


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollstream replay records`."""
    p = argparse.ArgumentParser(prog="rollstream replay records", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src", required=True, help="run name whose metrics log is replayed")
    p.add_argument("--to", dest="dst", required=True, help="new run name that receives the records")
    p.add_argument("--redis-url", default=None, help=f"Redis URL (default ${REDIS_URL_ENV} or {DEFAULT_REDIS_URL})")
    p.add_argument("--total-gpus", type=int, default=1, help="GPUs behind perf/throughput (as the live run)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Replay records; prints how many were written. Exit 2 when the destination already has records."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # a pass-through may keep "--"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    url = args.redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
    r = connect(url, password=read_password())
    try:
        n = replay_records(r, Keys(args.src), Keys(args.dst), total_gpus=args.total_gpus)
    except ValueError as e:
        print(f"rollstream replay: {e}", file=sys.stderr)
        return 2
    print(f"replayed {n} records from run {args.src!r} into {Keys(args.dst).records}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
