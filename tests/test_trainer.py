"""The trainer worker end to end (subprocess) against a fake paced producer on real Redis.

The log must prove: every published sample_id ends exactly once in `fates` (trained or dropped) or in
`dead`, or is still unacked in the rollouts stream; none is trained twice; step_end global steps are
1..N once each; `params` has versions 0..N; outstanding prompts never exceeded max_outstanding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from conftest import P0, PRODUCERS, padded_arrays

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from rollstream.keys import COMMITTED_STEP_FIELD, DROPPED_STALE_FIELD, HEARTBEAT_FIELD, TRAINER_GROUP, Keys
from rollstream.ops.audit import audit_run
from rollstream.ops.health import progress_health, worker_health
from rollstream.ops.log_cut import unacked_entry_ids
from rollstream.pacing.budget import ask_lease, mark_published
from rollstream.pacing.counters import dispatch_entries, lease_of
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.store import latest_param_version
from schemas import (
    TRAINED,
    DataProto,
    ParamVersion,
    RolloutSample,
    StepMetrics,
    ValidateMetrics,
    decode,
    decode_fate,
    decode_payload,
    encode,
    encode_payload,
)
from schemas.text_entries import GRANT, LEASE, TOPUP

ROOT = Path(__file__).resolve().parent.parent
TBS = 4
MAX_OUTSTANDING = 2 * TBS  # staleness_threshold=1


def trainer_args(keys: Keys, redis_url: str, run_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "consumers.trainer", "pipeline.yaml",
        f"run.name={keys.run}", f"run.redis_url={redis_url}", f"run.dir={run_dir}", "run.device=cpu",
        "model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32",
        f"data.train_batch_size={TBS}", "actor.ppo_mini_batch_size=2",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=1", "trainer.max_off_policy_threshold=1",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=2", "data.val_size=4",
        "data.epoch_size=32",
        "bus.block_ms=100",
        "rollout.num_producers=1",  # the FakeProducer is the run's one producer: its lease is the budget
        "--name", "trainer",
    ]


def as_schema_1(sample: RolloutSample) -> dict[str, Any]:
    """The entry a schema-1 writer made of this sample: its batch padded (verl's int64 DataProto) in the
    payload."""
    fields: dict[str, Any] = encode(sample)
    body = decode_payload(bytes(fields.pop("payload")))
    padded = padded_arrays(assemble_batch_from_rollout_samples([sample])[0])
    tensors = {k: v.astype(np.int64) if v.dtype.kind in "iu" or k == "response_mask" else v
               for k, v in padded.items()}
    body["full_batch"] = DataProto(tensors, dict(sample.full_batch.non_tensors))
    body["schema_version"] = 1
    fields = {k: v for k, v in fields.items() if not k.startswith("a")}  # the payload holds every array now
    fields["schema"], fields["payload"] = b"1", encode_payload(body)
    return fields


#: The fake producer's name (one of the run's producers: the trainer leases to it).
FAKE = P0


class FakeProducer(threading.Thread):
    """Asks the trainer for leases, publishes fake samples stamped with the newest version; the 5th (those
    at the `corrupt_at` indices) is corrupt, and every other one is written in RolloutSample schema 1 (the
    padded int64 batch that schema still decodes into; `as_schema_1`). `cap[v]` limits how many prompts it
    dispatches for version v (until the cap is removed)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        corrupt_at: tuple[int, ...] = (4,),
        flat_every: int = 0,
        failed_at: tuple[int, ...] = (),
    ) -> None:
        """`flat_every` > 0: every flat_every-th sample's 4 trajectories all get reward 1.0 (no GRPO signal);
        the samples at `failed_at` indices are rollout failures (rollout_status rollout_failure = 1)."""
        super().__init__(daemon=True)
        self.r, self.keys, self.corrupt_at, self.flat_every, self.failed_at = (
            r,
            keys,
            corrupt_at,
            flat_every,
            failed_at,
        )
        self.flat: list[str] = []
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.cap: dict[int, int] = {}
        self.taken: dict[int, int] = {}
        self.published: list[str] = []
        self.corrupt: list[str] = []
        self.schema: dict[str, bytes] = {}  # sample id -> the schema it was written in

    def run(self) -> None:
        while not self.stop.is_set():
            pv = latest_param_version(self.r, self.keys)
            if pv is None:
                time.sleep(0.02)
                continue
            v = pv.version
            want = 2
            if v in self.cap:
                want = min(want, self.cap[v] - self.taken.get(v, 0))
            left = lease_of(self.r, self.keys, FAKE) - len(self.published)
            if want > 0 and left <= 0:
                ask_lease(self.r, self.keys, FAKE, len(self.published) + want)
            amount = min(want, left)
            if amount <= 0:
                time.sleep(0.02)
                continue
            self.taken[v] = self.taken.get(v, 0) + amount
            pipe = self.r.pipeline(transaction=True)
            for _ in range(amount):
                sid = f"{FAKE}-{len(self.published)}"
                flat = self.flat_every > 0 and len(self.published) % self.flat_every == 1
                sample = fake_rollout_sample(
                    sid,
                    param_version=v,
                    n=4,
                    prompt_len=6,
                    response_len=8,
                    producer=FAKE,
                    seed=len(self.published),
                    rewards=[1.0] * 4 if flat else None,
                )
                if flat:
                    self.flat.append(sid)
                if len(self.published) in self.failed_at:
                    sample.rollout_status["rollout_failure"] = 1
                    self.failed.append(sid)
                fields: dict[str, Any] = (
                    encode(sample) if len(self.published) % 2 == 0 else as_schema_1(sample)
                )
                self.schema[sid] = fields["schema"]
                if len(self.published) in self.corrupt_at:
                    fields["payload"] = b"\xc1 not msgpack"
                    self.corrupt.append(sid)
                pipe.xadd(self.keys.rollouts_of(P0), fields)
                self.published.append(sid)
            mark_published(pipe, self.keys, FAKE, amount)
            pipe.execute()


def events(r: redis.Redis, stream: str) -> list[Any]:
    return [decode(f) for _, f in r.xrange(stream)]


def check_invariants(r: redis.Redis, keys: Keys, producer: FakeProducer, steps: int) -> dict[str, int]:
    # the run audit: every published sample ended once (trained, dropped or dead) or is still unacked,
    # none lost, none twice; step_end global steps are 1..N once each
    rep = audit_run(r, keys)
    assert rep.problems() == [], rep.problems()
    assert rep.published == set(producer.published) and rep.duplicate_entries == 0 and not rep.unknown
    assert rep.dead == set(producer.corrupt)
    unacked = {
        f[b"sample_id"].decode()
        for stream in keys.rollouts_streams(PRODUCERS)
        for i, f in r.xrange(stream)
        if i.decode() in unacked_entry_ids(r, stream)
    }
    assert unacked == rep.pending, "a committed sample is still pending"
    assert rep.steps == list(range(1, steps + 1))
    fates = [decode_fate(f) for _, f in r.xrange(keys.fates)]
    metrics = events(r, keys.metrics)
    updates = [ev for ev in metrics if isinstance(ev, StepMetrics) and ev.type == "local_update"]
    assert {ev.global_step for ev in updates} == set(range(1, steps + 1))
    vals = sorted(ev.param_version for ev in metrics if isinstance(ev, ValidateMetrics))
    assert vals[0] == 0 and set(range(0, steps + 1, 2)) <= set(vals)
    # params has 0..N; the budget bound held at every take
    versions = {ev.version for ev in events(r, keys.params) if isinstance(ev, ParamVersion)}
    assert versions == set(range(steps + 1))
    for e in dispatch_entries(r, keys):
        assert e.outstanding is None or e.outstanding <= MAX_OUTSTANDING, e
    assert int(r.get(keys.consumed)) == len(fates) + len(rep.dead)
    # every trained sample was within the threshold, every dropped one beyond it
    for f in fates:
        assert (f.staleness <= 1) == (f.fate == TRAINED), f
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) == str(steps).encode()
    # verl fully-async names on every local update; run-long counts in the trainer hash and the metrics
    for ev in updates:
        assert ev.metrics["fully_async/total_wait_time"] == ev.metrics["timing_s/gen"] >= 0
        assert ev.metrics["fully_async/count/current_param_version"] == ev.global_step - 1
    last = max(updates, key=lambda ev: (ev.global_step, ev.local_step)).metrics
    assert last["fully_async/count/stale_samples_processed"] == sum(
        f.fate == TRAINED and f.staleness >= 2 for f in fates
    )
    assert int(r.hget(keys.trainer, DROPPED_STALE_FIELD) or 0) == len(rep.dropped)
    return {"trained": len(rep.trained), "dropped": len(rep.dropped), "updates": len(updates)}


@pytest.fixture
def producer(r: redis.Redis, keys: Keys) -> Any:
    p = FakeProducer(r, keys)
    p.start()
    yield p
    p.stop.set()
    p.join(5)


def test_trainer_run_keeps_every_sample_exactly_once(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, producer: FakeProducer
) -> None:
    proc = subprocess.run(
        trainer_args(keys, redis_url, tmp_path, 4), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = check_invariants(r, keys, producer, 4)
    assert counts["trained"] == 4 * TBS and counts["dropped"] > 0 and counts["updates"] == 8
    schema_of = producer.schema
    trained = [
        fate.sample_id for fate in (decode_fate(f) for _, f in r.xrange(keys.fates)) if fate.fate == TRAINED
    ]
    # old-schema entries train alongside new ones
    assert {schema_of[sid] for sid in trained} == {b"1", str(RolloutSample.SCHEMA).encode()}
    assert len(list((tmp_path / keys.run / "checkpoints").iterdir())) == 2


def test_sync_mode_run_with_dead_lettered_samples_finishes(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    """Sync mode (staleness_threshold=0: max_outstanding = one global batch): a dead-lettered sample used up
    its step's whole window, producers got no budget until the next version and the trainer waited forever
    for a sample nobody could dispatch. Dead letters now top up the current version's budget, within the
    bound: the run finishes, every dead letter is consumed, outstanding never exceeded max_outstanding."""
    producer = FakeProducer(r, keys, corrupt_at=(5, 9, 10))  # one in step 2's batch, two in step 3's
    producer.start()
    try:
        args = trainer_args(keys, redis_url, tmp_path, 3)
        sync = [*args[:-2], "async_training.staleness_threshold=0", "trainer.sync_mode=true", *args[-2:]]
        proc = subprocess.run(sync, cwd=ROOT, capture_output=True, text=True, timeout=90)
    finally:
        producer.stop.set()
        producer.join(5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = audit_run(r, keys)
    assert rep.problems() == [] and rep.steps == [1, 2, 3]
    assert rep.dead == set(producer.corrupt) and len(rep.trained) == 3 * TBS and not rep.dropped
    log = dispatch_entries(r, keys)
    assert all(e.outstanding is None or e.outstanding <= TBS for e in log), log
    budget: dict[int | None, int] = {}  # per version: granted + topped up, and taken
    taken: dict[int | None, int] = {}
    for e in log:
        if e.op in (GRANT, TOPUP):
            assert e.outstanding is not None and e.outstanding + e.amount <= TBS, e
            budget[e.version] = budget.get(e.version, 0) + e.amount
        elif e.op == LEASE:
            taken[e.version] = taken.get(e.version, 0) + e.amount
    assert sum(e.amount for e in log if e.op == TOPUP) == 3  # one prompt back per dead letter
    assert all(taken[v] <= budget[v] for v in taken), (budget, taken)
    assert int(r.get(keys.consumed)) == 3 * TBS + 3  # type: ignore[arg-type]


def _wait_for_local_update(
    r: redis.Redis, keys: Keys, step: int, proc: subprocess.Popen, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        evs = events(r, keys.metrics)
        if any(
            isinstance(e, StepMetrics) and e.type == "local_update" and e.global_step == step for e in evs
        ):
            assert not any(
                isinstance(e, StepMetrics) and e.type == "step_end" and e.global_step == step for e in evs
            )
            return
        assert proc.poll() is None, "trainer exited early"
        time.sleep(0.05)
    proc.kill()
    err = proc.stderr.read()[-3000:] if proc.stderr else ""
    proc.wait(10)
    raise AssertionError(f"no local_update for step {step} within {timeout_s}s: {err}")


def test_trainer_sigkill_mid_step_then_restart_loses_and_repeats_nothing(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, producer: FakeProducer
) -> None:
    # version 1 gets only enough for step 2's first local update (2 good samples; the corrupt 5th may be
    # among its 3 when the trainer finished step 1 before it was published)
    producer.cap[1] = 3
    args = trainer_args(keys, redis_url, tmp_path, 4)
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_local_update(r, keys, 2, proc, 60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) == b"1"
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] > 0  # step 2's samples were not acked
    del producer.cap[1]
    proc2 = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    counts = check_invariants(r, keys, producer, 4)
    assert counts["trained"] == 4 * TBS
    if os.environ.get("TRAINER_DIAG"):
        print(proc2.stderr[-6000:], counts)


def test_bad_train_batch_size_is_refused_with_the_three_values(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumers.trainer",
            "pipeline.yaml",
            "data.train_batch_size=3",
            f"run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    for part in ("data.train_batch_size=3", "async_training.trigger_parameter_sync_step=1",
                 "actor.ppo_mini_batch_size=32"):
        assert part in proc.stderr
    assert "Traceback" not in proc.stderr


def test_trainer_with_real_producers(r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path) -> None:
    """Two real producer processes and the trainer: the same invariants hold on the log."""
    if not (ROOT / "producers" / "worker.py").exists():
        pytest.skip("producers not written yet")
    steps = 3
    args = trainer_args(keys, redis_url, tmp_path, steps)
    common = [a for a in args[4:] if "=" in a] + [
        "rollout.n=2",
        "rollout.num_producers=2",
        "rollout.prompts_per_dispatch=2",
        "data.max_response_length=4",
        "rollout.stats_every_s=1",
    ]
    prods = [
        subprocess.Popen(
            [sys.executable, "-m", "producers", "pipeline.yaml", *common, "--name", f"rollout_{i:02d}"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        trainer = subprocess.run(
            [*args[:4], *common, "--name", "trainer"], cwd=ROOT, capture_output=True, text=True, timeout=150
        )
    finally:
        for p in prods:
            p.send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=30)[1] for p in prods]
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert [p.returncode for p in prods] == [0, 0], [e[-2000:] for e in errs]

    published = [f[b"sample_id"].decode() for p in PRODUCERS for _, f in r.xrange(keys.rollouts_of(p))]
    fake = FakeProducer(r, keys)
    fake.published = published
    counts = check_invariants(r, keys, fake, steps)
    assert counts["trained"] == steps * TBS


def test_sigterm_while_waiting_for_samples_exits_0(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    proc = subprocess.Popen(
        trainer_args(keys, redis_url, tmp_path, 2),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while r.hget(keys.trainer, HEARTBEAT_FIELD) is None:  # version 0 published, now polling for samples
            assert proc.poll() is None and time.monotonic() < deadline, "trainer did not start"
            time.sleep(0.05)
        assert latest_param_version(r, keys) is not None
        trainer = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
        assert [w.state for w in worker_health(trainer, stall_after_s=30)] == ["ok"]  # status reads it
        # no samples come: the heart keeps beating, yet no global step completes, and status says so
        time.sleep(1.5)
        trainer = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
        assert [w.state for w in worker_health(trainer, stall_after_s=30)] == ["ok"]
        assert progress_health(trainer, stall_after_s=1.0, total_steps=2).state == "stalled"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) is None


def test_trainer_waits_for_num_warmup_batches_before_its_first_update(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, producer: FakeProducer
) -> None:
    producer.cap[0] = 4  # 2 mini-batches of version 0 arrive, then nothing until the cap is lifted
    args = [*trainer_args(keys, redis_url, tmp_path, 1), "trainer.num_warmup_batches=3"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while r.xlen(keys.rollouts_of(P0)) < 4 or r.hget(keys.trainer, HEARTBEAT_FIELD) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "trainer did not start"
            time.sleep(0.05)
        time.sleep(1.5)  # 4 samples would do for a first update (2 per mini-batch); warmup wants 6
        assert not [ev for ev in events(r, keys.metrics) if isinstance(ev, StepMetrics)]
        del producer.cap[0]
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()
    first = min(i for i, f in r.xrange(keys.metrics) if f.get(b"type") == b"local_update")
    assert len(r.xrange(keys.rollouts_of(P0), max=first)) >= 6  # 3 mini-batches had arrived before it


def test_stale_counts_follow_verl() -> None:
    from consumers.trainer.staleness import count_stale
    from rollstream.testing.fakes import fake_rollout_sample

    counters = {"stale_samples_processed": 5, "stale_trajectory_processed": 1}
    samples = [fake_rollout_sample("a", param_version=3, n=2), fake_rollout_sample("b", param_version=4, n=2)]
    # training version 4: sample a (v3) is stale; trajectories ending at 2 and 3 are, 4 and 5 are not
    out = count_stale(counters, 4, samples, [2, 3, 4, 5])
    assert out == {
        "fully_async/count/stale_samples_processed": 6.0,
        "fully_async/count/stale_trajectory_processed": 3.0,
        "fully_async/count/current_param_version": 4.0,
    }


def test_over_threshold_samples_train_under_rollout_correction_when_asked(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, producer: FakeProducer
) -> None:
    """trainer.max_off_policy_strategy=train: samples over the staleness threshold are trained (their IS
    weights from algorithm.rollout_correction), none dropped, and every step_end reports a dropped share of
    0."""
    args = trainer_args(keys, redis_url, tmp_path, 3)
    proc = subprocess.run(
        [*args[:-2], "trainer.max_off_policy_strategy=train", *args[-2:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = audit_run(r, keys)
    assert rep.problems() == [] and not rep.dropped and len(rep.trained) == 3 * TBS
    fates = [decode_fate(f) for _, f in r.xrange(keys.fates)]
    assert any(f.staleness > 1 for f in fates), "the run had no over-threshold sample to train"
    ends = [ev for ev in events(r, keys.metrics) if isinstance(ev, StepMetrics) and ev.type == "step_end"]
    assert [ev.metrics["training/off_policy/dropped_share"] for ev in ends] == [0.0, 0.0, 0.0]
    updates = [
        ev for ev in events(r, keys.metrics) if isinstance(ev, StepMetrics) and ev.type == "local_update"
    ]
    assert all("rollout_corr/rollout_is_mean" in ev.metrics for ev in updates)
