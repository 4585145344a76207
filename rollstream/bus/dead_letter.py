"""Dead letters: an entry no handler can use, copied with a reason to the run's `dead` stream (or, for a
reader whose user may not write it, RPUSHed to its outbox, rollstream/bus/outbox.py) and acked in one atomic
step. The copy is written only if the ack found the entry still pending, so a retry after a lost reply
writes nothing twice; a connection loss is retried. The consumer loop (rollstream/bus/reader.py) calls it for
an entry that fails to decode or was delivered too often; workers call it through their reader."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import redis

from rollstream.bus.connection import retry_on_connection
from rollstream.bus.ids import text
from rollstream.bus.outbox import pack_item
from schemas import dead_letter_of, encode

# KEYS: stream, dead stream, counter hash; ARGV: group, entry id, counter field ('' = do not count), then the
# dead copy's field names and values. Acks the entry and, only if it was still pending (a retry after a lost
# reply finds it acked), writes its dead copy and counts it: one dead copy and one count per entry.
_DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
return 1
"""


def write_dead_letter(
    r: Any,
    stream: str,
    group: str,
    entry_id: str,
    fields: Mapping[bytes, bytes],
    reason: str,
    *,
    dead_stream: str,
    dead_count: tuple[str, str] | None = None,
    counted: bool = True,
    dead_outbox: bool = False,
) -> None:
    """Copy entry `entry_id` of `stream` to `dead_stream` with `reason` and ack it for `group`, atomically:
    one script, which with `dead_count` (hash, field) and `counted` also counts it there; without
    `dead_count`, under WATCH in one
    MULTI (a reader whose user may not run scripts; with `dead_outbox` the copy is RPUSHed to that list).
    The copy is bounded: an oversize entry keeps its header, sizes and digest."""
    dl = dead_letter_of(
        stream,
        entry_id,
        reason[:1000],
        # field names are whatever the writer sent: a non-UTF-8 name must not stop dead-lettering
        {text(k, errors="backslashreplace"): bytes(v) for k, v in fields.items()},
    )
    body = encode(dl)
    key, field = dead_count if dead_count is not None and counted else (dead_stream, "")
    flat = [x for name, value in body.items() for x in (name, value)]

    def write() -> None:
        r.eval(_DEAD_LETTER, 3, stream, dead_stream, key, group, entry_id, field, *flat)

    retry_on_connection(
        write if dead_count is not None
        else partial(_dead_letter_watched, r, stream, group, body, entry_id, dead_stream, dead_outbox),
        f"dead-lettering {entry_id}",
    )


def _dead_letter_watched(
r: Any, stream: str, group: str, body: Mapping[str, Any], entry_id: str, dead_stream: str, dead_outbox: bool
) -> None:
    """The dead letter without a script (a reader whose user may not run scripts): under WATCH of the
    stream, XADD the copy (RPUSH to the outbox) and XACK in one MULTI only if the entry is still pending;
    a write to the stream in between makes EXEC fail and the check runs again."""
    while True:
        with r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(stream)
                if not pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1):
                    return  # acked already (a retry after a lost reply): nothing twice
                pipe.multi()
                if dead_outbox:
                    pipe.rpush(dead_stream, pack_item(body))
                else:
                    pipe.xadd(dead_stream, dict(body))
                pipe.xack(stream, group, entry_id)
                pipe.execute()
                return
            except redis.WatchError:
                continue
