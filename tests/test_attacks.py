"""A malicious producer: what it can put on `rollouts` with valid credentials goes to `dead`
with a reason naming the field and value, and the trainer goes on training the real samples."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from conftest import P0, PRODUCERS

from consumers.trainer.loop import Trainer
from rollstream.bus import setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import Keys
from rollstream.ops.audit import audit_run
from rollstream.pacing.budget import lease_outright
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.store import publish_weights
from schemas import DeadLetter, RolloutSample, decode, encode

MAX_ENTRY_BYTES = 256 << 10


def tiny_cfg(keys: Keys, tmp: Path, *extra: str) -> PipelineConfig:
    return load_config("pipeline.yaml", [*extra,
        f"run.name={keys.run}", f"run.dir={tmp}", "run.device=cpu", "model.d_model=16", "model.n_layer=1",
        "model.n_head=2", "model.max_seq_len=32", "data.train_batch_size=2", "actor.ppo_mini_batch_size=1",
        "async_training.trigger_parameter_sync_step=2", "trainer.test_freq=0",
        "trainer.total_training_steps=1000",
        "rollout.n=2", "bus.block_ms=20", f"bus.max_entry_bytes={MAX_ENTRY_BYTES}",
    ])


def leased_id(r: redis.Redis, keys: Keys) -> str:
    """One more prompt leased to rollout_00 (as the trainer would lease it): its sample id."""
    return f"rollout_00-{lease_outright(r, keys, 'rollout_00', 1) - 1}"


def sample_fields(sid: str, version: int = 0) -> dict[bytes, bytes]:
    """The fields of producer P0's sample `sid` (stamped with `version`, even a negative one)."""
    ev = fake_rollout_sample(sid, param_version=max(version, 0), n=2, prompt_len=4, response_len=5,
                             producer=P0)
    fields = {k.encode(): bytes(v) for k, v in encode(ev).items()}
    if version < 0:  # what a producer that skips the model would write
        fields[b"param_version"] = str(version).encode()
        body = fields[b"payload"]
        # fixint 0 -> -5
        fields[b"payload"] = body.replace(b"\xadparam_version\x00", b"\xadparam_version\xfb")
    return fields


@pytest.fixture
def trainer(r: redis.Redis, keys: Keys, tmp_path: Path) -> Iterator[Trainer]:
    t = Trainer(tiny_cfg(keys, tmp_path), r, keys, "trainer", threading.Event())
    t.resume()
    yield t
    t.effects.stop_leaser()


def dead_reasons(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """source entry id -> reason of every dead letter about rollouts."""
    out = {}
    for _, f in r.xrange(keys.dead):  # type: ignore[union-attr]
        ev = decode(f)
        assert isinstance(ev, DeadLetter)
        if ev.source == keys.rollouts_of(P0):
            out[ev.source_id] = ev.reason
    return out


def test_forged_rollouts_are_dead_lettered_with_the_field_and_value(
    r: redis.Redis, keys: Keys, trainer: Trainer
) -> None:
    attacks: dict[str, tuple[dict[bytes, Any], str]] = {}
    names = (
        "future",
        "neg",
        "payload",
        "header",
        "schema",
        "extra",
        "big",
        "reward",
        "good-0",
        "good-1",
    )
    lid = {name: leased_id(r, keys) for name in names}
    attacks["future"] = (
        sample_fields(lid["future"], 10**9),
        "invalid: param_version=1000000000 is newer than the newest published version 0",
    )
    attacks["negative"] = (
        sample_fields(lid["neg"], -5),
        "param_version: Input should be greater than or equal to 0",
    )
    mismatch = sample_fields(lid["payload"])
    mismatch[b"sample_id"] = lid["header"].encode()
    attacks["mismatch"] = (
        mismatch,
        f"header sample_id=b'{lid['header']}' != payload sample_id=b'{lid['payload']}'",
    )
    schema = sample_fields(lid["schema"])
    schema[b"schema"] = b"999"
    attacks["schema"] = (schema, f"header schema='999' != payload schema_version={RolloutSample.SCHEMA}")
    extra = sample_fields(lid["extra"])
    extra[b"junk"] = b"x" * (50 << 10)
    attacks["unknown"] = (extra, "unknown field 'junk' in a 'rollout' entry")
    big = sample_fields(lid["big"])
    big[b"payload"] = big[b"payload"] + b"\0" * MAX_ENTRY_BYTES
    attacks["oversized"] = (big, f"over the max_entry_bytes={MAX_ENTRY_BYTES} limit")
    absurd = fake_rollout_sample(lid["reward"], n=2, prompt_len=4, response_len=5, producer=P0)
    absurd.full_batch.rows["rewards"] = np.array([3e38, 0.5], dtype=np.float32)
    attacks["reward"] = (
        {k.encode(): bytes(v) for k, v in encode(absurd).items()},  # issue 24: loss inf, grad NaN
        "out of domain: rewards hold values in [0.5, 3.00",
    )
    nameless = fake_rollout_sample("", n=2, prompt_len=4, response_len=5, producer=P0)
    attacks["empty id"] = (
        {k.encode(): bytes(v) for k, v in encode(nameless).items()},
        f"impersonation: field sample_id='' on the stream of producer '{P0}'",
    )
    unleased = fake_rollout_sample(f"{P0}-{10**6}", n=2, prompt_len=4, response_len=5, producer=P0)
    attacks["outside the lease"] = (  # issue 24: entries published without budget loosened the pacing
        {k.encode(): bytes(v) for k, v in encode(unleased).items()},
        f"outside lease: sample_id='{P0}-1000000': seq 1000000 >= {len(lid)} prompts leased to '{P0}'",
    )
    other = fake_rollout_sample("rollout_01-0", n=2, prompt_len=4, response_len=5, producer="rollout_01")
    attacks["another's name"] = (
        {k.encode(): bytes(v) for k, v in encode(other).items()},
        f"impersonation: field producer='rollout_01' on the stream of producer '{P0}'",
    )

    ids = {}
    for name, (fields, _) in attacks.items():
        ids[name] = r.xadd(keys.rollouts_of(P0), fields).decode()  # type: ignore[union-attr]
    goods = [lid["good-0"], lid["good-1"]]
    for sid in goods:
        r.xadd(keys.rollouts_of(P0), sample_fields(sid))  # type: ignore[arg-type]
    guard = threading.Timer(30, trainer.stop.set)
    guard.start()
    try:
        assert trainer.train_step(1)
    finally:
        guard.cancel()

    dead = dead_reasons(r, keys)
    for name, (_, reason) in attacks.items():
        assert reason in dead[ids[name]], (name, dead[ids[name]])
    fates = [f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)]  # type: ignore[union-attr]
    assert sorted(fates) == sorted(goods)
    # each leased prompt counted once, by the header's sample_id (the mismatch's payload id never was)
    assert int(r.get(keys.consumed)) == len(lid) - 1  # type: ignore[arg-type]
    rep = audit_run(r, keys)  # the header's sample_id is what the audit sees: it ended in `dead`, not lost
    assert lid["header"] in rep.dead and not rep.lost and not rep.duplicated, rep.problems()


def fates_of(r: redis.Redis, keys: Keys) -> list[str]:
    """The sample id of every fate, in log order."""
    return [f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)]  # type: ignore[union-attr]


def test_a_dead_lettered_id_is_never_trained_later(
    r: redis.Redis, keys: Keys, trainer: Trainer, tmp_path: Path
) -> None:
    """Issue 62 item 3: rollout_00-<n> first came with a 3e38 reward (dead-lettered), then with valid content;
    the second copy was trained, so the id had a dead letter and a fate. Now every later copy is refused
    ("already ended"), in the same read, in a later one and after a trainer restart, and the audit tells the
    refusals apart from an id that ended twice."""
    bad = [leased_id(r, keys) for _ in range(2)]
    absurd = {}
    for sid in bad:
        ev = fake_rollout_sample(sid, n=2, prompt_len=4, response_len=5, producer=P0)
        ev.full_batch.rows["rewards"] = np.array([3e38, 0.5], dtype=np.float32)
        absurd[sid] = {k.encode(): bytes(v) for k, v in encode(ev).items()}
    goods = [leased_id(r, keys) for _ in range(6)]  # two a global step
    r.xadd(keys.rollouts_of(P0), absurd[bad[0]])  # type: ignore[arg-type]
    r.xadd(keys.rollouts_of(P0), sample_fields(bad[0]))  # type: ignore[arg-type]  # same read
    for sid in goods[:2]:
        r.xadd(keys.rollouts_of(P0), sample_fields(sid))  # type: ignore[arg-type]
    r.xadd(keys.rollouts_of(P0), absurd[bad[1]])  # type: ignore[arg-type]
    assert trainer.train_step(1)
    r.xadd(keys.rollouts_of(P0), sample_fields(bad[1]))  # type: ignore[arg-type]  # a later read
    for sid in goods[2:4]:
        r.xadd(keys.rollouts_of(P0), sample_fields(sid))  # type: ignore[arg-type]
    assert trainer.train_step(2)
    trainer.effects.stop_leaser()
    restarted = Trainer(tiny_cfg(keys, tmp_path), r, keys, "trainer", threading.Event())
    restarted.resume()
    try:
        for sid in (bad[0], bad[1], *goods[4:]):  # after a restart, which reads `dead` before any copy
            r.xadd(keys.rollouts_of(P0), sample_fields(sid, restarted.newest_published))  # type: ignore[arg-type]
        assert restarted.train_step(restarted.global_step + 1)
    finally:
        restarted.effects.stop_leaser()
    assert sorted(fates_of(r, keys)) == sorted(goods)
    reasons = sorted(dead_reasons(r, keys).values())
    assert [x.split(":")[0] for x in reasons] == ["already ended"] * 4 + ["out of domain"] * 2, reasons
    assert f"already ended: sample_id='{bad[0]}' has a dead letter (one fate per id)" in reasons
    assert int(r.get(keys.consumed)) == len(bad) + len(goods)  # type: ignore[arg-type]  # each prompt once
    rep = audit_run(r, keys)
    assert rep.problems() == [] and set(bad) <= rep.dead and rep.refused == {"already ended": 4}
    note = "4 re-published copies refused (already ended) of sample ids that ended once otherwise"
    assert note in rep.notes()


def test_an_id_refused_outside_the_lease_and_trained_inside_it_ended_once(
    r: redis.Redis, keys: Keys, trainer: Trainer
) -> None:
    """Issue 62 item 4: an id first published past its producer's lease (dead-lettered "outside lease", which
    counts nothing) and later inside it is trained once; the audit used to report it as ended twice."""
    early = f"{P0}-{lease_outright(r, keys, P0, 0)}"  # the next seq, not leased yet
    source = r.xadd(keys.rollouts_of(P0), sample_fields(early)).decode()  # type: ignore[arg-type,union-attr]
    while source not in dead_reasons(r, keys):
        assert trainer.collector.fill()
    assert dead_reasons(r, keys)[source].startswith("outside lease:")
    assert leased_id(r, keys) == early
    other = leased_id(r, keys)
    for sid in (early, other):
        r.xadd(keys.rollouts_of(P0), sample_fields(sid))  # type: ignore[arg-type]
    assert trainer.train_step(1)
    assert sorted(fates_of(r, keys)) == sorted([early, other])
    rep = audit_run(r, keys)
    assert rep.problems() == [] and early in rep.trained and not rep.duplicated
    assert rep.refused == {"outside lease": 1}


def test_an_undecodable_copy_of_a_trained_id_is_refused_not_a_second_end(
    r: redis.Redis, keys: Keys, trainer: Trainer
) -> None:
    """An undecodable copy (garbled payload, valid header) of an id already trained used to be dead-lettered
    "decode: …", a second end of that id in the audit; it is now refused ("already ended") and the audit is
    clean, while an undecodable entry of a fresh id still ends it ("decode: …")."""
    goods = [leased_id(r, keys) for _ in range(2)]
    for sid in goods:
        r.xadd(keys.rollouts_of(P0), sample_fields(sid))  # type: ignore[arg-type]
    assert trainer.train_step(1)
    fresh = leased_id(r, keys)
    sources = {}
    for sid in (goods[0], fresh):
        garbled = {**sample_fields(sid), b"payload": b"\xc1 not msgpack"}
        sources[sid] = r.xadd(keys.rollouts_of(P0), garbled).decode()  # type: ignore[arg-type,union-attr]
    while not set(sources.values()) <= set(dead_reasons(r, keys)):
        assert trainer.collector.fill()
    reasons = dead_reasons(r, keys)
    assert reasons[sources[goods[0]]].startswith(f"already ended: sample_id='{goods[0]}'"), reasons
    assert reasons[sources[fresh]].startswith("decode:"), reasons
    rep = audit_run(r, keys)
    assert rep.problems() == [] and not rep.duplicated and fresh in rep.dead
    assert rep.refused == {"already ended": 1}


def test_versions_published_before_a_restart_are_not_from_the_future(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """A trainer that restarts from an older checkpoint finds versions published by the steps its crash
    abandoned; samples stamped with them are real (seen in the fault test), only newer ones are invalid."""
    setup_run(r, keys, PRODUCERS)
    for v in (0, 1, 2):  # published by a previous trainer process that never checkpointed
        publish_weights(r, keys, v, b"w" * 16, global_step=v, inline_max_bytes=1 << 20)
    trainer = Trainer(tiny_cfg(keys, tmp_path), r, keys, "trainer", threading.Event())
    trainer.resume()
    trainer.effects.stop_leaser()
    assert trainer.global_step == 0 and trainer.collector.newest_published == 2
    ids = [leased_id(r, keys) for _ in range(3)]
    future = r.xadd(keys.rollouts_of(P0), sample_fields(ids[0], 3)).decode()  # type: ignore[arg-type,union-attr]
    for sid in ids[1:]:
        r.xadd(keys.rollouts_of(P0), sample_fields(sid, 2))  # type: ignore[arg-type]
    assert trainer.train_step(1)
    assert dead_reasons(r, keys) == {
        future: "invalid: param_version=3 is newer than the newest published version 2"
    }
    assert sorted(f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)) == ids[1:]  # type: ignore[union-attr]


def test_a_producer_hoarding_its_lease_does_not_stop_training(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Issues 41 (item 3) and 62 (item 1), on a real trainer at the default rollout.lease_timeout_s (600 s):
    rollout_00 asks for 10^9 prompts and publishes nothing (it held the whole window: 0 steps in 90 s, then
    693 s without a step while the trainer held entries of it). It is leased its fair share (half the
    window), rollout_01 (publishing whatever it is leased) gets the rest and the trainer steps on; the
    hoarder's lease expires after 3 of rollout_01's dispatch times, not 600 s."""
    import time

    from rollstream.pacing.budget import ask_lease
    from rollstream.pacing.counters import dispatch_entries, lease_of
    from rollstream.weights.store import latest_param_version
    from schemas.text_entries import EXPIRE

    cfg = tiny_cfg(keys, tmp_path, "async_training.staleness_threshold=1", "rollout.prompts_per_dispatch=1")
    ask_lease(r, keys, P0, 10**9)
    t = Trainer(cfg, r, keys, "trainer", threading.Event())
    t.resume()
    stop = threading.Event()

    def honest() -> None:
        """rollout_01: publish every leased seq stamped with the newest version, ask for one more."""
        seq = 0
        while not stop.is_set():
            lease = lease_of(r, keys, "rollout_01")
            while seq < lease:
                pv = latest_param_version(r, keys)
                version = pv.version if pv is not None else 0
                ev = fake_rollout_sample(f"rollout_01-{seq}", param_version=version, n=2, prompt_len=4,
                                         response_len=5, producer="rollout_01")
                r.xadd(keys.rollouts_of("rollout_01"), encode(ev))  # type: ignore[arg-type]
                seq += 1
            ask_lease(r, keys, "rollout_01", seq + 1)
            time.sleep(0.02)

    deadline = time.monotonic() + 10
    while lease_of(r, keys, P0) < cfg.max_outstanding // 2:  # the hoarder holds its share first
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    assert lease_of(r, keys, P0) == cfg.max_outstanding // 2  # never the whole window
    worker = threading.Thread(target=honest, daemon=True)
    worker.start()
    guard = threading.Timer(60, t.stop.set)
    guard.start()
    started = time.monotonic()
    steps = 0
    try:
        while steps < 2 or not any(e.op == EXPIRE for e in dispatch_entries(r, keys)):
            assert steps < 200 and time.monotonic() - started < 50, steps
            steps += 1
            assert t.train_step(steps)
    finally:
        guard.cancel()
        stop.set()
        worker.join(5)
        t.effects.stop_leaser()
    expired = [e for e in dispatch_entries(r, keys) if e.op == EXPIRE]
    assert expired and {e.producer for e in expired} == {P0}
    fates = [f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)]  # type: ignore[union-attr]
    assert len(fates) == 2 * steps and all(sid.startswith("rollout_01-") for sid in fates)
    assert audit_run(r, keys).problems() == []
