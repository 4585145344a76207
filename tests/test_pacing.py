"""Pacing on real Redis: dead-lettered rollouts count as consumed once and give their room back to the current
version's budget (TOPUP), never past max_outstanding - outstanding nor the grant's memory cap."""

from __future__ import annotations

from typing import Any

import pytest
import redis

import rollstream.pacing as pacing
from rollstream.bus import setup_run
from rollstream.names import Keys, dead_counted_field
from rollstream.pacing import (
    budget_left,
    consume_dead,
    current_budget,
    dead_counted,
    dispatch_entries,
    grant_budget,
    mark_published,
    release_unpublished,
    take_budget,
)
from schemas import DispatchRecord
from schemas.plain import TOPUP

FIELD = dead_counted_field(0)


def outstanding(r: redis.Redis, keys: Keys) -> int:
    """dispatched - consumed, from the counters."""
    return int(r.get(keys.dispatched) or 0) - int(r.get(keys.consumed) or 0)  # type: ignore[arg-type]


def test_a_dead_letter_gives_its_room_back_once(r: redis.Redis, keys: Keys) -> None:
    """Sync mode's window (max_outstanding = one batch) all dispatched, one rollout dead-lettered: the
    version gets one prompt of budget back; a repeat of the call (a retry after a lost reply) adds nothing."""
    setup_run(r, keys)
    grant_budget(r, keys, 0, max_outstanding=4)
    assert take_budget(r, keys, 0, 4, "rollout_00").amount == 4
    assert take_budget(r, keys, 0, 1, "rollout_00").amount == 0  # the window is full
    assert consume_dead(r, keys, FIELD, 1, max_outstanding=4) == (1, 1)
    assert consume_dead(r, keys, FIELD, 1, max_outstanding=4) == (0, 0)  # the retry: nothing twice
    assert int(r.get(keys.consumed)) == 1 and budget_left(r, keys, 0) == 1  # type: ignore[arg-type]
    assert take_budget(r, keys, 0, 2, "rollout_00").amount == 1
    assert outstanding(r, keys) == 4
    assert [e for e in dispatch_entries(r, keys) if e.op == TOPUP] == [
        DispatchRecord(TOPUP, version=0, amount=1, outstanding=3, max_outstanding=4, producer=None)
    ]
    # a later process of the same rank continues the running total
    assert dead_counted(r, keys, FIELD) == 1
    assert consume_dead(r, keys, FIELD, dead_counted(r, keys, FIELD) + 2, max_outstanding=4) == (2, 2)
    assert budget_left(r, keys, 0) == 2 and int(r.get(keys.consumed)) == 3  # type: ignore[arg-type]


def test_a_top_up_gives_back_only_the_dead_letters_room_and_never_passes_the_bound(
    r: redis.Redis, keys: Keys
) -> None:
    """Room freed otherwise (a crashed producer's released prompts) waits for the next grant; and budget left
    + outstanding never exceeds max_outstanding, even when a restart shrank the window under the grant."""
    setup_run(r, keys)
    grant_budget(r, keys, 0, max_outstanding=4)
    assert take_budget(r, keys, 0, 4, "rollout_00").amount == 4
    mark_published(r, keys, "rollout_00", 2)
    assert release_unpublished(r, keys, "rollout_00") == 2  # it crashed before publishing the other 2
    assert consume_dead(r, keys, FIELD, 1, max_outstanding=4) == (1, 1)  # one published was dead: 1 back
    assert budget_left(r, keys, 0) == 1 and outstanding(r, keys) == 1
    assert grant_budget(r, keys, 1, max_outstanding=4) == (3, 1)
    assert take_budget(r, keys, 1, 2, "rollout_01").amount == 2  # 3 out, 1 left
    # the trainer restarted with staleness_threshold lowered: max_outstanding 2 < 2 outstanding + 1 left
    assert consume_dead(r, keys, FIELD, 2, max_outstanding=2) == (1, 0)
    assert budget_left(r, keys, 1) == 1 and outstanding(r, keys) == 2


def test_a_top_up_keeps_the_memory_cap(r: redis.Redis, keys: Keys) -> None:
    """Under back-pressure a grant is capped at one global step's prompts; a top-up never leaves more than
    the cap to take. An uncapped grant lifts it."""
    setup_run(r, keys)
    grant_budget(r, keys, 0, max_outstanding=8)
    assert take_budget(r, keys, 0, 6, "rollout_00").amount == 6
    assert grant_budget(r, keys, 1, max_outstanding=8, cap=2) == (2, 6)
    assert consume_dead(r, keys, FIELD, 1, max_outstanding=8) == (1, 0)  # 2 left already: the cap
    assert take_budget(r, keys, 1, 2, "rollout_00").amount == 2
    assert consume_dead(r, keys, FIELD, 4, max_outstanding=8) == (3, 2)  # 3 freed, the cap allows 2
    assert budget_left(r, keys, 1) == 2 and outstanding(r, keys) == 4
    assert grant_budget(r, keys, 2, max_outstanding=8) == (4, 4)  # uncapped again
    assert consume_dead(r, keys, FIELD, 5, max_outstanding=8) == (1, 1)
    assert current_budget(r, keys) == (2, 5) and outstanding(r, keys) == 3


def test_a_grant_between_the_read_and_the_top_up_is_retried_on_the_new_version(
    r: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup_run(r, keys)
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
    assert consume_dead(r, keys, FIELD, 1, max_outstanding=2) == (1, 1)
    assert [v for v, _ in reads] == [0, 1]
    assert budget_left(r, keys, 1) == 1 and not r.exists(keys.budget(0))
    assert int(r.get(keys.consumed)) == 1  # type: ignore[arg-type]


def test_dead_letters_before_any_grant_only_count(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys)
    assert consume_dead(r, keys, FIELD, 2, max_outstanding=4) == (2, 0)
    assert int(r.get(keys.consumed)) == 2 and dispatch_entries(r, keys) == []  # type: ignore[arg-type]
