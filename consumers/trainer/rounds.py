"""A collection round: how data-parallel trainer ranks agree on a local update's samples (pure, no torch:
the exchange is DataParallel's all_gather, called by the collector).

Collecting a local update's samples goes in rounds. In each round every rank takes what its buffer holds
(up to its share, `ppo_mini_batch_size / world_size` kept samples; stale ones it meets are taken too, to
be dropped), polls once when that is not enough, and announces a `RoundClaim`: the sample ids it took
this round (kept or to drop), how many it had kept before, and whether it must stop (stop requested, or
in burst mode nothing left to read). `resolve_round` then runs, identically on every rank, over all
ranks' claims in rank order: an id already claimed (this round by a lower rank, or in an earlier round or
step by anyone) is a duplicate (a producer's retried XADD read by two ranks), handed back to its rank to
ack without a fate; the rest are claimed. The round ends the collection when every rank has its share
(all train), or when any rank must stop (all abandon the step, nothing acked). No rank ever waits in a
collective for longer than one poll of the others, so a stop or a vanished peer is noticed within a
round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoundClaim:
    """One rank's announcement in a collection round (msgpack-able via `to_plain`)."""

    ended: bool  # this rank must stop: stop requested, or (burst) nothing left to read
    kept_before: int  # samples it had kept in earlier rounds of this local update
    taken: list[tuple[str, bool]] = field(default_factory=list)  # (sample_id, kept) taken this round

    def to_plain(self) -> dict[str, Any]:
        """The claim as plain values."""
        return {"e": self.ended, "n": self.kept_before, "t": [[sid, kept] for sid, kept in self.taken]}

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> RoundClaim:
        """Inverse of to_plain."""
        return cls(bool(d["e"]), int(d["n"]), [(str(sid), bool(kept)) for sid, kept in d["t"]])


@dataclass(frozen=True)
class RoundResult:
    """The outcome of a round, the same on every rank."""

    duplicates: list[int]  # indexes into this rank's `taken` that another claim got first
    all_ready: bool  # every rank has its share of kept samples
    any_ended: bool  # some rank must stop: every rank abandons the step


def resolve_round(claims: list[RoundClaim], claimed: set[str], want: int, rank: int) -> RoundResult:
    """Resolve one round's claims (rank order) against `claimed` (updated in place: the ids claimed by any
    rank so far); `want` is each rank's share, `rank` the caller's."""
    duplicates: list[int] = []
    ready = True
    for r, claim in enumerate(claims):
        kept = claim.kept_before
        for i, (sid, keep) in enumerate(claim.taken):
            if sid in claimed:
                if r == rank:
                    duplicates.append(i)
                continue
            claimed.add(sid)
            kept += keep
        ready = ready and kept >= want
    return RoundResult(duplicates, ready, any(c.ended for c in claims))
