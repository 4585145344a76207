"""Dynamic sampling (algorithm.filter_groups) and rollout failures end to end: a trainer subprocess against a
fake paced producer whose every third sample has no reward variance and one sample is a rollout failure, on
real Redis, in sync mode (max_outstanding = one global batch, the case where an eviction without give-back
would wait forever)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis
from conftest import PRODUCERS
from test_trainer import ROOT, TBS, FakeProducer, trainer_args

from consumers.aggregator.fold import Fold
from consumers.trainer.ledger import StepLedger, commit_steps, count_consumed
from consumers.trainer.staleness import LengthBuckets, filter_groups_metrics
from rollstream.bus import setup_run
from rollstream.keys import Keys
from rollstream.ops.audit import audit_run, format_report
from rollstream.pacing.budget import ask_lease, consume, current_budget, grant_budget, lease_pass
from rollstream.pacing.counters import dispatch_entries
from schemas import EVICTED, FILTER_GROUPS, ROLLOUT_FAILURE, TRAINED, Fate, StepMetrics, decode, decode_fate
from schemas.text_entries import TOPUP


def test_zero_variance_groups_are_evicted_refilled_and_accounted(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    producer = FakeProducer(r, keys, corrupt_at=(), flat_every=3, failed_at=(5,))
    producer.start()
    try:
        args = trainer_args(keys, redis_url, tmp_path, 3)
        sync = [*args[:-2], "async_training.staleness_threshold=0", "trainer.sync_mode=true",
                "algorithm.filter_groups.enable=true", *args[-2:]]
        proc = subprocess.run(sync, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        producer.stop.set()
        producer.join(5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = audit_run(r, keys)
    assert rep.problems() == [] and rep.steps == [1, 2, 3]
    fates = [decode_fate(f) for _, f in r.xrange(keys.fates)]
    evicted = {f.sample_id for f in fates if f.fate == EVICTED and f.reason == FILTER_GROUPS}
    assert evicted and evicted <= set(producer.flat)  # only flat groups, and each consumed one
    failures = {f.sample_id for f in fates if f.fate == EVICTED and f.reason == ROLLOUT_FAILURE}
    assert failures == set(producer.failed)  # a producer's generation failure ends evicted, never lost
    evicted |= failures
    assert not {f.sample_id for f in fates if f.fate == TRAINED} & set(producer.flat)
    assert len(rep.trained) == 3 * TBS and set(rep.evicted) == evicted  # full batches despite the evictions
    assert f"{FILTER_GROUPS} {len(evicted - failures)}, {ROLLOUT_FAILURE} 1" in format_report(rep)
    # pacing: each eviction gave its room back at once, within the bound; consumed counts every fate once
    log = dispatch_entries(r, keys)
    assert all(e.outstanding is None or e.outstanding <= TBS for e in log), log
    assert sum(e.amount for e in log if e.op == TOPUP) == len(evicted)
    assert int(r.get(keys.consumed)) == len(fates)  # type: ignore[arg-type]
    # the records carry verl's filter_groups metrics: counts summed over the step, the reward breakdown merged
    fold, records = Fold(), []
    for entry_id, fields in r.xrange(keys.metrics):
        ev = decode(fields)
        if isinstance(ev, StepMetrics):
            records += [c.record for c in fold.feed(entry_id.decode(), ev)]
    assert [rec.global_step for rec in records] == [1, 2, 3]
    per_step = {rec.global_step: rec for rec in records}
    for g, rec in per_step.items():
        n = sum(1 for f in fates if f.reason == FILTER_GROUPS and f.global_step == g)
        lost = sum(1 for f in fates if f.reason == ROLLOUT_FAILURE and f.global_step == g)
        assert rec.metrics["training/filter_groups/evicted_samples"] == n
        assert rec.metrics["training/rollout_failure/evicted_samples"] == lost
        assert rec.counts.get("_dapo_filtered_reward_counts", {}) == ({"1.0": float(n)} if n else {})
        assert rec.metrics["fully_async/count/evicted_samples"] == n + lost


def test_evictions_counted_early_are_counted_once_across_the_commit_and_a_crash(
    r: redis.Redis, keys: Keys
) -> None:
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=4)
    ask_lease(r, keys, "rollout_00", 4)
    assert lease_pass(r, keys, ["rollout_00"]) == 4  # the whole window leased: no budget left
    assert current_budget(r, keys) == (0, 0)
    ids = [f"rollout_00-{i}" for i in range(4)]
    assert consume(r, keys, ids[:2], max_outstanding=4) == (2, 2)  # consumed now, room given back now
    assert current_budget(r, keys) == (0, 2) and int(r.get(keys.consumed)) == 2  # type: ignore[arg-type]

    def ledger(g: int, evicted: list[str], trained: list[str]) -> StepLedger:
        fates = [Fate(sid, "1-0", EVICTED, 1, g - 1, g, FILTER_GROUPS) for sid in evicted]
        fates += [Fate(sid, "1-0", TRAINED, 1, g - 1, g) for sid in trained]
        return StepLedger(g, fates)

    first = ledger(1, ids[:2], ids[2:])
    count_consumed(r, keys, first)  # the trained ones are counted, the evicted ones not again
    assert int(r.get(keys.consumed)) == 4  # type: ignore[arg-type]
    commit_steps(r, keys, [first], 1)  # the commit does not count anything again
    assert int(r.get(keys.consumed)) == 4  # type: ignore[arg-type]
    # a crash after evicting early in step 2: its samples come back and are evicted (or trained) again
    ask_lease(r, keys, "rollout_00", 6)
    assert lease_pass(r, keys, ["rollout_00"]) == 2
    more = ["rollout_00-4", "rollout_00-5"]
    assert consume(r, keys, more, max_outstanding=4)[0] == 2
    assert consume(r, keys, more, max_outstanding=4)[0] == 0  # the restarted trainer evicts them again
    commit_steps(r, keys, [ledger(2, [], more)], 2)  # ...or trains them
    assert int(r.get(keys.consumed)) == 6  # type: ignore[arg-type]


def test_filter_groups_and_dropped_share_metrics() -> None:
    metrics, counts = filter_groups_metrics([1.0, 0.0, 1.0])
    assert metrics == {"training/filter_groups/evicted_samples": 3.0}
    assert counts == {"_dapo_filtered_reward_counts": {"0.0": 1.0, "1.0": 2.0}}
    assert filter_groups_metrics([]) == ({"training/filter_groups/evicted_samples": 0.0}, {})
    buckets = LengthBuckets(8)  # quarters: [0, 2) [2, 4) [4, 6) [6, 8]
    buckets.trained, buckets.dropped = [3, 0, 1, 0], [1, 0, 1, 2]
    assert buckets.bucket(8.0) == 3 and buckets.bucket(1.9) == 0 and buckets.bucket(2.0) == 1
    assert buckets.share_metrics() == {
        "training/off_policy/dropped_share": 4 / 8,
        "training/off_policy/dropped_share/resp_len_q1": 1 / 4,
        "training/off_policy/dropped_share/resp_len_q3": 1 / 2,
        "training/off_policy/dropped_share/resp_len_q4": 1.0,  # long responses go stale first
    }
    merged = LengthBuckets.merged(8, [buckets.to_plain(), buckets.to_plain()])
    assert (
        merged.trained == [6, 0, 2, 0] and merged.share_metrics()["training/off_policy/dropped_share"] == 0.5
    )
