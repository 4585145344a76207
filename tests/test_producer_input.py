"""Issue 41: everything a producer writes is input. Each row of the issue's table this covers, under the
producer's real ACL user (the users `rollstream run` creates, on a private redis-server): non-canonical sample
ids are dead-lettered and train nothing twice; a poison id crashes no reader, now or after a restart; garbage
in its own `version` / `published` keys is reported and ignored by the trainer's weights GC, `status`,
`audit` and the other producers; `version=0` keeps a bounded number of blobs; the last possible id on its own
stream does not blind the audit; a sample in another producer's name is blamed on its writer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from conftest import P0
from test_confinement import MAX_ID, Roles
from test_security import PRODUCERS, private_redis  # noqa: F401  (a fixture)

from consumers.trainer.collect import Collector, rollouts_reader
from consumers.trainer.effects import TrainerEffects
from consumers.trainer.roles import RankRoles
from rollstream.bus import Publisher, connect, setup_run
from rollstream.config import load_config
from rollstream.keys import Keys
from rollstream.ops.acl import ROLES, apply_acl, generate_passwords
from rollstream.ops.audit import audit_run, format_report
from rollstream.ops.status import collect_status, format_status
from rollstream.pacing.budget import grant_budget, lease_outright, mark_published
from rollstream.pacing.counters import rollout_counts
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.store import PIN_VERSIONS, gc_weights, pinned_versions, publish_weights
from schemas import decode, encode

P1 = "rollout_01"


@pytest.fixture(name="roles")
def run_roles(private_redis: tuple[str, int], tmp_path: Path) -> Iterator[Roles]:  # noqa: F811
    """One connection per user of a run, as `rollstream run` sets them up (as tests/test_confinement.py)."""
    url, _ = private_redis
    keys = Keys("input")
    setup_run(redis.Redis.from_url(url), keys, PRODUCERS)
    files = generate_passwords(tmp_path / "secrets", [*ROLES, *PRODUCERS])
    pw = {role: p.read_text() for role, p in files.items()}
    apply_acl(redis.Redis.from_url(url), keys, pw, producers=PRODUCERS)
    yield Roles(
        url,
        keys,
        *(connect(url, username=u, password=pw[u]) for u in ("admin", "trainer", "aggregator")),
        {p: connect(url, username=p, password=pw[p]) for p in PRODUCERS},
    )


def collector(roles: Roles, tmp_path: Path) -> Collector:
    """The trainer's collector of the run, reading as the trainer's user (a fresh one is a restart)."""
    cfg = load_config(None, [f"run.name={roles.keys.run}", f"run.dir={tmp_path}", "bus.block_ms=10"])
    dp: Any = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    stop = threading.Event()
    reader = rollouts_reader(cfg, roles.trainer, roles.keys, "trainer", stop)
    effects = TrainerEffects(cfg, roles.trainer, roles.keys, tmp_path / "weights", dp)
    return Collector(cfg, effects, reader, dp, stop, True, 1000, 64)


def drain(c: Collector) -> list[str]:
    """Run the collector's consumer loop until the rollouts are read; the sample ids it buffered."""
    while c.fill() and not c.reader.drained:
        pass
    return [m.event.sample_id for m in c.buffer]  # type: ignore[union-attr]


def publish(roles: Roles, producer: str, sid: str) -> str:
    """XADD a small sample with `sid` to `producer`'s own stream, as that producer."""
    sample = fake_rollout_sample(sid, producer=producer, n=2, prompt_len=3, response_len=4)
    return Publisher(roles.producers[producer]).publish(roles.keys.rollouts_of(producer), sample)


def put_weights(roles: Roles, v: int) -> None:
    """The trainer publishes version `v` (a tiny inline blob)."""
    publish_weights(roles.trainer, roles.keys, v, b"w%d" % v, global_step=v, inline_max_bytes=1 << 20)


def dead_reasons(roles: Roles) -> list[str]:
    return [decode(f).reason for _, f in roles.admin.xrange(roles.keys.dead)]  # type: ignore[union-attr]


NON_CANONICAL = ["rollout_00-05", "rollout_00-000005", "rollout_00-５", "rollout_00-٥", "rollout_00-²",
                 "rollout_00-+5", "rollout_00- 5", "rollout_00-" + "9" * 30]


def test_a_leased_prompt_is_trained_once_whatever_form_its_seq_takes(roles: Roles, tmp_path: Path) -> None:
    """Rows 1-2: `rollout_00-05`, `-000005`, fullwidth and Arabic-Indic digits trained one leased prompt up to
    18 times; `rollout_00-²` (isdigit true, int() raises) crash-looped the trainer and, dead-lettered, every
    restart crashed again reading `dead`. Now the one canonical form trains, every other is dead-lettered
    once with its reason, counts nothing, and a restarted trainer reads `dead` without a crash."""
    keys = roles.keys
    lease_outright(roles.trainer, keys, P0, 6)
    for sid in [*NON_CANONICAL, "rollout_00-5"]:
        publish(roles, P0, sid)
    assert drain(collector(roles, tmp_path)) == ["rollout_00-5"]
    reasons = dead_reasons(roles)
    assert len(reasons) == len(NON_CANONICAL)
    assert all(r.startswith("outside lease: sample_id=") for r in reasons), reasons
    assert "rollout_00-²" in reasons[4] and "not a canonical decimal" in reasons[4]
    assert int(roles.admin.get(keys.consumed) or 0) == 0  # type: ignore[arg-type]  # nothing counted
    restarted = collector(roles, tmp_path)  # reads all of `dead` at its first pass
    assert drain(restarted) == ["rollout_00-5"] and restarted._dead_checked  # its pending entry, again
    assert roles.admin.xlen(keys.dead) == len(NON_CANONICAL)  # dead-lettered once each, never again
    rep = audit_run(roles.admin, keys)
    assert len(rep.dead) == len(NON_CANONICAL) and rep.pending == {"rollout_00-5"} and not rep.duplicated


def test_a_rollout_whose_checks_raise_is_dead_lettered_not_a_crash(
    roles: Roles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: whatever a check raises on an entry, the entry is dead-lettered with the error
    (once), the reader goes on, and the entries after it are read."""
    lease_outright(roles.trainer, roles.keys, P0, 2)
    publish(roles, P0, "rollout_00-0")
    publish(roles, P0, "rollout_00-1")
    c = collector(roles, tmp_path)
    real = c.lease_reason

    def boom(ev: Any) -> str | None:
        if ev.sample_id == "rollout_00-0":
            raise OverflowError("a check nobody foresaw")
        return real(ev)

    monkeypatch.setattr(c, "lease_reason", boom)
    assert drain(c) == ["rollout_00-1"]
    assert dead_reasons(roles) == ["unreadable: checking it raised OverflowError: a check nobody foresaw"]


def test_garbage_in_a_producers_own_keys_is_reported_and_ignored(roles: Roles, tmp_path: Path) -> None:
    """Rows 3 and 5: its own `version` = `abc` crash-looped the trainer's weights GC and made `status` print
    a traceback; its own `published` = `x` made `audit` and `status` raise. Now each is reported (naming the
    key and the value) and ignored; the other producers' view of the pacing counters holds too."""
    keys, prod = roles.keys, roles.producers[P0]
    lease_outright(roles.trainer, keys, P0, 2)
    pipe = prod.pipeline(transaction=True)
    for seq in range(2):
        pipe.xadd(keys.rollouts_of(P0), encode(fake_rollout_sample(f"{P0}-{seq}", producer=P0)))  # type: ignore[arg-type]
    mark_published(pipe, keys, P0, 2)
    pipe.execute()
    for v in range(3):
        put_weights(roles, v)
    prod.set(keys.producer_version(P0), "abc")
    prod.set(keys.producer_published(P0), "x")
    roles.producers[P1].set(keys.producer_version(P1), "２")  # fullwidth: isdigit() is true
    assert gc_weights(roles.trainer, keys, 2) == [0]  # keep_last=2; nothing pinned by garbage
    st = collect_status(roles.admin, keys, stall_after_s=60, max_outstanding=8)
    screen = format_status(st, "redis://…")
    assert f"ignored producer input: {P0}: {keys.producer_version(P0)}='abc' is not a canonical" in screen
    assert f"ignored producer input: {P0}: {keys.producer_published(P0)}='x' is not a canonical" in screen
    assert f"{P1}: {keys.producer_version(P1)}='２'" in screen
    assert st.producer_versions == {} and st.leases == {P0: (2, 0)}
    assert rollout_counts(roles.producers[P1], keys, PRODUCERS).in_flight == 2  # another producer's view
    rep = audit_run(roles.admin, keys)
    assert rep.pending == {f"{P0}-0", f"{P0}-1"} and not rep.destroyed_ids
    assert any("published='x' is not a canonical count: ignored" in n for n in rep.notes()), rep.notes()
    assert "note: ignored producer input: rollout_00: " in format_report(rep) and rep.problems() == []
    prod.set(keys.producer_published(P0), 10**15)  # canonical, far past its lease: read as its lease
    assert collect_status(roles.admin, keys, stall_after_s=60).leases == {P0: (2, 2)}
    assert audit_run(roles.admin, keys).problems() == []
    grant_budget(roles.trainer, keys, 0, 8)  # a want of garbage counts as 0
    prod.set(keys.producer_want(P0), "１０")
    from rollstream.pacing.budget import lease_pass

    assert lease_pass(roles.trainer, keys, [P0]) == 0


def test_a_claimed_version_pins_a_blob_only_if_published_and_recent(roles: Roles) -> None:
    """Row 4: its own `version` = 0 kept every weights blob (2 -> 58 keys in 56 steps, unbounded). A version a
    producer claims pins its blob only if the trainer published it and within PIN_VERSIONS of the newest."""
    keys, prod = roles.keys, roles.producers[P0]
    assert pinned_versions([0, 5, 21, 22, 25, 30, 31, 99], latest=30, window=8) == [22, 25, 30]
    prod.set(keys.producer_version(P0), 0)
    held = set()
    for v in range(3 * PIN_VERSIONS):
        put_weights(roles, v)
        gc_weights(roles.trainer, keys, v)
        found = roles.admin.scan_iter(match=keys.weights(0)[:-1] + "*")
        held = {int(k.decode().rsplit(":", 1)[1]) for k in found}
        assert len(held) <= PIN_VERSIONS + 1
    assert held == {3 * PIN_VERSIONS - 2, 3 * PIN_VERSIONS - 1}  # the last two: a claimed 0 pins nothing
    last = 3 * PIN_VERSIONS - 1
    prod.set(keys.producer_version(P0), last - 1)  # a recent, published version still pins its blob
    for v in (last + 1, last + 2):
        put_weights(roles, v)
        gc_weights(roles.trainer, keys, v)
    assert roles.admin.exists(keys.weights(last - 1))


def test_the_last_possible_id_on_its_own_stream_does_not_blind_the_audit(
    roles: Roles, tmp_path: Path
) -> None:
    """Row 7: XADD of the last possible id on its own `rollouts` made `rollstream audit` crash ("invalid start
    ID") for the rest of the run. The trainer dead-letters the entry and the audit reads on."""
    lease_outright(roles.trainer, roles.keys, P0, 1)
    publish(roles, P0, "rollout_00-0")
    sample = fake_rollout_sample("rollout_00-1", producer=P0, n=2, prompt_len=3, response_len=4)
    roles.producers[P0].xadd(roles.keys.rollouts_of(P0), encode(sample), id=MAX_ID)  # type: ignore[arg-type]
    rep = audit_run(roles.admin, roles.keys)
    assert rep.pending == {"rollout_00-0", "rollout_00-1"} and rep.problems() == []
    assert drain(collector(roles, tmp_path)) == ["rollout_00-0"]  # rollout_00-1 is outside its lease
    rep = audit_run(roles.admin, roles.keys)
    assert rep.dead == {"rollout_00-1"} and rep.pending == {"rollout_00-0"}, format_report(rep)


def test_a_sample_in_another_producers_name_is_blamed_on_its_writer(roles: Roles, tmp_path: Path) -> None:
    """Row 9: rollout_00 publishing `rollout_01-0` was dead-lettered, but the audit then said rollout_01's
    sample `ended more than once`: an innocent producer blamed. Now the entry counts under its writer."""
    keys = roles.keys
    lease_outright(roles.trainer, keys, P1, 1)
    publish(roles, P0, "rollout_01-0")  # the impersonation
    publish(roles, P1, "rollout_01-0")  # rollout_01's own
    assert drain(collector(roles, tmp_path)) == ["rollout_01-0"]
    rep = audit_run(roles.admin, keys)
    assert not rep.duplicated and rep.pending == {"rollout_01-0"}
    assert rep.misnamed == {P0: 1} and len(rep.dead) == 1 and next(iter(rep.dead)).startswith(f"{P0} entry ")
    assert rep.problems() == []  # dead-lettered: handled, and named as its writer's doing
    assert rep.notes() == [f"{P0} published 1 entries under another producer's sample ids (dead-lettered)"]



def test_a_string_at_a_producers_old_dispatch_log_key_does_not_stop_retention(
    roles: Roles, tmp_path: Path
) -> None:
    """`producer:<name>:dispatch_log` (an older run's dispatch log) is no longer a key the producer may write
    (issue 41: its ACL names its four keys one by one); retention archives it only when it is a stream, so a
    string there (an older run's, or an admin's) is no WRONGTYPE for the trainer's janitor."""
    from rollstream.bus import Archive, Janitor

    keys, prod = roles.keys, roles.producers[P0]
    with pytest.raises(redis.exceptions.NoPermissionError):
        prod.set(keys.producer_prefix(P0) + "dispatch_log", "not a stream")
    roles.admin.set(keys.producer_prefix(P0) + "dispatch_log", "not a stream")
    janitor = Janitor(roles.trainer, keys, Archive(tmp_path / "archive"), budget_bytes=1, every_s=0)
    assert keys.producer_prefix(P0) + "dispatch_log" not in janitor.streams()
    assert janitor.maybe_run() is not None  # one pass over every stream, under a budget of one byte


def test_status_shows_a_producers_idle_ratio_only_from_its_own_stats(roles: Roles) -> None:
    """Stats on `stats:rollout_00` in rollout_01's name are rollout_00's lie: `status` no longer shows them
    as rollout_01's idle ratio (the aggregator already dead-letters them)."""
    from schemas import ProducerStats

    def stats(name: str, idle: float) -> ProducerStats:
        return ProducerStats(producer=name, param_version=0, samples=1, tokens=1, gen_tokens_per_s=1.0,
                             idle_ratio=idle)

    Publisher(roles.producers[P1]).publish(roles.keys.stats_of(P1), stats(P1, 0.25))
    Publisher(roles.producers[P0]).publish(roles.keys.stats_of(P0), stats(P1, 0.75))  # the lie
    st = collect_status(roles.admin, roles.keys, stall_after_s=60)
    assert st.producer_idle == {P1: 0.25}
