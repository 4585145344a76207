"""The aggregator's pure fold: hand-written event logs -> hand-computed records (no Redis)."""

from __future__ import annotations

import pytest

from consumers.aggregator.fold import Fold, id_key
from rollstream.testing.fakes import fake_metrics_log, local_update, producer_stats, step_end, validation
from schemas import (
    WINDOW_GEN_S,
    WINDOW_IDLE_S,
    WINDOW_S,
    EventBase,
    ProducerStats,
    StepMetrics,
    SyncStepRecord,
    decode_as,
    encode,
)

approx = pytest.approx


def lu(g: int, k: int, sc: int, **metrics: float) -> StepMetrics:
    """A local_update event (keyword metric names)."""
    return local_update(g, k, sc, metrics)


def end(g: int, k: int, created_at: float = 100.0, **metrics: float) -> StepMetrics:
    """A step_end event (keyword metric names)."""
    return step_end(g, k, metrics, created_at)


def run(fold: Fold, log: list[tuple[str, EventBase]]) -> list[SyncStepRecord]:
    """Feed (id, event) pairs; return the records in completion order."""
    return [c.record for entry_id, ev in log for c in fold.feed(entry_id, ev)]


def test_step_record_merges_updates_sync_metrics_validation_and_producers() -> None:
    log = [
        ("1-0", producer_stats("a", 10, 50.0, 0.2, 0)),
        (
            "2-0",
            lu(
                1, 1, 4, **{"actor/loss": 1.0, "timing_s/update": 0.5, "actor/grad_max": 3.0, "actor/lr": 0.1}
            ),
        ),
        ("3-0", producer_stats("b", 6, 30.0, 0.4, 1)),
        ("3-5", producer_stats("a", 20, 70.0, 0.1, 1)),  # a's second window in step 1's span: merged
        (
            "4-0",
            lu(
                1,
                2,
                12,
                **{"actor/loss": 2.0, "timing_s/update": 0.25, "actor/grad_max": 2.0, "actor/lr": 0.05},
            ),
        ),
        ("5-0", producer_stats("a", 5, 90.0, 0.0, 1)),  # after step 1's last local update: step 2's span
        ("6-0", validation(1, {"val/acc": 0.5})),
        ("7-0", end(1, 2, created_at=123.0, **{"actor/lr": 0.07, "timing_s/step": 2.0, "timing_s/gen": 0.5})),
    ]
    fold = Fold()
    [rec] = run(fold, log)
    m = rec.metrics
    assert rec.global_step == 1 and rec.num_local_updates == 2 and rec.created_at == 123.0
    assert m["actor/loss"] == approx((4 * 1.0 + 12 * 2.0) / 16)  # weighted by sample_count = 1.75
    assert m["timing_s/update"] == approx(0.75)
    assert m["actor/grad_max"] == 3.0
    assert m["actor/lr"] == 0.07  # step_end metrics override the aggregated ones
    assert m["fully_async/trainer/idle_ratio"] == approx(0.25)  # derived on the merged record: gen / step
    assert m["val/acc"] == 0.5
    assert (
        m["producer/a/samples"] == 30 and m["producer/a/param_version"] == 1 and m["producer/a/tokens"] == 300
    )
    # windows without their seconds (an older log): generation seconds = tokens / rate, idle the plain mean
    a_rate = 300 / (100 / 50.0 + 200 / 70.0)
    assert m["producer/a/gen_tokens_per_s"] == approx(a_rate) and m["producer/a/idle_ratio"] == approx(0.15)
    assert m["producer/b/gen_tokens_per_s"] == 30.0
    assert m["producer/total_samples"] == 36
    assert m["producer/gen_tokens_per_s"] == approx(a_rate + 30.0)
    assert m["producer/idle_ratio"] == approx((0.15 + 0.4) / 2)
    assert m["training/global_step"] == 1.0
    assert list(m) == sorted(m)
    assert rec.source_ids == ["1-0", "2-0", "3-0", "3-5", "4-0", "6-0", "7-0"]
    assert fold.pending() == {}


def test_what_producers_answers_scored_reaches_the_record_per_producer_and_weighted_across() -> None:
    a, b = producer_stats("a", 10, 50.0, 0.2, 0), producer_stats("b", 6, 30.0, 0.4, 0)
    a.metrics.update({"producer/samples": 3.0, "producer/acc": 0.5, "producer/reward_mean": 0.6,
                      "producer/reward/wrong_sign": 0.1, "producer/window_s": 9.0})
    b.metrics.update({"producer/samples": 1.0, "producer/acc": 0.1, "producer/reward_mean": 0.2})
    log = [("1-0", a), ("2-0", b), ("3-0", lu(1, 1, 4, **{"actor/loss": 1.0})), ("4-0", end(1, 1))]
    [rec] = run(Fold(), log)
    m = rec.metrics
    assert m["producer/a/acc"] == 0.5 and m["producer/b/acc"] == 0.1
    assert m["producer/a/reward/wrong_sign"] == 0.1
    assert m["producer/acc"] == approx((3 * 0.5 + 1 * 0.1) / 4)  # weighted by the windows' samples
    assert m["producer/reward_mean"] == approx((3 * 0.6 + 1 * 0.2) / 4)
    assert m["producer/reward/wrong_sign"] == approx(0.1)  # only producer a reports it
    assert "producer/a/window_s" not in m  # the other window figures stay in the stats stream


def test_a_step_of_two_trainer_ranks_waits_for_both_and_folds_them() -> None:
    """step_end says world_size 2: the record waits for local updates 1..K of rank 0 and rank 1; averages
    weigh every rank's samples, sums add over ranks, times are the ranks' mean (they ran side by side)."""
    def ranked(k: int, rank: int, sc: int, **metrics: float) -> StepMetrics:
        return lu(1, k, sc, **metrics).model_copy(update={"rank": rank})

    closing = end(1, 2, **{"trainer/world_size": 2.0}).model_copy(update={"world_size": 2})
    log = [
        (
            "1-0",
            ranked(
                1,
                0,
                3,
                **{
                    "actor/loss": 1.0,
                    "timing_s/update_actor": 0.5,
                    "perf/total_num_tokens": 30.0,
                    "fully_async/total_wait_time": 0.2,
                },
            ),
        ),
        (
            "2-0",
            ranked(
                1,
                1,
                1,
                **{
                    "actor/loss": 5.0,
                    "timing_s/update_actor": 0.7,
                    "perf/total_num_tokens": 10.0,
                    "fully_async/total_wait_time": 0.4,
                },
            ),
        ),
        (
            "3-0",
            ranked(
                2, 0, 2, **{"actor/loss": 2.0, "timing_s/update_actor": 0.5, "perf/total_num_tokens": 20.0}
            ),
        ),
        ("4-0", closing),
    ]
    fold = Fold()
    assert run(fold, log) == []
    assert fold.pending() == {1: "missing local updates ['2/r1'] of 2 on each of 2 ranks"}
    [rec] = run(fold, [("5-0", ranked(2, 1, 2, **{"actor/loss": 4.0, "timing_s/update_actor": 0.3,
                                                  "perf/total_num_tokens": 20.0}))])
    m = rec.metrics
    assert rec.num_local_updates == 2 and m["trainer/world_size"] == 2.0
    assert m["actor/loss"] == approx((3 * 1.0 + 1 * 5.0 + 2 * 2.0 + 2 * 4.0) / 8)
    assert m["perf/total_num_tokens"] == 80.0
    assert m["timing_s/update_actor"] == approx(((0.5 + 0.5) + (0.7 + 0.3)) / 2)
    assert m["fully_async/total_wait_time"] == approx((0.2 + 0.4) / 2)  # both ranks waited at once: a mean
    # a retrained step: each rank's latest copy wins, one rank's copy never replaces another's
    again = Fold()
    records = run(again, [*log[:3], ("4-5", ranked(1, 1, 1, **{"actor/loss": 9.0})), log[3],
                          ("6-0", ranked(2, 1, 2, **{"actor/loss": 4.0}))])
    assert records[0].metrics["actor/loss"] == approx((3 * 1.0 + 1 * 9.0 + 2 * 2.0 + 2 * 4.0) / 8)


def test_schema_1_trainer_events_decode_as_rank_0_of_one() -> None:
    """StepMetrics schema 2 added rank and world_size; an entry written before reads as rank 0 of a world of
    one."""
    from schemas import decode, decode_payload, encode_payload

    fields = {k: bytes(v) for k, v in encode(lu(3, 1, 4, **{"actor/loss": 1.0})).items()}
    payload = decode_payload(fields["payload"])
    for name in ("rank", "world_size"):
        payload.pop(name)
    payload["schema_version"] = 1
    fields.pop("rank")
    fields.update({"schema": b"1", "payload": encode_payload(payload)})
    ev = decode(fields)
    assert isinstance(ev, StepMetrics) and (ev.rank, ev.world_size, ev.schema_version) == (0, 1, 2)


def test_retrained_step_last_copy_wins_and_redeliveries_are_ignored() -> None:
    fold = Fold()
    log = [
        ("10-0", lu(2, 1, 8, **{"actor/loss": 5.0})),
        ("11-0", lu(2, 2, 8, **{"actor/loss": 7.0})),
        ("12-0", lu(2, 1, 8, **{"actor/loss": 1.0})),
        ("11-0", lu(2, 2, 8, **{"actor/loss": 7.0})),  # redelivery of an id already held: no effect
        ("13-0", lu(2, 2, 8, **{"actor/loss": 3.0})),
        ("13-1", lu(2, 2, 8, **{"actor/loss": 3.0})),  # duplicate XADD of the retrained update
        ("9-0", lu(2, 1, 8, **{"actor/loss": 50.0})),  # an older copy arriving late loses to 12-0
        ("14-0", end(2, 2)),
    ]
    [rec] = run(fold, log)
    assert rec.metrics["actor/loss"] == approx((8 * 1.0 + 8 * 3.0) / 16)
    assert rec.source_ids == ["12-0", "13-1", "14-0"]
    assert fold.stats.duplicates == 1
    assert sorted(fold.take_ackable()) == sorted(["10-0", "11-0", "13-0", "9-0"])


def test_step_end_before_its_updates_waits_for_them() -> None:
    fold = Fold()
    assert run(fold, [("1-0", lu(3, 1, 2, x=1.0)), ("2-0", end(3, 3))]) == []
    assert fold.pending() == {3: "missing local updates [2, 3] of 3"}
    assert fold.first_id(3) == "1-0"
    assert run(fold, [("3-0", lu(3, 3, 2, x=3.0))]) == []
    [rec] = run(fold, [("4-0", lu(3, 2, 4, x=2.0))])
    assert rec.metrics["x"] == approx((2 * 1.0 + 4 * 2.0 + 2 * 3.0) / 8)
    assert rec.num_local_updates == 3


def test_each_record_takes_the_stats_of_its_span_and_acks_them_with_it() -> None:
    fold = Fold()
    log = [
        ("1-0", producer_stats("a", 1, 10.0, 0.5, 0)),
        ("2-0", end(1, 0)),  # no local update: the span ends at the step_end
        ("3-0", producer_stats("a", 2, 20.0, 0.0, 1)),
        ("4-0", lu(2, 1, 1, y=1.0)),
        ("5-0", end(2, 1)),
    ]
    done = [c for entry_id, ev in log for c in fold.feed(entry_id, ev)]
    records = [c.record for c in done]
    assert [r.metrics["producer/a/samples"] for r in records] == [1.0, 2.0]
    assert records[0].num_local_updates == 0 and records[0].source_ids == ["1-0", "2-0"]
    # A window is acked in the transaction of the record that took it (a restarted worker must not count it
    # again), never before: until then it is pending, for a restart to re-read.
    assert [c.ack_ids for c in done] == [["1-0", "2-0"], ["3-0", "4-0", "5-0"]]
    assert fold.take_ackable() == []


def test_validation_of_version_zero_is_a_step_zero_record_and_late_validation_is_ignored() -> None:
    fold = Fold()
    [rec0] = run(fold, [("1-0", validation(0, {"val/acc": 0.1}))])
    assert rec0.global_step == 0 and rec0.metrics == {"val/acc": 0.1, "training/global_step": 0.0}
    records = run(
        fold, [("2-0", lu(1, 1, 1, z=1.0)), ("3-0", end(1, 1)), ("4-0", validation(1, {"val/acc": 0.9}))]
    )
    assert "val/acc" not in records[0].metrics
    assert fold.stats.late == 1 and fold.take_ackable() == ["4-0"]


def test_done_steps_make_refolded_events_late() -> None:
    fold = Fold(done_steps=[1])
    assert run(fold, [("2-0", lu(1, 1, 1, z=1.0)), ("3-0", end(1, 1))]) == []
    assert fold.pending() == {} and fold.stats.late == 2


def test_same_log_gives_the_same_records_byte_for_byte() -> None:
    log = [(f"{i + 1}-0", ev) for i, ev in enumerate(fake_metrics_log(12, local_updates=3, producers=3))]
    a, b = run(Fold(), log), run(Fold(), log)
    assert [r.global_step for r in a] == list(range(1, 13))
    assert [encode(x) for x in a] == [encode(y) for y in b]
    assert "val/acc" in a[4].metrics and "val/acc" not in a[3].metrics


def test_cumulative_counters_are_never_averaged_in_a_record() -> None:
    gen, stale = "fully_async/count/total_generated_samples", "fully_async/count/stale_trajectory_processed"
    log = [
        ("1-0", lu(1, 1, 2, **{gen: 10.0, stale: 3.0, "fully_async/timing_s/wait": 0.5})),
        ("2-0", lu(1, 2, 6, **{gen: 14.0, stale: 5.0, "fully_async/timing_s/wait": 0.25})),
        ("3-0", end(1, 2)),
    ]
    [rec] = run(Fold(), log)
    assert rec.metrics[gen] == 14.0 and rec.metrics[stale] == 5.0  # last, not summed ("total") or averaged
    assert rec.metrics["fully_async/timing_s/wait"] == 0.75  # a prefixed time key is summed, not min


def test_producer_stats_in_the_span_are_used_whatever_the_feed_order() -> None:
    """Stats come from their own stream (producers may not write `metrics`): a record uses each producer's
    stats entries with an id up to its step's last local update, so the live worker (stats drained first)
    and replay (id order) agree."""
    stats = [
        ("stats:a:1-0", producer_stats("a", 1, 10.0, 0.5, 0)),
        ("stats:a:5-0", producer_stats("a", 9, 90.0, 0.0, 1)),
    ]
    steps = [("2-0", lu(1, 1, 1, y=1.0)), ("3-0", end(1, 1))]
    live, replay = run(Fold(), [*stats, *steps]), run(Fold(), [stats[0], *steps, stats[1]])
    assert (
        [r.metrics["producer/a/samples"] for r in live]
        == [1.0]
        == [r.metrics["producer/a/samples"] for r in replay]
    )
    assert [encode(x) for x in live] == [encode(y) for y in replay]
    assert live[0].source_ids == ["stats:a:1-0", "2-0", "3-0"]


def window(
    name: str, samples: int, tokens: int, gen_s: float, idle_s: float, pv: int, **answers: float
) -> ProducerStats:
    """A 5 s stats window as producers/stats.py writes it (its seconds in the metrics)."""
    metrics = {"producer/samples": float(samples), WINDOW_S: 5.0, WINDOW_GEN_S: gen_s, WINDOW_IDLE_S: idle_s}
    metrics.update({f"producer/{k}": v for k, v in answers.items()})
    return ProducerStats(
        producer=name,
        param_version=pv,
        samples=samples,
        tokens=tokens,
        gen_tokens_per_s=tokens / gen_s if gen_s else 0.0,
        idle_ratio=idle_s / 5.0,
        versions_in_use=[pv],
        metrics=metrics,
    )


def test_a_step_whose_last_window_is_idle_reports_what_its_producer_did_in_the_whole_step() -> None:
    """The newest window before a step's events is often one where the producer only waited (SmolLM2: 0
    samples, rate 0, no acc on every record): the record sums every window of the step's span instead."""
    swap = {"swap_check/version": 2.0, "swap_check/logprob_diff": 1e-4, "swap_check/logprob_diff_max": 1e-3}
    log = [
        ("stats:a:1-0", window("a", 2, 100, 4.0, 1.0, 0, acc=0.5)),  # step 1's span: the start of the log ..
        ("2-0", lu(1, 1, 4, x=1.0)),  # .. to step 1's last local update
        ("stats:a:3-0", window("a", 3, 300, 5.0, 0.0, 1, acc=1.0, reward_mean=0.9, **swap)),
        ("stats:a:4-0", window("a", 1, 60, 3.0, 2.0, 1, acc=0.0, reward_mean=0.2)),
        ("stats:a:5-0", window("a", 0, 0, 0.0, 5.0, 2)),  # waited for version 2 only: idle, no answers
        ("6-0", lu(2, 1, 4, x=1.0)),
        ("stats:a:7-0", window("a", 0, 0, 0.0, 5.0, 2)),  # after step 2's last local update: step 3's
        ("8-0", end(1, 1)),
        ("9-0", end(2, 1)),
    ]
    fold = Fold()
    first, second = run(fold, log)
    assert first.metrics["producer/a/samples"] == 2 and first.metrics["producer/acc"] == 0.5
    m = second.metrics
    assert m["producer/a/samples"] == 4 and m["producer/a/tokens"] == 360 and m["producer/total_samples"] == 4
    assert m["producer/a/gen_tokens_per_s"] == approx(360 / 8.0) == m["producer/gen_tokens_per_s"]
    assert m["producer/a/idle_ratio"] == approx(7.0 / 15.0)
    assert m["producer/acc"] == approx(0.75) == m["producer/a/acc"]  # (3 × 1.0 + 1 × 0.0) / 4 samples
    assert m["producer/reward_mean"] == approx((3 * 0.9 + 0.2) / 4)
    assert m["producer/a/param_version"] == 2  # the newest window's
    assert m["producer/a/swap_check/version"] == 2 and m["producer/swap_check/logprob_diff"] == 1e-4
    assert second.source_ids == ["stats:a:3-0", "stats:a:4-0", "stats:a:5-0", "6-0", "9-0"]
    # the idle window after step 2's last update is step 3's: there the producer only waited
    [third] = run(fold, [("10-0", lu(3, 1, 4, x=1.0)), ("11-0", end(3, 1))])
    t = third.metrics
    assert t["producer/a/samples"] == 0 and t["producer/a/idle_ratio"] == 1.0 and "producer/acc" not in t


def test_steps_whose_step_ends_come_with_a_later_checkpoint_each_get_their_own_span() -> None:
    """The trainer writes step_end only in the commit of a checkpoint (every trainer.save_freq steps): steps
    1..5 complete together after step 5's updates. Each record still gets the windows of its own span,
    not the ones current at the commit."""
    log: list[tuple[str, EventBase]] = []
    for g in range(1, 6):
        log += [
            (f"stats:a:{10 * g}-0", producer_stats("a", g, 10.0 * g, 0.0, g - 1)),
            (f"{10 * g + 1}-0", lu(g, 1, 4, x=1.0)),
            (f"stats:b:{10 * g + 2}-0", producer_stats("b", 10 * g, 5.0, 0.5, g - 1)),
            (f"{10 * g + 3}-0", lu(g, 2, 4, x=1.0)),
        ]
    log.append(("stats:a:60-0", producer_stats("a", 100, 99.0, 0.0, 5)))  # step 6's
    log += [(f"{70 + g}-0", end(g, 2)) for g in range(1, 6)]
    fold = Fold()
    records = run(fold, log)
    assert [r.global_step for r in records] == [1, 2, 3, 4, 5]
    assert [r.metrics["producer/a/samples"] for r in records] == [1, 2, 3, 4, 5]
    assert [r.metrics["producer/b/samples"] for r in records] == [10, 20, 30, 40, 50]
    assert [r.metrics["producer/a/param_version"] for r in records] == [0, 1, 2, 3, 4]
    assert [r.metrics["producer/total_samples"] for r in records] == [11, 22, 33, 44, 55]
    # the window after step 5's last update waits for step 6, and is not lost
    [six] = run(fold, [("80-0", lu(6, 1, 4, x=1.0)), ("81-0", end(6, 1))])
    assert six.metrics["producer/a/samples"] == 100 and "producer/b/samples" not in six.metrics


def test_a_retrained_step_spans_up_to_its_winning_local_updates() -> None:
    """A step retrained after a trainer crash re-emits its local updates; the last copies win, and the
    step's span runs to them: it holds the first attempt's windows and the crash's."""
    log = [
        ("stats:a:1-0", producer_stats("a", 1, 10.0, 0.0, 0)),
        ("2-0", lu(1, 1, 4, x=1.0)),
        ("stats:a:3-0", producer_stats("a", 2, 10.0, 0.0, 1)),
        ("4-0", lu(2, 1, 4, x=5.0)),  # first attempt of step 2 ...
        ("stats:a:5-0", producer_stats("a", 4, 10.0, 0.0, 1)),
        ("6-0", lu(2, 1, 4, x=1.0)),  # ... retrained
        ("stats:a:7-0", producer_stats("a", 8, 10.0, 0.0, 1)),  # step 3's
        ("8-0", end(1, 1)),
        ("9-0", end(2, 1)),
    ]
    first, second = run(Fold(), log)
    assert first.metrics["producer/a/samples"] == 1
    assert second.metrics["producer/a/samples"] == 6 and second.metrics["x"] == 1.0
    assert "stats:a:7-0" not in second.source_ids


def test_stats_fed_after_their_span_was_taken_are_late_and_acked() -> None:
    """Against the feed order (stats up to a metrics entry come before it), a window inside a span a record
    already took is set aside as late, never counted in the next record."""
    fold = Fold()
    [first] = run(fold, [("stats:a:1-0", producer_stats("a", 1, 10.0, 0.0, 0)), ("2-0", lu(1, 1, 4, x=1.0)),
                         ("3-0", end(1, 1))])
    assert run(fold, [("stats:a:1-5", producer_stats("a", 7, 10.0, 0.0, 0))]) == []
    assert fold.stats.late == 1 and fold.take_ackable() == ["stats:a:1-5"]
    [second] = run(fold, [("4-0", lu(2, 1, 4, x=1.0)), ("5-0", end(2, 1))])
    assert first.metrics["producer/a/samples"] == 1 and "producer/a/samples" not in second.metrics


def live_order(log: list[tuple[str, EventBase]], batch: int) -> list[tuple[str, EventBase]]:
    """The order the live worker feeds a log in: metrics entries in batches of `batch`, each preceded by
    every stats entry with an id up to the batch's newest (the stats drain)."""
    stats = [e for e in log if e[0].startswith("stats:")]
    metrics = [e for e in log if not e[0].startswith("stats:")]
    out: list[tuple[str, EventBase]] = []
    for i in range(0, len(metrics), batch):
        chunk = metrics[i : i + batch]
        upto = max(id_key(ref) for ref, _ in chunk)
        out += [e for e in stats if id_key(e[0]) <= upto and e not in out]
        out += chunk
    return out + [e for e in stats if e not in out]


def test_span_records_equal_their_replay_whatever_the_live_batches() -> None:
    """Records are a pure function of the log: the live worker's feed order (stats drained ahead of each
    metrics batch) gives the records replay's id order gives, byte for byte, with delayed step_ends."""
    log: list[tuple[str, EventBase]] = [("1-0", validation(0, {"val/acc": 0.1}))]
    for g in range(1, 7):
        log += [
            (f"stats:a:{10 * g}-0", window("a", g, 50 * g, 2.0, 1.0, g - 1, acc=g / 10)),
            (f"{10 * g + 1}-0", lu(g, 1, 4, x=float(g))),
            (f"stats:b:{10 * g + 1}-0", window("b", 1, 7, 1.0, 4.0, g - 1)),  # an id equal to an update's
            (f"stats:a:{10 * g + 2}-0", window("a", 0, 0, 0.0, 5.0, g)),
            (f"{10 * g + 3}-0", lu(g, 2, 4, x=float(g))),
        ]
        if g % 3 == 0:  # save_freq 3: steps g-2..g end at g's commit
            log += [(f"{10 * g + 5}-{k}", end(k, 2)) for k in range(g - 2, g + 1)]
    replay = run(Fold(), sorted(log, key=lambda e: (id_key(e[0]), not e[0].startswith("stats:"))))
    assert [r.global_step for r in replay] == list(range(7))
    for batch in (1, 2, 3, 5):
        live = run(Fold(), live_order(log, batch))
        assert [encode(x) for x in live] == [encode(y) for y in replay], batch
    assert [r.metrics["producer/a/samples"] for r in replay[1:]] == [1, 2, 3, 4, 5, 6]
    assert [r.metrics["producer/b/samples"] for r in replay[1:]] == [1] * 6


def test_dict_metrics_are_merged_into_the_record_counts_and_sums_summed() -> None:
    """The DAPO reward-count breakdown adds up over the step's local updates (record `counts`), and the
    filter_groups eviction counts are summed (verl PR 7082), through the encoded wire event."""
    first = lu(1, 1, 4, **{"training/filter_groups/evicted_samples": 2.0})
    first.counts = {"_dapo_filtered_reward_counts": {"0.0": 1.0, "1.0": 1.0}}
    second = lu(1, 2, 4, **{"training/filter_groups/evicted_samples": 1.0})
    second.counts = {"_dapo_filtered_reward_counts": {"0.0": 1.0}}
    wire = [decode_as(encode(ev), StepMetrics) for ev in (first, second)]
    [rec] = run(Fold(), [("1-0", wire[0]), ("2-0", wire[1]), ("3-0", end(1, 2))])
    assert rec.metrics["training/filter_groups/evicted_samples"] == 3.0
    assert rec.counts == {"_dapo_filtered_reward_counts": {"0.0": 2.0, "1.0": 1.0}}
    assert "_dapo_filtered_reward_counts" not in rec.metrics
