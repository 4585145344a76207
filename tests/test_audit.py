"""The run audit on a clean hand-written log: record 0 (validation before training) is not a problem."""

from __future__ import annotations

import redis

from consumers.aggregator.fake import local_update, step_end
from rollstream.audit import audit_run
from rollstream.bus import Publisher, setup_run
from rollstream.fake import fake_rollout_sample
from rollstream.names import TRAINER_GROUP, Keys
from schemas import SyncStepRecord


def test_clean_run_with_a_step_zero_validation_record_has_no_problems(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys)
    pub, records = Publisher(r), Publisher(r, nomkstream=False)
    entry = pub.publish(keys.rollouts, fake_rollout_sample("s1"))
    r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts: ">"})
    r.xack(keys.rollouts, TRAINER_GROUP, entry)
    r.xadd(keys.fates, {"sample_id": "s1", "source_id": entry, "fate": "trained", "staleness": 1,
                        "param_version": 0, "global_step": 1}, id="1-1")
    pub.publish(keys.metrics, local_update(1, 1, 1, {"x": 1.0}))
    pub.publish(keys.metrics, local_update(1, 1, 1, {"x": 1.0}))  # retrained after a restart: same values
    pub.publish(keys.metrics, step_end(1, 1))
    for g in (0, 1):  # record 0 is the validation of version 0, before training
        records.publish(keys.records, SyncStepRecord(global_step=g, num_local_updates=g), entry_id=f"{g}-1")
    rep = audit_run(r, keys)
    assert rep.records == [0, 1] and rep.records_consecutive
    assert rep.problems() == [], rep.problems()
    assert rep.reemitted == {(1, 1): 2} and "re-emitted local updates 1" in rep.summary()  # finding 9

    records.publish(keys.records, SyncStepRecord(global_step=3, num_local_updates=1), entry_id="3-1")
    assert audit_run(r, keys).problems() == ["records are not steps [0,] 1..M: [0, 1, 3]"]
