"""The embedded replicated Redis (`run.redis.replicas: N`): a primary, N replicas and 3 Sentinels, each its
own redis-server on a free loopback port (Sentinel names primaries by host:port, so no unix sockets here).

Every data node keeps an AOF in its own folder (`<run_dir>/redis` for node 0, `<run_dir>/redis-<i>` for
replica i), loads the run's ACL file, and reads a private config file (`<run_dir>/secrets/redis-<i>.conf`,
0600) holding `masteruser`/`masterauth` of the `replication` ACL user, so no password is on a command line;
CONFIG REWRITE (Sentinel's, after a failover) writes the node's new role there. The Sentinels log in to the
nodes as the `sentinel` ACL user, require a password of their own (`<run_dir>/secrets/sentinel.password`;
clients pass it, and Sentinels among themselves), and keep their state in `<run_dir>/sentinel-<i>/`.

A data node starts through `python -m rollstream.topology.node` (topology/node.py): after its first start
it takes the role the Sentinels agree on, not the plan's (a promoted replica restarted stays the primary), and
a node they name the primary whose data is gone (its disk lost) does not come up empty as the primary (its
replicas would copy the empty set): it waits for the failover and starts as the new primary's replica."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rollstream.ops.embedded_redis import free_port, no_retry, redis_server_binary
from rollstream.runtime.files import PRIVATE_UMASK, private_dir
from rollstream.topology.replication import parse_sentinel_url, sentinel_url

#: ACL users the data nodes have beside the run's roles: replicas log in as `replication`, Sentinels as
#: `sentinel` (the commands Redis documents for each).
REPLICATION_USER = "replication"
SENTINEL_USER = "sentinel"
REPLICATION_RULES = ["+psync", "+replconf", "+ping"]
SENTINEL_RULES = [
    "allchannels", "+multi", "+slaveof", "+replicaof", "+ping", "+exec", "+subscribe", "+config|rewrite",
    "+role", "+publish", "+info", "+client|setname", "+client|kill", "+script|kill",
]
#: Name of the Sentinels' own password (clients and Sentinels log in with it) and its file in secrets.
SENTINELS_USER = "sentinels"
SENTINEL_PASSWORD_FILE = f"{SENTINELS_USER}.password"
#: How many Sentinels the embedded mode starts.
SENTINELS = 3
#: Marker in the run dir, one per data node (`redis-<i>.started`): the node has started once; from then on it
#: follows the Sentinels rather than the plan (topology/node.py).
STARTED_MARKER = "redis-{index}.started"
#: File in the run dir naming the data folder of the node that was the primary when the run was stopped
#: (the stopped run's log is served from its AOF).
PRIMARY_DATA_FILE = "redis.primary"


@dataclass
class Node:
    """One redis-server of the topology: its program name, port, data folder and argv."""

    name: str
    port: int
    data_dir: Path
    argv: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        """host:port."""
        return f"127.0.0.1:{self.port}"


@dataclass
class Topology:
    """The planned data nodes (node 0 starts as the primary), Sentinels and the URL clients use."""

    nodes: list[Node]
    sentinels: list[Node]
    master_name: str
    url: str


def node_data_dir(run_dir: Path, index: int) -> Path:
    """Data folder of node `index` (0: the single server's `<run_dir>/redis`)."""
    return run_dir / ("redis" if index == 0 else f"redis-{index}")


def node_name(index: int) -> str:
    """supervisord program name of data node `index` (0 keeps the single server's name `redis`)."""
    return "redis" if index == 0 else f"redis_{index}"


def data_dir_of(supervisord_conf: str, address: str) -> Path | None:
    """The data folder of the node at host:port, read from its program's command in supervisord.conf."""
    for line in supervisord_conf.splitlines():
        if line.startswith("command=") and f"--self {address} " in line and "--data-dir " in line:
            return Path(line.split("--data-dir ", 1)[1].split(" ", 1)[0])
    return None


def has_data(data_dir: Path) -> bool:
    """True when the folder holds an AOF (a node that has data to serve)."""
    aof = data_dir / "appendonlydir"
    return aof.is_dir() and any(aof.iterdir())


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def plan_topology(
    run_dir: Path,
    replicas: int,
    master_name: str,
    secrets_dir: Path,
    *,
    acl_file: Path | None,
    passwords: dict[str, str],
    appendfsync: str = "everysec",
    maxmemory: int | None = None,
    quorum: int = 2,
    down_after_ms: int = 5000,
    failover_timeout_ms: int = 60000,
) -> Topology:
    """Plan node 0 (the primary), `replicas` replicas and 3 Sentinels for run_dir: folders, private config
    files, argv of each (data nodes wrapped in topology/node.py). `passwords` holds the Sentinels' own
    password (key "sentinels") and, with an `acl_file` (which must hold topology_acl_lines), the
    `replication` and `sentinel` users' (keys REPLICATION_USER, SENTINEL_USER)."""
    if replicas < 1:
        raise ValueError(f"run.redis.replicas={replicas} must be >= 1 for a replicated topology")
    run_dir = run_dir.resolve()
    private_dir(secrets_dir)
    ports = [free_port() for _ in range(replicas + 1 + SENTINELS)]
    nodes = [Node(node_name(i), ports[i], node_data_dir(run_dir, i)) for i in range(replicas + 1)]
    url = sentinel_url([f"127.0.0.1:{p}" for p in ports[replicas + 1 :]], master_name)
    for i, node in enumerate(nodes):
        private_dir(node.data_dir)
        conf = secrets_dir / f"redis-{i}.conf"
        lines = ["# written by `rollstream run`; CONFIG REWRITE (a failover) may add to it"]
        if acl_file is not None:
            lines += [f"masteruser {REPLICATION_USER}", f'masterauth "{passwords[REPLICATION_USER]}"']
        _write_private(conf, "\n".join(lines) + "\n")
        argv = [
            redis_server_binary(), str(conf),
            "--port", str(node.port), "--bind", "127.0.0.1",
            "--appendonly", "yes", "--appendfsync", appendfsync,
            "--dir", str(node.data_dir), "--save", "", "--protected-mode", "yes",
            "--replica-read-only", "yes", "--repl-diskless-sync-delay", "0",
        ]
        if maxmemory is not None:
            argv += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "noeviction"]
        if acl_file is not None:
            argv += ["--aclfile", str(acl_file)]
        if i:
            argv += ["--replicaof", "127.0.0.1", str(nodes[0].port)]
        node.argv = [
            sys.executable, "-m", "rollstream.topology.node", "--url", url, "--self", node.address,
            "--data-dir", str(node.data_dir), "--marker", str(run_dir / STARTED_MARKER.format(index=i)),
            "--sentinel-password-file", str(secrets_dir / SENTINEL_PASSWORD_FILE), "--", *argv,
        ]
    sentinels = []
    for j in range(SENTINELS):
        port = ports[replicas + 1 + j]
        folder = private_dir(run_dir / f"sentinel-{j}")
        conf = folder / "sentinel.conf"
        pw = passwords[SENTINELS_USER]
        text = "\n".join([
            f"port {port}", "bind 127.0.0.1", f"dir {folder}", f'requirepass "{pw}"',
            f'sentinel sentinel-pass "{pw}"',
            f"sentinel monitor {master_name} 127.0.0.1 {nodes[0].port} {quorum}",
            f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
            f"sentinel failover-timeout {master_name} {failover_timeout_ms}",
            f"sentinel parallel-syncs {master_name} 1",
        ])
        if acl_file is not None:
            text += f"\nsentinel auth-user {master_name} {SENTINEL_USER}"
            text += f'\nsentinel auth-pass {master_name} "{passwords[SENTINEL_USER]}"'
        _write_private(conf, text + "\n")  # Sentinel rewrites it with what it learns (replicas, epochs)
        argv = [redis_server_binary(), str(conf), "--sentinel"]
        sentinels.append(Node(f"sentinel_{j}", port, folder, argv))
    return Topology(nodes, sentinels, master_name, url)


def topology_acl_lines(passwords: dict[str, str]) -> list[str]:
    """ACL file lines of the `replication` and `sentinel` users (sha256 hashes only)."""
    lines = []
    for user, rules in ((REPLICATION_USER, REPLICATION_RULES), (SENTINEL_USER, SENTINEL_RULES)):
        digest = hashlib.sha256(passwords[user].encode()).hexdigest()
        lines.append(" ".join(["user", user, "on", f"#{digest}", "resetchannels", *rules]))
    return lines


def failover_ready(url: str, password: str | None, replicas: int) -> str | None:
    """None when every Sentinel of `url` knows `replicas` replicas with a working link and the other
    Sentinels (a failover can happen); else what is missing, in words."""
    hosts, master, _ = parse_sentinel_url(url)
    for host, port in hosts:
        s = redis.Redis(host, port, password=password, socket_timeout=2, socket_connect_timeout=1,
                        decode_responses=True)
        try:
            known: Any = s.execute_command("SENTINEL", "REPLICAS", master)
            others: Any = s.execute_command("SENTINEL", "SENTINELS", master)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
            return f"Sentinel {host}:{port}: {e}"
        finally:
            s.close()
        ok = [r for r in known if "s_down" not in r["flags"] and r["master-link-status"] == "ok"]
        if len(ok) < replicas or len(others) < len(hosts) - 1:
            return (f"Sentinel {host}:{port} knows {len(ok)} of {replicas} replicas in sync and "
                    f"{len(others)} of {len(hosts) - 1} other Sentinels")
    return None


def wait_failover_ready(url: str, password: str | None, replicas: int, timeout_s: float = 60.0) -> None:
    """Wait until a failover can happen (`failover_ready`): Sentinel learns replicas from the primary's
    INFO every 10 s, so for up to ~10 s after a start it could not promote one; RuntimeError naming what is
    missing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (missing := failover_ready(url, password, replicas)) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no failover possible after {timeout_s:.0f}s: {missing}")
        time.sleep(0.2)


class EmbeddedTopology:
    """A replicated topology as child processes, outside supervisord (tests, scripts); each process can be
    killed and restarted on its own."""

    def __init__(self, topo: Topology, run_dir: Path) -> None:
        """Hold a planned topology (nothing starts yet)."""
        self.topo, self.run_dir = topo, Path(run_dir)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start_process(self, node: Node) -> None:
        """Start one node or Sentinel, its output appended to <run_dir>/<name>.log."""
        path = self.run_dir / f"{node.name}.log"
        log = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        self.procs[node.name] = subprocess.Popen(
            node.argv, stdout=log, stderr=subprocess.STDOUT, umask=PRIVATE_UMASK, start_new_session=True
        )
        log.close()

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every data node and Sentinel; return once each answers a PING (RuntimeError after
        timeout_s)."""
        for node in [*self.topo.nodes, *self.topo.sentinels]:
            self.start_process(node)
        deadline = time.monotonic() + timeout_s
        for node in [*self.topo.nodes, *self.topo.sentinels]:
            client = redis.Redis(port=node.port, socket_timeout=2, socket_connect_timeout=1, retry=no_retry())
            while True:
                try:
                    client.ping()
                    break
                except redis.AuthenticationError:
                    break  # answering, and asking for a password: up
                except redis.ResponseError as e:
                    if "NOAUTH" in str(e) or "NOPERM" in str(e) or "WRONGPASS" in str(e):
                        break
                    raise
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"{node.name} on {node.address} did not answer: {e}") from e
                    time.sleep(0.05)
            client.close()

    def kill(self, name: str) -> None:
        """SIGKILL one process and reap it."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every process still running (Sentinels first), then wait; SIGKILL what does not exit."""
        order = [*self.topo.sentinels, *self.topo.nodes]
        for node in order:
            proc = self.procs.get(node.name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for node in order:
            proc = self.procs.get(node.name)
            if proc is None:
                continue
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
