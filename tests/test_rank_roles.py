"""Rank roles are methods on one object: what a trainer rank does (rank 0 alone, the ranks that need the whole
model, several ranks together, fsdp) is decided by RankRoles (consumers/trainer/roles.py) and
DataParallel (consumers/trainer/distributed.py); the rest of the trainer calls their methods and tests no role
flag (`roles.main`, `.agreed`, `.sharded`, `.whole_model`) nor the world size against 1 itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from consumers.trainer.roles import RankInfo, RankRoles
from rollstream.keys import HEARTBEAT_FIELD, rank_heartbeat_field

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "consumers" / "trainer"
#: The modules that own the rank roles: the only ones that test the flags.
ROLES_MODULES = {"distributed.py", "roles.py"}
FLAGS = {"main", "agreed", "sharded", "whole_model"}


def role_tests(source: str) -> list[int]:
    """Lines of `source` that read a role flag (`<...>roles.<flag>`) or compare a `world_size` with 1."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FLAGS:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "roles":
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            sized = any((getattr(s, "attr", None) or getattr(s, "id", None)) == "world_size" for s in sides)
            one = any(isinstance(s, ast.Constant) and s.value == 1 for s in sides)
            if sized and one:
                lines.append(node.lineno)
    return sorted(lines)


def test_the_check_sees_a_role_flag_and_a_world_size_test() -> None:
    src = "if dp.roles.main:\n    pass\nx = a if self.roles.sharded else b\nif world_size > 1:\n    pass\n"
    assert role_tests(src) == [1, 3, 4]
    assert role_tests("dp.roles.only_main(f)\nn = dp.world_size\n") == []


def test_no_role_flag_is_tested_outside_the_roles_modules() -> None:
    offenders = sorted(
        f"{p.name}:{line}"
        for p in TRAINER.rglob("*.py")
        if p.name not in ROLES_MODULES
        for line in role_tests(p.read_text(encoding="utf-8"))
    )
    assert offenders == [], "call a RankRoles / DataParallel method instead of testing a role flag"


@pytest.mark.parametrize(
    ("rank", "world", "strategy", "main", "whole", "several", "sharded"),
    [
        (0, 1, "ddp", True, True, False, False),
        (0, 2, "ddp", True, True, True, False),
        (1, 2, "ddp", False, False, True, False),
        (1, 2, "fsdp", False, True, True, True),
    ],
)
def test_each_role_method_runs_on_the_ranks_it_names(
    rank: int, world: int, strategy: str, main: bool, whole: bool, several: bool, sharded: bool
) -> None:
    roles = RankRoles.of(RankInfo(rank, world), strategy)
    assert (roles.only_main(lambda x: x + 1, 1) == 2) == main
    assert (roles.with_whole_model(lambda: "w") == "w") == whole
    assert (roles.if_several(lambda: "s") == "s") == several
    assert (roles.gather_if_sharded(lambda: "g") == "g") == sharded
    assert roles.expires_leases() == main  # rank 0 runs the Leaser: its revoked watch needs no re-read
    assert roles.agreed_or("own", lambda x: f"agreed {x}", 3) == ("agreed 3" if several else "own")
    # a world of one obeys its own stop at once; several ranks only the one they agreed on
    assert roles.stopping(own=True, agreed=False) == (not several)
    assert roles.stopping(own=False, agreed=True) == several
    entries = [{"r": r} for r in range(world)]
    assert roles.own_entry(entries) == ({"r": rank} if several else None)
    assert roles.own_entry(entries + [{"r": world}]) is None  # written by a world of another size
    fields = ([HEARTBEAT_FIELD] if main else []) + ([rank_heartbeat_field(rank)] if several else [])
    assert roles.heartbeat_fields() == fields
