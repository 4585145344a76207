"""The embedded replicated Redis (a primary, replicas, 3 Sentinels, each a real redis-server on a free
port): clients through Sentinel follow a failover after the primary is SIGKILLed and its data removed; WAIT
gates what counts as acknowledged; a lost primary restarts as a replica instead of wiping its replicas."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from consumers.trainer.ledger import StepLedger, commit_steps
from rollstream.bus import connect, retry_on_connection, setup_run
from rollstream.config import load_config
from rollstream.keys import COMMITTED_STEP_FIELD, Keys
from rollstream.ops.acl import generate_passwords
from rollstream.ops.plan import plan_run, write_acl
from rollstream.runtime.files import private_dir
from rollstream.topology.node import sentinel_master
from rollstream.topology.replicated import (
    REPLICATION_USER,
    SENTINEL_USER,
    SENTINELS_USER,
    EmbeddedTopology,
    failover_ready,
    plan_topology,
    topology_acl_lines,
    wait_failover_ready,
)
from rollstream.topology.replication import (
    NotReplicatedError,
    execute_replicated,
    parse_sentinel_url,
    sentinel_url,
)
from rollstream.topology.status import add_sentinel_view, format_replication, read_replication
from schemas import StepMetrics
from tests.conftest import PRODUCERS
from tests.test_ops_supervise import private_violations, sections


@dataclass
class Deployment:
    """A started topology and the credentials to reach it."""

    emb: EmbeddedTopology
    admin_password: str
    sentinel_password: str

    def client(self, wait_replicas: int = 1, wait_timeout_ms: int = 1000, user: str = "admin") -> redis.Redis:
        """A user's client through Sentinel, as a worker's (WAIT per wait_replicas)."""
        password = (self.emb.run_dir / "secrets" / f"{user}.password").read_text().strip()
        return connect(
            self.emb.topo.url, username=user, password=password,
            sentinel_password=self.sentinel_password, wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms, socket_timeout_s=5.0,
        )

    def node(self, port: int) -> redis.Redis:
        """A direct admin client on one data node."""
        return redis.Redis(port=port, username="admin", password=self.admin_password, socket_timeout=5)

    def sentinel(self, index: int = 0) -> redis.Redis:
        """A client on one Sentinel."""
        port = self.emb.topo.sentinels[index].port
        pw = self.sentinel_password
        return redis.Redis(port=port, password=pw, socket_timeout=5, decode_responses=True)


def start_deployment(tmp_path: Path, replicas: int, keys: Keys) -> Deployment:
    """Plan and start a topology with the run's ACL users on every node (Sentinel: down after 500 ms)."""
    run_dir = private_dir(tmp_path / "run")
    secrets = run_dir / "secrets"
    files = generate_passwords(secrets, [REPLICATION_USER, SENTINEL_USER, SENTINELS_USER])
    pw = {u: p.read_text().strip() for u, p in files.items()}
    acl_file, _ = write_acl(run_dir, keys, list(PRODUCERS), extra_lines=topology_acl_lines(pw))
    topo = plan_topology(
        run_dir, replicas, f"rollstream-{keys.run}", secrets, acl_file=acl_file, passwords=pw,
        appendfsync="always", down_after_ms=500, failover_timeout_ms=2000,
    )
    emb = EmbeddedTopology(topo, run_dir)
    emb.start()
    dep = Deployment(emb, (secrets / "admin.password").read_text().strip(), pw[SENTINELS_USER])
    wait_known(dep, replicas)
    return dep


def wait_known(dep: Deployment, replicas: int, timeout_s: float = 40.0) -> None:
    """Until every Sentinel knows every replica (in sync) and the other Sentinels: a failover can happen."""
    wait_failover_ready(dep.emb.topo.url, dep.sentinel_password, replicas, timeout_s)
    assert failover_ready(dep.emb.topo.url, dep.sentinel_password, replicas) is None


@pytest.fixture
def run_keys() -> Keys:
    """Key names of a test run (the deployment is the test's own, removed with tmp_path)."""
    return Keys("repl")


@pytest.fixture
def two_replicas(tmp_path: Path, run_keys: Keys) -> Iterator[Deployment]:
    """A primary, 2 replicas and 3 Sentinels; stopped afterwards."""
    dep = start_deployment(tmp_path, 2, run_keys)
    yield dep
    dep.emb.stop()


@pytest.fixture
def one_replica(tmp_path: Path, run_keys: Keys) -> Iterator[Deployment]:
    """A primary, 1 replica and 3 Sentinels; stopped afterwards."""
    dep = start_deployment(tmp_path, 1, run_keys)
    yield dep
    dep.emb.stop()


def test_sentinel_url_round_trips() -> None:
    url = sentinel_url(["127.0.0.1:26379", "h2:26380"], "m1", db=2)
    assert parse_sentinel_url(url) == ([("127.0.0.1", 26379), ("h2", 26380)], "m1", 2)
    for bad in ["redis://h:1/0", "redis+sentinel://h/m", "redis+sentinel://h:1/", "redis+sentinel://h:1/m?db=x"]:
        with pytest.raises(ValueError, match="redis"):
            parse_sentinel_url(bad)


def _write(r: redis.Redis, stream: str, i: int) -> None:
    """One acknowledged write: XADD with an explicit id (a repeat is refused: idempotent) under WAIT."""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(stream, {"i": i}, id=f"{i}-1")
    res = execute_replicated(pipe, f"write {i}", raise_on_error=False)
    if isinstance(res[0], redis.ResponseError) and "equal or smaller" not in str(res[0]):
        raise res[0]


def test_failover_after_the_primary_and_its_data_are_lost(two_replicas: Deployment) -> None:
    """SIGKILL the primary and remove its data: Sentinel promotes a replica, the same client keeps writing to
    it, every write acknowledged before the kill is there, and the lost node comes back as a replica."""
    dep, topo = two_replicas, two_replicas.emb.topo
    r = dep.client()
    stream = "rs:{repl}:acked"
    acked = []
    for i in range(1, 51):
        _write(r, stream, i)
        acked.append(i)
    old = topo.nodes[0]
    assert sentinel_master(topo.url, dep.sentinel_password) == old.address
    t_kill = time.monotonic()
    dep.emb.kill(old.name)
    shutil.rmtree(old.data_dir)
    i = acked[-1] + 1
    retry_on_connection(lambda: _write(r, stream, i), "write after kill", timeout_s=60)
    t_first = time.monotonic() - t_kill
    acked.append(i)
    for j in range(i + 1, i + 20):
        retry_on_connection(lambda j=j: _write(r, stream, j), "write", timeout_s=30)  # type: ignore[misc]
        acked.append(j)
    deadline = time.monotonic() + 30
    while (new := sentinel_master(topo.url, dep.sentinel_password)) is None:  # agreed on by the Sentinels
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert new != old.address
    ids = [int(e[0].split(b"-")[0]) for e in r.xrange(stream)]
    assert ids == acked, "an acknowledged write is missing on the new primary"
    print(f"kill -> first write acknowledged on the new primary: {t_first:.2f} s")
    assert t_first < 30
    # Sentinel has not yet seen the replica set as healthy again (the old primary is down): not ready
    assert failover_ready(topo.url, dep.sentinel_password, 2) is not None
    # the lost node restarts without data: it waits for Sentinel's new primary and replicates it
    dep.emb.start_process(old)
    back = dep.node(old.port)
    deadline = time.monotonic() + 30
    while True:
        try:
            role = back.execute_command("ROLE")
            if role[0] == b"slave" and role[3] == b"connected" and back.xlen(stream) == len(acked):
                break
        except redis.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the lost node did not come back as a replica with the data"
        time.sleep(0.2)
    assert f"127.0.0.1:{role[2]}" == new
    r.close()


def test_a_commit_without_a_replica_is_not_acknowledged(one_replica: Deployment, run_keys: Keys) -> None:
    """With the replica killed, the trainer's commit and a producer's publish fail WAIT (NotReplicatedError,
    a connection error their retries repeat), each under its own ACL user; once the replica is back the
    repeated commit is acknowledged, once."""
    dep = one_replica
    r = dep.client(wait_replicas=1, wait_timeout_ms=200, user="trainer")
    setup_run(r, run_keys, list(PRODUCERS))
    producer = dep.client(wait_replicas=1, wait_timeout_ms=200, user=PRODUCERS[0])
    pipe = producer.pipeline(transaction=True)
    pipe.xadd(run_keys.rollouts_of(PRODUCERS[0]), {"x": 1})
    assert len(execute_replicated(pipe, "publish")) == 1  # the replica is up: acknowledged
    replica = dep.emb.topo.nodes[1]
    # a barrier: one connection's acknowledged write covers what another wrote before it (the trainer's
    # confirm_replicated relies on it); read back on the replica itself
    other = dep.client(wait_replicas=0, user="trainer")
    burst = other.pipeline(transaction=False)
    for i in range(300):
        burst.hset(run_keys.trainer, f"f{i}", i)
    burst.execute()
    barrier = r.pipeline(transaction=True)
    barrier.hset(run_keys.trainer, "heartbeat", 1)
    execute_replicated(barrier, "barrier")
    assert dep.node(replica.port).hlen(run_keys.trainer) >= 301
    other.close()
    # the status lines: the primary, its replica in sync, Sentinel's view agreeing
    st = read_replication(r)
    add_sentinel_view(st, dep.emb.topo.url, dep.sentinel_password)
    assert st.primary == dep.emb.topo.nodes[0].address and st.role == "master"
    assert [rep.address for rep in st.replicas] == [replica.address] and st.problems(10.0) == []
    assert st.sentinel_primary == st.primary and st.failovers == 0 and st.sentinels_seen == 3
    assert "in sync" in "\n".join(format_replication(st, 10.0))
    dep.emb.kill(replica.name)
    st = read_replication(r)
    assert st.problems(10.0) == ["no replica in sync (acknowledged within 10s): writes are not acknowledged"]
    pipe.xadd(run_keys.rollouts_of(PRODUCERS[0]), {"x": 2})
    with pytest.raises(NotReplicatedError, match="publish: 0 of 1 replicas acknowledged"):
        execute_replicated(pipe, "publish")
    producer.close()
    end = StepMetrics(type="step_end", global_step=1, local_step=1, sample_count=0, num_local_updates=1)
    ledger = StepLedger(1, step_end=end)
    with pytest.raises(NotReplicatedError, match="0 of 1 replicas acknowledged"):
        commit_steps(r, run_keys, [ledger], param_version=1)
    assert isinstance(NotReplicatedError("x"), redis.ConnectionError)
    dep.emb.start_process(replica)
    retry_on_connection(lambda: commit_steps(r, run_keys, [ledger], param_version=1), "commit", timeout_s=30)
    assert r.hget(run_keys.trainer, COMMITTED_STEP_FIELD) == b"1"
    ends = [f for _, f in r.xrange(run_keys.metrics) if f[b"type"] == b"step_end"]
    assert len(ends) == 1
    # without acknowledgements asked for, the same write goes through with the replica gone
    dep.emb.kill(replica.name)
    plain = dep.client(wait_replicas=0, user="trainer")
    commit_steps(plain, run_keys, [StepLedger(2, step_end=end.model_copy(update={"global_step": 2}))], 2)
    assert plain.hget(run_keys.trainer, COMMITTED_STEP_FIELD) == b"2"
    r.close()
    plain.close()


def test_conf_for_replicated_redis_starts_nodes_then_sentinels_with_no_password_on_a_command_line(
    tmp_path: Path,
) -> None:
    cfg = load_config("pipeline.yaml", [f"run.dir={tmp_path}", "run.name=rep", "run.redis.replicas=2"])
    plan = plan_run(cfg)
    conf = sections(plan.conf_path.read_text())
    nodes, sentinels = ["redis", "redis_1", "redis_2"], ["sentinel_0", "sentinel_1", "sentinel_2"]
    assert plan.workers == ["warden", "aggregator", "trainer", "rollout_00", "rollout_01"]
    assert plan.redis_url.startswith("redis+sentinel://127.0.0.1:")
    assert plan.redis_url.endswith("/rollstream-rep?db=0")
    for name in nodes:
        cmd = conf[f"program:{name}"]["command"]
        assert conf[f"program:{name}"]["priority"] == "1" and conf[f"program:{name}"]["autostart"] == "true"
        assert "--appendonly yes --appendfsync always" in cmd and "--aclfile" in cmd
        assert ("--replicaof" in cmd) == (name != "redis")
    for name in sentinels:
        prog = conf[f"program:{name}"]
        assert prog["priority"] == "2" and "--sentinel" in prog["command"]
    env = conf["program:trainer"]["environment"]
    assert f'ROLLSTREAM_REDIS_URL="{plan.redis_url}"' in env and "ROLLSTREAM_SENTINEL_PASSWORD_FILE" in env
    secrets = tmp_path / "rep" / "secrets"
    acl = (secrets / "users.acl").read_text()
    assert "user replication on #" in acl and "user sentinel on #" in acl and "+psync" in acl
    text = plan.conf_path.read_text()
    for pw in secrets.glob("*.password"):
        assert pw.read_text().strip() not in text, f"{pw.name}'s password is on a command line"
    assert "masterauth" in (secrets / "redis-1.conf").read_text()
    assert (secrets / "redis-1.conf").stat().st_mode & 0o777 == 0o600
    assert private_violations(tmp_path / "rep") == []
    # the single server is planned as before: no Sentinel, no node launcher
    single = plan_run(load_config("pipeline.yaml", [f"run.dir={tmp_path}", "run.name=one"]))
    assert [p.name for p in single.programs][0] == "redis" and "sentinel" not in single.conf_path.read_text()
    assert "rollstream.topology.node" not in single.conf_path.read_text()
