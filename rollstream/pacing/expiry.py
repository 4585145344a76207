"""Which producers' prompts the trainer took back, known without a Redis round trip per sample.

A sample whose seq the trainer took back (its producer's lease expired, or it was fenced: `revoked:<name>`,
pacing/budget.py `expire_lease`) is dead-lettered "lease expired". Asking Redis for that bit on every
consumed sample costs one GETBIT per sample although a lease rarely expires. A `RevokedWatch` knows which
producers have a `revoked:<name>` bitmap at all (one pipelined EXISTS per producer) and asks for a bit only
for those. It reads them again when an expiry may have happened since: `expire_lease` bumps this process's
expiry epoch before and after its script (the trainer's Leaser, rank 0, runs in the trainer's process), and
a watch in a process that does not expire leases itself (a data-parallel rank other than 0) reads them again
at every pass of its consumer loop (`new_pass`). A restarted trainer starts with a fresh watch, which reads
them first. The bitmaps only grow, so a producer once known stays known.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import redis

from rollstream.keys import Keys

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
            return bool(r.getbit(self.keys.revoked_bits(producer), seq))
        if self._seen != (now := epoch()):
            self._refresh(r)
            self._seen = now
        return producer in self.known and bool(r.getbit(self.keys.revoked_bits(producer), seq))

    def _refresh(self, r: redis.Redis) -> None:
        pipe: Any = r.pipeline(transaction=False)
        for p in self.producers:
            pipe.exists(self.keys.revoked_bits(p))
        self.known |= {p for p, n in zip(self.producers, pipe.execute(), strict=True) if int(n)}
        self.refreshes += 1
