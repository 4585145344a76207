"""Redis Cluster: many runs on one Cluster, each run on the node that serves its hash slot.

A Cluster is named by one URL, `redis+cluster://host:port,host:port,...` (some of its nodes: any one that
answers is enough; no db: a Cluster has only db 0), in `run.redis_url` like any other Redis. Every key of a
run is `rs:{<run>}:…` (rollstream/keys.py): the braces are a hash tag, so all of a run's keys hash to one slot
(CRC16 of the run name mod 16384) and live on one primary. That is what lets the run work unchanged: its
MULTI/EXEC transactions, Lua scripts, WATCH, XREADGROUP over all its producers' streams, SCAN of its keys and
WAIT after an EXEC all touch keys of that one slot, which Redis Cluster allows (it refuses them, CROSSSLOT,
across slots). Different runs hash to different slots, so runs spread over the Cluster's primaries.

So a client here is not a cluster client (redis-py's RedisCluster routes command by command and has no
connection to hold for a WAIT after an EXEC, no one pool to count reconnects on; its transactions, in the
installed redis-py 8.2, work only when every key shares one slot anyway: `TransactionStrategy` raises "All
keys involved in a cluster transaction must map to the same slot"). It is a plain `redis.Redis` whose
connections go to the primary that serves the run's slot: each new connection asks the Cluster (CLUSTER SLOTS,
seeds first, then the last owner) which node that is. A reply that says the slot moved (MOVED or ASK for the
run's slot: a failover or a resharding) or that the Cluster cannot serve it now (CLUSTERDOWN, TRYAGAIN, a
demoted primary's UNBLOCKED) becomes a ConnectionError after the connection is dropped: the existing retry
paths reconnect, to the new owner, as they do for a Sentinel failover. A key of another slot (another run's,
a key outside any run) is refused: CrossSlotRefused names the slot and run.redis_url, and is never retried.
Keyless commands (INFO, CONFIG GET, SCRIPT LOAD, MEMORY, CLIENT, ACL) go to the run's node, which is the
node they are about: its memory bounds the run's back-pressure, its script cache runs the run's EVALSHA, and
its ACL users are the ones the run's clients log in as.

ACL users are per node in a Cluster (ACL SETUSER is not propagated): `apply_acl_on_cluster` sets a run's users
on every node of the Cluster, primaries and replicas (a failover promotes a replica with its own ACL table);
run it again after adding a node."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from redis.connection import Connection, ConnectionPool
from redis.crc import key_slot

#: URL scheme of a Redis Cluster.
CLUSTER_SCHEME = "redis+cluster"
#: Slots of a Redis Cluster.
SLOTS = 16384
#: Reply prefix of a blocked client unblocked because its node's role changed (a failover).
_UNBLOCKED = "UNBLOCKED"


class CrossSlotRefused(redis.ResponseError):
    """A command touched a key outside the run's slot on a client pinned to that slot (redis+cluster://):
    another run's keys, or a key outside any run. Not retried."""


def cluster_url(nodes: Sequence[str]) -> str:
    """The URL of a Redis Cluster from some of its nodes (host:port)."""
    if not nodes:
        raise ValueError("cluster_url needs at least one node host:port")
    return f"{CLUSTER_SCHEME}://{','.join(nodes)}"


def is_cluster_url(url: str) -> bool:
    """True for a `redis+cluster://` URL."""
    return url.startswith(CLUSTER_SCHEME + "://")


def parse_cluster_url(url: str) -> list[tuple[str, int]]:
    """The node addresses of a `redis+cluster://h:p,h:p` URL; ValueError naming the URL and the part that is
    wrong (not host:port, a db other than 0, a password: it goes in run.password_file or the env)."""
    parts = urlsplit(url)
    if parts.scheme != CLUSTER_SCHEME:
        raise ValueError(f"{url!r} is not a {CLUSTER_SCHEME}:// URL")
    netloc = parts.netloc
    if "@" in netloc:
        raise ValueError(
            f"cluster URL {url.split('@')[-1]!r}: no user or password in a {CLUSTER_SCHEME}:// URL; put "
            "the password in run.password_file or $ROLLSTREAM_REDIS_PASSWORD, the user in "
            "$ROLLSTREAM_REDIS_USERNAME"
        )
    nodes: list[tuple[str, int]] = []
    for item in netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster URL {url!r}: {item!r} is not host:port (port 1-65535)")
        nodes.append((host.strip("[]"), int(port)))
    db = parts.path.strip("/") or parse_qs(parts.query).get("db", ["0"])[0]
    if db != "0":
        raise ValueError(f"cluster URL {url!r}: db {db!r}: a Redis Cluster has only db 0")
    return nodes


def run_slot(run: str) -> int:
    """The hash slot of every key of run `run` (`rs:{<run>}:…` hashes its tag, the run name)."""
    return int(key_slot(run.encode()))


def slot_owner(
    nodes: Sequence[tuple[str, int]], slot: int, *, timeout_s: float = 5.0, **login: Any
) -> tuple[str, int]:
    """(host, port) of the primary that serves `slot`, asked of `nodes` in order (CLUSTER SLOTS) until one
    answers; ConnectionError when none does or no node serves the slot. `login`: username / password."""
    problems = []
    for host, port in nodes:
        conn = Connection(host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                          **{k: v for k, v in login.items() if v is not None})  # type: ignore[no-untyped-call]
        try:
            conn.connect()  # type: ignore[no-untyped-call]
            conn.send_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            reply = conn.read_response()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            problems.append(f"{host}:{port}: {e}")
            continue
        except redis.ResponseError as e:
            problems.append(f"{host}:{port}: {e}")
            continue
        finally:
            conn.disconnect()  # type: ignore[no-untyped-call]
        for entry in reply:
            start, end, primary = int(entry[0]), int(entry[1]), entry[2]
            if start <= slot <= end:
                owner = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                return (owner or host), int(primary[1])  # an empty host: the node asked
        problems.append(f"{host}:{port}: no node serves slot {slot}")
    raise redis.ConnectionError(f"Redis Cluster: no owner of slot {slot} found ({'; '.join(problems)})")


def require_one_slot(url: str, runs: Sequence[str], what: str) -> None:
    """ValueError when `url` is a Cluster and the runs hash to different slots: a command that reads one
    run and writes another (a replay) goes over one client, pinned to one slot."""
    if not is_cluster_url(url):
        return
    slots = {run: run_slot(run) for run in runs}
    if len(set(slots.values())) > 1:
        raise ValueError(
            f"{what}: runs {', '.join(f'{r!r} (slot {s})' for r, s in slots.items())} are in different slots "
            f"of the Redis Cluster run.redis_url={url!r}; a command across runs needs them in one slot: "
            "replay on a single (non-cluster) Redis, or pick a destination name in the source's slot "
            "(`python -c 'from rollstream.topology.cluster import run_slot; print(run_slot(NAME))'`)"
        )


class _SlotProxy:
    """What a SlotConnection asks: the seeds, the run's slot, the owner last seen (shared by the pool's
    connections), the login to ask with."""

    def __init__(self, pool: ConnectionPool, nodes: list[tuple[str, int]], slot: int, run: str,
                 timeout_s: float, login: dict[str, Any]) -> None:
        self.pool_ref = weakref.ref(pool)
        self.nodes, self.slot, self.run, self.timeout_s, self.login = nodes, slot, run, timeout_s, login
        self.owner: tuple[str, int] | None = None

    def find_owner(self) -> tuple[str, int]:
        """The slot's primary, asked of the last owner seen first, then the seeds."""
        order = ([self.owner] if self.owner else []) + [n for n in self.nodes if n != self.owner]
        owner = slot_owner(order, self.slot, timeout_s=self.timeout_s, **self.login)
        self.moved_to(owner)
        return owner

    def moved_to(self, owner: tuple[str, int]) -> None:
        """Record a new owner; idle connections to the old one are dropped."""
        if owner != self.owner:
            old, self.owner = self.owner, owner
            pool = self.pool_ref()
            if old is not None and pool is not None:
                pool.disconnect(inuse_connections=False)


class SlotConnection(Connection):
    """A connection to the primary serving one slot, found on each connect; a reply saying the slot moved
    becomes a ConnectionError (see the module doc), a key of another slot CrossSlotRefused."""

    def __init__(self, **kwargs: Any) -> None:
        """Connection kwargs plus `slot_proxy` (the pool's _SlotProxy)."""
        self.slot_proxy: _SlotProxy = kwargs.pop("slot_proxy")
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]

    def _connect(self) -> Any:
        self.host, self.port = self.slot_proxy.find_owner()
        return super()._connect()  # type: ignore[no-untyped-call]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.exceptions.AskError as e:  # MOVED is an AskError
            proxy = self.slot_proxy
            if e.slot_id != proxy.slot:
                raise CrossSlotRefused(
                    f"a key of slot {e.slot_id} is not in run {proxy.run!r} (slot {proxy.slot}): with a "
                    f"{CLUSTER_SCHEME}:// run.redis_url a client reaches only its run's keys "
                    f"rs:{{{proxy.run}}}:…"
                ) from e
            if isinstance(e, redis.exceptions.MovedError):
                proxy.moved_to(e.node_addr)
            self.disconnect()  # type: ignore[no-untyped-call]
            raise redis.ConnectionError(f"run {proxy.run!r}: slot {proxy.slot} moved ({e})") from e
        except (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError) as e:
            self.disconnect()  # type: ignore[no-untyped-call]
            slot = self.slot_proxy.slot
            raise redis.ConnectionError(f"Redis Cluster cannot serve slot {slot} now ({e})") from e
        except redis.ResponseError as e:
            if str(e).startswith(_UNBLOCKED):  # a blocked read on a primary that was demoted
                self.disconnect()  # type: ignore[no-untyped-call]
                raise redis.ConnectionError(f"the run's primary changed role ({e})") from e
            raise


def cluster_client(url: str, run: str | None, **kwargs: Any) -> redis.Redis:
    """A client on the primary serving run `run`'s slot of the Cluster named by `url`, with connect()'s
    connection kwargs; ValueError when no run is given (the slot is the run's)."""
    if not run:
        raise ValueError(
            f"run.redis_url={url!r} names a Redis Cluster: a client is pinned to one run's slot, so it needs "
            "the run name (connect(url, run=...))"
        )
    nodes = parse_cluster_url(url)
    login = {"username": kwargs.get("username"), "password": kwargs.get("password")}
    pool = ConnectionPool(connection_class=SlotConnection, **kwargs)
    timeout_s = float(kwargs.get("socket_connect_timeout", 5.0))
    proxy = _SlotProxy(pool, nodes, run_slot(run), run, timeout_s, login)
    pool.connection_kwargs["slot_proxy"] = proxy
    return redis.Redis.from_pool(pool)


def refuse_plain_cluster_node(r: redis.Redis, url: str) -> None:
    """ValueError naming run.redis_url when `url` is a plain redis:// URL of a Cluster node (INFO cluster
    says cluster_enabled): its clients would get MOVED for a run whose slot another node serves."""
    if is_cluster_url(url):
        return
    try:
        info = r.info("cluster")
    except redis.ResponseError:  # a server without the section, or a user without INFO: nothing to say
        return
    if info.get("cluster_enabled"):
        raise ValueError(
            f"run.redis_url={url!r} is a node of a Redis Cluster: name the Cluster as "
            f"{CLUSTER_SCHEME}://host:port[,host:port…] so every client reaches the node serving the run's "
            "slot"
        )


def is_cluster_client(r: redis.Redis) -> bool:
    """True for a client from cluster_client (pinned to a run's slot); asks no node."""
    return isinstance(r.connection_pool.connection_kwargs.get("slot_proxy"), _SlotProxy)


def pinned_slot(r: redis.Redis) -> tuple[int, str] | None:
    """(slot, host:port of the primary last seen serving it) of a client from cluster_client; None for any
    other client."""
    proxy = r.connection_pool.connection_kwargs.get("slot_proxy")
    if not isinstance(proxy, _SlotProxy):
        return None
    owner = proxy.owner or proxy.find_owner()
    return proxy.slot, f"{owner[0]}:{owner[1]}"


def cluster_nodes(url: str, **login: Any) -> list[dict[str, Any]]:
    """Every node of the Cluster (CLUSTER NODES of the first node that answers): dicts with `address`
    (host:port), `id`, `primary` (bool), `slots` (the slot ranges it serves, as text), `flags`."""
    problems = []
    for host, port in parse_cluster_url(url):
        conn = Connection(host=host, port=port, socket_timeout=5, socket_connect_timeout=5,
                          **{k: v for k, v in login.items() if v is not None})  # type: ignore[no-untyped-call]
        try:
            conn.connect()  # type: ignore[no-untyped-call]
            conn.send_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
            reply = conn.read_response()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError) as e:
            problems.append(f"{host}:{port}: {e}")
            continue
        finally:
            conn.disconnect()  # type: ignore[no-untyped-call]
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        out = []
        for line in text.splitlines():
            f = line.split()
            address = f[1].split("@")[0]
            if address.startswith(":"):  # a node that does not know its own address yet
                address = f"{host}{address}"
            flags = f[2].split(",")
            out.append({"address": address, "id": f[0], "primary": "master" in flags, "slots": f[8:],
                        "flags": flags})
        return out
    raise redis.ConnectionError(f"Redis Cluster {url!r}: no node answered ({'; '.join(problems)})")


def for_each_node(url: str, fn: Callable[[redis.Redis], None], **login: Any) -> list[str]:
    """Call fn with a client on every node of the Cluster (primaries and replicas): what is per node, such as
    ACL users. Returns the nodes' addresses."""
    done = []
    for node in cluster_nodes(url, **login):
        if "fail" in node["flags"] or "noaddr" in node["flags"]:
            raise redis.ConnectionError(f"Redis Cluster node {node['address']} is down ({node['flags']})")
        host, _, port = node["address"].rpartition(":")
        r = redis.Redis(host.strip("[]"), int(port), socket_timeout=5, socket_connect_timeout=5,
                        **{k: v for k, v in login.items() if v is not None})
        try:
            fn(r)
        finally:
            r.close()
        done.append(node["address"])
    return done
