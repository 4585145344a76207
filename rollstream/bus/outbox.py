"""The aggregator's outboxes (issue 41, item 5): it appends, the trainer moves into the derived streams.

An ACL cannot refuse XADD's MAXLEN/MINID, so a user that may XADD to `records` may also empty it. The
aggregator's user therefore may not XADD to `records` nor to `dead:aggregator`: it RPUSHes each record and
each dead letter or note to a list (`outbox:records`, `outbox:dead:aggregator`), and RPUSH, its only right
there, appends and cannot remove anything (no LTRIM, LPOP, DEL). The trainer (rank 0, in its Leaser
thread, and once more before it exits) moves them: LRANGE a batch, then one MULTI that XADDs each to its
stream and LTRIMs the batch off the list. Only the trainer removes from an outbox and RPUSH only appends, so
the batch it read is still the head of the list when the MULTI runs: a crash before EXEC moves nothing, one
after moves all of it, and nothing is moved twice.

What the trainer writes is checked first (the aggregator's items are input, like a producer's): a record
must decode as a SyncStepRecord and is written with id `<global_step>-1` for a step the trainer has begun
(`training_step`); a record Redis refuses as a duplicate is one a re-fold wrote again (kept as it was,
a warning if it differs), one refused because a later step is already in `records` becomes a note; an
item that does not unpack, or a record that does not decode or names a step ahead of the trainer, becomes a
note on `dead:aggregator` (source `aggregator`) with the reason. Dead letters and notes are copied as they
are (the reader of `dead:aggregator` parses nothing in them as trusted).

Without ACLs (tests, `run.acl` off, a shared Redis) the aggregator may write the streams itself:
`OutboxDrain` there runs in the aggregator after each commit, so `records` never lags; under its ACL user
its first MULTI is refused (NOPERM) and it leaves the moving to the trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import redis

from rollstream.keys import AGGREGATOR_NOTE_SOURCE, COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD, Keys
from schemas import DecodeError, SyncStepRecord, dead_letter_of, decode, encode

log = logging.getLogger(__name__)

#: Largest outbox item the trainer moves (a dead letter's copy is at most 1 MiB; a record is kilobytes).
OUTBOX_ITEM_MAX_BYTES = 4 << 20
#: Items moved per MULTI.
DRAIN_BATCH = 256
#: Redis' reply when an explicit id is not above the stream's last one.
DUPLICATE_ID_ERROR = "equal or smaller than the target stream top item"


def record_id(global_step: int) -> str:
    """The explicit records-stream id of a global step."""
    return f"{global_step}-1"


def pack_item(fields: Mapping[str, Any]) -> bytes:
    """One outbox item: an entry's fields (str names, bytes or str values) as a msgpack list of pairs."""
    return msgpack.packb([[k, v] for k, v in fields.items()], use_bin_type=True)  # type: ignore[no-any-return]


def unpack_item(raw: bytes) -> dict[str, bytes] | None:
    """An item's fields, or None when it is not a bounded msgpack list of [str, bytes|str] pairs."""
    if len(raw) > OUTBOX_ITEM_MAX_BYTES:
        return None
    try:
        pairs = msgpack.unpackb(raw, raw=False)  # (bounded: the length is checked above)
    except Exception:  # noqa: BLE001 - any malformed item is reported, never raised
        return None
    if not isinstance(pairs, list):
        return None
    out: dict[str, bytes] = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            return None
        value = pair[1].encode() if isinstance(pair[1], str) else pair[1]
        if not isinstance(value, bytes):
            return None
        out[pair[0]] = value
    return out


def pending_records(r: redis.Redis, keys: Keys) -> list[SyncStepRecord]:
    """The records still in the outbox, not yet in `records` (an aggregator's restart counts them done)."""
    out = []
    rows: Any = r.lrange(keys.records_outbox, 0, -1)
    for raw in rows:
        fields = unpack_item(bytes(raw))
        try:
            ev = decode({k.encode(): v for k, v in fields.items()}) if fields is not None else None
        except DecodeError:
            continue
        if isinstance(ev, SyncStepRecord):
            out.append(ev)
    return out


def pending_dead(r: redis.Redis, keys: Keys) -> list[dict[bytes, bytes]]:
    """The dead letters and notes still in the outbox (fields as a stream entry has them)."""
    raw: Any = r.lrange(keys.dead_aggregator_outbox, 0, -1)
    items = (unpack_item(bytes(x)) for x in raw)
    return [{k.encode(): v for k, v in f.items()} for f in items if f is not None]


class OutboxDrain:
    """Moves both outboxes into `records` and `dead:aggregator` (module docstring); `maybe_drain` at most
    every `every_s`."""

    def __init__(self, keys: Keys, *, every_s: float = 0.2, clock: Any = None) -> None:
        """Drain `keys`' outboxes, when due every `every_s` seconds."""
        self.keys, self.every_s = keys, every_s
        self.clock = clock or time.monotonic
        self.moved = 0  # items moved by this process
        self._next = 0.0

    def maybe_drain(self, r: redis.Redis) -> int:
        """Drain when due; returns the items moved."""
        now = self.clock()
        if now < self._next:
            return 0
        self._next = now + self.every_s
        return self.drain(r)

    def drain(self, r: redis.Redis) -> int:
        """Move everything now in both outboxes; returns the items moved."""
        moved = 0
        for outbox in (self.keys.dead_aggregator_outbox, self.keys.records_outbox):
            while n := self._move_batch(r, outbox):
                moved += n
        self.moved += moved
        return moved

    def _move_batch(self, r: redis.Redis, outbox: str) -> int:
        """Move up to DRAIN_BATCH items from the head of `outbox` (under WATCH: an append meanwhile, or
        another drainer, makes EXEC fail and the batch is read again)."""
        while True:
            pipe: Any
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(outbox)
                    raw: Any = pipe.lrange(outbox, 0, DRAIN_BATCH - 1)
                    if not raw:
                        return 0
                    writes = self._writes(pipe, outbox, [bytes(x) for x in raw])
                    pipe.multi()
                    for stream, fields, entry_id, _ in writes:
                        pipe.xadd(stream, fields, id=entry_id)
                    pipe.ltrim(outbox, len(raw), -1)
                    results = pipe.execute(raise_on_error=False)
                except redis.WatchError:
                    continue
            for (_, fields, _, rec), res in zip(writes, results, strict=False):
                duplicate = isinstance(res, redis.ResponseError) and DUPLICATE_ID_ERROR in str(res)
                if duplicate and rec is not None:
                    self._refused(r, rec, fields)
                elif isinstance(res, Exception):
                    raise res
            if isinstance(results[-1], Exception):
                raise results[-1]
            return len(raw)

    def _writes(
        self, r: Any, outbox: str, raw: list[bytes]
    ) -> list[tuple[str, dict[str, bytes], str, SyncStepRecord | None]]:
        """(stream, fields, id, the record or None) to XADD for each item, checked (module docstring)."""
        records = outbox == self.keys.records_outbox
        begun = self._begun(r) if records else 0
        writes: list[tuple[str, dict[str, bytes], str, SyncStepRecord | None]] = []
        for item in raw:
            fields = unpack_item(item)
            if not fields:  # (an entry needs a field: XADD refuses none)
                writes.append(self._note("an outbox item that is not a list of field pairs", item[:4096]))
            elif not records:
                writes.append((self.keys.dead_aggregator, fields, "*", None))
            elif isinstance(rec := self._record(fields), str):
                writes.append(self._note(rec, item[:4096]))
            elif rec.global_step > begun:
                why = f"a record of step {rec.global_step}, ahead of the trainer's step {begun}"
                writes.append(self._note(why, item[:4096]))
            else:
                writes.append((self.keys.records, fields, record_id(rec.global_step), rec))
        return writes

    def _begun(self, r: redis.Redis) -> int:
        raw: Any = r.hmget(self.keys.trainer, TRAINING_STEP_FIELD, COMMITTED_STEP_FIELD)
        return max((int(v) for v in raw if v is not None and bytes(v).isdigit() and len(v) < 19), default=0)

    @staticmethod
    def _record(fields: dict[str, bytes]) -> SyncStepRecord | str:
        try:
            ev = decode({k.encode(): v for k, v in fields.items()})
        except DecodeError as e:
            return f"a record that does not decode ({str(e)[:200]})"
        return ev if isinstance(ev, SyncStepRecord) else f"not a record: a {ev.type!r} event"

    def _note(self, why: str, copy: bytes) -> tuple[str, dict[str, bytes], str, None]:
        log.error("aggregator outbox: %s -> dead:aggregator", why)
        dl = dead_letter_of(AGGREGATOR_NOTE_SOURCE, "outbox", f"refused from the aggregator's outbox: {why}",
                            {"item": copy})
        return self.keys.dead_aggregator, {k: bytes(v) for k, v in encode(dl).items()}, "*", None

    def _refused(self, r: redis.Redis, rec: SyncStepRecord, fields: dict[str, bytes]) -> None:
        """XADD refused: the record exists (a re-fold after a restart) or a later step was written first."""
        g = rec.global_step
        existing: Any = r.xrange(self.keys.records, min=record_id(g), max=record_id(g))
        if existing:
            if {bytes(k).decode(): bytes(v) for k, v in existing[0][1].items()} != fields:
                log.warning("step %d: re-folded record differs from the one written earlier (kept it)", g)
            return
        reason = f"record of step {g} not written: the records stream already holds a later step"
        log.error("%s", reason)
        dl = dead_letter_of(AGGREGATOR_NOTE_SOURCE, record_id(g), reason, fields)
        r.xadd(self.keys.dead_aggregator, encode(dl))  # type: ignore[arg-type]
