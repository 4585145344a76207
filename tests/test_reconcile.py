"""A commit a failover lost is committed again (issue 42 item 2): with `wait_replicas` below the number of
replicas, a commit WAIT-acknowledged by one replica is lost when another is promoted. The new primary then has
an older commit's committed_step, the lost steps' samples pending again (acked as duplicates by a collector
that remembers their ids, without a fate); the trainer's reconciliation (reconcile.reconcile_and_commit)
commits the kept ledgers again, live, on resume from a checkpoint, and against real replicas."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch
from conftest import P0, PRODUCERS

from consumers.trainer import reconcile as reconcile_mod
from consumers.trainer.effects import TrainerEffects
from consumers.trainer.ledger import StepLedger
from consumers.trainer.reconcile import CommitHistory, reconcile_and_commit
from consumers.trainer.roles import RankRoles
from rollstream.bus import GroupReader, Publisher, delete_run, setup_run
from rollstream.config import load_config
from rollstream.keys import COMMITTED_STEP_FIELD, TRAINER_GROUP, Keys
from rollstream.ops.audit import audit_run
from rollstream.ops.embedded_redis import free_port
from rollstream.pacing.budget import current_budget
from rollstream.testing.fakes import leased_fakes, local_update
from rollstream.topology.replication import set_acks
from schemas import TRAINED, Fate, StepMetrics, encode

TINY = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32", "run.device=cpu"]


def _steps(r: redis.Redis, keys: Keys, n_steps: int, per_step: int = 2) -> list[StepLedger]:
    """Publish n_steps * per_step leased samples, deliver them to the trainer group and return one ledger per
    step (every sample trained, a step_end each), as the trainer would have built them."""
    samples = leased_fakes(r, keys, n_steps * per_step, n=1)
    ids = [r.xadd(keys.rollouts_of(P0), encode(s)).decode() for s in samples]  # type: ignore[union-attr,arg-type]
    r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(P0): ">"})
    out = []
    for g in range(1, n_steps + 1):
        part = range((g - 1) * per_step, g * per_step)
        out.append(StepLedger(
            g,
            [Fate(samples[i].sample_id, ids[i], TRAINED, 1, g - 1, g) for i in part],
            [(keys.rollouts_of(P0), ids[i]) for i in part],
            StepMetrics(
                type="step_end", global_step=g, local_step=1, sample_count=per_step, num_local_updates=1
            ),
        ))
    return out


def _emit_updates(r: redis.Redis, keys: Keys, ledgers: list[StepLedger]) -> None:
    """Each step's local update, emitted live (as the trainer does while it trains) and kept in its ledger."""
    for lg in ledgers:
        update = local_update(lg.global_step, 1, len(lg.fates), {"actor/loss": float(lg.global_step)})
        lg.updates.append((Publisher(r).publish(keys.metrics, update), update))


def _snapshot(r: redis.Redis, keys: Keys) -> dict[bytes, bytes]:
    """Every key of the run, DUMPed: what a replica that stopped receiving here would hold."""
    return {k: r.dump(k) for k in r.scan_iter(match=keys.pattern())}  # type: ignore[misc]


def _fail_over_to(r: redis.Redis, keys: Keys, snap: dict[bytes, bytes]) -> None:
    """The run's keys become the snapshot's: a failover to the replica that held only that much."""
    delete_run(r, keys)
    for k, v in snap.items():
        r.restore(k, 0, v)


def _ack_as_duplicates(r: redis.Redis, keys: Keys, ledgers: list[StepLedger]) -> None:
    """What the trainer's collector does after the reconnect: it re-reads its pending list, finds the lost
    steps' sample ids in its `seen` and acks them without a fate."""
    r.xack(keys.rollouts_of(P0), TRAINER_GROUP, *[i for lg in ledgers for _, i in lg.ack_ids])


def _state(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """What a commit writes: fates (ids), step_end steps in log order, committed_step, consumed, pending."""
    events = [(f[b"type"], int(f[b"global_step"])) for _, f in r.xrange(keys.metrics)]
    return {
        "fates": [i.decode() for i, _ in r.xrange(keys.fates)],
        "step_ends": [g for kind, g in events if kind == b"step_end"],
        "updates": sorted(g for kind, g in events if kind == b"local_update"),
        "committed_step": int(r.hget(keys.trainer, COMMITTED_STEP_FIELD) or 0),  # type: ignore[arg-type]
        "consumed": int(r.get(keys.consumed) or 0),  # type: ignore[arg-type]
        "pending": r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"],
    }


def _effects(r: redis.Redis, keys: Keys, tmp_path: Path) -> TrainerEffects:
    """Rank 0's effects of a world of one, on `r`."""
    cfg = load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"])
    dp = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    return TrainerEffects(cfg, r, keys, tmp_path / "weights", dp)  # type: ignore[arg-type]


def _assert_restored(r: redis.Redis, keys: Keys, ledgers: list[StepLedger], pending: int = 0) -> None:
    """Every step's fates, acks, consumed count and exactly one step_end, as if nothing had been lost
    (`pending`: the delivered entries of later steps, not committed yet)."""
    n = len(ledgers)
    assert _state(r, keys) == {
        "fates": [f"{lg.global_step}-{i}" for lg in ledgers for i in range(1, len(lg.fates) + 1)],
        "step_ends": list(range(1, n + 1)),
        "updates": sorted(lg.global_step for lg in ledgers for _ in lg.updates),
        "committed_step": n,
        "consumed": sum(len(lg.fates) for lg in ledgers),
        "pending": pending,
    }
    rep = audit_run(r, keys)
    assert rep.problems() == [] and not rep.lost and len(rep.trained) == sum(len(lg.fates) for lg in ledgers)


def test_a_commit_lost_in_a_failover_is_committed_again(
    r: redis.Redis, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 1-2 and 3-4 committed (each commit followed by its version's grant); the failover's new primary
    has only the first commit and grant, and the collector acked steps 3-4's samples as duplicates: the audit
    finds them acked without a fate. The reconciliation at the next step's start commits 3-4 again (a warning
    naming them), with step 4's local update, lost too, and grants version 4 again; a second one changes
    nothing; the next commit goes on from there."""
    setup_run(r, keys, PRODUCERS)
    ledgers = _steps(r, keys, 6)
    effects = _effects(r, keys, tmp_path)
    effects.grant(0)  # as the trainer's resume does
    assert effects.reconcile(0) == []  # nothing committed yet: nothing to do
    _emit_updates(r, keys, ledgers[0:3])
    effects.commit(ledgers[0:2], 2)
    effects.grant(2)
    replica = _snapshot(r, keys)  # the replica Sentinel will promote stops receiving here
    _emit_updates(r, keys, ledgers[3:4])
    effects.commit(ledgers[2:4], 4)  # WAIT-acknowledged by the other replica only
    effects.grant(4)
    assert _state(r, keys)["committed_step"] == 4
    _fail_over_to(r, keys, replica)
    _ack_as_duplicates(r, keys, ledgers[2:4])
    lost = _state(r, keys)
    assert lost["committed_step"] == 2 and lost["step_ends"] == [1, 2] and lost["updates"] == [1, 2, 3]
    assert current_budget(r, keys)[0] == 2
    assert len(audit_run(r, keys).lost) == 4  # what TOPOLOGY.md's table saw: acked samples without a fate

    with caplog.at_level(logging.WARNING, logger="consumers"):
        assert effects.reconcile(4) == [3, 4]
    assert "committing steps [3, 4] again" in caplog.text
    assert "emitting again 1 local updates the failover lost (steps [4])" in caplog.text
    assert "the budget of version 4 is not on Redis" in caplog.text and current_budget(r, keys)[0] == 4
    _assert_restored(r, keys, ledgers[:4], pending=4)  # step 3's update once: it was not lost
    before = _state(r, keys)
    assert effects.reconcile(4) == [] and _state(r, keys) == before  # a second reconciliation: nothing
    _emit_updates(r, keys, ledgers[4:6])
    effects.commit(ledgers[4:6], 6)
    _assert_restored(r, keys, ledgers)
    assert [lg.global_step for lg in effects.history.ledgers_after(0)] == [1, 2, 3, 4, 5, 6]
    assert effects.committed_for_checkpoint() == []  # a single Redis (AOF) loses no acknowledged commit


def test_the_next_commit_restores_a_lost_one_even_when_the_failover_comes_after_its_read(
    r: redis.Redis, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit of steps 5-6 reads committed_step 4 (nothing lost), then the failover to the replica
    holding only steps 1-2 happens before its EXEC: the EXEC is refused (WATCH) and all is read again, so
    steps 3-4 are committed before 5-6 (their fates' ids `<g>-<i>` must come first) and nothing is lost."""
    setup_run(r, keys, PRODUCERS)
    ledgers = _steps(r, keys, 6)
    effects = _effects(r, keys, tmp_path)
    effects.commit(ledgers[0:2], 2)
    replica = _snapshot(r, keys)
    effects.commit(ledgers[2:4], 4)
    report = reconcile_mod._report_lost
    calls = []

    def failover_after_the_read(history: CommitHistory, done: int, redo: list[StepLedger]) -> None:
        calls.append((done, [lg.global_step for lg in redo]))
        if len(calls) == 1:  # between the WATCHed read and the EXEC
            other = redis.Redis.from_url(_url(r))  # another client: the trainer's connection stays as it was
            _fail_over_to(other, keys, replica)
            _ack_as_duplicates(other, keys, ledgers[2:4])
            other.close()
        report(history, done, redo)

    monkeypatch.setattr(reconcile_mod, "_report_lost", failover_after_the_read)
    effects.commit(ledgers[4:6], 6)
    assert calls == [(4, []), (2, [3, 4])]
    _assert_restored(r, keys, ledgers)


def _url(r: redis.Redis) -> str:
    """The URL of the server `r` talks to (same host, port and db)."""
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def test_a_history_older_than_redis_reaches_is_reported_not_invented(
    r: redis.Redis, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis behind further than the kept ledgers reach: those kept are committed again, the steps before them
    are named in an error (they cannot be restored), and nothing is made up for them."""
    setup_run(r, keys, PRODUCERS)
    ledgers = _steps(r, keys, 4)
    history = CommitHistory()
    history.add(ledgers[2:4], at=0.0)  # only the commit of steps 3-4 is kept
    with caplog.at_level(logging.WARNING, logger="consumers.trainer.reconcile"):
        assert reconcile_and_commit(r, keys, history) == [3, 4]
    assert "commits of steps 1-2 are lost" in caplog.text and "committing steps [3, 4] again" in caplog.text
    assert _state(r, keys)["fates"] == ["3-1", "3-2", "4-1", "4-2"] and _state(r, keys)["step_ends"] == [3, 4]


def test_entries_held_and_delivered_again_as_new_after_a_failover_are_passed_over(
    r: redis.Redis, keys: Keys
) -> None:
    """The trainer holds two entries (read, not yet committed); the failover's new primary never saw that
    read, so the group delivers them again as new: the reader passes them over (it holds them; acking them as
    duplicates would ack them before their fates are committed), and its ack of them later lands."""
    setup_run(r, keys, PRODUCERS)
    for s in leased_fakes(r, keys, 2, n=1):
        r.xadd(keys.rollouts_of(P0), encode(s))  # type: ignore[arg-type]
    replica = _snapshot(r, keys)
    reader = GroupReader(
        r, [keys.rollouts_of(P0)], TRAINER_GROUP, "trainer", dead_stream=keys.dead, block_ms=0
    )
    held = [m for _ in range(3) for m in reader.poll(0)]
    assert len(held) == 2
    _fail_over_to(r, keys, replica)
    assert [m for _ in range(3) for m in reader.poll(0)] == []
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 2  # delivered to us again
    assert reader.ack(m.ref for m in held) == 2
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0


def test_commit_history_keeps_recent_commits_and_round_trips() -> None:
    """Commits older than RETAIN_COMMITS_S or past MAX_RETAINED_STEPS go, but never the last
    MIN_RETAINED_COMMITS; the history survives the checkpoint's plain form."""
    h = CommitHistory()
    end = StepMetrics(type="step_end", global_step=1, local_step=1, sample_count=1, num_local_updates=1)
    for c in range(5):  # commits of 2 steps each, 50 s apart: those over 120 s older than the last go
        h.add([StepLedger(2 * c + 1, step_end=end), StepLedger(2 * c + 2)], at=50.0 * c)
    assert [[lg.global_step for lg in c.ledgers] for c in h.commits] == [[5, 6], [7, 8], [9, 10]]
    assert h.last_step == 10 and h.first_step == 5
    h.add([StepLedger(11)], at=10_000.0)  # long after: only the last MIN_RETAINED_COMMITS stay
    assert [c.at for c in h.commits] == [200.0, 10_000.0]
    big = CommitHistory()
    for g in range(1, 101):  # a fast run: a commit a step, 40 ms apart
        big.add([StepLedger(g)], at=g * 0.04)
    assert [lg.global_step for lg in big.ledgers_after(0)] == list(range(37, 101))  # MAX_RETAINED_STEPS: 64
    big.add([StepLedger(g) for g in range(101, 201)], at=5.0)
    assert [len(c.ledgers) for c in big.commits] == [1, 100]  # MIN_RETAINED_COMMITS, however big
    back = CommitHistory.from_plain(h.to_plain())
    assert [(c.at, [lg.to_plain() for lg in c.ledgers]) for c in back.commits] == [
        (c.at, [lg.to_plain() for lg in c.ledgers]) for c in h.commits
    ]
    assert CommitHistory().last_step == 0 and CommitHistory().first_step is None


def test_a_restarted_trainer_restores_from_its_checkpoint_what_a_failover_lost(
    r: redis.Redis, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tiny trainer trains 6 steps (commits at 2, 4 and 6); the failover's new primary holds what Redis had
    before the commit of step 2, and the trainer dies, for long (its checkpoint's commits are old). Restarted,
    it resumes from the step-6 checkpoint, whose `committed` holds the ledgers of steps 1-4: all six steps are
    committed again, each step_end and local update once, the audit is clean, nothing is trained again, every
    step gets its record; a second restart changes nothing."""
    from safetensors.torch import load_file, save_file

    from consumers.aggregator.sinks import Sinks
    from consumers.aggregator.worker import AggregatorWorker
    from consumers.trainer.checkpoint import checkpoint_path, read_checkpoint
    from consumers.trainer.loop import Trainer
    from schemas import decode_payload, encode_payload

    cfg = load_config(None, TINY + [f"run.name={keys.run}", f"run.dir={tmp_path}", "trainer.test_freq=0",
                                    "actor.ppo_mini_batch_size=1", "data.train_batch_size=2",
                                    "async_training.trigger_parameter_sync_step=2", "trainer.save_freq=2",
                                    "trainer.total_training_steps=6", "trainer.max_off_policy_threshold=10",
                                    "bus.block_ms=10", "run.redis.sentinels=['127.0.0.1:26379']"])
    # (replicas behind Sentinel in the config: the checkpoint keeps the earlier commits; the client is `r`)
    setup_run(r, keys, PRODUCERS)
    for s in leased_fakes(r, keys, 12, n=2, prompt_len=4, response_len=4):
        s.param_version = 0
        r.xadd(keys.rollouts_of(P0), encode(s))  # type: ignore[arg-type]
    trainer = Trainer(cfg, r, keys, "trainer", threading.Event(), burst=True)
    replica: dict[bytes, bytes] = {}
    commit = trainer.effects.commit

    def snapshot_then_commit(ledgers: list[StepLedger], global_step: int) -> None:
        if global_step == 2:  # the replica to be promoted stops receiving before this commit
            replica.update(_snapshot(r, keys))
        commit(ledgers, global_step)

    trainer.effects.commit = snapshot_then_commit  # type: ignore[method-assign]
    assert trainer.run() == 0 and trainer.global_step == 6
    done = _state(r, keys)
    assert done["committed_step"] == 6 and done["step_ends"] == [1, 2, 3, 4, 5, 6] and done["pending"] == 0
    trained = sorted(decode_ids(r, keys))
    assert len(trained) == 12
    path = checkpoint_path(trainer.ckpt_dir, 6)
    _, _, meta = read_checkpoint(path.read_bytes())
    assert [[s["global_step"] for s in c["steps"]] for c in meta["committed"]] == [[1, 2], [3, 4]]
    assert [s["global_step"] for s in meta["steps"]] == [5, 6]
    tensors = load_file(str(path))  # the trainer stays down for long: its kept commits are old
    raw = decode_payload(tensors["meta/payload"].numpy().tobytes())
    raw["committed"] = [{**c, "at": 0.0} for c in raw["committed"]]
    tensors["meta/payload"] = torch.frombuffer(bytearray(encode_payload(raw)), dtype=torch.uint8)
    save_file(tensors, str(path))

    _fail_over_to(r, keys, replica)  # and the trainer is gone
    assert _state(r, keys)["committed_step"] == 0
    for _ in range(2):  # the second restart finds everything done and changes nothing
        caplog.clear()
        t = Trainer(cfg, r, keys, "trainer", threading.Event(), burst=True)
        with caplog.at_level(logging.WARNING, logger="consumers.trainer.reconcile"):
            assert t.run() == 0
        assert t.global_step == 6  # total_training_steps reached: nothing trained again
        state = _state(r, keys)
        assert state["committed_step"] == 6 and state["step_ends"] == [1, 2, 3, 4, 5, 6], state
        assert state["updates"] == [g for g in range(1, 7) for _ in range(2)]  # 3-6's, lost, emitted again
        assert sorted(decode_ids(r, keys)) == trained and len(state["fates"]) == 12
        rep = audit_run(r, keys)
        assert rep.problems() == [] and not rep.lost and not rep.duplicated and not rep.pending
        assert ("committing steps [1, 2, 3, 4, 5, 6] again" in caplog.text) == (_ == 0)
    AggregatorWorker(cfg, r, keys, sinks=Sinks(r, keys, [])).run(burst=True)  # every step can complete
    assert audit_run(r, keys).records == [1, 2, 3, 4, 5, 6]


def decode_ids(r: redis.Redis, keys: Keys) -> list[str]:
    """The sample ids in `fates`."""
    return [f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)]


# -- real replicas ----------------------------------------------------------------------------------


class Node:
    """A private redis-server (no persistence) on a free port, optionally a replica of another."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.port = free_port()
        d = tmp / name
        d.mkdir()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
             "--appendonly", "no", "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.r = redis.Redis(port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.r.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def follow(self, primary: Node | None) -> None:
        """REPLICAOF the primary (None: become a primary, keeping its data), and wait until in sync."""
        if primary is None:
            self.r.execute_command("REPLICAOF", "NO", "ONE")
            return
        self.r.execute_command("REPLICAOF", "127.0.0.1", primary.port)
        deadline = time.monotonic() + 10
        while self.r.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica did not sync"
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminate the server."""
        self.r.close()
        self.proc.terminate()
        self.proc.wait(5)


@pytest.fixture
def three_nodes(tmp_path: Path) -> Iterator[tuple[Node, Node, Node]]:
    """A primary and two replicas of it (plain redis-servers, no Sentinel: the test promotes by hand)."""
    nodes = [Node(tmp_path, name) for name in ("primary", "replica_1", "replica_2")]
    try:
        nodes[1].follow(nodes[0])
        nodes[2].follow(nodes[0])
        yield nodes[0], nodes[1], nodes[2]
    finally:
        for n in nodes:
            n.stop()


def test_a_commit_acknowledged_by_one_replica_survives_promoting_the_other(
    three_nodes: tuple[Node, Node, Node], tmp_path: Path
) -> None:
    """Real replication, WAIT 1: steps 1-2 reach both replicas; replica 2 is cut off, steps 3-4 are
    WAIT-acknowledged by replica 1 alone; replica 2 is promoted (as Sentinel might when it cannot tell the
    two apart) and the others follow it. The trainer, its client now on the new primary, commits steps 3-4
    again, acknowledged by a replica of the new primary; the audit is clean on every node."""
    primary, rep1, rep2 = three_nodes
    keys = Keys("recon")
    r = redis.Redis(port=primary.port, socket_timeout=5)
    set_acks(r, 1, 2000)
    setup_run(r, keys, PRODUCERS)
    ledgers = _steps(r, keys, 4)
    effects = _effects(r, keys, tmp_path)
    effects.grant(0)  # as the trainer's resume does
    effects.commit(ledgers[0:2], 2)
    assert [c["at"] for c in effects.committed_for_checkpoint()] == [effects.history.commits[0].at]  # WAIT
    deadline = time.monotonic() + 10  # until replica 2 holds the commit of step 2 too
    while int(rep2.r.hget(keys.trainer, COMMITTED_STEP_FIELD) or 0) != 2:  # type: ignore[arg-type]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rep2.follow(None)  # replica 2 is cut off from the primary (it keeps what it had)
    effects.commit(ledgers[2:4], 4)  # WAIT 1: replica 1 acknowledged it
    assert int(rep1.r.hget(keys.trainer, COMMITTED_STEP_FIELD)) == 4  # type: ignore[arg-type]
    assert int(rep2.r.hget(keys.trainer, COMMITTED_STEP_FIELD)) == 2  # type: ignore[arg-type]
    # the failover: replica 2 is the new primary, the old primary and replica 1 replicate it (losing step 3-4)
    rep1.follow(rep2)
    primary.follow(rep2)
    new = redis.Redis(port=rep2.port, socket_timeout=5)
    set_acks(new, 1, 2000)
    _ack_as_duplicates(new, keys, ledgers[2:4])
    assert len(audit_run(new, keys).lost) == 4
    effects.r = new  # the trainer's client follows the failover
    assert effects.reconcile(0) == [3, 4]
    _assert_restored(new, keys, ledgers)
    deadline = time.monotonic() + 10
    for node in (rep1, primary):  # the replicas of the new primary hold it too
        while int(node.r.hget(keys.trainer, COMMITTED_STEP_FIELD) or 0) != 4:  # type: ignore[arg-type]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert audit_run(node.r, keys).problems() == []
    r.close()
    new.close()
