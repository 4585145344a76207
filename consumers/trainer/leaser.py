"""The trainer's lease loop (rollstream/pacing/__init__.py tells the scheme): rank 0's thread that leases the
current budget to the producers that ask, checks expiries and floods, and drains the aggregator's outboxes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import redis

from rollstream.bus.connection import CONNECTION_ERRORS
from rollstream.keys import Keys
from rollstream.pacing.budget import lease_once
from rollstream.pacing.expiry import LeaseExpiry

log = logging.getLogger(__name__)

#: Seconds between two passes of the trainer's Leaser (a producer waits at most about this for a lease).
LEASE_PERIOD_S = 0.005


class Leaser:
    """The trainer's lease loop: a daemon thread running `lease_pass` every LEASE_PERIOD_S, the producers
    taken in turn (a different one first each pass), until `stop`. Connection errors are waited out."""

    def __init__(
        self, r: redis.Redis, keys: Keys, producers: Sequence[str], stop: threading.Event,
        period_s: float = LEASE_PERIOD_S, *, expiry: LeaseExpiry | None = None, fence: Any = None,
        outbox: Any = None,
    ) -> None:
        """Lease to `producers` (the run's producer names) on `r` until `stop` is set; with `expiry`, take
        back the leases of producers that finish nothing (see LeaseExpiry); with `fence` (a
        rollstream.pacing.fence.FloodFence), fence producers that flood Redis and lease them nothing more;
        with `outbox` (a rollstream.bus.outbox.OutboxDrain), move the aggregator's outboxes into its
        streams."""
        self.r, self.keys, self.producers, self.stop, self.period_s = r, keys, list(producers), stop, period_s
        self.expiry, self.fence, self.outbox = expiry, fence, outbox
        self.leased = 0  # prompts leased by this loop
        self.thread: threading.Thread | None = None
        self._turn = 0
        self._version = -1  # the budget's version at the last pass (-1: read it on the next)

    def run_once(self) -> int:
        """One pass (with an expiry check, a fence check and an outbox drain when due); returns the prompts
        leased."""
        if self.outbox is not None:
            self.outbox.maybe_drain(self.r)
        if not self.producers:
            return 0
        if self.fence is not None:
            self.fence.maybe_check(self.r, self.keys, self.producers)
        if self.expiry is not None:
            self.expiry.maybe_check(self.r, self.keys, self.producers)
        k = self._turn % len(self.producers)
        self._turn += 1
        order = self.producers[k:] + self.producers[:k]
        if self.fence is not None and self.fence.fenced:
            order = [p for p in order if p not in self.fence.fenced]
        caps, shares = (self.expiry.caps, self.expiry.shares) if self.expiry is not None else (None, None)
        n, self._version = lease_once(self.r, self.keys, order, self._version, caps, shares)
        self.leased += n
        return n

    def start(self) -> Leaser:
        """Run the loop in a daemon thread; returns self."""
        self.thread = threading.Thread(target=self._loop, name="leaser", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.wait(self.period_s):
            try:
                self.run_once()
            except CONNECTION_ERRORS as e:
                log.warning("leaser: %s; retrying", e)
                self.stop.wait(0.5)
            except redis.ResponseError as e:  # e.g. BUSY while another script runs: waited out
                log.warning("leaser: %s; retrying", e)
                self.stop.wait(0.5)
