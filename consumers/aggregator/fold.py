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
     lies in the step's span, merged (`merge_windows`). The span of step g is (the end of the span of the
     previous training record, U(g)], where U(g) is the id of the last of step g's winning local updates
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
from rollstream.bus import parse_id
from rollstream.weights.fingerprint import SWAP_CHECK_DIFF, SWAP_CHECK_DIFF_MAX, SWAP_CHECK_VERSION
from schemas import (
    ANSWER_METRIC_PREFIX,
    ANSWER_METRICS,
    WINDOW_GEN_S,
    WINDOW_IDLE_S,
    WINDOW_S,
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
#: The swap check's metrics a producer's stats carry (producers/worker.py swap_check_metrics): per producer in
#: the record as `producer/<name>/swap_check/…`; across producers the worst diff and the oldest version.
SWAP_CHECK_METRICS = (SWAP_CHECK_VERSION, SWAP_CHECK_DIFF, SWAP_CHECK_DIFF_MAX)


def answer_metric_names(ev: ProducerStats) -> list[str]:
    """The names of the answer metrics (schemas' ANSWER_METRICS, ANSWER_METRIC_PREFIX…) a stats event
    carries: per producer in the record as `producer/<name>/acc`, `…/reward/<task metric>`; across producers
    (answer_metrics_across) under the stats' own names (`producer/acc`: training accuracy at the sampling
    temperature, beside the shaped reward the trainer reports)."""
    return [k for k in ev.metrics if k in ANSWER_METRICS or k.startswith(ANSWER_METRIC_PREFIX)]


def answer_metrics_across(latest: list[ProducerStats]) -> dict[str, float]:
    """Each answer metric's mean over the producers that report it, weighted by their span's samples."""
    sums: dict[str, list[float]] = {}
    for ev in latest:
        weight = float(ev.metrics.get("producer/samples", 1.0))
        for name in answer_metric_names(ev):
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += weight * float(ev.metrics[name])
            total[1] += weight
    return {name: s / w for name, (s, w) in sums.items() if w > 0}


def window_gen_s(ev: ProducerStats) -> float:
    """A window's generation seconds: its WINDOW_GEN_S, else (a window of an older log) tokens /
    gen_tokens_per_s, which is what the producer divided (0 when the rate is 0)."""
    if WINDOW_GEN_S in ev.metrics:
        return float(ev.metrics[WINDOW_GEN_S])
    return ev.tokens / ev.gen_tokens_per_s if ev.gen_tokens_per_s > 0 else 0.0


def merged_idle_ratio(windows: list[ProducerStats]) -> float:
    """Idle seconds / window seconds over the windows (capped at 1); a window without WINDOW_IDLE_S has
    idle_ratio × its seconds. When some window lacks WINDOW_S (an older log) the plain mean of the
    windows' idle_ratio."""
    if not all(WINDOW_S in w.metrics for w in windows):
        return math.fsum(w.idle_ratio for w in windows) / len(windows)
    total = math.fsum(float(w.metrics[WINDOW_S]) for w in windows)
    idle = math.fsum(float(w.metrics.get(WINDOW_IDLE_S, w.idle_ratio * w.metrics[WINDOW_S])) for w in windows)
    return min(1.0, idle / total) if total > 0 else math.fsum(w.idle_ratio for w in windows) / len(windows)


def merged_answer_metrics(windows: list[ProducerStats]) -> dict[str, float]:
    """Each answer metric's mean over the windows that report it, weighted by their samples (a plain mean
    when none of them has a sample)."""
    sums: dict[str, list[float]] = {}
    for w in windows:
        for name in answer_metric_names(w):
            total = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])  # weighted sum, weights, plain sum, count
            value = float(w.metrics[name])
            total[0] += w.samples * value
            total[1] += w.samples
            total[2] += value
            total[3] += 1
    return {name: ws / w if w > 0 else s / n for name, (ws, w, s, n) in sums.items()}


def merge_windows(windows: list[ProducerStats]) -> ProducerStats:
    """One producer's stats windows (in log order) as one window: samples and tokens add, gen_tokens_per_s
    is tokens / generation seconds (`window_gen_s`), idle_ratio idle / window seconds (`merged_idle_ratio`),
    the answer metrics are weighted by samples, param_version and the swap check's figures are the newest
    window's (the newest that carries a check). A single window is returned as it is."""
    if len(windows) == 1:
        return windows[0]
    newest = windows[-1]
    samples = sum(w.samples for w in windows)
    tokens = sum(w.tokens for w in windows)
    gen_s = math.fsum(window_gen_s(w) for w in windows)
    metrics: dict[str, float] = {
        "producer/samples": float(samples),
        WINDOW_GEN_S: gen_s,
        **merged_answer_metrics(windows),
    }
    if all(WINDOW_S in w.metrics for w in windows):
        metrics[WINDOW_S] = math.fsum(float(w.metrics[WINDOW_S]) for w in windows)
    checked = [w for w in windows if any(name in w.metrics for name in SWAP_CHECK_METRICS)]
    if checked:
        check = checked[-1].metrics
        metrics.update({name: check[name] for name in SWAP_CHECK_METRICS if name in check})
    return ProducerStats(
        producer=newest.producer,
        param_version=newest.param_version,
        samples=samples,
        tokens=tokens,
        gen_tokens_per_s=tokens / gen_s if gen_s > 0 else 0.0,
        idle_ratio=merged_idle_ratio(windows),
        versions_in_use=sorted({v for w in windows for v in w.versions_in_use}),
        metrics=metrics,
        created_at=newest.created_at,
    )


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
        metrics.update(self.producer_metrics([merge_windows([ev for _, ev in run]) for run in windows]))
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

    def producer_metrics(self, windows: list[ProducerStats]) -> dict[str, float]:
        """Metrics of the given stats windows (one per producer: `merge_windows` of its span), with totals
        across producers."""
        out: dict[str, float] = {}
        for ev in windows:
            prefix = f"producer/{ev.producer}/"
            out[prefix + "samples"] = float(ev.samples)
            out[prefix + "tokens"] = float(ev.tokens)
            out[prefix + "gen_tokens_per_s"] = float(ev.gen_tokens_per_s)
            out[prefix + "idle_ratio"] = float(ev.idle_ratio)
            out[prefix + "param_version"] = float(ev.param_version)
            for name in [*(n for n in SWAP_CHECK_METRICS if n in ev.metrics), *answer_metric_names(ev)]:
                out[prefix + name.removeprefix("producer/")] = float(ev.metrics[name])
        out.update(answer_metrics_across(windows))
        checked = [ev.metrics for ev in windows if SWAP_CHECK_DIFF in ev.metrics]
        if checked:  # the worst producer's newest check, and the oldest version checked
            out[SWAP_CHECK_DIFF] = max(float(m[SWAP_CHECK_DIFF]) for m in checked)
            out[SWAP_CHECK_VERSION] = min(float(m.get(SWAP_CHECK_VERSION, -1.0)) for m in checked)
        if windows:
            out["producer/total_samples"] = float(sum(ev.samples for ev in windows))
            out["producer/gen_tokens_per_s"] = math.fsum(ev.gen_tokens_per_s for ev in windows)
            out["producer/idle_ratio"] = math.fsum(ev.idle_ratio for ev in windows) / len(windows)
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
