"""Pacing on real Redis: dead-lettered rollouts count as consumed once and give their room back to the current
version's budget (TOPUP), never past max_outstanding - outstanding nor the grant's memory cap."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from conftest import P0, PRODUCERS

import rollstream.pacing as pacing
from rollstream.bus import setup_run
from rollstream.names import DEAD_LETTERED_FIELD, Keys
from rollstream.pacing import (
    budget_left,
    consume_dead,
    current_budget,
    dispatch_entries,
    grant_budget,
    mark_published,
    release_unpublished,
    take_budget,
)
from schemas import DispatchRecord
from schemas.text_entries import TOPUP


def dead(r: redis.Redis, keys: Keys, total: int, max_outstanding: int) -> tuple[int, int]:
    """`total` rollouts dead-lettered so far (as the trainer's reader counts them), then the trainer's
    TOPUP."""
    r.hset(keys.trainer, DEAD_LETTERED_FIELD, total)
    return consume_dead(r, keys, max_outstanding)


def outstanding(r: redis.Redis, keys: Keys) -> int:
    """dispatched - consumed, from the counters."""
    return int(r.get(keys.dispatched) or 0) - int(r.get(keys.consumed) or 0)  # type: ignore[arg-type]


def test_a_dead_letter_gives_its_room_back_once(r: redis.Redis, keys: Keys) -> None:
    """Sync mode's window (max_outstanding = one batch) all dispatched, one rollout dead-lettered: the
    version gets one prompt of budget back; a repeat of the call (a retry after a lost reply) adds nothing."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=4)
    assert take_budget(r, keys, 0, 4, "rollout_00").amount == 4
    assert take_budget(r, keys, 0, 1, "rollout_00").amount == 0  # the window is full
    assert dead(r, keys, 1, 4) == (1, 1)
    assert dead(r, keys, 1, 4) == (0, 0)  # the retry: nothing twice
    assert int(r.get(keys.consumed)) == 1 and budget_left(r, keys, 0) == 1  # type: ignore[arg-type]
    assert take_budget(r, keys, 0, 2, "rollout_00").amount == 1
    assert outstanding(r, keys) == 4
    assert [e for e in dispatch_entries(r, keys) if e.op == TOPUP] == [
        DispatchRecord(TOPUP, version=0, amount=1, outstanding=3, max_outstanding=4, producer=None)
    ]
    # two more dead letters, one of them left uncounted by a trainer that crashed: the next call counts both
    assert dead(r, keys, 3, 4) == (2, 2)
    assert budget_left(r, keys, 0) == 2 and int(r.get(keys.consumed)) == 3  # type: ignore[arg-type]


def test_a_top_up_gives_back_only_the_dead_letters_room_and_never_passes_the_bound(
    r: redis.Redis, keys: Keys
) -> None:
    """A crashed producer's released prompts and a dead letter each give their room back; budget left +
    outstanding never exceeds max_outstanding, even when a restart shrank the window under the grant."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=4)
    assert take_budget(r, keys, 0, 4, "rollout_00").amount == 4
    mark_published(r, keys, "rollout_00", 2)
    assert release_unpublished(r, keys, "rollout_00", 4) == 2  # it crashed before publishing the other 2
    assert budget_left(r, keys, 0) == 2 and outstanding(r, keys) == 2  # their room is back at once
    assert dead(r, keys, 1, 4) == (1, 1)  # one published was dead: 1 back
    assert budget_left(r, keys, 0) == 3 and outstanding(r, keys) == 1
    assert grant_budget(r, keys, 1, max_outstanding=4) == (3, 1)
    assert take_budget(r, keys, 1, 2, "rollout_01").amount == 2  # 3 out, 1 left
    # the trainer restarted with staleness_threshold lowered: max_outstanding 2 < 2 outstanding + 1 left
    assert dead(r, keys, 2, 2) == (1, 0)
    assert budget_left(r, keys, 1) == 1 and outstanding(r, keys) == 2


def test_a_top_up_keeps_the_memory_cap(r: redis.Redis, keys: Keys) -> None:
    """Under back-pressure a grant is capped at one global step's prompts; a top-up never leaves more than
    the cap to take. An uncapped grant lifts it."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=8)
    assert take_budget(r, keys, 0, 6, "rollout_00").amount == 6
    assert grant_budget(r, keys, 1, max_outstanding=8, cap=2) == (2, 6)
    assert dead(r, keys, 1, 8) == (1, 0)  # 2 left already: the cap
    assert take_budget(r, keys, 1, 2, "rollout_00").amount == 2
    assert dead(r, keys, 4, 8) == (3, 2)  # 3 freed, the cap allows 2
    assert budget_left(r, keys, 1) == 2 and outstanding(r, keys) == 4
    assert grant_budget(r, keys, 2, max_outstanding=8) == (4, 4)  # uncapped again
    assert dead(r, keys, 5, 8) == (1, 1)
    assert current_budget(r, keys) == (2, 5) and outstanding(r, keys) == 3


def test_a_grant_between_the_read_and_the_top_up_is_retried_on_the_new_version(
    r: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=2)
    assert take_budget(r, keys, 0, 2, "rollout_00").amount == 2
    reads: list[tuple[int, int]] = []
    real = pacing.current_budget

    def stale_first(rr: Any, kk: Keys) -> tuple[int, int]:
        reads.append(real(rr, kk))
        if len(reads) == 1:
            grant_budget(r, keys, 1, max_outstanding=2)  # lands after the read: version 0's budget is gone
        return reads[-1]

    monkeypatch.setattr(pacing, "current_budget", stale_first)
    assert dead(r, keys, 1, 2) == (1, 1)
    assert [v for v, _ in reads] == [0, 1]
    assert budget_left(r, keys, 1) == 1 and not r.exists(keys.budget(0))
    assert int(r.get(keys.consumed)) == 1  # type: ignore[arg-type]


def test_a_crashed_producers_release_gives_sync_mode_its_prompts_back(r: redis.Redis, keys: Keys) -> None:
    """Sync mode (window = one batch of 4): a producer took all 4, published 2 and was killed (or lost Redis).
    The trainer needs all 4 for its step; the restarted producer's release puts their room back into the
    version's budget so it can dispatch them again (it waited for a version that needs them before), within
    the
    bound and the memory cap, once."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=4)
    assert take_budget(r, keys, 0, 4, "rollout_00").amount == 4
    mark_published(r, keys, "rollout_00", 2)
    assert release_unpublished(r, keys, "rollout_00", 4) == 2
    assert release_unpublished(r, keys, "rollout_00", 4) == 0  # a second restart: nothing more
    assert take_budget(r, keys, 0, 4, "rollout_00").amount == 2 and outstanding(r, keys) == 4
    log = dispatch_entries(r, keys)
    assert [(e.op, e.amount) for e in log] == [
        ("grant", 4),
        ("take", 4),
        ("release", 2),
        ("topup", 2),
        ("take", 2),
    ]
    # under back-pressure the cap holds: one prompt left of a cap of 1, so a release of 2 adds nothing
    grant_budget(r, keys, 1, max_outstanding=8, cap=1)
    assert take_budget(r, keys, 1, 0, "rollout_01").amount == 0
    r.incrby(keys.producer_inflight("rollout_01"), 2)  # (as if it had taken 2 under an earlier grant)
    r.incrby(keys.dispatched, 2)
    assert release_unpublished(r, keys, "rollout_01", 8) == 2 and budget_left(r, keys, 1) == 1


def test_dead_letters_before_any_grant_only_count(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys, PRODUCERS)
    assert dead(r, keys, 2, 4) == (2, 0)
    assert int(r.get(keys.consumed)) == 2 and dispatch_entries(r, keys) == []  # type: ignore[arg-type]


def test_a_dead_letter_is_counted_once_across_a_retry_and_a_trainer_crash(r: redis.Redis, keys: Keys) -> None:
    """The trainer's reader counts a dead letter in the script that acks it: a retried dead-letter (lost
    reply)
    writes no second copy and no second count, and a trainer killed before pacing counted it leaves it to the
    next process, whose first pass tops the budget up (sync mode would otherwise wait forever for the 4th)."""
    import threading
    from types import SimpleNamespace

    from consumers.trainer.collect import Collector
    from rollstream.bus import GroupReader
    from rollstream.config import load_config
    from rollstream.fakes import fake_rollout_sample
    from rollstream.names import TRAINER_GROUP
    from schemas import encode

    B = 4
    cfg = load_config("pipeline.yaml", [f"run.name={keys.run}", f"data.train_batch_size={B}",
                      "actor.ppo_mini_batch_size=4", "trainer.parameter_sync_step=1",
                      "rollout.staleness_threshold=0"])  # fmt: skip
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, cfg.max_outstanding)
    assert take_budget(r, keys, 0, B, "rollout_00").amount == B
    pipe = r.pipeline(transaction=True)
    for i in range(B):
        fields: dict[str, Any] = encode(
            fake_rollout_sample(f"{P0}-s{i}", param_version=0, n=2, prompt_len=4, response_len=4, producer=P0)
        )
        if i == 1:
            fields["payload"] = b"\xc1 corrupt"
        pipe.xadd(keys.rollouts_of(P0), fields)  # type: ignore[arg-type]
    mark_published(pipe, keys, "rollout_00", B)
    pipe.execute()
    dp = SimpleNamespace(rank=0, world_size=1, active=False, is_main=True)

    def collector() -> Collector:
        reader = GroupReader(r, keys.rollouts_of(P0), TRAINER_GROUP, "trainer", dead_stream=keys.dead,
                             block_ms=10, dead_count=(keys.trainer, DEAD_LETTERED_FIELD))  # as the Trainer
        return Collector(cfg, r, keys, reader, dp, threading.Event(), False, 1000, 64,  # type: ignore[arg-type]
                         lambda: None)

    first = collector()
    first.reader.poll(0)  # the corrupt entry is dead-lettered inside the read...
    (dead_id, dead_fields), = [
        (i, f) for i, f in r.xrange(keys.rollouts_of(P0)) if f[b"payload"] == b"\xc1 corrupt"
    ]
    first.reader.dead_letter(
        dead_id.decode(), dead_fields, "a retry after a lost reply", stream=keys.rollouts_of(P0)
    )
    assert r.xlen(keys.dead) == 1 and int(r.hget(keys.trainer, DEAD_LETTERED_FIELD)) == 1  # type: ignore[arg-type]
    assert int(r.get(keys.consumed) or 0) == 0  # ...and the trainer dies before pacing counted it
    del first

    second = collector()  # the restarted trainer
    assert second.fill()
    assert int(r.get(keys.consumed)) == 1 and budget_left(r, keys, 0) == 1  # type: ignore[arg-type]
    assert take_budget(r, keys, 0, 1, "rollout_00").amount == 1  # a producer can replace it
    assert outstanding(r, keys) == B
    for _ in range(2):
        second.fill()
    assert int(r.get(keys.consumed)) == 1 and len(second.buffer) == 3  # counted once; 3 good ones buffered


def test_a_dead_letter_that_is_no_prompt_is_not_counted(r: redis.Redis, keys: Keys) -> None:
    """An entry that is not a rollout (the trainer dead-letters it with counted=False) was never dispatched:
    it gets its dead copy but must not count as a consumed prompt."""
    from rollstream.bus import GroupReader, Publisher
    from rollstream.names import TRAINER_GROUP
    from schemas import ParamVersion

    setup_run(r, keys, PRODUCERS)
    Publisher(r).publish(
        keys.rollouts_of(P0), ParamVersion(version=0, uri="x", sha256="0" * 64, bytes=0, global_step=0)
    )
    reader = GroupReader(r, keys.rollouts_of(P0), TRAINER_GROUP, "trainer", dead_stream=keys.dead,
                         block_ms=10,
                         dead_count=(keys.trainer, DEAD_LETTERED_FIELD))  # fmt: skip
    (m,) = reader.poll(0)
    reader.dead_letter(m.id, m.fields, "not a rollout", counted=False)
    assert r.xlen(keys.dead) == 1 and r.hget(keys.trainer, DEAD_LETTERED_FIELD) is None
    assert consume_dead(r, keys, max_outstanding=4) == (0, 0)
