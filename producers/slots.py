"""A producer's slots: copies of its dispatch loop run side by side in threads (an inference engine's
continuous batching), for a generate function that can run concurrently (the latency-model benchmark's
modelled decode, benchmarks/latency_producer.py).

The producer (producers/worker.py) guards its shared state (prompt source, lease, counters, stats window,
weights) with its lock, so its loop steps run one slot at a time; what is specific to slots lives here:
the threads, the reconnect generation (a dispatch taken before a reconnect is discarded instead of
published: the reconnect resynced the producer, whose unpublished prompts are dispatched again under the
same ids), one newest-version check shared by the idle slots, and the share of one slot in seconds counted
by all of them (idle and generation seconds are slot-averaged, so idle_ratio stays the idle fraction of the
slots). With one slot the loop runs in the caller's thread and nothing here changes what it does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Slots:
    """`count` slots of one producer's loop: their threads, reconnect generation and shared version check."""

    def __init__(self, count: int, poll_s: float) -> None:
        if count < 1:
            raise ValueError(f"a producer runs at least one slot, not {count}")
        self.count = count
        self.poll_s = poll_s  # how long idle slots share one newest-version check
        self.generation = 0  # bumped by each reconnect; a dispatch taken under an older one is not published
        self._taken = threading.local()  # the generation this slot's current dispatch was taken under
        self._newest = (-1, 0.0)  # (version, monotonic time of the check), shared by idle slots

    def run(self, loop: Callable[[], None], name: str) -> None:
        """Run `loop` in `count` threads named `<name>-slot<i>` and wait for all of them."""
        threads = [
            threading.Thread(target=loop, name=f"{name}-slot{i}", daemon=True) for i in range(self.count)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def taken(self) -> None:
        """Note that the calling slot's dispatch is taken now, under the current generation."""
        self._taken.generation = self.generation

    def reconnected(self) -> None:
        """A reconnect resynced the producer: every dispatch in flight belongs to the old generation."""
        self.generation += 1

    def stale(self, prompts: int) -> bool:
        """Whether the calling slot's dispatch (of `prompts` prompts) was taken before a reconnect, logged: it
        is discarded. Never with one slot: there a reconnect abandons the only dispatch in flight."""
        if self.count == 1 or getattr(self._taken, "generation", self.generation) == self.generation:
            return False
        log.warning("discarding %d samples: taken before a reconnect resynced the producer", prompts)
        return True

    def share(self, seconds: float) -> float:
        """One slot's share of `seconds` counted by every slot (slot-averaged idle and generation time)."""
        return seconds / self.count

    def newest(self, check: Callable[[], int]) -> int:
        """`check()` (the newest published version); idle slots share one check per `poll_s`."""
        if self.count == 1:
            return check()
        version, at = self._newest
        if time.monotonic() - at < self.poll_s:
            return version
        self._newest = (check(), time.monotonic())
        return self._newest[0]
