"""A producer's slots (producers/slots.py): the reconnect generation that discards a slot's dispatch taken
before a reconnect, the newest-version check idle slots share, slot-averaged seconds. No Redis."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from producers.slots import Slots


def in_thread(fn: Callable[[], object]) -> object:
    """`fn()` run in a thread of its own (a slot), its result returned."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    return out[0]


def test_a_dispatch_taken_before_a_reconnect_is_stale_in_its_slot_only() -> None:
    slots = Slots(2, poll_s=0.005)
    slots.taken()  # this slot takes a dispatch ...
    slots.reconnected()  # ... another slot reconnects
    assert slots.stale(1)
    assert not in_thread(lambda: slots.stale(1))  # a slot that took nothing (the watchdog's thread)

    def take_then_finish() -> bool:
        slots.taken()
        return slots.stale(1)

    assert not in_thread(take_then_finish)  # taken after the reconnect
    slots.taken()
    assert not slots.stale(1)


def test_one_slot_never_discards() -> None:
    one = Slots(1, poll_s=0.005)
    one.taken()
    one.reconnected()
    assert not one.stale(1) and one.share(3.0) == 3.0


def test_idle_slots_share_one_version_check_per_poll() -> None:
    checks: list[int] = []

    def check() -> int:
        checks.append(1)
        return 7

    slots = Slots(4, poll_s=60)
    assert [slots.newest(check) for _ in range(5)] == [7] * 5 and len(checks) == 1
    one = Slots(1, poll_s=60)
    assert [one.newest(check) for _ in range(3)] == [7] * 3 and len(checks) == 4  # one slot: every call
    assert slots.share(2.0) == 0.5


def test_a_producer_runs_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        Slots(0, poll_s=0.005)
