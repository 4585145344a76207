"""A real trainer and aggregator (subprocesses) on a small Redis budget, so that retention moves most of the
log to the archive while the run goes on: the trainer is SIGKILLed by the fault hook between an archive
commit and its XTRIM and restarted; afterwards the log read through archive + Redis audits clean (every
published sample ended exactly once, steps and records consecutive), `replay records` equals the live
records field for field, `replay trainer` copies archived rollouts, and no entry is missing or read
twice. A second run whose aggregator is down
shows back-pressure: unread data over the budget paces producers to one global step.

The budget is 64 KiB (the config's minimum) for fake samples of ~1.5 KB in Redis: the same ratio as a few
MB for realistic ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import P0, PRODUCERS
from test_trainer import TBS, FakeProducer, trainer_args

from consumers.aggregator.replay import replay_records
from rollstream.bus import delete_run, iter_stream, parse_id, run_archive
from rollstream.bus.retention import KILL_BEFORE_TRIM_ENV
from rollstream.keys import COMMITTED_STEP_FIELD, Keys
from rollstream.ops.audit import audit_run
from rollstream.ops.replay_copy import consumed_entry_ids, copy_steps
from rollstream.pacing.counters import dispatch_entries
from schemas.text_entries import GRANT, LEASE, TOPUP

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
BUDGET = 64 << 10


@pytest.fixture
def producer(r: redis.Redis, keys: Keys) -> Iterator[FakeProducer]:
    p = FakeProducer(r, keys)
    p.start()
    yield p
    p.stop.set()
    p.join(5)


@pytest.fixture
def dst(r: redis.Redis) -> Iterator[Keys]:
    k = Keys(f"t-{uuid.uuid4().hex[:12]}-replay")
    yield k
    delete_run(r, k)


def small_budget(keys: Keys, redis_url: str, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """The trainer command of test_trainer with a small Redis budget and a retention pass every step."""
    args = trainer_args(keys, redis_url, run_dir, steps)
    assert args[-2:] == ["--name", "trainer"]
    return [*args[:-2], f"bus.redis_max_bytes={BUDGET}", "bus.trim_every_s=0.05", *extra, *args[-2:]]


def test_a_small_budget_run_archives_its_log_survives_a_kill_mid_trim_and_replays_whole(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, producer: FakeProducer, dst: Keys
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = small_budget(keys, redis_url, tmp_path, STEPS)
    agg = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "consumers.aggregator",
            "pipeline.yaml",
            *args[4:-2],
            "aggregator.tensorboard=false",
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        killed = subprocess.run(args, cwd=ROOT, env={**env, KILL_BEFORE_TRIM_ENV: "2"}, capture_output=True,
                                text=True, timeout=120)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert "SIGKILL after archiving" in killed.stderr
        arc = run_archive(r, keys.rollouts_of(P0))
        assert arc is not None
        both = [k for k in keys.all_streams(PRODUCERS) if (last := arc.index(k).last) is not None
                and (first := r.xrange(k, count=1)) and parse_id(first[0][0]) <= parse_id(last)]
        assert both, "the killed pass left its entries archived and still in Redis"
        assert int(r.hget(keys.trainer, COMMITTED_STEP_FIELD) or 0) < STEPS

        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        deadline = time.monotonic() + 60
        while sum(1 for _ in iter_stream(r, keys.records)) < STEPS + 1:  # records 0 (validation) .. STEPS
            assert agg.poll() is None and time.monotonic() < deadline, (
                "the aggregator did not fold every step"
            )
            time.sleep(0.1)
    finally:
        agg.send_signal(signal.SIGTERM)
        _, agg_err = agg.communicate(timeout=30)
    assert agg.returncode == 0, agg_err[-2000:]
    producer.stop.set()
    producer.join(5)

    # most of the log lives in the archive; read together, each entry once and in order
    for stream in (keys.rollouts_of(P0), keys.metrics):
        assert arc.index(stream).entries > r.xlen(stream), stream
    for stream in keys.all_streams([P0]):
        ids = [parse_id(i) for i, _ in iter_stream(r, stream)]
        assert ids == sorted(set(ids)), stream
        in_redis = {parse_id(i) for i, _ in r.xrange(stream)}
        assert {parse_id(i) for i, _ in arc.entries(stream)} | in_redis == set(ids), stream

    rep = audit_run(r, keys)  # over archive + Redis
    assert rep.problems() == [], rep.problems()
    assert rep.published == set(producer.published) and rep.dead == set(producer.corrupt)
    assert rep.steps == list(range(1, STEPS + 1)) and not rep.lost and not rep.duplicated

    assert replay_records(r, keys, dst) == STEPS + 1
    live = list(iter_stream(r, keys.records))
    assert list(iter_stream(r, dst.records)) == live  # field for field, byte for byte

    # `replay trainer --steps 2-4` copies what those steps consumed, from the archive
    refs = consumed_entry_ids(r, keys, 2, 4)
    assert {p for p, _ in refs} == {P0}  # the fake producer is rollout_00
    ids = [i for _, i in refs]
    assert not {i.decode() for i, _ in r.xrange(keys.rollouts_of(P0))} & set(ids)  # all archived by now
    n, _ = copy_steps(r, keys, dst, 2, 4)
    source = dict(iter_stream(r, keys.rollouts_of(P0)))
    assert n == len(ids) and [f for _, f in r.xrange(dst.rollouts_of(P0))] == [source[i] for i in ids]


def test_unread_data_over_the_budget_paces_producers_to_one_step(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, producer: FakeProducer
) -> None:
    """No aggregator: metrics stay unread, so the streams cannot get under the budget; the trainer caps its
    grants at one global step's prompts (instead of max_outstanding - outstanding), checkpoints every step,
    and still finishes."""
    args = small_budget(keys, redis_url, tmp_path, 10, "trainer.save_freq=5", "trainer.keep_checkpoints=20",
                        "async_training.staleness_threshold=3")  # uncapped, a grant could be 4 steps' prompts
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "producers are paced to one global step per version" in done.stderr
    log = list(dispatch_entries(r, keys))
    capped = [e for e in log if e.op == GRANT and e.amount < (e.max_outstanding or 0) - (e.outstanding or 0)]
    assert capped and all(e.amount == TBS for e in capped)
    for g in capped:  # a capped version leases the cap, plus replacements for early consumption
        leased = sum(e.amount for e in log if e.op == LEASE and e.version == g.version)
        topped = sum(e.amount for e in log if e.op == TOPUP and e.version == g.version)
        assert leased <= g.amount + topped, (g, leased, topped)
    rep = audit_run(r, keys)
    assert rep.problems() == [] and rep.steps == list(range(1, 11))
    saved = list((tmp_path / keys.run / "checkpoints").iterdir())
    assert len(saved) > 2, saved  # save_freq=5 alone would have saved steps 5 and 10
