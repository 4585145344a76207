"""The aggregator worker: reads `metrics` as group `aggregator`, folds, writes `records`, feeds the sinks.

Each batch is one MULTI/EXEC: XADD every record it completed with explicit id `<global_step>-1` (a
record already written is refused by Redis, which makes a re-fold idempotent) and XACK the entries no
future record needs (the completed steps' events, superseded and late copies). Everything else stays
pending: the events of incomplete steps and the latest ProducerStats of each producer. A restarted
aggregator re-reads its own pending entries first, in log order, so it rebuilds the same fold state
(run one aggregator per run, under a stable name). A step still incomplete after
`aggregator.incomplete_timeout_s` is reported once: an ERROR line and a DeadLetter note on `dead`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from consumers.aggregator.fold import Completed, Fold
from consumers.aggregator.sinks import Sinks, build_sinks
from rollstream.bus import CONNECTION_ERRORS, GroupReader, Message, backoff_delays
from rollstream.config import PipelineConfig
from rollstream.names import AGGREGATOR_GROUP, Keys
from schemas import DeadLetter, ProducerStats, StepMetrics, ValidateMetrics, encode

log = logging.getLogger(__name__)

DUPLICATE_ID_ERROR = "equal or smaller than the target stream top item"
BURST_BLOCK_MS = 50
#: Event types the fold consumes; anything else on `metrics` is dead-lettered.
FOLDED_EVENTS = (StepMetrics, ValidateMetrics, ProducerStats)


def record_id(global_step: int) -> str:
    """The explicit records-stream id of a global step."""
    return f"{global_step}-1"


def recorded_steps(r: redis.Redis, keys: Keys, chunk: int = 1000) -> set[int]:
    """Global steps that already have a record (ids only matter; read in chunks)."""
    rc: Any = r
    steps: set[int] = set()
    cursor = "-"
    while True:
        entries = rc.xrange(keys.records, min=cursor, max="+", count=chunk)
        for raw_id, _ in entries:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
            steps.add(int(entry_id.split("-")[0]))
            cursor = "(" + entry_id
        if len(entries) < chunk:
            return steps


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
        self.reader = GroupReader(
            r,
            keys.metrics,
            AGGREGATOR_GROUP,
            name,
            dead_stream=keys.dead,
            block_ms=cfg.bus.block_ms,
            count=cfg.bus.read_count,
            claim_idle_s=cfg.bus.claim_idle_s,
            max_deliveries=cfg.aggregator.max_deliveries,
            stop=self.stop,
        )
        self.fold = Fold(cfg.aggregator.total_gpus, done_steps=recorded_steps(r, keys))
        self.sinks = sinks if sinks is not None else Sinks(r, keys, build_sinks(cfg, r, keys))
        self.records_written = 0
        self.events = 0
        self._first_seen: dict[int, float] = {}
        self._reported: set[int] = set()

    # -- one batch ------------------------------------------------------------------------------------

    def handle(self, msgs: list[Message]) -> list[Completed]:
        """Fold a batch, then write its records and acks in one transaction (retried until it lands)."""
        completed: list[Completed] = []
        for m in msgs:
            if not isinstance(m.event, FOLDED_EVENTS):  # e.g. a rollout written to metrics by mistake
                self.reader.dead_letter(m.id, m.fields, f"not a metrics event: {m.event.type}")
                continue
            completed += self.fold.feed(m.id, m.event)
        self.events += len(msgs)
        ack_ids = self.fold.take_ackable()
        for c in completed:
            ack_ids += c.ack_ids
        if completed or ack_ids:
            self._commit(completed, ack_ids)
        return completed

    def _commit(self, completed: list[Completed], ack_ids: list[str]) -> None:
        delays = backoff_delays()
        while True:
            try:
                pipe = self.r.pipeline(transaction=True)
                for c in completed:
                    pipe.xadd(self.keys.records, encode(c.record), id=record_id(c.record.global_step))
                if ack_ids:
                    pipe.xack(self.keys.metrics, AGGREGATOR_GROUP, *ack_ids)
                results = pipe.execute(raise_on_error=False)
                break
            except CONNECTION_ERRORS as e:  # EXEC may or may not have landed: re-running it is idempotent
                delay = next(delays)
                log.warning("commit failed (%s); retry in %.2fs", e, delay)
                time.sleep(delay)
        for c, res in zip(completed, results, strict=False):
            if isinstance(res, redis.ResponseError):
                self._refused(c, res)
            elif isinstance(res, Exception):
                raise res
            else:
                self.records_written += 1
                log.info("step %d: record written (%d local updates)", c.record.global_step, c.record.num_local_updates)
        if ack_ids and isinstance(results[-1], Exception):
            raise results[-1]
        self.reader.forget(ack_ids)  # acked inside the transaction

    def _refused(self, c: Completed, err: redis.ResponseError) -> None:
        """XADD refused: the record exists (a re-fold after a restart) or a later step was written first."""
        g = c.record.global_step
        if DUPLICATE_ID_ERROR not in str(err):
            raise err
        existing = self.r.xrange(self.keys.records, min=record_id(g), max=record_id(g))
        if existing:
            if {k.decode(): bytes(v) for k, v in existing[0][1].items()} != {
                k: bytes(v) for k, v in encode(c.record).items()
            }:
                log.warning("step %d: re-folded record differs from the one written earlier (kept that one)", g)
            return
        reason = f"record of step {g} not written: the records stream already holds a later step"
        log.error("%s", reason)
        self._note(record_id(g), reason, encode(c.record))

    def _note(self, source_id: str, reason: str, fields: Any = None) -> None:
        """A DeadLetter note on `dead` about the metrics stream (nothing is acked by it)."""
        dl = DeadLetter(
            source=self.keys.metrics,
            source_id=source_id,
            reason=reason,
            fields={k: bytes(v) for k, v in (fields or {}).items()},
        )
        self.r.xadd(self.keys.dead, encode(dl))

    # -- timeouts -------------------------------------------------------------------------------------

    def check_incomplete(self, now: float | None = None) -> list[int]:
        """Report (once) every step incomplete for longer than the timeout; returns the steps reported."""
        now = time.monotonic() if now is None else now
        pending = self.fold.pending()
        self._first_seen = {g: self._first_seen.get(g, now) for g in pending}
        reported = []
        for g, missing in pending.items():
            if g in self._reported or now - self._first_seen[g] < self.timeout_s:
                continue
            reason = f"step {g} incomplete after {self.timeout_s:g}s: {missing}"
            log.error("%s", reason)
            self._note(self.fold.first_id(g), reason)
            self._reported.add(g)
            reported.append(g)
        return reported

    # -- loop -----------------------------------------------------------------------------------------

    def run(self, burst: bool = False) -> int:
        """Poll, fold, commit, report and feed the sinks until stop (or, in burst mode, until drained).
        Returns the number of events handled."""
        sinks_due, empty_polls = True, 0
        try:
            while not self.stop.is_set():
                msgs = self.reader.poll_retrying(block_ms=BURST_BLOCK_MS if burst else None)
                empty_polls = 0 if msgs else empty_polls + 1
                if msgs and self.handle(msgs):
                    sinks_due = True
                try:
                    if sinks_due:
                        self.sinks.flush()
                        sinks_due = False
                    self.check_incomplete()
                except CONNECTION_ERRORS as e:  # both are retried on the next pass
                    log.warning("redis unavailable for sinks/timeouts (%s); retrying", e)
                if burst and empty_polls >= 2 and not sinks_due:  # own pending drained and nothing new
                    break
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
