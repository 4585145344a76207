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
from dataclasses import dataclass
from typing import Any

import redis

from rollstream.bus.ids import count_or_none, text
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


@dataclass
class LeaseSnapshot:
    """The pacing as the expiry clock and the fair shares read it, per producer, in one MULTI."""

    lease: dict[str, int]  # prompts leased to it so far
    done: dict[str, int]  # of those, seqs the trainer finished with or took back (`consumed:<name>` bits)
    finished: dict[str, int]  # of those, seqs it finished (consumed bits less `revoked:<name>` bits)
    held: dict[str, int]  # its entries the trainer group has not acked: pending, or not read yet
    want: dict[str, int]  # the lease total it asks for (its own key: a non-canonical value reads as 0)


def lease_snapshot(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> LeaseSnapshot:
    """One MULTI snapshot of every producer's lease, finished seqs, held entries and want. Unread entries are
    told by the trainer group's `lag` (XINFO GROUPS); only where Redis cannot tell it (a null lag) is XINFO
    STREAM asked for the last id, in a second round trip (its reply carries the stream's first and last
    entries, whole rollouts: BENCHMARKS.md, the trainer's watches), and the stream then counts as holding one
    unread entry more."""
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(keys.lease)
    for p in producers:
        pipe.bitcount(keys.consumed_bits(p))
        pipe.bitcount(keys.revoked_bits(p))
        pipe.xinfo_groups(keys.rollouts_of(p))
        pipe.get(keys.producer_want(p))
    raw, *per = pipe.execute(raise_on_error=False)
    lease = {text(k): int(v) for k, v in raw.items()}
    snap = LeaseSnapshot({p: lease.get(p, 0) for p in producers}, {}, {}, {}, {})
    unknown: dict[str, str] = {}
    for i, p in enumerate(producers):
        done, revoked, groups, want = per[4 * i : 4 * i + 4]
        snap.done[p], snap.finished[p] = int(done), int(done) - int(revoked)
        snap.want[p] = count_or_none(want) or 0 if want is not None else 0
        snap.held[p] = 0
        if isinstance(groups, Exception):
            continue  # no stream yet: nothing published
        for g in groups:
            if text(g.get("name", b"")) != TRAINER_GROUP:
                continue
            snap.held[p] = int(g.get("pending", 0)) + int(g.get("lag") or 0)
            if g.get("lag") is None:
                unknown[p] = text(g.get("last-delivered-id", b"0-0"))
    if unknown:
        pipe = r.pipeline(transaction=False)
        for p in unknown:
            pipe.xinfo_stream(keys.rollouts_of(p))
        for (p, delivered), info in zip(unknown.items(), pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(info, Exception) and text(info.get("last-generated-id", b"0-0")) != delivered:
                snap.held[p] += 1
    return snap


def finished_counts(
    r: redis.Redis, keys: Keys, producers: Sequence[str]
) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """(producer -> prompts leased to it, producer -> of those, seqs finished with or taken back, the
    producers whose entries wait with the trainer group, unread or unacked): `lease_snapshot`, in short."""
    snap = lease_snapshot(r, keys, producers)
    return snap.lease, snap.done, {p for p in producers if snap.held[p] > 0}


#: A producer's lease expires after this many of its dispatch times without progress.
EXPIRY_DISPATCHES = 3
#: The shortest expiry (seconds), whatever the dispatch times: a producer's own pauses (a weight swap, a
#: busy host) are not hoarding.
MIN_EXPIRY_S = 5.0


def fair_shares(
    snap: LeaseSnapshot, producers: Sequence[str], max_outstanding: int, floor: int,
    active: Sequence[str] = (),
) -> dict[str, int]:
    """Producer -> the most unfinished prompts it may hold. The budget (`max_outstanding`) is shared by the
    producers that ask (want above their lease, or `active`: made progress lately, so an honest producer
    whose want is met for the moment keeps its share): one that has delivered nothing yet (seqs finished,
    entries the trainer holds) is kept the budget over all the run's producers, so the first to ask cannot
    take everything before the others have asked; the rest is split among those that have delivered, each
    weighted by 1 + what it delivered, so a producer's share grows with the throughput it has shown and a
    hoarder that delivers nothing is left about one dispatch. Never below `floor` (one dispatch) nor above the
    budget."""
    delivered = {p: snap.finished[p] + snap.held[p] for p in producers}
    asking = [p for p in producers if snap.want[p] > snap.lease[p] or p in active]
    start = max_outstanding // max(1, len(producers))
    kept = sum(start for p in asking if delivered[p] == 0)
    rest = max(0, max_outstanding - kept)
    total = sum(1 + delivered[p] for p in asking if delivered[p] > 0)
    out = {}
    for p in producers:
        weight = 1 + delivered[p]
        if delivered[p] == 0:
            share = start
        else:
            share = -(-rest * weight // (total + (0 if p in asking else weight)))  # rounded up: all used
        out[p] = min(max_outstanding, max(floor, share))
    return out


class LeaseExpiry:
    """The Leaser's expiry clock and fair shares (rollstream/pacing/__init__.py).

    Progress is judged per producer on its seqs: those the trainer finished with (trained, dropped, evicted,
    dead-lettered; not those taken back) plus its entries the trainer holds (each counts once, when it
    appears: entries the trainer holds never keep a lease alive; they reset the clock while the trainer
    waited to fill a batch with the very prompts the producer hoarded). A producer with leased
    prompts neither finished nor held, that made no progress for EXPIRY_DISPATCHES dispatch times (a
    producer's dispatch time: the mean time between two of its progress steps; the clock is the slowest
    producer's, so an honest producer is never judged by a faster one; none observed yet: `timeout_s`), at
    most `timeout_s` and at least MIN_EXPIRY_S, loses them (`expire_lease`) and goes on probation: leased at
    most `probation` unfinished prompts until it makes progress again. At every check its lease is also
    capped at its fair share of the budget (`fair_shares`), so others keep training while one hoards."""

    def __init__(
        self, timeout_s: float, max_outstanding: int, probation: int, *, every_s: float = 0.25,
        clock: Any = None,
    ) -> None:
        """Expire after at most `timeout_s` seconds (> 0), checked every `every_s`; `probation` >= 1 prompts
        (also the least fair share)."""
        if not timeout_s > 0:
            raise ValueError(f"rollout.lease_timeout_s={timeout_s!r} must be > 0")
        if probation < 1:
            raise ValueError(f"probation={probation!r} must be >= 1 prompt")
        self.timeout_s, self.max_outstanding, self.probation = timeout_s, max_outstanding, probation
        self.every_s = min(every_s, timeout_s / 4)
        self.clock = clock or time.monotonic
        self.caps: dict[str, int] = {}  # producer -> the most lease total it may reach while on probation
        self.shares: dict[str, int] = {}  # producer -> the most unfinished prompts it may hold (fair share)
        self.expired: dict[str, int] = {}  # producer -> prompts taken back from it over this process
        self.dispatch_s: dict[str, float] = {}  # producer -> its mean time between two progress steps
        self._progress: dict[str, tuple[int, float]] = {}  # producer -> (most progress seen, since when)
        self._steps: dict[str, int] = {}  # producer -> progress steps seen (0: the first look)
        self._next = 0.0

    def deadline_s(self, producer: str) -> float:
        """Seconds without progress after which `producer`'s unfinished lease expires: EXPIRY_DISPATCHES of
        the slowest dispatch time observed (its own or another's), within [MIN_EXPIRY_S, timeout_s];
        timeout_s before any is observed (a first progress measures start-up, not a dispatch)."""
        clock = max(self.dispatch_s.values(), default=None)
        if clock is None:
            return self.timeout_s
        return min(self.timeout_s, max(MIN_EXPIRY_S, EXPIRY_DISPATCHES * clock))

    def maybe_check(self, r: redis.Redis, keys: Keys, producers: Sequence[str]) -> list[tuple[str, int]]:
        """Check when due: update the fair-share caps and take back the leases due; returns (producer, prompts
        taken back) for each lease expired now."""
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.every_s
        snap = lease_snapshot(r, keys, producers)
        idle = []
        for p in producers:  # progress first (every producer's dispatch time), then the expiries
            progress = snap.finished[p] + snap.held[p]
            best = self._progress.get(p)
            if best is not None and progress <= best[0]:
                idle.append((p, progress, best[1]))
                continue
            steps = self._steps.get(p, -1) + 1  # the first step after the first look measures its start
            if best is not None and steps > 1:
                dt = now - best[1]
                self.dispatch_s[p] = dt if p not in self.dispatch_s else 0.5 * (self.dispatch_s[p] + dt)
            if best is not None:
                self.caps.pop(p, None)  # progress again: off probation
            self._steps[p] = steps
            self._progress[p] = (progress, now)
        out = []
        for p, progress, since in idle:
            unfinished = snap.lease[p] - snap.done[p] - snap.held[p]
            if unfinished <= 0 or now - since < self.deadline_s(p):
                continue  # nothing unfinished, or not long enough
            taken, added = expire_lease(r, keys, p, self.max_outstanding)
            self.caps[p] = snap.lease[p] + self.probation
            self._progress[p] = (progress, now)
            snap.done[p] += taken
            if taken:
                self.expired[p] = self.expired.get(p, 0) + taken
                out.append((p, taken))
                log.warning(
                    "lease of %s expired: no progress for %.1f s (%d dispatch times of %.2f s, at most "
                    "rollout.lease_timeout_s=%g); %d unfinished prompts taken back (budget topped up by %d); "
                    "at most %d more leased to it until it makes progress", p, now - since, EXPIRY_DISPATCHES,
                    self.deadline_s(p) / EXPIRY_DISPATCHES, self.timeout_s, taken, added, self.probation,
                )
        active = [  # made progress lately (the first look at a producer is not progress)
            p for p in producers
            if self._steps.get(p, 0) >= 1 and now - self._progress[p][1] < self.deadline_s(p)
        ]
        shares = fair_shares(snap, producers, self.max_outstanding, self.probation, active)
        # a share of the whole budget caps nothing (the budget does): only producers that share it are capped;
        # the lease script counts each share against the producer's consumed bits as they are at the lease
        self.shares = {p: share for p, share in shares.items() if share < self.max_outstanding}
        return out
