"""Issue 42 item 4, many runs on one Redis Cluster: a real 3-primary Cluster (3 redis-servers with
`cluster-enabled yes`, slots assigned and nodes met by hand), a client pinned to a run's slot follows the slot
when it moves and refuses another slot's keys, two runs land on different primaries (CLUSTER KEYSLOT, CLUSTER
NODES), ACL users go on every node, a client follows its run through a Cluster failover, and a tiny run trains
against the Cluster unchanged."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from rollstream.bus import connect, retry_on_connection
from rollstream.bus.connection import reconnect_count
from rollstream.config import ConfigError, load_config
from rollstream.keys import Keys
from rollstream.ops.acl import ROLES, apply_acl_on_cluster
from rollstream.ops.audit import audit_run, format_report
from rollstream.ops.run_target import open_run
from rollstream.topology.cluster import (
    CrossSlotRefused,
    cluster_nodes,
    cluster_url,
    parse_cluster_url,
    pinned_slot,
    refuse_plain_cluster_node,
    require_one_slot,
    run_slot,
)

#: Slot ranges of the 3 primaries, as `redis-cli --cluster create` splits them.
RANGES = [(0, 5460), (5461, 10922), (10923, 16383)]


@dataclass
class Cluster:
    """The running Cluster: its nodes' ports and processes, and its URL."""

    ports: list[int]
    procs: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return cluster_url([f"127.0.0.1:{p}" for p in self.ports])

    def node(self, i: int) -> redis.Redis:
        return redis.Redis(port=self.ports[i], socket_timeout=5)

    def owner_port(self, run: str) -> int:
        """The port of the primary serving run's slot, read off CLUSTER NODES."""
        slot = run_slot(run)
        for node in cluster_nodes(self.url):
            for item in node["slots"]:
                lo, _, hi = item.partition("-")
                if not item.startswith("[") and int(lo) <= slot <= int(hi or lo):
                    return int(node["address"].rpartition(":")[2])
        raise AssertionError(f"no node serves slot {slot}")


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, at most 55535 (Redis refuses more)."""
    while True:
        port = random.randint(20000, 45000)
        if all(_free(p) for p in (port, port + 10000)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextmanager
def _running_cluster(root: Path, nodes: int = 3, node_timeout_ms: int = 5000) -> Iterator[Cluster]:
    """`nodes` redis-servers with cluster-enabled, the first 3 the primaries (slots and MEET as
    `redis-cli --cluster create` does), the rest met but not replicas yet; stopped on the way out. Skips
    without redis-server or cluster support."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not on PATH: no Redis Cluster to test against")
    ports = [_cluster_port() for _ in range(nodes)]
    procs = []
    try:
        for i, port in enumerate(ports):
            d = root / f"node-{i}"
            d.mkdir(parents=True)
            argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms), "--save", "", "--appendonly", "no"]
            log = open(d / "redis.log", "wb")  # noqa: SIM115 (held by the child)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        c = Cluster(ports, procs)
        _form(c)
        yield c
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with _running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def _form(c: Cluster) -> None:
    """Assign the slot ranges and MEET the nodes (what `redis-cli --cluster create` does); skip when the
    server has no cluster support."""
    for i in range(len(c.ports)):
        r = c.node(i)
        _wait(lambda r=r: _pings(r), 20, f"node {i} to answer")
        try:
            enabled = r.info("cluster").get("cluster_enabled")
        except redis.ResponseError as e:
            pytest.skip(f"this redis-server has no cluster support: {e}")
        if not enabled:
            pytest.skip("this redis-server ignores cluster-enabled: no cluster support")
    for i, (lo, hi) in enumerate(RANGES):
        c.node(i).execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi + 1))
    for port in c.ports[1:]:
        c.node(0).execute_command("CLUSTER", "MEET", "127.0.0.1", port)

    def ready() -> bool:
        for i in range(len(c.ports)):
            info = c.node(i).execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info or f"cluster_known_nodes:{len(c.ports)}" not in info:
                return False
        return True

    _wait(ready, 30, "cluster_state:ok on every node")


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


def _runs_on_two_nodes() -> tuple[str, str]:
    """Two run names whose slots are in different primaries' ranges (deterministic)."""
    def range_of(name: str) -> int:
        return next(i for i, (lo, hi) in enumerate(RANGES) if lo <= run_slot(name) <= hi)

    names = [f"run{i}" for i in range(50)]
    first = names[0]
    second = next(n for n in names if range_of(n) != range_of(first))
    return first, second


def test_cluster_urls_parse_and_bad_ones_are_named() -> None:
    parsed = parse_cluster_url("redis+cluster://10.0.0.1:7000,[::1]:7001/0")
    assert parsed == [("10.0.0.1", 7000), ("::1", 7001)]
    for bad, says in [("redis+cluster://h", "'h' is not host:port"), ("redis+cluster://h:7000/3", "db '3'"),
                      ("redis+cluster://u:pw@h:7000", "no user or password")]:
        with pytest.raises(ValueError, match=says):
            parse_cluster_url(bad)
    with pytest.raises(ConfigError, match="run.redis_url"):
        load_config(None, ["run.redis_url=redis+cluster://h:0"])
    with pytest.raises(ConfigError, match="no Sentinel"):
        load_config(None, ["run.redis_url=redis+cluster://h:7000", "run.redis.sentinels=[h:26379]"])
    with pytest.raises(ValueError, match="needs the run name"):
        connect("redis+cluster://127.0.0.1:7000")
    a, b = _runs_on_two_nodes()
    with pytest.raises(ValueError, match="different slots"):
        require_one_slot("redis+cluster://h:7000", [a, b], "replay")
    require_one_slot("redis://h:6379", [a, b], "replay")  # one Redis: no slots to share


def test_two_runs_land_on_different_primaries(cluster: Cluster) -> None:
    a, b = _runs_on_two_nodes()
    node = cluster.node(0)
    for run in (a, b):  # the server hashes every key of a run to the run's slot
        keys = Keys(run)
        some = (keys.trainer, keys.records, keys.rollouts_of("rollout_00"), keys.weights(3))
        server_slots = {int(node.execute_command("CLUSTER", "KEYSLOT", k)) for k in some}
        assert server_slots == {run_slot(run)}
    assert run_slot(a) != run_slot(b)
    assert cluster.owner_port(a) != cluster.owner_port(b)
    for run in (a, b):  # each run's client writes on its own primary, a transaction included
        r = connect(cluster.url, run=run, socket_timeout_s=5)
        keys = Keys(run)
        pipe = r.pipeline(transaction=True)
        pipe.hset(keys.trainer, "global_step", 1)
        pipe.xadd(keys.records, {"x": 1})
        pipe.execute()
        assert r.connection_pool.get_connection().port == cluster.owner_port(run)  # type: ignore[attr-defined]
        owner = redis.Redis(port=cluster.owner_port(run))
        assert owner.hget(keys.trainer, "global_step") == b"1" and owner.xlen(keys.records) == 1
        r.delete(keys.trainer, keys.records)
        r.close()


def test_a_plain_url_of_a_cluster_node_is_refused(cluster: Cluster) -> None:
    url = f"redis://127.0.0.1:{cluster.ports[0]}/0"
    with pytest.raises(ValueError, match="is a node of a Redis Cluster: name the Cluster as redis\\+cluster://"):
        refuse_plain_cluster_node(redis.Redis(port=cluster.ports[0]), url)
    refuse_plain_cluster_node(connect(cluster.url, run="x"), cluster.url)


def test_another_slots_key_is_refused_not_retried(cluster: Cluster) -> None:
    a, b = _runs_on_two_nodes()
    r = connect(cluster.url, run=a, socket_timeout_s=5)
    with pytest.raises(CrossSlotRefused, match=f"not in run '{a}'.*run.redis_url"):
        r.get(Keys(b).setup)
    assert r.ping()
    r.close()


def test_the_client_follows_its_slot_when_it_moves(cluster: Cluster) -> None:
    """The run's slot is handed to another primary (empty slot: CLUSTER SETSLOT … NODE on every node): the
    next command on the old connection gets MOVED, reconnects to the new owner and goes through."""
    run = "moving"
    slot = run_slot(run)
    old_port = cluster.owner_port(run)
    r = connect(cluster.url, run=run, socket_timeout_s=5)
    assert r.get(Keys(run).setup) is None  # connected to the old owner, slot still empty
    target = next(i for i, p in enumerate(cluster.ports) if p != old_port)
    target_id = cluster.node(target).execute_command("CLUSTER", "MYID").decode()
    for i in [target, *(j for j in range(3) if j != target)]:
        cluster.node(i).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    _wait(lambda: cluster.owner_port(run) == cluster.ports[target], 20, "the slot's new owner")
    try:
        r.set(Keys(run).setup, 1)  # MOVED -> ConnectionError -> redis-py's retry reconnects to the new owner
        assert reconnect_count(r) == 1  # the same connection, opened again (on the new owner)
        assert redis.Redis(port=cluster.ports[target]).get(Keys(run).setup) == b"1"
    finally:
        r.close()


def test_the_client_follows_its_run_through_a_cluster_failover(tmp_path: Path) -> None:
    """The primary serving the run's slot is SIGKILLed; the Cluster promotes its replica (node timeout 1 s)
    and the same client, retrying on connection errors, reads the acknowledged write from the new primary."""
    with _running_cluster(tmp_path, nodes=4, node_timeout_ms=1000) as c:
        run = "failover"
        old_port = c.owner_port(run)
        old = c.ports.index(old_port)
        old_id = c.node(old).execute_command("CLUSTER", "MYID").decode()
        c.node(3).execute_command("CLUSTER", "REPLICATE", old_id)
        _wait(lambda: c.node(3).info("replication").get("master_link_status") == "up", 30, "the replica")
        r = connect(c.url, run=run, socket_timeout_s=5)
        r.set(Keys(run).setup, "1")
        assert r.wait(1, 2000) == 1  # the replica has it
        c.procs[old].kill()
        c.procs[old].wait()
        got = retry_on_connection(lambda: r.get(Keys(run).setup), "get", timeout_s=60)
        assert got == b"1"
        pinned = pinned_slot(r)
        assert pinned == (run_slot(run), f"127.0.0.1:{c.ports[3]}")
        r.set(Keys(run).setup, "2")  # and writes there
        assert redis.Redis(port=c.ports[3]).get(Keys(run).setup) == b"2"
        r.close()


def test_acl_users_are_set_on_every_node(cluster: Cluster) -> None:
    run = "acl-run"
    keys = Keys(run)
    pw = {role: f"pw-{role}" for role in [*ROLES, "rollout_00"]}
    done = apply_acl_on_cluster(cluster.url, keys, pw, producers=["rollout_00"])
    assert sorted(done) == sorted(f"127.0.0.1:{p}" for p in cluster.ports)
    for i in range(3):
        assert b"rollout_00" in cluster.node(i).execute_command("ACL", "USERS")
    r = connect(cluster.url, run=run, username="rollout_00", password=pw["rollout_00"], socket_timeout_s=5)
    r.set(keys.producer_cursor("rollout_00"), "c")  # the producer finds the owner (CLUSTER SLOTS) and writes
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.set(keys.trainer, "x")
    r.close()
    for i in range(3):  # leave the shared cluster's users as they were for the run test
        for role in pw:
            cluster.node(i).execute_command("ACL", "DELUSER", role)


def test_a_tiny_run_trains_on_the_cluster(cluster: Cluster, tmp_path: Path) -> None:
    """`rollstream run` with run.redis_url=redis+cluster://…: every worker and CLI command reaches the node
    serving the run's slot, the run trains, its keys are all on that node, and its audit is clean (~35 s)."""
    _train(cluster, tmp_path, ["tiny"])  # a name no other test writes


@pytest.mark.slow
def test_two_tiny_runs_train_side_by_side_on_the_cluster(cluster: Cluster, tmp_path: Path) -> None:
    """Two `rollstream run`s with the same run.redis_url, run names on different primaries, at once: each
    trains on its own node, and both audits are clean (53-100 s on a loaded 2-core box: slow)."""
    first = "tiny2"
    other = next(f"tiny{i}" for i in range(50) if cluster.owner_port(f"tiny{i}") != cluster.owner_port(first))
    _train(cluster, tmp_path, [first, other])


def _train(cluster: Cluster, tmp_path: Path, runs: list[str]) -> None:
    """Start the runs on the cluster, wait for 3 records each, check where their keys are, audit, stop."""
    from tests.test_faults import TINY, _wait_records, rollstream

    argv = {run: ["pipeline.yaml", *TINY, f"run.dir={tmp_path}", f"run.name={run}",
                  f"run.redis_url={cluster.url}"] for run in runs}
    try:
        for run in runs:
            started = rollstream("run", *argv[run], "--wait-records", "2", "--wait-timeout", "200",
                                 timeout_s=260)
            assert started.returncode == 0, started.stdout + started.stderr
        for run in runs:
            target = open_run(None, run_dir=str(tmp_path / run))
            _wait_records(target, 3, timeout_s=120)
            owner = redis.Redis(port=cluster.owner_port(run))
            assert owner.xlen(Keys(run).records) >= 3
            others = [redis.Redis(port=p) for p in cluster.ports if p != cluster.owner_port(run)]
            assert all(not list(o.scan_iter(match=Keys(run).pattern())) for o in others)
            r = target.connect()
            rep = audit_run(r, target.keys)
            r.close()
            assert rep.problems() == [], format_report(rep)
            assert rep.trained
            status = rollstream("status", "--run-dir", str(tmp_path / run), timeout_s=60)
            assert status.returncode == 0, status.stdout + status.stderr
            where = f"slot {run_slot(run)} is served by the primary 127.0.0.1:{cluster.owner_port(run)}"
            assert where in status.stdout, status.stdout
    finally:
        stopped = {run: rollstream("stop", *argv[run], timeout_s=200) for run in runs}
    for done in stopped.values():
        assert done.returncode in (0, 1), done.stdout + done.stderr


@pytest.mark.slow
def test_a_run_trains_through_a_cluster_failover(tmp_path: Path) -> None:
    """A tiny run on a Cluster whose run's primary has 2 replicas (writes WAIT for one: wait_replicas 1);
    the primary is SIGKILLed, the Cluster promotes a replica (node timeout 2 s) and points the other at it,
    and the run trains on without a worker restart; the audit of the live log is clean (~35 s here). With one
    replica the run waits after the failover, as documented: the new primary has none to acknowledge."""
    from tests.test_failover_run import _global_step
    from tests.test_faults import TINY, _pid, _wait_records, rollstream

    run = "cfo"
    with _running_cluster(tmp_path / "nodes", nodes=5, node_timeout_ms=2000) as c:
        old = c.ports.index(c.owner_port(run))
        old_id = c.node(old).execute_command("CLUSTER", "MYID").decode()
        for i in (3, 4):
            c.node(i).execute_command("CLUSTER", "REPLICATE", old_id)
            _wait(lambda i=i: c.node(i).info("replication").get("master_link_status") == "up", 30,
                  "a replica in sync")
        args = ["pipeline.yaml", *TINY, f"run.dir={tmp_path}", f"run.name={run}", f"run.redis_url={c.url}",
                "run.redis.wait_replicas=1"]
        run_dir = tmp_path / run
        try:
            started = rollstream("run", *args, "--wait-records", "2", "--wait-timeout", "200", timeout_s=260)
            assert started.returncode == 0, started.stdout + started.stderr
            target = open_run(None, run_dir=str(run_dir))
            workers = {n: _pid(run_dir, n) for n in ("rollout_00", "rollout_01", "trainer", "aggregator")}
            step = _global_step(target)
            c.procs[old].kill()
            c.procs[old].wait()
            t_kill = time.monotonic()
            while _global_step(target) <= step + 2:
                assert time.monotonic() - t_kill < 120, "no new global step within 120 s of the kill"
                time.sleep(0.2)
            after = time.monotonic() - t_kill
            assert c.owner_port(run) in (c.ports[3], c.ports[4])
            _wait_records(target, step + 3, timeout_s=120)
            now = {n: _pid(run_dir, n) for n in workers}
            assert now == workers, "a worker was restarted, not reconnected"
            r = target.connect()
            rep = audit_run(r, target.keys)
            r.close()
            print(f"\nkill -> 3 more global steps: {after:.1f} s\n{format_report(rep)}")
            assert rep.problems() == [], format_report(rep)
        finally:
            stopped = rollstream("stop", *args, timeout_s=200)
        assert stopped.returncode in (0, 1), stopped.stdout + stopped.stderr
