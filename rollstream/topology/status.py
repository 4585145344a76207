"""The replication lines of `rollstream status`: the primary, each replica's state and offset lag (from the
primary's INFO replication) and, through Sentinel, its view of the primary and the last failover.

A replica is *in sync* when the primary sees it online and its last acknowledgement is at most
`run.redis.replica_lag_bound_s` old; `status --check` fails when a replicated run has no replica in sync
(then no write is acknowledged: producers and the trainer retry until one is)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from rollstream.bus.ids import text
from rollstream.topology.replication import parse_sentinel_url


@dataclass
class ReplicaLine:
    """One replica as the primary sees it."""

    address: str
    state: str  # online, wait_bgsave, send_bulk, …
    offset: int
    lag_bytes: int  # primary's offset minus the replica's
    ack_age_s: int  # seconds since its last acknowledgement

    def in_sync(self, bound_s: float) -> bool:
        """Online and acknowledged within bound_s."""
        return self.state == "online" and self.ack_age_s <= bound_s


@dataclass
class ReplicationStatus:
    """The topology: who is primary, its replicas, and Sentinel's view (when reachable)."""

    primary: str
    role: str
    offset: int
    replicas: list[ReplicaLine] = field(default_factory=list)
    sentinel_primary: str | None = None
    failovers: int | None = None  # Sentinel's config epoch: failovers since the Sentinels started
    primary_for_s: float | None = None  # since Sentinel saw the current primary take the role
    sentinels_seen: int | None = None

    def problems(self, bound_s: float) -> list[str]:
        """Why the topology is not safe for acknowledged writes (empty when a replica is in sync)."""
        out = []
        if self.role != "master":
            out.append(f"redis {self.primary} answers as {self.role}, not the primary")
        if not any(rep.in_sync(bound_s) for rep in self.replicas):
            out.append(f"no replica in sync (acknowledged within {bound_s:g}s): writes are not acknowledged")
        if self.sentinel_primary is not None and self.sentinel_primary != self.primary:
            out.append(f"Sentinel names {self.sentinel_primary}, clients reached {self.primary}")
        return out


def _replica(fields: str, master_offset: int) -> ReplicaLine:
    """Parse INFO's `slaveN:ip=…,port=…,state=…,offset=…,lag=…`."""
    kv = dict(item.split("=", 1) for item in fields.split(","))
    offset = int(kv.get("offset", 0))
    return ReplicaLine(
        f"{kv.get('ip')}:{kv.get('port')}", kv.get("state", "?"), offset, master_offset - offset,
        int(kv.get("lag", 0)),
    )


def read_replication(r: redis.Redis) -> ReplicationStatus:
    """The primary's INFO replication (r reaches the primary, through Sentinel or directly)."""
    info: dict[str, Any] = r.info("replication")
    pool: Any = r.connection_pool
    kwargs = pool.connection_kwargs
    address = getattr(pool, "master_address", None)  # a Sentinel pool: the primary it reached
    if address is not None:
        where = f"{address[0]}:{address[1]}"
    else:
        where = str(kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}")
    offset = int(info.get("master_repl_offset", 0))
    replicas = []
    for key, value in info.items():
        if key.startswith("slave") and key[5:].isdigit():
            if isinstance(value, dict):  # redis-py parses the k=v list into a dict
                value = ",".join(f"{k}={v}" for k, v in value.items())
            replicas.append(_replica(str(value), offset))
    return ReplicationStatus(where, str(info.get("role", "?")), offset, replicas)


def add_sentinel_view(st: ReplicationStatus, url: str, password: str | None) -> None:
    """Fill in what the first answering Sentinel of `url` says: primary, failovers, time since."""
    hosts, master, _ = parse_sentinel_url(url)
    for host, port in hosts:
        s = redis.Redis(host, port, password=password, socket_timeout=2, socket_connect_timeout=1)
        try:
            flat: Any = s.execute_command("SENTINEL", "MASTER", master)
            others: Any = s.execute_command("SENTINEL", "SENTINELS", master)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            continue
        finally:
            s.close()
        if not isinstance(flat, dict):
            flat = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        m = {text(k): text(v) for k, v in flat.items()}
        st.sentinel_primary = f"{m.get('ip')}:{m.get('port')}"
        st.failovers = int(m.get("config-epoch", 0))
        st.primary_for_s = int(m.get("role-reported-time", 0)) / 1000
        st.sentinels_seen = len(others) + 1
        return


def format_replication(st: ReplicationStatus, bound_s: float) -> list[str]:
    """The status screen's replication lines."""
    out = [f"redis primary {st.primary} ({st.role}), offset {st.offset}"]
    for rep in st.replicas:
        sync = "in sync" if rep.in_sync(bound_s) else "NOT IN SYNC"
        out.append(
            f"  replica {rep.address} {rep.state}, lag {rep.lag_bytes} bytes, last ack {rep.ack_age_s}s ago: "
            f"{sync}"
        )
    if not st.replicas:
        out.append("  no replica connected")
    if st.sentinel_primary is not None:
        since = f"{st.primary_for_s:.0f}s" if st.primary_for_s is not None else "?"
        out.append(
            f"sentinel: primary {st.sentinel_primary}, failovers (config epoch) {st.failovers}, primary for "
            f"{since}, sentinels {st.sentinels_seen}"
        )
    out += [f"REPLICATION: {p}" for p in st.problems(bound_s)]
    return out
