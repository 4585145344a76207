"""The run audit (`rollstream audit`) on hand-written logs: a clean one (record 0, the validation before
training, is not a problem) passes; a sample that ended twice or was lost fails with exit 1."""

from __future__ import annotations

import pytest
import redis
from conftest import P0, PRODUCERS

from rollstream.bus import Publisher, setup_run
from rollstream.cli.main import main
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.ops.audit import audit_run
from rollstream.testing.fakes import fake_rollout_sample, local_update, step_end
from schemas import DROPPED, TRAINED, Fate, SyncStepRecord, encode_fate


def clean_run(r: redis.Redis, keys: Keys) -> list[str]:
    """Three samples of two producers, all consumed at step 1 (two trained, one dropped), its step_end,
    records 0 and 1; returns the rollouts entry ids."""
    setup_run(r, keys, PRODUCERS)
    pub, records = Publisher(r), Publisher(r, nomkstream=False)
    entries = []
    for sid, v, p in (("s1", 0, "rollout_00"), ("s2", 0, "rollout_01"), ("s3", 1, "rollout_01")):
        sample = fake_rollout_sample(sid, param_version=v, producer=p)
        entries.append(pub.publish(keys.rollouts_of(p), sample))
        r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(p): ">"})
        r.xack(keys.rollouts_of(p), TRAINER_GROUP, entries[-1])
    for i, (sid, fate) in enumerate((("s1", TRAINED), ("s2", TRAINED), ("s3", DROPPED)), start=1):
        r.xadd(keys.fates, encode_fate(Fate(sid, entries[i - 1], fate, 1, 0, 1)), id=f"1-{i}")  # type: ignore[arg-type]
    pub.publish(keys.metrics, local_update(1, 1, 1, {"x": 1.0}))
    pub.publish(keys.metrics, local_update(1, 1, 1, {"x": 1.0}))  # retrained after a restart: same values
    pub.publish(keys.metrics, step_end(1, 1))
    for g in (0, 1):  # record 0 is the validation of version 0, before training
        records.publish(keys.records, SyncStepRecord(global_step=g, num_local_updates=g), entry_id=f"{g}-1")
    return entries


def audit_cli(capsys: pytest.CaptureFixture[str], keys: Keys, redis_url: str) -> tuple[int, str]:
    code = main(["audit", f"run.name={keys.run}", f"run.redis_url={redis_url}"])
    return code, capsys.readouterr().out


def test_clean_run_with_a_step_zero_validation_record_has_no_problems(r: redis.Redis, keys: Keys) -> None:
    clean_run(r, keys)
    rep = audit_run(r, keys)
    assert rep.records == [0, 1] and rep.records_consecutive
    assert rep.problems() == [], rep.problems()
    assert rep.reemitted == {(1, 1): 2} and "re-emitted local updates 1" in rep.summary()  # finding 9
    assert {p: dict(c) for p, c in rep.producer_versions.items()} == {
        "rollout_00": {0: 1},
        "rollout_01": {0: 1, 1: 1},
    }

    Publisher(r, nomkstream=False).publish(keys.records, SyncStepRecord(global_step=3, num_local_updates=1),
                                           entry_id="3-1")
    assert audit_run(r, keys).problems() == ["records are not steps [0,] 1..M: [0, 1, 3]"]


def test_audit_command_prints_the_summary_and_exits_0_on_a_clean_log(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    clean_run(r, keys)
    code, out = audit_cli(capsys, keys, redis_url)
    assert code == 0, out
    assert f"run {keys.run}" in out and "published 3 samples" in out
    assert "trained once 2  dropped once 1  evicted once 0  dead-lettered once 0  still pending 0" in out
    assert "ended more than once 0  missing (acked, no fate) 0" in out
    assert "producers: rollout_00 1 samples, versions 0; rollout_01 2 samples, versions 0-1" in out
    assert out.rstrip().endswith("problems: none")


def test_audit_command_exits_1_on_a_sample_ended_twice_or_lost(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    entries = clean_run(r, keys)
    r.xadd(keys.fates, encode_fate(Fate("s1", entries[0], TRAINED, 1, 0, 2)), id="2-1")  # type: ignore[arg-type]
    lost = Publisher(r).publish(keys.rollouts_of(P0), fake_rollout_sample("s4"))
    r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(P0): ">"})
    r.xack(keys.rollouts_of(P0), TRAINER_GROUP, lost)  # acked with no fate anywhere
    code, out = audit_cli(capsys, keys, redis_url)
    assert code == 1, out
    assert "trained once 1" in out and "ended more than once 1  missing (acked, no fate) 1" in out
    assert "1 published samples lost: ['s4']" in out and "1 samples ended more than once: ['s1']" in out
