"""What a data-parallel trainer rank is and does (pure, no torch: the collectives are DataParallel's).

A rank's place comes from torchrun's environment (`rank_info`), its rollouts consumer name from that
(`consumer_name`: stable across restarts, so a restarted rank re-reads its own pending entries), and what it
does from its place and the strategy (`RankRoles`: rank 0 alone, or every rank together).

Which rank does what is tested here, as the methods of RankRoles, and in distributed.py alone
(tests/test_rank_roles.py); how ranks agree on a local update's samples is rounds.py's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rollstream.keys import HEARTBEAT_FIELD, rank_heartbeat_field

T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits among the trainer ranks (from torchrun's environment)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


@dataclass(frozen=True)
class RankRoles:
    """What a trainer rank does, decided once from its place and the strategy. Its flags are tested here and
    in distributed.py alone (tests/test_rank_roles.py): the rest of the trainer calls the methods, which say
    what the step does (`only_main`, `with_whole_model`, `gather_if_sharded`, `if_several`, `agreed_or`,
    `stopping`, …).
    Rank 0 alone: `main`. Every rank together: `agreed` (several ranks: collectives communicate, collection
    rounds and the stop are agreed) and `sharded` (fsdp: reading the weights or optimizer state whole is a
    collective). `whole_model`: the ranks that take part in what needs the whole model."""

    rank: int = 0
    world_size: int = 1
    sharded: bool = False

    @classmethod
    def of(cls, info: RankInfo, strategy: str) -> RankRoles:
        """The roles of the rank at `info` under `trainer.strategy` (`ddp` or `fsdp`)."""
        return cls(info.rank, info.world_size, strategy == "fsdp")

    @property
    def main(self) -> bool:
        """Rank 0: the run's Redis writes (resume, training_step, weights, commit, grant, retention, leases,
        validation events) and the checkpoint's files."""
        return self.rank == 0

    @property
    def agreed(self) -> bool:
        """More than one rank: collectives really communicate, and collection rounds and stops are agreed."""
        return self.world_size > 1

    @property
    def whole_model(self) -> bool:
        """Rank 0, and under fsdp every rank (gathering the whole weights or the optimizer state, and decoding
        for validation, are collectives there): the ranks that validate and read the optimizer state."""
        return self.main or self.sharded

    def only_main(self, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args) on rank 0, the rank of the run's Redis writes (resume, training_step, weights, commit,
        grant, retention, leases, validation events) and the checkpoint's files; None on the other ranks."""
        return fn(*args) if self.main else None

    def with_whole_model(self, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args) on the ranks that take part in what needs the whole model (rank 0; every rank under fsdp,
        where reading the optimizer state whole and decoding for validation are collectives); None on the
        others."""
        return fn(*args) if self.whole_model else None

    def gather_if_sharded(self, fn: Callable[[], T]) -> T | None:
        """fn() under fsdp, where reading the whole weights is a collective every rank calls (rank 0 gets
        them); None otherwise (rank 0 reads the module's own tensors when it needs them)."""
        return fn() if self.sharded else None

    def if_several(self, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args) when there are several ranks (collectives communicate); None in a world of one."""
        return fn(*args) if self.agreed else None

    def agreed_or(self, own: T, agree: Callable[..., T], *args: Any) -> T:
        """In a world of one, this rank's `own` answer; with several ranks, the one they agree on:
        agree(*args), a collective every rank calls (a collection round's outcome)."""
        return agree(*args) if self.agreed else own

    def expires_leases(self) -> bool:
        """Whether lease expiries happen in this process: rank 0 runs the run's Leaser (started through
        `only_main`), so its revoked-bit watch needs no re-read; the other ranks read again each pass."""
        return self.main

    def stopping(self, own: bool, agreed: bool) -> bool:
        """Whether this rank stops now: a world of one obeys its `own` stop request at once; several ranks
        only a stop they `agreed` on (at a collection round or a step's end), so no rank leaves the others
        waiting in a collective."""
        return agreed if self.agreed else own

    def own_entry(self, entries: Sequence[T]) -> T | None:
        """This rank's entry of a per-rank list (a checkpoint's `ranks`) written by a world of this size with
        several ranks; None otherwise (another world size, or a world of one)."""
        return entries[self.rank] if self.agreed and len(entries) == self.world_size else None

    def heartbeat_fields(self) -> list[str]:
        """The trainer-hash fields this rank's heartbeat sets: rank 0 `heartbeat`; with several ranks each
        rank also its own `heartbeat:r<rank>`."""
        fields = [HEARTBEAT_FIELD] if self.main else []
        return fields + [rank_heartbeat_field(self.rank)] if self.agreed else fields


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's rank, world size and local rank from torchrun's variables (a world of one without
    them)."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local = int(env.get("LOCAL_RANK", str(rank)))
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in a world of WORLD_SIZE={world}")
    return RankInfo(rank, world, local)


def consumer_name(base: str, info: RankInfo) -> str:
    """The rollouts consumer name of a rank: `base` alone in a world of one, else `<base>-r<rank>`."""
    return base if info.world_size == 1 else f"{base}-r{info.rank}"
