"""The aggregator's fold: metrics events, in log order, -> one SyncStepRecord per global step.

Pure: no Redis, no clock. Fed `(entry_id, event)` pairs; returns each record as soon as its step is
complete, together with the entry ids that may be acked once that record is written.

A global step g is complete when its `step_end` is in and local updates 1..K of every trainer rank
0..W-1 are all in (K = step_end.num_local_updates, W = step_end.world_size: a data-parallel trainer's
ranks each emit their own). Its record's metrics are built in this order, later layers overriding
same-named keys (verl merges its sync metrics over the aggregated ones):

  1. `MetricsAggregator` over the local updates ((local_step, rank) order, each weighted by its
     sample_count: across ranks this is the average over every rank's samples); with W ranks, time keys
     (`timing_s/…`) count 1/W each, so they are the ranks' mean of their per-step sums (the ranks run
     side by side), while sums (`perf/total_num_tokens`, dropped samples) add over the ranks
  2. the step_end's metrics (sync-step metrics override the aggregated ones)
  3. the derived keys (`perf/throughput`, `fully_async/trainer/idle_ratio`, …) recomputed on the merge
  4. the metrics of the ValidateMetrics for version g, when it arrived before completion (names as emitted)
  5. per producer, what it did during the step: every ProducerStats window of that producer whose entry id
     lies in the step's span, merged (`merge_windows`, consumers/aggregator/windows.py). The span of step g
     is (the end of the span of the previous training record, U(g)], where U(g) is the id of the last of
     step g's winning local updates
     (the highest id among the copies that count: a retrained step's re-emitted ones), or its step_end's
     when it has none; the first training record's span begins at the start of the log. Local updates are
     emitted live, as each mini-batch update ends, while the step_end comes only with the checkpoint commit
     (every trainer.save_freq steps), so the span is the step's own time even when steps 1..5 complete
     together at step 5's commit. In practice the span is (U(g-1), U(g)]: a record takes the windows it
     uses, and they are acked with it, so a window counts in one record only, and a step completing after a
     later one (its step_end lost, say) gets only windows the later record left. Merged per producer:
     samples and tokens add, `gen_tokens_per_s` = tokens / generation seconds, `idle_ratio` = idle /
     window seconds (the windows' WINDOW_GEN_S, WINDOW_IDLE_S, WINDOW_S metrics; `merge_windows` says how a
     window of an older log without them counts), the answer metrics (`acc`, `reward_mean`,
     `reward/<metric>`) weighted by samples, `param_version` and the swap check's figures the newest in the
     span. In the record: `producer/<name>/{samples,tokens,gen_tokens_per_s,idle_ratio,param_version}`,
     `producer/total_samples`, `producer/gen_tokens_per_s` (sums over producers), `producer/idle_ratio`
     (mean), the answer metrics per producer and across (weighted by samples); the swap check's figures per
     producer (`producer/<name>/swap_check/{version,logprob_diff,logprob_diff_max}`), the worst of them as
     `producer/swap_check/logprob_diff` and the oldest version checked as `producer/swap_check/version`. A
     producer with no window in the span has no keys in the record. Record 0 (validation of version 0,
     before training) instead shows each producer's latest window with an id below the validation's, and
     takes none: they count in step 1's span too
  6. `training/global_step` = g

Dict-valued metrics (the local updates' `counts`, e.g. `_dapo_filtered_reward_counts`) are merged by the
same MetricsAggregator and go in the record's `counts`, not its `metrics`.

Trainer events come from `metrics`, producer stats from `stats` (a stream producers may write and the
trainer never does); both streams' ids are server-clock ids, so "in the span (…, U(g)]" is the same rule
live and in replay. Stats entries are fed as refs `stats:<producer>:<id>` (see `stats_ref`; each
producer writes its own `stats:<producer>` stream), so a record's `source_ids` says which stream each id came
from. The caller feeds every stats entry with an id up to a metrics entry's (equal included) before that
metrics entry (the worker drains every producer's stats stream up to each metrics batch's newest id; replay
merges the streams by id, stats first on a tie): U(g) is at most the id of the event completing step g, so a
span's windows are all in when its record completes. A stats entry with an id inside a span already taken
arrives against that contract: it is counted late and acked. Memory: the fold holds the windows not yet
taken, those after the newest span end (with save_freq 5, about five steps' windows per producer).

Record 0 is the validation of version 0, taken before any training: a ValidateMetrics for version 0
completes at once as the record of step 0; training records are steps 1, 2, ….
Repeats of an event (a retrained step re-emits its local updates, a duplicate XADD, a redelivery) are
resolved by entry id: the LAST one in log order (highest id) wins, an id already seen is ignored.
Events of a step that already has a record are late: ignored and acked. Record metric keys are sorted and
`created_at` is the step_end's, so the same log always gives the same records, byte for byte.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from consumers.aggregator.metrics import MetricsAggregator, add_derived_metrics, aggregation_rule
from consumers.aggregator.windows import merge_windows, producer_metrics
from rollstream.bus import parse_id
from schemas import (
    EventBase,
    ProducerStats,
    StepMetrics,
    SyncStepRecord,
    ValidateMetrics,
)

log = logging.getLogger(__name__)

E = TypeVar("E", bound=EventBase)
Entry = tuple[str, Any]  # (entry id, event)


STATS_PREFIX = "stats:"
def stats_ref(producer: str, entry_id: str) -> str:
    """The ref `stats:<producer>:<id>` under which an entry of a producer's `stats:<producer>` stream is fed
    to the fold (ids of two streams may collide)."""
    return f"{STATS_PREFIX}{producer}:{entry_id}"


def split_ref(ref: str) -> tuple[str | None, str]:
    """(the producer of a stats entry, None for a `metrics` entry; the bare stream entry id) of a ref."""
    if ref.startswith(STATS_PREFIX):
        producer, entry_id = ref[len(STATS_PREFIX) :].rsplit(":", 1)
        return producer, entry_id
    return None, ref


def id_key(ref: str) -> tuple[int, int]:
    """Sort key of a stream entry id `<ms>-<seq>` or a ref `stats:<producer>:<ms>-<seq>` (server-clock
    order)."""
    return parse_id(split_ref(ref)[1])


def _newer(entry_id: str, than: str) -> bool:
    return id_key(entry_id) > id_key(than)


@dataclass
class _Step:
    """Events of one global step collected so far (each slot holds the latest entry by id)."""

    updates: dict[tuple[int, int], tuple[str, StepMetrics]] = field(
        default_factory=dict
    )  # (local_step, rank)
    end: tuple[str, StepMetrics] | None = None
    validation: tuple[str, ValidateMetrics] | None = None

    def ids(self) -> list[str]:
        """Every entry id held for this step."""
        ids = [i for i, _ in self.updates.values()]
        ids += [slot[0] for slot in (self.end, self.validation) if slot is not None]
        return ids

    def slots(self) -> list[tuple[int, int]]:
        """The (local_step, rank) pairs the step_end says complete the step ([] before it arrives)."""
        if self.end is None:
            return []
        end = self.end[1]
        return [(k, r) for k in range(1, end.num_local_updates + 1) for r in range(end.world_size)]

    def missing(self) -> str:
        """What the step still waits for, in words."""
        one_rank = all(r == 0 for _, r in self.updates) and (self.end is None or self.end[1].world_size == 1)
        have: list[Any] = (
            sorted(k for k, _ in self.updates) if one_rank else [f"{k}/r{r}" for k, r in sorted(self.updates)]
        )
        if self.end is None:
            extra = " and a validation" if self.validation is not None else ""
            return f"missing step_end (have local updates {have}{extra})"
        k = self.end[1].num_local_updates
        lacking = [slot for slot in self.slots() if slot not in self.updates]
        if one_rank:
            return f"missing local updates {[i for i, _ in lacking]} of {k}"
        each = [f"{i}/r{r}" for i, r in lacking]
        return f"missing local updates {each} of {k} on each of {self.end[1].world_size} ranks"


@dataclass(frozen=True)
class Completed:
    """A finished step: its record and the ids to ack in the same transaction as writing it."""

    record: SyncStepRecord
    ack_ids: list[str]


@dataclass
class FoldStats:
    """Counters of what the fold set aside (for logs and tests)."""

    superseded: int = 0  # older copies of a (step, slot)
    duplicates: int = 0  # an entry id fed twice
    late: int = 0  # events of a step that already has a record, stats inside a span already taken
    foreign: int = 0  # event types that do not belong on the metrics stream


class Fold:
    """The state machine: feed events in log order, get records; keeps only incomplete steps in memory."""

    def __init__(self, total_gpus: int = 1, done_steps: Iterable[int] = ()) -> None:
        """`done_steps`: steps that already have a record (a restarted worker reads them from `records`)."""
        self.total_gpus = total_gpus
        self.stats = FoldStats()
        self._steps: dict[int, _Step] = {}
        self._done: set[int] = set(done_steps)
        # per producer, its stats windows no record has taken yet (sorted by id): all after `_taken`
        self._producers: dict[str, list[tuple[str, ProducerStats]]] = {}
        self._taken = (0, 0)  # id_key of the end of the newest span a training record took
        self._ackable: list[str] = []

    # -- input ----------------------------------------------------------------------------------------

    def feed(self, entry_id: str, event: Any) -> list[Completed]:
        """Fold one event; returns the records it completed ([] or one)."""
        if isinstance(event, StepMetrics | ValidateMetrics):
            if isinstance(event, StepMetrics):
                return self._step_event(entry_id, event)
            return self._validation(entry_id, event)
        if isinstance(event, ProducerStats):
            self._producer(entry_id, event)
            return []
        self.stats.foreign += 1
        log.warning("metrics entry %s is a %r event; ignored", entry_id, getattr(event, "type", "?"))
        self._ackable.append(entry_id)
        return []

    def _keep_latest(self, held: tuple[str, E] | None, entry_id: str, event: E) -> tuple[str, E]:
        """The slot's new content: the entry with the higher id; the other one becomes ackable."""
        if held is None:
            return entry_id, event
        if held[0] == entry_id:
            self.stats.duplicates += 1
            return held
        self.stats.superseded += 1
        if _newer(entry_id, held[0]):
            self._ackable.append(held[0])
            return entry_id, event
        self._ackable.append(entry_id)
        return held

    def _late(self, entry_id: str, what: str) -> bool:
        """Set aside an event of a step that already has a record."""
        self.stats.late += 1
        log.warning("metrics entry %s (%s) arrived after its step's record; ignored", entry_id, what)
        self._ackable.append(entry_id)
        return True

    def _step_event(self, entry_id: str, ev: StepMetrics) -> list[Completed]:
        g = ev.global_step
        if g in self._done:
            self._late(entry_id, f"{ev.type} of step {g}")
            return []
        step = self._steps.setdefault(g, _Step())
        if ev.type == "step_end":
            step.end = self._keep_latest(step.end, entry_id, ev)
        else:
            slot = (ev.local_step, ev.rank)
            step.updates[slot] = self._keep_latest(step.updates.get(slot), entry_id, ev)
        return self._maybe_complete(g)

    def _validation(self, entry_id: str, ev: ValidateMetrics) -> list[Completed]:
        v = ev.param_version
        if v in self._done:
            self._late(entry_id, f"validation of version {v}")
            return []
        step = self._steps.setdefault(v, _Step())
        step.validation = self._keep_latest(step.validation, entry_id, ev)
        return self._maybe_complete(v)

    def _producer(self, entry_id: str, ev: ProducerStats) -> None:
        if id_key(entry_id) <= self._taken:  # inside a span a record already took (against the feed order)
            self._late(entry_id, f"stats of {ev.producer} inside a recorded step's span")
            return
        history = self._producers.setdefault(ev.producer, [])
        if any(ref == entry_id for ref, _ in history):
            self.stats.duplicates += 1
            return
        history.append((entry_id, ev))
        history.sort(key=lambda item: id_key(item[0]))

    def refs(self, g: int) -> list[str]:
        """The refs an incomplete step holds, in log order."""
        return sorted(self._steps[g].ids(), key=id_key) if g in self._steps else []

    def discard(self, g: int) -> list[str]:
        """Drop an incomplete step that can never complete; returns the refs it held (to dead-letter)."""
        refs = self.refs(g)
        self._steps.pop(g, None)
        return refs

    # -- completion -----------------------------------------------------------------------------------

    def _maybe_complete(self, g: int) -> list[Completed]:
        step = self._steps[g]
        if g == 0 and step.validation is not None and step.end is None and not step.updates:
            return [self._complete(g, step, [], step.validation[1].created_at, step.validation[0])]
        if step.end is None:
            return []
        slots = step.slots()
        if any(slot not in step.updates for slot in slots):
            return []
        updates = [step.updates[slot] for slot in slots]
        return [self._complete(g, step, updates, step.end[1].created_at, step.end[0])]

    def _complete(
        self, g: int, step: _Step, updates: list[tuple[str, StepMetrics]], created_at: float, closing_id: str
    ) -> Completed:
        agg = MetricsAggregator(self.total_gpus)
        ranks = step.end[1].world_size if step.end is not None else 1
        for _, ev in updates:
            metrics = ev.metrics
            if ranks > 1:  # ranks run side by side: a time is their mean, not their sum
                metrics = {
                    k: v / ranks if aggregation_rule(k) == "time_sum" else v for k, v in metrics.items()
                }
            agg.add_step_metrics({**metrics, **ev.counts}, ev.sample_count)
        metrics = agg.scalar_metrics()
        sources = [i for i, _ in updates]
        if step.end is not None:
            metrics.update(step.end[1].metrics)
            add_derived_metrics(metrics, self.total_gpus)
            sources.append(step.end[0])
        if step.validation is not None:
            metrics.update(step.validation[1].metrics)
            sources.append(step.validation[0])
        windows = self._span_stats(step, updates, closing_id)
        metrics.update(producer_metrics([merge_windows([ev for _, ev in run]) for run in windows]))
        used = [ref for run in windows for ref, _ in run]
        taken = used if step.end is not None else []  # record 0 takes none
        sources += used
        metrics["training/global_step"] = float(g)
        if bad := sorted(k for k, v in metrics.items() if not math.isfinite(v)):  # derived: e.g. a 0 s step
            log.warning("step %d: non-finite %s left out of the record", g, bad)
            metrics = {k: v for k, v in metrics.items() if k not in bad}
        extra = sorted(set(step.updates) - set(step.slots()))
        k = step.end[1].num_local_updates if step.end is not None else 0
        if extra:
            log.warning(
                "step %d: local updates (local_step, rank) %s beyond num_local_updates=%d of world_size=%d "
                "ignored",
                g,
                extra,
                k,
                ranks,
            )
        record = SyncStepRecord(
            global_step=g,
            num_local_updates=k,
            metrics=dict(sorted(metrics.items())),
            counts={
                name: {str(k): float(c) for k, c in sorted(merged.items())}
                for name, merged in agg.dict_metrics().items()
            },
            source_ids=sorted(sources, key=id_key),
            created_at=created_at,
        )
        del self._steps[g]
        self._done.add(g)
        return Completed(record, sorted([*step.ids(), *taken], key=id_key))

    def _span_stats(
        self, step: _Step, updates: list[tuple[str, StepMetrics]], closing_id: str
    ) -> list[list[tuple[str, ProducerStats]]]:
        """Per producer, the stats windows of a completing step's record: record 0 (no step_end) reads each
        producer's latest before the validation; a training step takes those of its span, up to its last
        winning local update (its step_end when it has none)."""
        if step.end is None:
            return self.latest_stats(before=closing_id)
        return self.take_stats(upto=max([i for i, _ in updates] or [closing_id], key=id_key))

    def latest_stats(self, before: str) -> list[list[tuple[str, ProducerStats]]]:
        """Per producer (by name), [its latest held stats entry with an id below `before`] (record 0's rule;
        nothing is taken)."""
        out = []
        for _, history in sorted(self._producers.items()):
            below = [item for item in history if id_key(item[0]) < id_key(before)]
            if below:
                out.append([below[-1]])
        return out

    def take_stats(self, upto: str) -> list[list[tuple[str, ProducerStats]]]:
        """Per producer (by name), its held stats entries with an id up to `upto` (the span's end), in log
        order; they leave the fold (the record that takes them acks them) and the span's end becomes the
        start of the next one."""
        end = id_key(upto)
        self._taken = max(self._taken, end)
        out = []
        for name, history in sorted(self._producers.items()):
            cut = next((i for i, (ref, _) in enumerate(history) if id_key(ref) > end), len(history))
            if cut:
                out.append(history[:cut])
                del history[:cut]
            if not history:
                del self._producers[name]
        return out

    # -- output ---------------------------------------------------------------------------------------

    def take_ackable(self) -> list[str]:
        """Ids no future record needs (superseded, late, foreign), cleared on return; ack them any time."""
        ids, self._ackable = self._ackable, []
        return ids

    def pending(self) -> dict[int, str]:
        """Incomplete steps -> what each still misses."""
        return {g: step.missing() for g, step in sorted(self._steps.items())}

    def first_id(self, g: int) -> str:
        """The lowest entry id held for an incomplete step ('' when none)."""
        ids = self._steps[g].ids() if g in self._steps else []
        return min(ids, key=id_key) if ids else ""

    @property
    def done_steps(self) -> frozenset[int]:
        """Steps that have a record."""
        return frozenset(self._done)
