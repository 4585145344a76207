"""Pacing on real Redis: the trainer leases its budget to the producers that ask, and counts each leased
prompt as consumed once (early consumption gives its room back, never past max_outstanding - outstanding
nor the grant's memory cap); nothing a producer writes moves it."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from conftest import P0, PRODUCERS

import rollstream.pacing.budget as budget
import rollstream.pacing.expiry as expiry
from consumers.trainer.leaser import Leaser
from consumers.trainer.roles import RankRoles
from rollstream.bus import setup_run
from rollstream.bus.ids import split_sample_id
from rollstream.keys import Keys
from rollstream.pacing.budget import (
    ask_lease,
    budget_left,
    consume,
    current_budget,
    grant_budget,
    lease_once,
    lease_pass,
    queue_count_consumed,
)
from rollstream.pacing.counters import dispatch_entries, is_consumed, lease_of
from rollstream.pacing.expiry import LeaseExpiry, is_revoked
from schemas import DispatchRecord
from schemas.text_entries import EXPIRE, LEASE, TOPUP


def outstanding(r: redis.Redis, keys: Keys) -> int:
    """dispatched (leased) - consumed, from the counters."""
    return int(r.get(keys.dispatched) or 0) - int(r.get(keys.consumed) or 0)  # type: ignore[arg-type]


def leased(r: redis.Redis, keys: Keys, producer: str, n: int) -> list[str]:
    """`producer` asks for `n` more prompts and one lease pass runs; returns the ids it may now publish."""
    have = lease_of(r, keys, producer)
    ask_lease(r, keys, producer, have + n)
    lease_pass(r, keys, [producer])
    return [f"{producer}-{seq}" for seq in range(have, lease_of(r, keys, producer))]


def test_a_lease_pass_gives_each_asking_producer_up_to_its_want_and_never_more_than_the_budget(
    r: redis.Redis, keys: Keys
) -> None:
    setup_run(r, keys, PRODUCERS)
    assert lease_pass(r, keys, ["rollout_00"]) == 0  # no grant yet: nothing to lease
    grant_budget(r, keys, 0, max_outstanding=5)
    ask_lease(r, keys, "rollout_00", 3)
    ask_lease(r, keys, "rollout_01", 4)
    assert lease_pass(r, keys, ["rollout_00", "rollout_01", "rollout_02"]) == 5  # 3 + 2: the budget is out
    assert (lease_of(r, keys, "rollout_00"), lease_of(r, keys, "rollout_01")) == (3, 2)
    assert lease_of(r, keys, "rollout_02") == 0 and budget_left(r, keys, 0) == 0 and outstanding(r, keys) == 5
    assert lease_pass(r, keys, ["rollout_00", "rollout_01"]) == 0  # a repeat leases nothing
    leases = [e for e in dispatch_entries(r, keys) if e.op == LEASE]
    assert leases == [
        DispatchRecord(
            LEASE, version=0, amount=3, outstanding=3, max_outstanding=None, producer="rollout_00"
        ),
        DispatchRecord(
            LEASE, version=0, amount=2, outstanding=5, max_outstanding=None, producer="rollout_01"
        ),
    ]
    # the next version's grant carries over: 5 outstanding of 8 leaves 3, rollout_01 still wants 2 more
    assert grant_budget(r, keys, 1, max_outstanding=8) == (3, 5)
    assert lease_pass(r, keys, ["rollout_00", "rollout_01"]) == 2 and lease_of(r, keys, "rollout_01") == 4


def test_a_pass_with_a_stale_version_leases_from_the_current_grant(r: redis.Redis, keys: Keys) -> None:
    """The Leaser keeps the version it read last: after a new grant, its next pass is told the version moved
    and leases from the new grant's budget, never the old one's."""
    setup_run(r, keys, PRODUCERS)
    assert lease_once(r, keys, ["rollout_00"]) == (0, -1)  # before any grant
    grant_budget(r, keys, 0, max_outstanding=2)
    ask_lease(r, keys, "rollout_00", 2)
    assert lease_once(r, keys, ["rollout_00"], -1) == (2, 0)
    grant_budget(r, keys, 1, max_outstanding=5)  # 2 outstanding of 5: 3 more
    ask_lease(r, keys, "rollout_00", 9)
    assert lease_once(r, keys, ["rollout_00"], 0) == (3, 1)  # told 0, leased from version 1's grant
    assert lease_of(r, keys, "rollout_00") == 5 and budget_left(r, keys, 1) == 0
    assert [e.version for e in dispatch_entries(r, keys) if e.op == LEASE] == [0, 1]


@pytest.mark.parametrize("junk", [b"not a number", b"inf", b"nan", b"-5", b"1e300", b"0x10", b""])
def test_a_producers_want_of_any_value_never_leases_past_the_budget(
    r: redis.Redis, keys: Keys, junk: bytes
) -> None:
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=4)
    r.set(keys.producer_want("rollout_00"), junk)
    n = lease_pass(r, keys, ["rollout_00"])
    assert 0 <= n <= 4 and lease_of(r, keys, "rollout_00") == n and outstanding(r, keys) == n <= 4
    assert budget_left(r, keys, 0) == 4 - n


def test_consume_counts_each_leased_prompt_once_and_nothing_else(r: redis.Redis, keys: Keys) -> None:
    """Sync mode's window (max_outstanding = one batch) all leased and published: a dead-lettered or evicted
    one gives its room back once; a retry, an id outside the lease, another producer's id, junk ids and the
    commit's count of the same ids add nothing."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=4)
    ids = leased(r, keys, "rollout_00", 4)
    assert ids == ["rollout_00-0", "rollout_00-1", "rollout_00-2", "rollout_00-3"]
    assert leased(r, keys, "rollout_00", 1) == []  # the window is full
    assert consume(r, keys, ["rollout_00-1"], 4) == (1, 1)
    assert consume(r, keys, ["rollout_00-1"], 4) == (0, 0)  # the retry: nothing twice
    assert budget_left(r, keys, 0) == 1 and is_consumed(r, keys, "rollout_00-1")
    beyond = ["rollout_00-4", "rollout_00-999", "rollout_01-0", "rollout_00", "x-1-", "rollout_00--1", ""]
    assert consume(r, keys, beyond, 4) == (0, 0)  # outside any lease, or not a leased id
    assert leased(r, keys, "rollout_00", 2) == ["rollout_00-4"]  # the room given back, leased again
    pipe = r.pipeline(transaction=True)  # the step's commit counts what it trained, and the eviction again
    queue_count_consumed(pipe, keys, ["rollout_00-0", "rollout_00-1", "rollout_00-2"])
    pipe.execute()
    assert int(r.get(keys.consumed)) == 3 and outstanding(r, keys) == 2  # type: ignore[arg-type]
    assert [(e.op, e.amount) for e in dispatch_entries(r, keys) if e.op == TOPUP] == [(TOPUP, 1)]


def test_a_top_up_keeps_the_bound_and_the_memory_cap(r: redis.Redis, keys: Keys) -> None:
    """Under back-pressure a grant is capped at one global step's prompts; a top-up never leaves more than
    the cap to lease, nor more than max_outstanding - outstanding. An uncapped grant lifts it."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=8)
    ids = leased(r, keys, "rollout_00", 6)
    assert grant_budget(r, keys, 1, max_outstanding=8, cap=2) == (2, 6)
    assert consume(r, keys, ids[:1], 8) == (1, 0)  # 2 left already: the cap
    ids += leased(r, keys, "rollout_00", 2)
    assert consume(r, keys, ids[1:4], 8) == (3, 2)  # 3 freed, the cap allows 2
    assert budget_left(r, keys, 1) == 2 and outstanding(r, keys) == 4
    assert grant_budget(r, keys, 2, max_outstanding=8) == (4, 4)  # uncapped again
    assert consume(r, keys, ids[4:5], 8) == (1, 1)  # 4 left + 3 outstanding = 7 of 8: room for 1 more
    assert current_budget(r, keys) == (2, 5) and outstanding(r, keys) == 3
    # the trainer restarted with staleness lowered: max_outstanding 2 < 3 outstanding: nothing given back
    assert consume(r, keys, ids[5:6], 2) == (1, 0)


def test_consume_before_any_grant_only_counts(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys, PRODUCERS)
    budget.lease_outright(r, keys, "rollout_00", 2)
    assert consume(r, keys, ["rollout_00-0", "rollout_00-1"], 4) == (2, 0)
    assert int(r.get(keys.consumed)) == 2 and dispatch_entries(r, keys) == []  # type: ignore[arg-type]


def test_a_grant_between_the_read_and_the_top_up_is_retried_on_the_new_version(
    r: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=2)
    ids = leased(r, keys, "rollout_00", 2)
    reads: list[tuple[int, int]] = []
    real = budget.current_budget

    def stale_first(rr: Any, kk: Keys) -> tuple[int, int]:
        reads.append(real(rr, kk))
        if len(reads) == 1:
            grant_budget(r, keys, 1, max_outstanding=2)  # lands after the read: version 0's budget is gone
        return reads[-1]

    monkeypatch.setattr(budget, "current_budget", stale_first)
    assert consume(r, keys, ids[:1], 2) == (1, 1)
    assert [v for v, _ in reads] == [0, 1]
    assert budget_left(r, keys, 1) == 1 and not r.exists(keys.budget(0))
    assert int(r.get(keys.consumed)) == 1  # type: ignore[arg-type]


def test_the_leaser_takes_producers_in_turn(r: redis.Redis, keys: Keys) -> None:
    """Two producers both asking for more than the budget: the one served first alternates, so neither is
    starved by the other's place in the list."""
    setup_run(r, keys, PRODUCERS)
    leaser = Leaser(r, keys, ["rollout_00", "rollout_01"], threading.Event())
    firsts = []
    for v in range(4):
        grant_budget(r, keys, v, max_outstanding=outstanding(r, keys) + 1)
        before = {p: lease_of(r, keys, p) for p in ("rollout_00", "rollout_01")}
        for p in before:
            ask_lease(r, keys, p, before[p] + 5)
        assert leaser.run_once() == 1
        firsts += [p for p in before if lease_of(r, keys, p) > before[p]]
    assert firsts == ["rollout_00", "rollout_01", "rollout_00", "rollout_01"]


def test_split_sample_id() -> None:
    assert split_sample_id("rollout_00-12") == ("rollout_00", 12)
    assert split_sample_id("my-producer-3") == ("my-producer", 3)
    for bad in (
        "rollout_00",
        "rollout_00-",
        "-3",
        "rollout_00-+3",
        "rollout_00- 3",
        "rollout_00-3.0",
        "a-1e3",
    ):
        assert split_sample_id(bad) is None, bad


def test_a_dead_letter_is_counted_once_across_a_retry_and_a_trainer_crash(r: redis.Redis, keys: Keys) -> None:
    """A retried dead-letter (lost reply) writes no second copy, and a trainer killed before pacing counted
    it leaves it to the next process, whose first pass reads `dead` and tops the budget up (sync mode would
    otherwise wait forever for the 4th). A junk entry that names no leased prompt counts nothing."""
    from consumers.trainer.collect import Collector, rollouts_reader
    from consumers.trainer.effects import TrainerEffects
    from rollstream.config import load_config
    from rollstream.testing.fakes import fake_rollout_sample
    from schemas import encode

    B = 4
    cfg = load_config("pipeline.yaml", [f"run.name={keys.run}", f"data.train_batch_size={B}",
                      "actor.ppo_mini_batch_size=4", "async_training.trigger_parameter_sync_step=1",
                      "async_training.staleness_threshold=0", "bus.block_ms=10"])  # fmt: skip
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, cfg.max_outstanding)
    ids = leased(r, keys, "rollout_00", B)
    pipe = r.pipeline(transaction=True)
    for i, sid in enumerate([*ids, "rollout_00-77"]):
        fields: dict[str, Any] = encode(
            fake_rollout_sample(
                sid, param_version=0, n=2, prompt_len=4, response_len=4, producer="rollout_00"
            )
        )
        if i in (1, B):
            fields["payload"] = b"\xc1 corrupt"
        pipe.xadd(keys.rollouts_of(P0), fields)  # type: ignore[arg-type]
    pipe.execute()
    dp = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())

    def collector() -> Collector:
        reader = rollouts_reader(cfg, r, keys, "trainer", threading.Event())
        effects = TrainerEffects(cfg, r, keys, cfg.run_dir() / "weights", dp)  # type: ignore[arg-type]
        return Collector(cfg, effects, reader, dp, threading.Event(), False, 1000, 64)  # type: ignore[arg-type]

    first = collector()
    first.reader.poll(0)  # the corrupt entries are dead-lettered inside the read...
    rows: Any = r.xrange(keys.rollouts_of(P0))
    dead_id, dead_fields = next((i, f) for i, f in rows if f[b"sample_id"] == ids[1].encode())
    retry = "a retry after a lost reply"
    first.reader.dead_letter(dead_id.decode(), dead_fields, retry, stream=keys.rollouts_of(P0))
    assert r.xlen(keys.dead) == 2
    assert int(r.get(keys.consumed) or 0) == 0  # type: ignore[arg-type]  # ...and the trainer dies here
    del first

    second = collector()  # the restarted trainer
    assert second.fill()
    assert int(r.get(keys.consumed)) == 1 and budget_left(r, keys, 0) == 1  # type: ignore[arg-type]
    assert leased(r, keys, "rollout_00", 1) == [f"rollout_00-{B}"]  # a producer can replace it
    assert outstanding(r, keys) == B
    for _ in range(2):
        second.fill()
    assert int(r.get(keys.consumed)) == 1 and len(second.buffer) == 3  # counted once; 3 good ones buffered


class _Clock:
    """A settable monotonic clock for LeaseExpiry."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_hoarders_lease_is_its_fair_share_and_expires_after_three_dispatch_times(
    r: redis.Redis, keys: Keys
) -> None:
    """Issue 62, item 1: rollout_00 asks for 10^9 and publishes one sample, which the trainer holds while it
    waits to fill a batch. It used to get the whole budget when first in turn, and its clock restarted while
    the trainer held that entry: 693 s without a step at lease_timeout_s=600. Now it is leased its fair share
    (half the budget: nobody has delivered anything yet), the held entry counts as progress once, and its
    unfinished prompts come back EXPIRY_DISPATCHES dispatch times (here rollout_01's, 2 s) after its last
    progress, far below lease_timeout_s; then it is on probation."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=8)
    clock = _Clock()
    lease_expiry = LeaseExpiry(600.0, 8, probation=2, every_s=0, clock=clock)
    leaser = Leaser(r, keys, PRODUCERS, threading.Event(), expiry=lease_expiry)
    ask_lease(r, keys, P0, 10**9)
    leaser._turn = 0
    assert leaser.run_once() == 4  # the hoarder first, alone: 4 of 8 (the budget over both producers)
    honest = "rollout_01"
    ask_lease(r, keys, honest, 2)
    assert leaser.run_once() == 2 and lease_of(r, keys, P0) == 4
    r.xadd(keys.rollouts_of(P0), {"sample_id": f"{P0}-0"})
    r.xreadgroup("trainer", "t", {keys.rollouts_of(P0): ">"})  # held by the trainer, never acked
    clock.now = 0.5
    leaser.run_once()  # the held entry: progress, once
    for t in (2.0, 4.0):  # rollout_01 publishes a dispatch of 2 every 2 s
        clock.now = t
        seq = lease_of(r, keys, honest) - 2
        for s in (seq, seq + 1):
            r.xadd(keys.rollouts_of(honest), {"sample_id": f"{honest}-{s}"})
        ask_lease(r, keys, honest, seq + 4)
        leaser.run_once()
    assert lease_expiry.dispatch_s[honest] == 2.0 and lease_expiry.deadline_s(P0) == 6.0
    held = lease_of(r, keys, P0)
    assert held <= 6  # its share grew by the one sample it delivered, never to the whole budget
    clock.now = 6.0
    assert lease_expiry.maybe_check(r, keys, PRODUCERS) == []  # 5.5 s since its progress
    clock.now = 6.5
    assert lease_expiry.maybe_check(r, keys, PRODUCERS) == [(P0, held)]  # 3 x 2 s: taken back
    assert [is_revoked(r, keys, P0, s) for s in range(held)] == [True] * held
    assert [(e.op, e.producer, e.amount) for e in dispatch_entries(r, keys) if e.op == EXPIRE] == [
        (EXPIRE, P0, held)
    ]
    leaser._turn = 0
    leaser.run_once()  # probation: 2 more to the hoarder at most
    assert lease_of(r, keys, P0) == held + 2
    assert consume(r, keys, [f"{P0}-{s}" for s in range(1, held)], 8) == (0, 0)  # a late one counts nothing
    clock.now = 7.0
    assert lease_expiry.maybe_check(r, keys, PRODUCERS) == []


def simulate(r: redis.Redis, keys: Keys, hoard: bool, horizon_s: float = 40.0) -> tuple[int, list[float]]:
    """A run on the pacing's real scripts: rollout_01 dispatches 2 prompts at a time, each dispatch taking
    2 s, and asks one dispatch ahead; the trainer steps on every 4 published samples (reads, acks and counts
    them in one commit, then grants the next version's budget of 8); with `hoard`, rollout_00 asks for 10^9
    and publishes one sample, which the trainer holds unacked. Returns (steps in `horizon_s`, the times the
    hoarder's leases expired)."""
    setup_run(r, keys, PRODUCERS)
    grant_budget(r, keys, 0, max_outstanding=8)
    clock = _Clock()
    lease_expiry = LeaseExpiry(600.0, 8, probation=2, every_s=0, clock=clock)
    leaser = Leaser(r, keys, PRODUCERS, threading.Event(), expiry=lease_expiry)
    honest, stream = "rollout_01", keys.rollouts_of("rollout_01")
    if hoard:
        ask_lease(r, keys, P0, 10**9)
        leaser._turn = 0
        leaser.run_once()
        r.xadd(keys.rollouts_of(P0), {"sample_id": f"{P0}-0"})
        r.xreadgroup("trainer", "t", {keys.rollouts_of(P0): ">"})
    ask_lease(r, keys, honest, 2)
    next_seq, due, steps, version, expired = 0, None, 0, 0, []
    while clock.now <= horizon_s:
        expired += [clock.now for p, _ in lease_expiry.maybe_check(r, keys, PRODUCERS) if p == P0]
        leaser.run_once()
        if due is not None and clock.now >= due:  # the dispatch is published
            for s in range(next_seq - 2, next_seq):
                r.xadd(stream, {"sample_id": f"{honest}-{s}"})
            due = None
        if r.xinfo_groups(stream)[0]["lag"] >= 4:  # a step: read 4, commit them, grant the next version
            [(_, batch)] = r.xreadgroup("trainer", "t", {stream: ">"}, count=4)
            pipe = r.pipeline(transaction=True)
            pipe.xack(stream, "trainer", *(i for i, _ in batch))
            queue_count_consumed(pipe, keys, [f[b"sample_id"].decode() for _, f in batch])
            pipe.execute()
            version, steps = version + 1, steps + 1
            grant_budget(r, keys, version, max_outstanding=8)
        if due is None and lease_of(r, keys, honest) - next_seq >= 2:  # the next dispatch starts
            next_seq += 2
            due = clock.now + 2.0
            ask_lease(r, keys, honest, next_seq + 2)
        clock.now += 0.25
    return steps, expired


def test_one_hoarder_leaves_the_other_producers_steps_at_least_half_their_rate(
    r: redis.Redis, keys: Keys
) -> None:
    """Issue 62, item 1's test: with one producer asking for 10^9 and publishing nothing more, the other's
    steps go on at >= 50 % of their rate alone, and the hoarded prompts come back within 3 dispatch times
    of 2 s (+ one 0.25 s tick) of its last progress."""
    alone, _ = simulate(r, keys, hoard=False)
    for key in r.scan_iter(match=keys.prefix + "*"):
        r.delete(key)
    with_hoarder, expired = simulate(r, keys, hoard=True)
    assert alone >= 8 and with_hoarder >= alone / 2, (alone, with_hoarder)
    assert expired and expired[0] <= 3 * 2.0 + 0.25, expired


def test_a_lease_is_not_expired_while_its_entries_wait_unread_even_after_an_xdel(
    r: redis.Redis, keys: Keys
) -> None:
    """The expiry's snapshot tells unread entries by the group's lag; where an XDEL left Redis unable to tell
    it (a null lag), by the stream's last id: either way a producer whose entry waits with the trainer keeps
    its lease, and one whose entries were all read and acked does not."""
    setup_run(r, keys, PRODUCERS)
    stream = keys.rollouts_of(P0)
    ids = [r.xadd(stream, {"sample_id": f"{P0}-{s}"}) for s in range(4)]
    assert expiry.finished_counts(r, keys, PRODUCERS)[2] == {P0}  # unread (lag 4)
    r.xreadgroup("trainer", "t", {stream: ">"}, count=1)
    r.xack(stream, "trainer", ids[0])
    r.xdel(stream, ids[2])  # Redis cannot tell the group's lag any more; ids[1] and ids[3] still wait
    [group] = [g for g in r.xinfo_groups(stream) if g["name"] in ("trainer", b"trainer")]
    assert group["lag"] is None
    assert expiry.finished_counts(r, keys, PRODUCERS)[2] == {P0}
    r.xreadgroup("trainer", "t", {stream: ">"})
    r.xack(stream, "trainer", ids[1], ids[3])
    assert expiry.finished_counts(r, keys, PRODUCERS)[2] == set()  # all read and acked: not busy


def test_lease_expiry_refuses_a_bad_timeout() -> None:
    """A timeout that is not > 0 names the config field and the value."""
    with pytest.raises(ValueError, match=r"rollout.lease_timeout_s=0 must be > 0"):
        LeaseExpiry(0, 8, 1)
