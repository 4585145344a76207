"""The aggregator worker against a real Redis: records, acks, replay equality, timeouts, sinks, SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import P0, PRODUCERS

from consumers.aggregator.replay import main as replay_main
from consumers.aggregator.replay import replay_records
from consumers.aggregator.sinks import JsonlSink, Sinks, TensorBoardSink
from consumers.aggregator.worker import AggregatorWorker
from rollstream.bus import Publisher, delete_run, setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import AGGREGATOR_GROUP, COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD, Keys
from rollstream.testing.fakes import (
    fake_metrics_log,
    local_update,
    producer_stats,
    publish_log,
    step_end,
    validation,
)
from schemas import DeadLetter, EventBase, SyncStepRecord, decode_as

REPO = Path(__file__).resolve().parents[1]
approx = pytest.approx


@pytest.fixture
def dst_keys(r: redis.Redis) -> Iterator[Keys]:
    """A second run namespace (replay target), deleted afterwards."""
    k = Keys(f"t-{uuid.uuid4().hex[:12]}-replay")
    yield k
    delete_run(r, k)


def lu(g: int, k: int, sc: int, **metrics: float) -> EventBase:
    """A local_update event (keyword metric names)."""
    return local_update(g, k, sc, metrics)


def make_cfg(keys: Keys, tmp_path: Path, redis_url: str, *extra: str) -> PipelineConfig:
    """Config for this test's run namespace, run dir under tmp_path."""
    base = [f"run.name={keys.run}", f"run.dir={tmp_path}", f"run.redis_url={redis_url}", "bus.block_ms=100"]
    return load_config(None, base + list(extra))


def publish(r: redis.Redis, keys: Keys, events: list[EventBase], trainer_at: int = 10**6) -> list[str]:
    """The events on the run's log in one order, the trainer hash vouching up to `trainer_at`
    (publish_log)."""
    return publish_log(r, keys, events, trainer_at)


def records(r: redis.Redis, keys: Keys) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The raw records stream (ids and fields, byte for byte)."""
    rc: Any = r
    return [(i, dict(f)) for i, f in rc.xrange(keys.records)]


def decoded(r: redis.Redis, keys: Keys) -> dict[int, SyncStepRecord]:
    """Records by global step."""
    out = {}
    for _, fields in records(r, keys):
        rec = decode_as(fields, SyncStepRecord)
        out[rec.global_step] = rec
    return out


def pending_ids(r: redis.Redis, keys: Keys) -> list[str]:
    """Ids still pending in the aggregator group (metrics and stats; test ids never collide)."""
    rc: Any = r
    return [row["message_id"].decode() for s in (keys.metrics, *keys.stats_streams(PRODUCERS))
            for row in rc.xpending_range(s, AGGREGATOR_GROUP, "-", "+", 1000)]


def jsonl_steps(cfg: PipelineConfig) -> list[int]:
    """The `step` of every line of records.jsonl."""
    lines = (cfg.run_dir() / "records.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_hand_written_log_through_redis(r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str) -> None:
    cfg = make_cfg(keys, tmp_path, redis_url, "bus.read_count=3")
    events: list[EventBase] = [
        validation(0, {"val/acc": 0.1}),
        producer_stats("rollout_00", 10, 50.0, 0.2, 0),
        lu(1, 1, 4, **{"actor/loss": 1.0, "timing_s/update": 0.5}),
        lu(1, 2, 12, **{"actor/loss": 2.0, "timing_s/update": 0.25}),
        producer_stats("rollout_01", 6, 30.0, 0.4, 1),
        validation(1, {"val/acc": 0.5}),
        step_end(1, 2, {"timing_s/step": 2.0}),
        lu(2, 1, 8, **{"actor/loss": 5.0}),  # first attempt of step 2 ...
        producer_stats("rollout_00", 20, 70.0, 0.1, 1),
        lu(2, 1, 8, **{"actor/loss": 1.0}),  # ... retrained after a trainer crash
        lu(2, 2, 8, **{"actor/loss": 3.0}),
        lu(2, 2, 8, **{"actor/loss": 3.0}),  # duplicate XADD
        step_end(2, 2),
        lu(3, 1, 2, **{"actor/loss": 4.0}),
        step_end(3, 2),  # out of order: step 3's end before its second update
        lu(3, 2, 6, **{"actor/loss": 8.0}),
        lu(4, 1, 1, **{"actor/loss": 0.0}),  # step 4 stays incomplete
    ]
    ids = publish(r, keys, events)
    AggregatorWorker(cfg, r, keys).run(burst=True)

    recs = decoded(r, keys)
    assert sorted(recs) == [0, 1, 2, 3]
    assert recs[0].metrics == {"val/acc": 0.1, "training/global_step": 0.0}
    m1, m2, m3 = recs[1].metrics, recs[2].metrics, recs[3].metrics
    assert m1["actor/loss"] == approx(1.75) and m1["timing_s/update"] == approx(0.75)
    assert m1["timing_s/step"] == 2.0 and m1["val/acc"] == 0.5
    # step 1's span ends at its last local update: rollout_01's window after it is step 2's
    assert m1["producer/total_samples"] == 10 and m1["producer/idle_ratio"] == approx(0.2)
    assert "producer/rollout_01/samples" not in m1
    assert m2["actor/loss"] == approx(2.0)  # (8*1 + 8*3) / 16 from the retrained updates
    assert m2["producer/rollout_00/samples"] == 20 and m2["producer/total_samples"] == 26
    assert m3["actor/loss"] == approx((2 * 4.0 + 6 * 8.0) / 8)
    # winning copies + producer stats used (stats entries as `stats:<producer>:<id>`)
    assert recs[2].source_ids == [
        f"stats:rollout_01:{ids[4]}", f"stats:rollout_00:{ids[8]}", *(ids[i] for i in (9, 11, 12))
    ]
    # Only what a restart needs stays pending: step 4's update (every stats window was acked with the record
    # whose span took it).
    assert sorted(pending_ids(r, keys)) == [ids[16]]
    assert jsonl_steps(cfg) == [0, 1, 2, 3]


def test_replay_equals_live_records_field_for_field(
    r: redis.Redis, keys: Keys, dst_keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    cfg = make_cfg(keys, tmp_path, redis_url, "bus.read_count=5")
    publish(r, keys, fake_metrics_log(10, local_updates=3, producers=2))
    AggregatorWorker(cfg, r, keys).run(burst=True)
    live = records(r, keys)
    assert [i for i, _ in live] == [f"{g}-1".encode() for g in range(1, 11)]

    assert replay_main(["--from", keys.run, "--to", dst_keys.run, "--redis-url", redis_url]) == 0
    assert records(r, dst_keys) == live
    with pytest.raises(ValueError, match="already holds records"):
        replay_records(r, keys, dst_keys)


def test_incomplete_step_is_reported_once(
    r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_cfg(keys, tmp_path, redis_url, "aggregator.incomplete_timeout_s=0.01")
    ids = publish(r, keys, [lu(5, 1, 1, x=1.0), lu(5, 2, 1, x=1.0)])
    r.hset(keys.trainer, COMMITTED_STEP_FIELD, 4)  # step 5 still in progress: it may yet complete
    worker = AggregatorWorker(cfg, r, keys)
    with caplog.at_level(logging.ERROR, logger="consumers.aggregator.worker"):
        worker.run(burst=True)
        worker.check_incomplete(now=time.monotonic() + 60)  # past the timeout again: no second report
    rc: Any = r
    notes = [decode_as(f, DeadLetter) for _, f in rc.xrange(keys.dead_aggregator)]
    assert len(notes) == 1
    assert notes[0].source == "aggregator" and notes[0].source_id == ids[0]
    assert "step 5" in notes[0].reason and "missing step_end (have local updates [1, 2])" in notes[0].reason
    assert [rec.message for rec in caplog.records].count(notes[0].reason) == 1
    assert sorted(pending_ids(r, keys)) == sorted(ids)  # reported, not dropped

    # Once the trainer has committed step 5 its missing step_end will never come: the events go to dead.
    r.hset(keys.trainer, COMMITTED_STEP_FIELD, 5)
    assert worker.check_incomplete(now=time.monotonic() + 120) == [5]
    dead = [decode_as(f, DeadLetter) for _, f in rc.xrange(keys.dead_aggregator)][1:]
    assert [d.source_id for d in dead] == ids and all("so it never will" in d.reason for d in dead)
    assert pending_ids(r, keys) == [] and worker.fold.pending() == {}
    worker.check_incomplete(now=time.monotonic() + 180)
    assert worker._reported == set()  # a discarded step is forgotten: a days-long run does not pile them up


def test_step_end_waits_for_its_checkpoint_without_alarms(
    r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With save_freq 5 a step's step_end comes only with the commit of the checkpoint covering it, minutes
    after its local updates: no ERROR, no dead letter, every record once the commit is in. A step_end the
    commit lacks is still dead-lettered (timed from the commit), and a step the trainer left behind
    uncommitted while it went on is still reported."""
    cfg = make_cfg(keys, tmp_path, redis_url, "trainer.save_freq=5", "aggregator.incomplete_timeout_s=120")
    clock = [1000.0]
    worker = AggregatorWorker(cfg, r, keys, sinks=Sinks(r, keys, []))  # one worker, run again and again
    worker.clock = lambda: clock[0]
    rc: Any = r
    updates: dict[int, list[str]] = {}  # step -> the ids of its local updates

    def train(g: int, committed: int, commit: tuple[int, ...] = ()) -> None:
        """The trainer's step g: its local updates as it trains, then (a commit) the given step_ends; the
        trainer hash as the trainer writes it (training_step g, committed_step)."""
        events = [lu(g, 1, 1, x=float(g)), lu(g, 2, 1, x=float(g)), *(step_end(h, 2) for h in commit)]
        updates[g] = publish(r, keys, events)[:2]
        r.hset(keys.trainer, mapping={TRAINING_STEP_FIELD: g, COMMITTED_STEP_FIELD: committed})
        worker.run(burst=True)

    def notes() -> list[DeadLetter]:
        return [decode_as(f, DeadLetter) for _, f in rc.xrange(keys.dead_aggregator)]

    with caplog.at_level(logging.ERROR, logger="consumers.aggregator.worker"):
        for g in range(1, 5):
            train(g, committed=0)
            clock[0] += 300  # a slow step: far past the timeout before the next one begins
            assert worker.check_incomplete() == []
        assert sorted(worker.fold.pending()) == [1, 2, 3, 4] and decoded(r, keys) == {}
        train(5, committed=5, commit=(1, 2, 3, 4, 5))
        assert sorted(decoded(r, keys)) == [1, 2, 3, 4, 5]
        assert notes() == [] and caplog.records == [] and pending_ids(r, keys) == []

        # The commit of step 10 lacks step 8's step_end: dead-lettered 120 s after that commit was read.
        for g in range(6, 10):
            train(g, committed=5)
            clock[0] += 300
            assert worker.check_incomplete() == []
        train(10, committed=10, commit=(6, 7, 9, 10))
        assert sorted(decoded(r, keys)) == [1, 2, 3, 4, 5, 6, 7, 9, 10]
        clock[0] += 119
        assert worker.check_incomplete() == [] and notes() == []
        clock[0] += 1
        assert worker.check_incomplete() == [8]
        dead = notes()
        assert [d.source_id for d in dead] == updates[8]
        assert all(d.reason.startswith("step 8 incomplete 120s after its step_end was due (the trainer "
                                       "committed step 10): missing step_end") for d in dead)
        assert all(d.reason.endswith("so it never will") for d in dead) and worker.fold.pending() == {}

        # Step 11 never committed while the trainer went on to step 16: reported once, kept pending.
        train(11, committed=10)
        clock[0] += 300
        assert worker.check_incomplete() == []
        train(16, committed=10)
        clock[0] += 120
        assert worker.check_incomplete() == [11]
        clock[0] += 300
        assert worker.check_incomplete() == []
    reports = notes()[len(dead):]
    assert len(reports) == 1 and reports[0].source == "aggregator"
    assert "step 11 incomplete 120s after its step_end was due (the trainer began step 16, past checkpoint " \
        "step 15)" in reports[0].reason
    assert sorted(worker.fold.pending()) == [11, 16] and pending_ids(r, keys) == updates[11] + updates[16]
    AggregatorWorker(cfg, r, keys).run(burst=True)  # a restarted aggregator: the sinks have every record
    assert jsonl_steps(cfg) == [1, 2, 3, 4, 5, 6, 7, 9, 10]


def test_what_cannot_be_placed_is_dead_lettered_not_folded(
    r: redis.Redis, keys: Keys, dst_keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    """A forged step far ahead must not complete a record, block the real
    ones, or stay pending; wrong-stream events are dead-lettered; replay folds what live folded."""
    cfg = make_cfg(keys, tmp_path, redis_url)
    real = [lu(1, 1, 2, x=1.0), step_end(1, 1), lu(2, 1, 2, x=2.0), step_end(2, 1)]
    forged = [lu(10**6, 1, 2, x=666.0), step_end(10**6, 1), lu(40, 1, 2, x=666.0), step_end(40, 1)]
    ids = publish(r, keys, [real[0], *forged, real[1]], trainer_at=1)
    setup_run(r, keys, PRODUCERS)
    Publisher(r).publish(keys.metrics, producer_stats("evil", 1, 1.0, 0.0, 0))  # stats belong on `stats`
    Publisher(r).publish(keys.stats_of(P0), step_end(1, 1))  # trainer events belong on `metrics`
    AggregatorWorker(cfg, r, keys).run(burst=True)
    ids += publish(r, keys, real[2:], trainer_at=2)
    AggregatorWorker(cfg, r, keys).run(burst=True)

    recs = decoded(r, keys)
    assert sorted(recs) == [1, 2] and recs[1].metrics["x"] == 1.0 and recs[2].metrics["x"] == 2.0
    rc: Any = r
    dead = [decode_as(f, DeadLetter) for _, f in rc.xrange(keys.dead_aggregator)]
    by_id = {d.source_id: d.reason for d in dead}
    assert (
        by_id[ids[1]]
        == "implausible: local_update global_step=1000000 is ahead of the trainer's training_step=1"
    )
    assert (
        by_id[ids[2]]
        == "implausible: step_end global_step=1000000 is ahead of the trainer's committed_step=1"
    )
    assert len(dead) == 6 and any(
        "not a trainer event: a 'producer' event on metrics" in d.reason for d in dead
    )
    assert any("not producer stats: a 'step_end' event on stats" in d.reason for d in dead)
    assert pending_ids(r, keys) == []
    assert replay_records(r, keys, dst_keys) == 2 and records(r, dst_keys) == records(r, keys)


class FakeWriter:
    """Stands in for tensorboard's SummaryWriter: remembers (tag, value, step) calls."""

    calls: list[tuple[str, float, int]] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        FakeWriter.calls.append((tag, value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_sinks_write_each_step_once_across_restarts(
    r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    cfg = make_cfg(keys, tmp_path, redis_url)
    path = cfg.run_dir() / "records.jsonl"
    FakeWriter.calls = []

    def start() -> AggregatorWorker:
        sinks = Sinks(r, keys, [JsonlSink(path), TensorBoardSink(r, keys, tmp_path / "tb", FakeWriter)])
        return AggregatorWorker(cfg, r, keys, sinks=sinks)

    events = fake_metrics_log(5, local_updates=2, producers=1, test_freq=0)
    cut = next(
        i for i, ev in enumerate(events) if getattr(ev, "type", "") == "step_end" and ev.global_step == 3
    )
    publish(r, keys, events[: cut + 1])
    start().run(burst=True)
    assert jsonl_steps(cfg) == [1, 2, 3]
    with path.open("a") as f:
        f.write('{"step": 4, "actor/pg_loss": 1')  # a line torn by a crash
    publish(r, keys, events[cut + 1 :])
    start().run(burst=True)
    start().run(burst=True)  # a restart with nothing new writes nothing
    assert jsonl_steps(cfg) == [1, 2, 3, 4, 5]
    tb_steps = [step for tag, _, step in FakeWriter.calls if tag == "training/global_step"]
    assert tb_steps == [1, 2, 3, 4, 5]
    rec4 = decoded(r, keys)[4]
    assert json.loads(path.read_text().splitlines()[3]) == {"step": 4, **rec4.metrics}


def test_sigkill_mid_fold_then_restart_gives_the_uninterrupted_records(
    r: redis.Redis, keys: Keys, dst_keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    cfg = make_cfg(keys, tmp_path, redis_url)
    events = fake_metrics_log(6, local_updates=3, producers=2, test_freq=2)
    # Phase 1: steps 1-2 complete, step 3 partial (no step_end yet).
    cut = next(i for i, ev in enumerate(events) if getattr(ev, "local_step", 0) == 2 and ev.global_step == 3)
    publish(r, keys, events[: cut + 1])
    cmd = [sys.executable, "-m", "consumers.aggregator", str(REPO / "pipeline.yaml"),
           f"run.name={keys.run}", f"run.dir={tmp_path}", f"run.redis_url={redis_url}", "bus.block_ms=100"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        # step 3's 2 updates + 2 producers
        while len(records(r, keys)) < 2 or len(pending_ids(r, keys)) != 2 + 2:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "aggregator never wrote steps 1-2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.stderr:
            proc.stderr.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(decoded(r, keys)) == [1, 2]

    # Phase 2: the rest of the log, then a restarted aggregator drains it.
    publish(r, keys, events[cut + 1 :])
    done = subprocess.run([*cmd, "--burst"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]

    got = decoded(r, keys)
    assert sorted(got) == list(range(1, 7))
    assert replay_records(r, keys, dst_keys) == 6  # the uninterrupted fold of the same log
    assert records(r, dst_keys) == records(r, keys)
    assert jsonl_steps(cfg) == [1, 2, 3, 4, 5, 6]
    assert pending_ids(r, keys) == []  # each stats window was acked with the record of its step's span


def test_sigterm_finishes_and_exits_zero(r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str) -> None:
    publish(r, keys, fake_metrics_log(2, local_updates=2, producers=1, test_freq=0))
    cmd = [sys.executable, "-m", "consumers.aggregator", str(REPO / "pipeline.yaml"),
           f"run.name={keys.run}", f"run.dir={tmp_path}", f"run.redis_url={redis_url}", "bus.block_ms=100"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while len(records(r, keys)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "aggregator never wrote steps 1-2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "aggregator stopping: 8 events, 2 records written" in err


def test_stats_drain_after_a_reconnect_reads_past_entries_it_already_holds(
    r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    """After a reconnect the stats reader re-reads its own pending list, whose first pages may hold only
    entries the fold already has; such an empty page is not a drained stream (seen in the fault test:
    a record folded without the stats entries of its span, unlike the replay)."""
    cfg = make_cfg(keys, tmp_path, redis_url, "bus.read_count=2")
    publish(
        r, keys, [producer_stats(p, 1, 10.0, 0.5, 0) for p in "abc"] + [lu(1, 1, 2, x=1.0), step_end(1, 1)]
    )
    worker = AggregatorWorker(cfg, r, keys, sinks=Sinks(r, keys, []))
    worker.run(burst=True)
    worker.stats_reader.on_reconnect()  # as after a Redis restart
    publish(r, keys, [producer_stats("rollout_00", 7, 70.0, 0.0, 1), lu(2, 1, 2, x=1.0), step_end(2, 1)])
    worker.stop.clear()
    worker.run(burst=True)
    assert decoded(r, keys)[2].metrics["producer/rollout_00/samples"] == 7


def test_a_record_lost_in_a_failover_is_folded_again_when_the_trainer_emits_its_step_end_again(
    r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    """The failover's new primary has step 2's local update but not its step_end nor its record (the promoted
    replica had not received them); the trainer's reconciliation emits the step_end again. The aggregator,
    reconnected, rebuilds its fold from Redis, as a restart would, and writes record 2 (a fold still holding
    step 2 as recorded would set the step_end aside as late, and record 2 would never come)."""
    cfg = make_cfg(keys, tmp_path, redis_url)
    publish(r, keys, [lu(1, 1, 2, x=1.0), step_end(1, 1), lu(2, 1, 2, x=3.0)], trainer_at=1)
    r.hset(keys.trainer, TRAINING_STEP_FIELD, 2)  # step 2 begun, committed up to 1
    worker = AggregatorWorker(cfg, r, keys, sinks=Sinks(r, keys, []))
    worker.run(burst=True)
    assert sorted(decoded(r, keys)) == [1]
    replica = {k: r.dump(k) for k in r.scan_iter(match=keys.pattern())}  # stops receiving here
    publish(r, keys, [step_end(2, 1)], trainer_at=2)
    worker.stop.clear()
    worker.run(burst=True)
    assert sorted(decoded(r, keys)) == [1, 2]
    delete_run(r, keys)  # the failover
    for k, v in replica.items():
        r.restore(k, 0, v)  # type: ignore[arg-type]
    assert sorted(decoded(r, keys)) == [1]
    publish(r, keys, [step_end(2, 1)], trainer_at=2)  # the trainer commits step 2 again
    worker.reader.on_reconnect()  # the failover broke the aggregator's connection
    worker.stop.clear()
    worker.run(burst=True)
    recs = decoded(r, keys)
    assert sorted(recs) == [1, 2] and recs[2].metrics["x"] == 3.0
    assert pending_ids(r, keys) == []
