"""Copy a range of one run's rollouts stream into a new run namespace (same entry ids, raw fields), so a
trainer can be replayed on exactly that data:

    rollstream replay trainer --from RUN --to NEWRUN [--start ID --end ID] [pipeline.yaml …]
    python -m consumers.trainer pipeline.yaml run.name=NEWRUN --burst
"""

from __future__ import annotations

from typing import Any

import redis

from rollstream.bus import setup_run
from rollstream.names import Keys

BATCH = 500


class ReplayCopyError(RuntimeError):
    """The destination is not empty, or the source has nothing in the range."""


def copy_rollouts(r: redis.Redis, src: Keys, dst: Keys, start: str = "-", end: str = "+") -> int:
    """Set dst up (streams and groups) and XADD every rollouts entry of src in [start, end] with its id;
    returns how many were copied. Refuses a dst whose rollouts stream already has entries."""
    if src.run == dst.run:
        raise ReplayCopyError("--from and --to name the same run")
    if r.exists(dst.rollouts) and int(r.xlen(dst.rollouts)) > 0:
        raise ReplayCopyError(f"{dst.rollouts} already has entries; pick a new run name")
    setup_run(r, dst)
    copied, cursor, inclusive = 0, start, True
    while True:
        lo = cursor if inclusive else f"({cursor}"
        rows: Any = r.xrange(src.rollouts, min=lo, max=end, count=BATCH)
        if not rows:
            break
        pipe = r.pipeline(transaction=False)
        for entry_id, fields in rows:
            pipe.xadd(dst.rollouts, fields, id=entry_id)
        pipe.execute()
        copied += len(rows)
        cursor, inclusive = rows[-1][0].decode(), False
    if copied == 0:
        raise ReplayCopyError(f"no rollouts in {src.rollouts} between {start} and {end}")
    return copied
