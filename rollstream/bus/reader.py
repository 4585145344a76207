# Over 400 lines on purpose: GroupReader is one state machine (poll, claim, ack, reconnect, burst).
"""THE consumer loop every worker runs: `GroupReader.batches`, one consumer of one group on one or more
streams (the trainer reads every producer's `rollouts:<p>` with one reader), with acks committed by the
caller. Each entry is known by its stream and id (`EntryRef`; `Message.ref`): ids of two streams may be equal.

Order of work in each poll: (1) our own pending entries from id 0 (at start, after a reconnect and after a
handler failure), (2) every so often entries idle longer than claim_idle_s from other consumers (XAUTOCLAIM),
(3) new entries (`>`: one XREADGROUP naming every stream, at most `count` entries in all). Each entry is
decoded; one that fails to decode, or has been delivered max_deliveries times, goes to `dead` with a reason
and is acked in the same step (rollstream/bus/dead_letter.py). Acks happen after the caller's effect, in
batches: through `ack`, or inside its own MULTI with the effect and then `forget` (the trainer acks only once
a checkpoint covers a step; the aggregator acks in the transaction that writes records). Entries held
unacked are kept fresh with XCLAIM JUSTID (which resets idle time without counting a delivery) so no one
else claims them. An entry held that a read of new entries delivers again (the group's last-delivered-id
went back: a failover to a replica that had not received the earlier read) is passed over: it is already
ours, and acked with its effect.

Burst mode (tests, replays, benchmarks): the loop ends after the poll that finds the stream drained, i.e.
a read of new entries (`>`) that returned none while not re-reading our own pending list. A connection
loss is retried inside the loop (`retry_on_connection`), after which our own pending entries are re-read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from rollstream.bus.connection import CONNECTION_ERRORS, reconnect_count, retry_on_connection
from rollstream.bus.dead_letter import write_dead_letter
from rollstream.bus.ids import text
from rollstream.bus.publish import ensure_group
from schemas import ALREADY_ENDED, DEFAULT_LIMITS, DecodeError, Event, Limits, decode

log = logging.getLogger(__name__)

#: How long a burst-mode poll waits for a late entry before the stream counts as drained.
BURST_BLOCK_MS = 50
#: The first read of each pass of the loop: XREADGROUP without BLOCK, which takes only what is there and is
#: answered at once. (A `BLOCK 1` is not that: Redis ends a timed-out block on its next event-loop tick, up
#: to 1000/hz ms later, 100 ms at the default hz 10, and an entry published meanwhile ends it instead, so the
#: "ready" read waited for producers and that wait was counted as transport.)
READY_BLOCK_MS = 0


def entry_limits(max_entry_bytes: int) -> Limits:
    """Decode limits for a run's readers: the entry, its payload and each field capped at max_entry_bytes."""
    n = max_entry_bytes
    return Limits(max_bin_len=n, max_ext_len=n, max_payload_bytes=n, max_field_bytes=n, max_entry_bytes=n)


#: An entry of one of a reader's streams: (stream key, entry id).
EntryRef = tuple[str, str]


@dataclass
class Message:
    """One decoded stream entry handed to a handler, with the stream it was read from."""

    id: str
    fields: Mapping[bytes, bytes]
    event: Event
    deliveries: int = 1
    stream: str = ""

    @property
    def ref(self) -> EntryRef:
        """(stream, id): what ack, forget, release and dead_letter take."""
        return (self.stream, self.id)


@dataclass
class ReaderStats:
    """Counters a worker can log or publish."""

    delivered: int = 0
    acked: int = 0
    dead: int = 0
    claimed: int = 0
    reconnects: int = 0
    decode_s: float = 0.0
    transport_s: float = 0.0  # moving entries out of Redis and decoding them, not waiting for writers


class GroupReader:
    """Reads one or more streams as one consumer of one group, with claim, dead-letter, batched acks and
    reconnect."""

    def __init__(
        self,
        r: redis.Redis,
        stream: str | Sequence[str],
        group: str,
        consumer: str,
        *,
        dead_stream: str,
        block_ms: int = 1000,
        count: int = 64,
        claim_idle_s: float = 60.0,
        max_deliveries: int = 5,
        limits: Limits | None = None,
        stop: threading.Event | None = None,
        dead_count: tuple[str, str] | None = None,
        dead_outbox: bool = False,
    ) -> None:
        """Read `stream`(s) as `consumer` of `group`; dead letters go to `dead_stream` (with `dead_outbox`,
        a list they are RPUSHed to, rollstream/bus/outbox.py: the aggregator's)."""
        self.r: Any = r  # redis-py's stubs type stream replies loosely; we parse them here
        self.dead_outbox = dead_outbox
        self.dead_count = dead_count
        self.streams = [stream] if isinstance(stream, str) else list(stream)
        if not self.streams:
            raise ValueError("a GroupReader needs at least one stream")
        self.group = group
        self.consumer = consumer
        self.dead_stream = dead_stream
        self.block_ms = block_ms
        self.count = count
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.max_deliveries = max_deliveries
        self.limits = limits
        self.stop = stop or threading.Event()
        self.stats = ReaderStats()
        # header sample id -> True when that id already ended or is held (set by the trainer's Collector): an
        # undecodable copy of such an id is refused ("already ended"), not a second end of it
        self.ended_id: Callable[[str], bool] | None = None
        self._read_own_pending = True
        self._pending_cursors = dict.fromkeys(self.streams, "0")  # streams whose own PEL is being re-read
        self._next_claim = 0.0
        self._claim_queue = list(self.streams)  # streams left in this round of XAUTOCLAIM
        self._claim_cursor = dict.fromkeys(self.streams, "0-0")
        self._rotation = 0  # first stream of the next read of new entries (when count < streams)
        self._found_empty: set[str] = set()  # streams found empty since a read of new entries returned some
        self._inflight: set[EntryRef] = set()
        self._last_touch = time.monotonic()
        self._group_ready = False
        self._connects: int | None = None  # the client's re-connections at the last look (None: none yet)
        self.drained = False  # the last poll read new entries (`>`) and found none

    @property
    def stream(self) -> str:
        """The reader's stream, when it reads exactly one (ValueError otherwise)."""
        if len(self.streams) != 1:
            raise ValueError(f"this reader reads {len(self.streams)} streams; name the entry's stream")
        return self.streams[0]

    def _ref(self, ref: str | EntryRef) -> EntryRef:
        """An EntryRef; a bare id is one of the reader's only stream."""
        return (self.stream, ref) if isinstance(ref, str) else (ref[0], ref[1])

    # -- setup -------------------------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the group on each stream (idempotent; MKSTREAM) so a reader may start before any producer.
        A user that may not create groups (the aggregator's) finds it made by setup_run, or gets an error
        saying so."""
        for stream in self.streams:
            try:
                ensure_group(self.r, stream, self.group)
            except redis.exceptions.NoPermissionError:
                try:
                    groups = self.r.xinfo_groups(stream)
                except redis.ResponseError:  # no such stream
                    groups = []
                if not any(text(g["name"]) == self.group for g in groups):
                    raise RuntimeError(
                        f"group {self.group} of {stream} does not exist and this user may not "
                        "create it: run `rollstream run` or setup_run first"
                    ) from None
        self._group_ready = True

    # -- reading -----------------------------------------------------------------------------------

    def poll(self, block_ms: int | None = None) -> list[Message]:
        """One read: own pending first, then claims, then new entries. Returns decoded messages (maybe []).
        block_ms: how long the read of new entries may wait (None: the reader's block_ms; 0: not at all)."""
        self.drained = False
        if not self._group_ready:
            self.ensure_group()
        self._check_reconnected()
        self._touch_inflight()
        if self._read_own_pending:
            msgs = self._read_pending()
            if msgs is not None:
                return msgs
        if time.monotonic() >= self._next_claim:
            msgs = self._claim()
            if msgs:
                return msgs
        return self._read_new(self.block_ms if block_ms is None else block_ms)

    def _read_new(self, wait: int) -> list[Message]:
        """New entries (`>`) of the streams, at most `count` in all: one XREADGROUP over every stream with
        COUNT count // streams, or, when count is below the number of streams, over `count` of them in
        turn (COUNT 1). `drained` once every stream's last read found none."""
        n = len(self.streams)
        k = min(n, max(1, self.count))
        start = self._rotation % n
        chosen = [self.streams[(start + i) % n] for i in range(k)]
        self._rotation = (start + k) % n
        resp = self.r.xreadgroup(
            self.group, self.consumer, dict.fromkeys(chosen, ">"), count=max(1, self.count // k),
            block=wait or None,
        )
        got = {text(stream): entries for stream, entries in resp or [] if entries}
        # drained: every stream found empty since the last read that returned anything
        self._found_empty = set() if got else self._found_empty | set(chosen)
        self.drained = not got and self._found_empty >= set(self.streams)
        out: list[Message] = []
        for stream, entries in got.items():
            # an entry this process holds, delivered again as new: the group's last-delivered-id went back (a
            # failover to a replica that had not received the read): it is ours already, acked with its effect
            fresh = self._unheld(stream, entries)
            if len(fresh) < len(entries):
                log.warning("%s: %d entries of %s already held were delivered again as new (a failover?); "
                            "passed over", self.consumer, len(entries) - len(fresh), stream)
            out += self._accept(stream, fresh, deliveries=None)
        return out

    def _read_pending(self) -> list[Message] | None:
        """Our own PEL of each stream from its cursor; None once all are drained (then we switch to `>`)."""
        resp = self.r.xreadgroup(self.group, self.consumer, dict(self._pending_cursors), count=self.count)
        out: list[Message] = []
        replies = {text(stream): raw for stream, raw in resp or []}
        for stream in list(self._pending_cursors):
            raw = replies.get(stream) or []
            entries = self._unheld(stream, raw)
            if raw:  # entries already in flight in this process are passed over
                self._pending_cursors[stream] = text(raw[-1][0])
            else:
                del self._pending_cursors[stream]
            out += self._accept(stream, entries, deliveries=self._delivery_counts(stream, entries))
        if not self._pending_cursors:
            self._read_own_pending = False
            self._pending_cursors = dict.fromkeys(self.streams, "0")
            return out or None
        return out

    def _claim(self) -> list[Message]:
        """XAUTOCLAIM entries idle past claim_idle_s (their consumer died or hung), one stream at a time."""
        while self._claim_queue:
            stream = self._claim_queue[0]
            resp = self.r.xautoclaim(
                stream,
                self.group,
                self.consumer,
                self.claim_idle_ms,
                start_id=self._claim_cursor[stream],
                count=self.count,
            )
            cursor, entries = text(resp[0]), resp[1]
            self._claim_cursor[stream] = cursor
            if cursor == "0-0":
                self._claim_queue.pop(0)
            entries = self._unheld(stream, entries)
            if entries:
                self.stats.claimed += len(entries)
                log.warning("%s: claimed %d idle entries from %s", self.consumer, len(entries), stream)
                return self._accept(stream, entries, deliveries=self._delivery_counts(stream, entries))
        self._claim_queue = list(self.streams)
        self._next_claim = time.monotonic() + max(self.claim_idle_ms / 4000, 0.05)
        return []

    def _unheld(self, stream: str, entries: list[Any]) -> list[Any]:
        """The entries of `stream` this process does not already hold (in flight: read, not yet acked)."""
        if not self._inflight:
            return entries
        return [(i, f) for i, f in entries if (stream, text(i)) not in self._inflight]

    def _delivery_counts(self, stream: str, entries: list[Any]) -> dict[str, int]:
        if not entries:
            return {}
        rows = self.r.xpending_range(
            stream, self.group, min=entries[0][0], max=entries[-1][0], count=len(entries) * 4 + 16
        )
        return {text(row["message_id"]): int(row["times_delivered"]) for row in rows}

    def _accept(self, stream: str, entries: list[Any], deliveries: dict[str, int] | None) -> list[Message]:
        """Decode entries of `stream`; dead-letter the undecodable and the over-delivered; return the rest."""
        out: list[Message] = []
        for raw_id, fields in entries:
            entry_id = text(raw_id)
            if (
                fields is None
            ):  # deleted while pending (a writer's own XADD MAXLEN): on record, counted like a loss
                self.dead_letter(
                    entry_id, {}, "deleted while pending (trimmed by a writer); its content is lost",
                    stream=stream,
                )
                continue
            count = 1 if deliveries is None else deliveries.get(entry_id, 1)
            if count > self.max_deliveries:
                self.dead_letter(
                    entry_id, fields, f"delivered {count} times (max_deliveries={self.max_deliveries})",
                    stream=stream,
                )
                continue
            t0 = time.perf_counter()
            try:
                event = decode(fields, self.limits or DEFAULT_LIMITS)
            except DecodeError as e:
                self.dead_letter(entry_id, fields, self._undecodable_reason(fields, e), stream=stream)
                continue
            finally:
                self.stats.decode_s += time.perf_counter() - t0
            out.append(Message(entry_id, fields, event, count, stream))
            self._inflight.add((stream, entry_id))
        self.stats.delivered += len(out)
        return out

    def _undecodable_reason(self, fields: Mapping[bytes, bytes], e: DecodeError) -> str:
        """The dead letter's reason for an entry that does not decode: a refusal when its header's sample id
        already ended or is held (`ended_id`), so a garbled re-publish never ends an id a second time."""
        sid = text(fields.get(b"sample_id", b""))
        if sid and self.ended_id is not None and self.ended_id(sid):
            return f"{ALREADY_ENDED}: sample_id={sid!r} ended or is held; this copy is undecodable ({e})"
        return f"decode: {e}"

    # -- effects -----------------------------------------------------------------------------------

    def ack(self, refs: Iterable[str | EntryRef]) -> int:
        """XACK entries (refs, or bare ids of a one-stream reader), one call per stream, after their effect;
        returns how many were pending."""
        by_stream = group_refs(self._ref(x) for x in refs)
        n = 0
        for stream, ids in by_stream.items():
            n += int(self.r.xack(stream, self.group, *ids))
            self._inflight.difference_update((stream, i) for i in ids)
        self.stats.acked += n
        return n

    def forget(self, refs: Iterable[str | EntryRef]) -> None:
        """Stop tracking entries the caller acked itself (e.g. inside its own MULTI/EXEC with the effect)."""
        done = [self._ref(x) for x in refs]
        self._inflight.difference_update(done)
        self.stats.acked += len(done)

    def release(self, refs: Iterable[str | EntryRef]) -> None:
        """Forget entries without acking (they stay pending and are re-read from our PEL on the next poll)."""
        self._inflight.difference_update(self._ref(x) for x in refs)
        self._reread_own_pending()
        self.drained = False

    def release_all(self) -> None:
        """Forget every entry held (they stay pending and are re-read from our PEL, in log order)."""
        self.release(list(self._inflight))

    def _reread_own_pending(self) -> None:
        self._read_own_pending = True
        self._pending_cursors = dict.fromkeys(self.streams, "0")

    def dead_letter(
        self,
        entry_id: str,
        fields: Mapping[bytes, bytes],
        reason: str,
        counted: bool = True,
        *,
        stream: str | None = None,
    ) -> None:
        """Copy an entry of `stream` (default: the reader's only one) to `dead` with a reason and ack it,
        atomically (`write_dead_letter`, rollstream/bus/dead_letter.py); with `dead_count` set, a `counted`
        dead letter also increments that (hash, field) in the same step."""
        stream = self.stream if stream is None else stream
        write_dead_letter(
            self.r, stream, self.group, entry_id, fields, reason, dead_stream=self.dead_stream,
            dead_count=self.dead_count, counted=counted, dead_outbox=self.dead_outbox,
        )
        self._inflight.discard((stream, entry_id))
        self.stats.dead += 1
        log.error("%s: %s -> dead: %s", stream, entry_id, reason)

    def _touch_inflight(self) -> None:
        """Reset idle time of entries we still hold (XCLAIM JUSTID does not count a delivery)."""
        if not self._inflight or time.monotonic() - self._last_touch < self.claim_idle_ms / 3000:
            return
        for stream, ids in group_refs(sorted(self._inflight)).items():
            for i in range(0, len(ids), 512):
                self.r.xclaim(stream, self.group, self.consumer, 0, ids[i : i + 512], justid=True)
        self._last_touch = time.monotonic()

    @property
    def reading_own_pending(self) -> bool:
        """True while polls re-read this consumer's own pending list (at start, after a reconnect or a
        `release`): the entries they return are older than any new one."""
        return self._read_own_pending

    # -- loop --------------------------------------------------------------------------------------

    def on_reconnect(self) -> None:
        """After a connection loss: re-read our own pending entries (those not already held) and re-check
        the group (Redis may have restarted)."""
        self.stats.reconnects += 1
        self._reread_own_pending()
        self._group_ready = False
        self.drained = False

    def _check_reconnected(self) -> None:
        """redis-py may reconnect silently inside a command; a new socket means a response may have been
        lost, so our own pending entries are re-read."""
        n = reconnect_count(self.r)
        if self._connects is not None and n != self._connects:
            log.warning("%s: redis connection was re-established; re-reading own pending", self.consumer)
            self.on_reconnect()
            self._group_ready = True
        self._connects = n

    def _poll_retrying(self, block_ms: int) -> list[Message]:
        """`poll` through `retry_on_connection` (our own pending list is re-read after a loss); [] once stop
        is set while Redis is away, or when the group was missing (Redis restarted empty: the next poll
        recreates it)."""

        def attempt() -> list[Message]:
            try:
                return self.poll(block_ms)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("%s: group %s missing (redis restarted?); recreating", self.consumer, self.group)
                self.on_reconnect()
                return []

        try:
            return retry_on_connection(
                attempt,
                f"{self.consumer}: reading {', '.join(self.streams)}",
                stop=self.stop,
                on_retry=self.on_reconnect,
            )
        except CONNECTION_ERRORS:
            return []

    def batches(self, *, burst: bool = False, block_ms: int | None = None) -> Iterator[list[Message]]:
        """The consumer loop: one decoded batch per pass (bad entries already dead-lettered) until stop is
        set or, in burst mode, after the pass that found the stream drained. A pass first takes what is
        ready (a read without BLOCK); only when nothing is does it wait up to block_ms (default: the
        reader's, 50 ms in burst mode; 0: no wait), so a batch may be empty and the caller can do timed
        work between polls, and
        `stats.transport_s` counts moving entries, not waiting for writers. The caller acks (`ack`, or
        `forget` after acking in its own MULTI) or hands entries back (`release`)."""
        wait_ms = block_ms if block_ms is not None else BURST_BLOCK_MS if burst else self.block_ms
        while not self.stop.is_set():
            t0 = time.perf_counter()
            msgs = self._poll_retrying(READY_BLOCK_MS)
            if msgs:
                self.stats.transport_s += time.perf_counter() - t0
            elif wait_ms > READY_BLOCK_MS:  # nothing ready: of a blocking read only the decoding is transport
                decode0 = self.stats.decode_s
                msgs = self._poll_retrying(wait_ms)
                self.stats.transport_s += self.stats.decode_s - decode0
            yield msgs
            if burst and self.drained:
                return


def group_refs(refs: Iterable[EntryRef]) -> dict[str, list[str]]:
    """stream -> its entry ids, in the order given (one XACK or XCLAIM per stream)."""
    out: dict[str, list[str]] = {}
    for stream, entry_id in refs:
        out.setdefault(stream, []).append(entry_id)
    return out
