"""Leases taken back (rollstream/pacing/__init__.py tells the scheme): the expiry clock (`LeaseExpiry`: a
producer that finishes nothing for `rollout.lease_timeout_s` loses its unfinished lease), `expire_lease` (the
one way a lease is taken back, an expiry's or a fence's: the seqs' bits set in `consumed:<name>` and
`revoked:<name>`), and the one reader of the `revoked:<name>` bitmaps (`is_revoked`, and `RevokedWatch` for
the trainer's consumer loop).

A sample whose seq the trainer took back (its producer's lease expired, or it was fenced: `revoked:<name>`) is
dead-lettered "lease expired". Asking Redis for that bit on every consumed sample costs one GETBIT per sample
although a lease rarely expires. A `RevokedWatch` knows which producers have a `revoked:<name>` bitmap at all
(one pipelined EXISTS per producer) and asks for a bit only for those. It reads them again when an expiry may
have happened since: `expire_lease` bumps this process's expiry epoch before and after its script (the
trainer's Leaser, rank 0, runs in the trainer's process), and a watch in a process that does not expire leases
itself (a data-parallel rank other than 0) reads them again at every pass of its consumer loop (`new_pass`). A
restarted trainer starts with a fresh watch, which reads them first. The bitmaps only grow, so a producer once
known stays known.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from rollstream.bus.ids import text
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.pacing.budget import take_back

log = logging.getLogger(__name__)

_lock = threading.Lock()
_epoch = 0  # expirations begun or ended in this process


def bump_epoch() -> None:
    """Note that a lease expiry is about to run or just ran in this process (watches read again)."""
    global _epoch
    with _lock:
        _epoch += 1


def epoch() -> int:
    """This process's expiry epoch (changes whenever an expiry may have set revoked bits)."""
    return _epoch


def expire_lease(r: redis.Redis, keys: Keys, producer: str, max_outstanding: int) -> tuple[int, int]:
    """Trainer side: take back every unfinished seq of `producer`'s lease (counted as consumed once, marked
    revoked, logged as `expire`) and give the current version's budget their room; returns (taken back,
    budget added). Bumps this process's expiry epoch before and after (the revoked watches read again)."""
    bump_epoch()
    try:
        return take_back(r, keys, producer, max_outstanding)
    finally:
        bump_epoch()


def is_revoked(r: redis.Redis, keys: Keys, producer: str, seq: int) -> bool:
    """True when the trainer took `producer`'s prompt `seq` back (its lease expired)."""
    return bool(r.getbit(keys.revoked_bits(producer), seq))


class RevokedWatch:
    """Per producer, whether any of its seqs was taken back; a bit is read only for those producers."""

    def __init__(self, keys: Keys, producers: Sequence[str], *, local: bool = True) -> None:
        """Watch `producers`' `revoked:<name>` bitmaps; `local`: expiries run in this process (else every
        `new_pass` reads the bitmaps' existence again)."""
        self.keys, self.producers, self.local = keys, list(producers), local
        self.known: set[str] = set()  # producers with a revoked bitmap
        self.refreshes = 0  # times the bitmaps' existence was read
        self._seen: int | None = None  # the epoch of the last read (None: read before the next check)

    def new_pass(self) -> None:
        """A consumer-loop pass begins: a watch that is not `local` reads the bitmaps' existence again."""
        if not self.local:
            self._seen = None

    def is_revoked(self, r: redis.Redis, producer: str, seq: int) -> bool:
        """True when the trainer took `producer`'s prompt `seq` back; no round trip for a producer with
        nothing taken back (after the first check and after each expiry)."""
        if producer not in self.producers:  # not one the watch tracks: ask Redis
            return is_revoked(r, self.keys, producer, seq)
        if self._seen != (now := epoch()):
            self._refresh(r)
            self._seen = now
        return producer in self.known and is_revoked(r, self.keys, producer, seq)

    def _refresh(self, r: redis.Redis) -> None:
        pipe: Any = r.pipeline(transaction=False)
        for p in self.producers:
            pipe.exists(self.keys.revoked_bits(p))
        self.known |= {p for p, n in zip(self.producers, pipe.execute(), strict=True) if int(n)}
        self.refreshes += 1


def finished_counts(
    r: redis.Redis, keys: Keys, producers: Sequence[str]
) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """One MULTI snapshot: (producer -> prompts leased to it, producer -> of those, prompts the trainer
    finished with (its `consumed:<name>` bit count), the producers whose `rollouts:<name>` hold entries the
    trainer group has not read or not acked yet: their work is with the trainer). Unread entries are told
    by the group's `lag` (XINFO GROUPS); only where Redis cannot tell it (a null lag) is XINFO STREAM asked
    for the last id, in a second round trip: its reply carries the stream's first and last entries, whole
    rollouts, every second (BENCHMARKS.md, the trainer's watches)."""
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(keys.lease)
    for p in producers:
        pipe.bitcount(keys.consumed_bits(p))
        pipe.xinfo_groups(keys.rollouts_of(p))
    raw, *per = pipe.execute(raise_on_error=False)
    lease = {text(k): int(v) for k, v in raw.items()}
    done, busy, unknown = {}, set(), {}
    for i, p in enumerate(producers):
        count, groups = per[2 * i : 2 * i + 2]
        done[p] = int(count)
        if isinstance(groups, Exception):
            continue  # no stream yet: nothing published
        for g in groups:
            if text(g.get("name", b"")) != TRAINER_GROUP:
                continue
            if int(g.get("pending", 0)) > 0 or (g.get("lag") or 0) > 0:
                busy.add(p)
            elif g.get("lag") is None:
                unknown[p] = text(g.get("last-delivered-id", b"0-0"))
    if unknown:
        pipe = r.pipeline(transaction=False)
        for p in unknown:
            pipe.xinfo_stream(keys.rollouts_of(p))
        for (p, delivered), info in zip(unknown.items(), pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(info, Exception) and text(info.get("last-generated-id", b"0-0")) != delivered:
                busy.add(p)
    return {p: lease.get(p, 0) for p in producers}, done, busy


class LeaseExpiry:
    """The Leaser's expiry clock (rollstream/pacing/__init__.py): per producer, when the trainer last finished
    one of its prompts or last held unread or unacked entries of its stream; past `timeout_s` with leased
    prompts still unfinished and none of its entries with the trainer, its unfinished lease is taken back
    (`expire_lease`) and it goes on probation: leased at most `probation` unfinished prompts until one of its
    prompts is finished again."""

    def __init__(
        self, timeout_s: float, max_outstanding: int, probation: int, *, every_s: float = 1.0,
        clock: Any = None,
    ) -> None:
        """Expire after `timeout_s` seconds (> 0), checked every `every_s`; `probation` >= 1 prompts."""
        if not timeout_s > 0:
            raise ValueError(f"rollout.lease_timeout_s={timeout_s!r} must be > 0")
        if probation < 1:
            raise ValueError(f"probation={probation!r} must be >= 1 prompt")
        self.timeout_s, self.max_outstanding, self.probation = timeout_s, max_outstanding, probation
        self.every_s = min(every_s, timeout_s / 4)
        self.clock = clock or time.monotonic
        self.caps: dict[str, int] = {}  # producer -> the most lease total it may reach (probation)
        self.expired: dict[str, int] = {}  # producer -> prompts taken back from it over this process
        self._seen: dict[str, tuple[int, float]] = {}  # producer -> (prompts finished, since when)
        self._next = 0.0

    def maybe_check(self, r: redis.Redis, keys: Keys, producers: Sequence[str]) -> list[tuple[str, int]]:
        """Check when due; returns (producer, prompts taken back) for each lease expired now."""
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.every_s
        lease, done, busy = finished_counts(r, keys, producers)
        out = []
        for p in producers:
            seen = self._seen.get(p)
            if seen is None or seen[0] != done[p] or p in busy:
                self._seen[p] = (done[p], now)
                if seen is not None and seen[0] != done[p]:
                    self.caps.pop(p, None)  # one of its prompts finished: off probation
                continue
            since = seen[1]
            if lease[p] <= done[p] or now - since < self.timeout_s:
                continue  # nothing unfinished, or not long enough
            taken, added = expire_lease(r, keys, p, self.max_outstanding)
            self.caps[p] = lease[p] + self.probation
            self._seen[p] = (done[p] + taken, now)
            if taken:
                self.expired[p] = self.expired.get(p, 0) + taken
                out.append((p, taken))
                log.warning(
                    "lease of %s expired: no prompt of it finished nor any entry of it unread for %.0f s; %d "
                    "unfinished prompts taken back (budget topped up by %d); at most %d more leased to it "
                    "until one of its prompts is finished", p, now - since, taken, added, self.probation,
                )
        return out
