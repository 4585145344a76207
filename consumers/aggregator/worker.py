"""The aggregator worker: reads `metrics` (trainer events) and every producer's `stats:<p>` (producer stats)
as group `aggregator`, folds, appends its records to `outbox:records`, feeds the sinks.

Each metrics batch is preceded by draining the stats streams up to the batch's newest id, so the fold has
every stats entry a record may use (see fold.py). Each batch is one MULTI/EXEC: RPUSH every record it
completed to `outbox:records` and XACK the entries no future record needs (the completed steps' events,
superseded and late copies). Everything else stays pending: the events of incomplete steps and the stats
entries a future record may use. A restarted aggregator re-reads its own pending entries first, in log order,
so it rebuilds the same fold state (run one aggregator per run, under a stable name). After a reconnect it
does the same in place (`rebuild`): a failover to a replica that had not received the last writes may have
lost records and acks the fold counted, and the step_ends the trainer's reconciliation emits again must
complete those steps, not be set aside as late.

Its user may not XADD `records` nor `dead:aggregator` (an XADD may trim, issue 41 item 5): records, dead
letters and notes go to its outboxes, which the trainer moves into those streams (rollstream/bus/outbox.py:
a record is written with explicit id `<global_step>-1`, so a re-fold's duplicate is refused by Redis and the
fold stays idempotent). Without ACLs it moves them itself after each batch; under its user the sinks, which
read `records`, see a record one trainer drain later (they are flushed every pass).

What the fold cannot place is dead-lettered with its reason, never left pending: an event of the wrong kind
for its stream, stats in the name of a producer other than the one whose stream they came from (identity from
the key: only that producer's user may write it), a value outside its domain (a non-finite metric; stats of a
producer the run does not have, or out of range), a trainer event ahead of the trainer's progress
(admission.py), and the events of a step still incomplete `aggregator.incomplete_timeout_s` after its step_end
was due that can no longer complete (the trainer committed past it). An incomplete step that may still
complete is only reported (an ERROR line and a note on `dead` with source `aggregator`). Replay skips what the
live aggregator dead-lettered.

When a step_end is due: the trainer emits a step's local updates as it trains, but its step_end only in the
commit of the checkpoint that covers it, at step ceil(g / trainer.save_freq) * save_freq (earlier on a stop,
the last step or an over-budget ack). So the clock of step g starts when the trainer hash, as last read
(TrainerProgress, re-read by admission whenever an event claims more, and here while idle), says the trainer
committed step g or began a step past that checkpoint step, not at g's first event: with save_freq 5 and
minute-long steps, steps 1..4 legitimately wait minutes for their step_end. A trainer that stops emitting
anything starts no clock; `rollstream status` reports it (a stale heartbeat, no global step completed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis

from consumers.aggregator.admission import TrainerProgress, nonfinite_reason, stats_reason
from consumers.aggregator.fold import Completed, Fold, id_key, split_ref, stats_ref
from consumers.aggregator.sinks import Sinks, build_sinks
from rollstream.bus import (
    CONNECTION_ERRORS,
    GroupReader,
    Message,
    entry_limits,
    group_refs,
    iter_stream,
    parse_id,
)
from rollstream.bus.connection import retried
from rollstream.bus.outbox import OutboxDrain, pack_item, pending_records
from rollstream.config import PipelineConfig
from rollstream.keys import AGGREGATOR_GROUP, AGGREGATOR_NOTE_SOURCE, Keys, producer_names
from rollstream.topology.replication import execute_and_wait, require_acks
from schemas import ProducerStats, StepMetrics, ValidateMetrics, dead_letter_of, encode

log = logging.getLogger(__name__)

#: Event types the fold takes from `metrics` (the trainer's); anything else there is dead-lettered.
TRAINER_EVENTS = (StepMetrics, ValidateMetrics)
#: Longest a stats drain waits for the server clock to pass a metrics batch (then it folds anyway).
DRAIN_MAX_S = 1.0


def recorded_steps(r: redis.Redis, keys: Keys) -> set[int]:
    """Global steps that already have a record, in `records` (ids only matter; read in pages) or still in
    its outbox."""
    done = {parse_id(entry_id)[0] for entry_id, _ in iter_stream(r, keys.records)}
    return done | {rec.global_step for rec in pending_records(r, keys)}


class AggregatorWorker:
    """One aggregator: a GroupReader on `metrics`, a Fold, and the sinks."""

    def __init__(
        self,
        cfg: PipelineConfig,
        r: redis.Redis,
        keys: Keys,
        *,
        name: str = "aggregator",
        stop: threading.Event | None = None,
        sinks: Sinks | None = None,
    ) -> None:
        """Build the reader and sinks; the fold starts from the steps already in `records`."""
        self.cfg = cfg
        self.r: Any = r
        self.keys = keys
        self.stop = stop or threading.Event()
        self.timeout_s = cfg.aggregator.incomplete_timeout_s
        self.save_freq = cfg.trainer.save_freq  # a step's step_end comes with the checkpoint covering it
        self.clock: Callable[[], float] = time.monotonic  # of the incomplete-step timeout (tests fake it)
        self.producers = frozenset(producer_names(cfg.rollout.num_producers))  # whose stats are folded
        self.reader, self.stats_reader = (
            GroupReader(
                r,
                streams,
                AGGREGATOR_GROUP,
                name,
                dead_stream=keys.dead_aggregator_outbox,
                dead_outbox=True,
                block_ms=cfg.bus.block_ms,
                count=cfg.bus.read_count,
                claim_idle_s=cfg.bus.claim_idle_s,
                max_deliveries=cfg.aggregator.max_deliveries,
                limits=entry_limits(cfg.bus.max_entry_bytes),
                stop=self.stop,
            )
            for streams in ([keys.metrics], keys.stats_streams(sorted(self.producers)))
        )
        self.progress = TrainerProgress(r, keys)
        self.fold = Fold(cfg.aggregator.total_gpus, done_steps=recorded_steps(r, keys))
        self.sinks = sinks if sinks is not None else Sinks(r, keys, build_sinks(cfg, r, keys))
        self.records_written = 0  # records appended to the outbox
        self.drain: OutboxDrain | None = OutboxDrain(keys, every_s=0)  # None once its user may not (ACL)
        self.events = 0
        self._due_since: dict[int, tuple[float, str]] = {}  # step -> (when its step_end became due, why)
        self._reported: set[int] = set()
        self._reconnects = 0  # the metrics reader's reconnects when the fold was last (re)built

    # -- one batch ------------------------------------------------------------------------------------

    def handle(self, msgs: list[Message], stats: list[Message] | None = None) -> list[Completed]:
        """Fold a batch (`stats` entries first, then `metrics` ones), then write its records and acks in one
        transaction (retried until it lands). What cannot be placed is dead-lettered with its reason."""
        completed: list[Completed] = []
        for m in stats or []:
            producer = self.keys.stream_producer(m.stream)
            dead = partial(self.stats_reader.dead_letter, m.id, m.fields, stream=m.stream)
            if not isinstance(m.event, ProducerStats):
                dead(f"not producer stats: a {m.event.type!r} event on stats")
            elif m.event.producer != producer:
                dead(f"impersonation: field producer={m.event.producer!r} on the stream of producer "
                     f"{producer!r}")
            elif (why := stats_reason(m.event, self.producers)) is not None:
                dead(f"implausible: {why}")
            else:
                completed += self.fold.feed(stats_ref(producer, m.id), m.event)
        for m in msgs:
            if not isinstance(m.event, TRAINER_EVENTS):  # producer stats, a rollout, a record …
                self.reader.dead_letter(
                    m.id, m.fields, f"not a trainer event: a {m.event.type!r} event on metrics"
                )
                continue
            if (why := self.progress.reason(m.event) or nonfinite_reason(m.event.metrics)) is not None:
                self.reader.dead_letter(m.id, m.fields, f"implausible: {why}")
                continue
            completed += self.fold.feed(m.id, m.event)
        self.events += len(msgs) + len(stats or [])
        refs = self.fold.take_ackable()
        for c in completed:
            refs += c.ack_ids
        if completed or refs:
            self._commit(completed, refs)
        self.move_outbox()
        return completed

    def rebuild(self) -> None:
        """Start the fold again from what Redis holds, as a restarted aggregator does: the steps in `records`,
        then every entry of its pending lists, re-read in log order (both readers let go of what they hold).
        Run after a reconnect: a failover to a replica that had not received the last writes loses records
        and acks this fold counted, and the trainer's reconciliation emits those steps' step_ends again,
        which a fold still holding the steps as recorded would set aside as late (a record lost for good)."""
        self.reader.release_all()
        self.stats_reader.release_all()
        done = self._recorded_steps()
        stats = self.fold.stats  # the process's counts go on
        self.fold = Fold(self.cfg.aggregator.total_gpus, done_steps=done)
        self.fold.stats = stats
        self.progress = TrainerProgress(self.r, self.keys)
        self._due_since.clear()
        self._reported.clear()
        log.warning("reconnected: fold rebuilt from Redis (%d steps recorded), pending entries re-read",
                    len(done))

    def move_outbox(self) -> None:
        """Without ACLs, move the outboxes into `records` and `dead:aggregator` now; under the aggregator's
        user (which may not) stop trying at the first refusal: the trainer moves them."""
        if self.drain is None:
            return
        try:
            self._drain_outbox()
        except redis.exceptions.NoPermissionError:
            log.info("records and dead letters go through the outbox: the trainer moves them")
            self.drain = None

    def drain_stats(self, upto: str | None) -> tuple[list[Message], bool]:
        """Read the stats streams until every entry with an id below `upto` is in: until each stream has
        delivered an entry above it, or the streams are drained once more after the server clock passed it
        (no later XADD can get a lower id). Returns (entries, complete); not complete when stopped first
        (the caller then holds back the metrics batch, so no record is folded without its stats)."""
        out: list[Message] = []
        deadline = time.monotonic() + DRAIN_MAX_S
        reader = self.stats_reader
        past: set[str] = set()  # streams that delivered an entry above `upto`
        clock_past = False  # the server clock was past `upto` before the last drain began
        while True:
            for msgs in reader.batches(burst=True, block_ms=0):
                out += msgs
                # a page of the own-pending re-read is not the edge of the stream yet
                if upto is not None and not reader.reading_own_pending:
                    past |= {m.stream for m in msgs if id_key(m.id) > id_key(upto)}
                    if len(past) == len(reader.streams):
                        return out, True
            if self.stop.is_set():
                return out, upto is None
            if upto is None or clock_past:
                return out, True
            try:  # drained: done after one more drain once the server clock is past `upto` (an XADD that ran
                # before the clock passed it may have an id below it, on a stream already drained)
                sec, usec = self.r.time()
            except CONNECTION_ERRORS:
                continue
            if int(sec) * 1000 + int(usec) // 1000 > id_key(upto)[0] or time.monotonic() > deadline:
                clock_past = True
                continue
            time.sleep(0.001)

    def _commit(self, completed: list[Completed], refs: list[str]) -> None:
        ack_ids = [i for producer, i in map(split_ref, refs) if producer is None]
        stats_refs = [
            (self.keys.stats_of(producer), i) for producer, i in map(split_ref, refs) if producer is not None
        ]

        results = self._commit_transaction(completed, ack_ids, stats_refs)
        for res in results:
            if isinstance(res, Exception):
                raise res
        for c in completed:
            self.records_written += 1
            log.info("step %d: record written (%d local updates)", c.record.global_step,
                     c.record.num_local_updates)
        self.reader.forget(ack_ids)  # acked inside the transaction
        self.stats_reader.forget(stats_refs)

    def _note(self, source_id: str, reason: str, fields: Any = None) -> None:
        """A DeadLetter note for `dead:aggregator` (source `aggregator`, through the outbox) about the metrics
        log; nothing is acked by it."""
        dl = dead_letter_of(
            AGGREGATOR_NOTE_SOURCE, source_id, reason, {k: bytes(v) for k, v in (fields or {}).items()}
        )
        self.r.rpush(self.keys.dead_aggregator_outbox, pack_item(encode(dl)))

    # -- timeouts -------------------------------------------------------------------------------------

    def due_reason(self, g: int) -> str | None:
        """Why step g's step_end should be on the log by now, as the trainer hash last read says (None while
        it may legitimately be still to come): the trainer committed g, or it began a step past the checkpoint
        step whose commit carries g's step_end (ceil(g / save_freq) * save_freq)."""
        p = self.progress
        if p.committed >= g:
            return f"the trainer committed step {p.committed}"
        checkpoint = -(-g // self.save_freq) * self.save_freq
        if p.training > checkpoint:
            return f"the trainer began step {p.training}, past checkpoint step {checkpoint}"
        return None

    def check_incomplete(self, now: float | None = None, drained: bool = True) -> list[int]:
        """Every step still incomplete longer than the timeout after its step_end was due (due_reason; the
        clock starts at the first check that finds it due): dead-letter its events when it can no longer
        complete (the trainer committed past it; only when `drained`, i.e. the last poll found nothing new,
        so its step_end is not merely unread), else report it once. Returns the steps handled."""
        now = self.clock() if now is None else now
        pending = self.fold.pending()
        if drained and any(g not in self._due_since for g in pending):
            self.progress.refresh()  # idle: no event refreshes it (e.g. a commit whose step_ends are lost)
        self._due_since = {g: due for g in pending if (due := self._due(g, now)) is not None}
        self._reported.intersection_update(pending)  # a step completed or discarded since is forgotten
        handled = []
        for g, (since, why) in self._due_since.items():
            if now - since < self.timeout_s:
                continue
            reason = f"step {g} incomplete {self.timeout_s:g}s after its step_end was due ({why}): "
            reason += pending[g]
            if drained and not self.progress.can_complete(g):
                reason += f"; the trainer committed step {self.progress.committed}, so it never will"
                for ref in self.fold.refs(g):  # dead-letter first: a connection loss leaves the step held
                    self._dead_letter_ref(ref, reason)
                self.fold.discard(g)
                log.error("%s: its events -> dead", reason)
            elif g in self._reported:
                continue
            else:
                log.error("%s", reason)
                self._note(self.fold.first_id(g), reason)
                self._reported.add(g)
            handled.append(g)
        if handled:
            self.move_outbox()
        return handled

    def _due(self, g: int, now: float) -> tuple[float, str] | None:
        """(since when, why) step g's step_end has been due, kept from an earlier check; None while not."""
        if g in self._due_since:
            return self._due_since[g]
        why = self.due_reason(g)
        return None if why is None else (now, why)

    def _dead_letter_ref(self, ref: str, reason: str) -> None:
        """Dead-letter a held entry (metrics or stats) by its fold ref, copying its fields."""
        producer, entry_id = split_ref(ref)
        reader = self.reader if producer is None else self.stats_reader
        stream = self.keys.metrics if producer is None else self.keys.stats_of(producer)
        rows = self._read_entry(stream, entry_id)
        reader.dead_letter(entry_id, rows[0][1] if rows else {}, reason, stream=stream)

    # -- its effects, each under the one retry policy (rollstream/bus/connection.py `retried`) -------------

    @retried("reading records")
    def _recorded_steps(self) -> set[int]:
        """The global steps `records` already holds."""
        return recorded_steps(self.r, self.keys)

    @retried("moving the outbox")
    def _drain_outbox(self) -> int:
        """Move the outboxes into `records` and `dead:aggregator` (NoPermissionError under the aggregator's
        user)."""
        return self.drain.drain(self.r) if self.drain else 0

    @retried("committing records and acks")
    def _commit_transaction(
        self, completed: list[Completed], ack_ids: list[str], stats_refs: list[tuple[str, str]]
    ) -> list[Any]:
        """Records into the outbox and their entries' acks in one MULTI (and WAIT). EXEC may or may not have
        landed: the outbox drain refuses a duplicate. With replicas, a commit too few replicas acknowledged
        is repeated: a failover may have lost it, records and acks together."""
        pipe = self.r.pipeline(transaction=True)
        for c in completed:
            pipe.rpush(self.keys.records_outbox, pack_item(encode(c.record)))
        if ack_ids:
            pipe.xack(self.keys.metrics, AGGREGATOR_GROUP, *ack_ids)
        for stream, ids in group_refs(stats_refs).items():
            pipe.xack(stream, AGGREGATOR_GROUP, *ids)
        results, acked = execute_and_wait(pipe, raise_on_error=False)
        require_acks(self.r.connection_pool, acked, f"commit of {len(completed)} records")
        return list(results)

    @retried("reading entry {entry_id}")
    def _read_entry(self, stream: str, entry_id: str) -> list[Any]:
        """The entry `entry_id` of `stream` ([] when it is gone)."""
        rows: list[Any] = self.r.xrange(stream, min=entry_id, max=entry_id)
        return rows

    @retried("flushing sinks")
    def _flush_sinks(self) -> None:
        """Flush the sinks (records.jsonl, TensorBoard, W&B) up to the newest record."""
        self.sinks.flush()

    # -- loop -----------------------------------------------------------------------------------------

    def run(self, burst: bool = False) -> int:
        """Run the shared consumer loop on `metrics`: per batch, drain `stats` up to it, fold, commit, feed
        the sinks and check timeouts, until stop (or, in burst mode, until drained). Returns the number of
        events handled."""
        sinks_due = True
        try:
            for msgs in self.reader.batches(burst=burst):
                if self.reader.stats.reconnects != self._reconnects:  # a failover may have lost folded steps
                    self._reconnects = self.reader.stats.reconnects
                    self.rebuild()  # this batch too is re-read from the pending list, in log order
                    continue
                stats, complete = self.drain_stats(msgs[-1].id if msgs else None)
                if not complete:  # stopped mid-drain: these stay pending for the next aggregator
                    self.reader.release(m.id for m in msgs)
                    msgs = []
                if (msgs or stats) and self.handle(msgs, stats):
                    sinks_due = True
                try:
                    if sinks_due or self.drain is None:  # (the trainer moves records in meanwhile)
                        self.sinks.flush()
                        sinks_due = False
                    self.check_incomplete(drained=self.reader.drained)
                except CONNECTION_ERRORS as e:  # both are retried on the next pass
                    log.warning("redis unavailable for sinks/timeouts (%s); retrying", e)
            if burst and sinks_due and not self.stop.is_set():  # the last pass could not flush
                self._flush_sinks()
        finally:
            self.sinks.close()
        log.info(
            "aggregator stopping: %d events, %d records written, %d steps incomplete %s",
            self.events,
            self.records_written,
            len(self.fold.pending()),
            self.fold.stats,
        )
        return self.events
