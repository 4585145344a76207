"""Replication: Sentinel URLs (clients find the primary through Sentinel and follow a failover) and WAIT
(a write counts only once enough replicas acknowledged it).

A Sentinel deployment is named by one URL, `redis+sentinel://host:port,host:port/<master name>?db=0`, so every
worker and CLI command reaches it through `connect()` like any other Redis. redis-py's Sentinel pool asks the
Sentinels for the primary on each new connection, and turns a reply from a demoted primary (READONLY,
UNBLOCKED) into a ConnectionError: the existing retry paths reconnect, to the new primary.

WAIT counts the replicas that acknowledged every write *this connection* made before it; it does not block
inside MULTI, and it says nothing about the replicas' disks (WAITAOF, Redis 7.2+, does). So the EXEC and its
WAIT go over one connection, held between them (`execute_and_wait`), and too few acknowledgements raise
NotReplicatedError, a ConnectionError: the caller's retry treats the write as not done and repeats it (every
replicated write of the run is idempotent by sample id or entry id)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from redis.client import Pipeline
from redis.connection import AbstractConnection, ConnectionPool

#: URL scheme of a Sentinel deployment.
SENTINEL_SCHEME = "redis+sentinel"
#: Attribute on a client's connection pool holding (replicas, timeout_ms) for WAIT.
_ACKS_ATTR = "rollstream_acks"


class NotReplicatedError(redis.ConnectionError):
    """WAIT: fewer replicas than required acknowledged a write within the timeout; it may be lost in a
    failover, so it does not count and is retried."""


def sentinel_url(sentinels: Sequence[str], master_name: str, db: int = 0) -> str:
    """The URL of a Sentinel deployment: its Sentinels (host:port) and the primary's master name."""
    if not sentinels:
        raise ValueError("sentinel_url needs at least one Sentinel host:port")
    return f"{SENTINEL_SCHEME}://{','.join(sentinels)}/{master_name}?db={db}"


def is_sentinel_url(url: str) -> bool:
    """True for a `redis+sentinel://` URL."""
    return url.startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """(Sentinel addresses, master name, db) of a `redis+sentinel://h:p,h:p/<master>?db=N` URL; ValueError
    naming the URL when it is not one."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"{url!r} is not a {SENTINEL_SCHEME}:// URL")
    hosts: list[tuple[str, int]] = []
    for item in parts.netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"Sentinel URL {url!r}: {item!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    master = parts.path.strip("/")
    if not master:
        raise ValueError(f"Sentinel URL {url!r} names no master (…/<master name>)")
    db = parse_qs(parts.query).get("db", ["0"])[0]
    if not db.isdigit():
        raise ValueError(f"Sentinel URL {url!r}: db={db!r} is not a number")
    return hosts, master, int(db)


def sentinel_client(url: str, sentinel_password: str | None = None, **kwargs: Any) -> redis.Redis:
    """A client on the primary named by a Sentinel URL, with connect()'s connection kwargs; each new
    connection asks the Sentinels (logging in with `sentinel_password` when given) where the primary is."""
    from redis.sentinel import Sentinel

    hosts, master, db = parse_sentinel_url(url)
    timeout = kwargs.get("socket_connect_timeout", 5.0)
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if sentinel_password is not None:
        sentinel_kwargs["password"] = sentinel_password
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs)
    client: redis.Redis = sentinel.master_for(master, redis_class=redis.Redis, db=db, **kwargs)
    return client


def set_acks(r: redis.Redis, replicas: int, timeout_ms: int) -> None:
    """Make `execute_and_wait` on r's pipelines wait for `replicas` acknowledgements (0: no WAIT)."""
    if replicas < 0 or timeout_ms <= 0:
        raise ValueError(f"replicas={replicas!r} must be >= 0 and timeout_ms={timeout_ms!r} > 0")
    setattr(r.connection_pool, _ACKS_ATTR, (replicas, timeout_ms))


def acks_of(pool: ConnectionPool) -> tuple[int, int]:
    """(replicas, timeout_ms) a client's pool waits for; (0, 0) when none was set."""
    value: tuple[int, int] = getattr(pool, _ACKS_ATTR, (0, 0))
    return value


class _HeldPool:
    """One connection, held: the pipeline takes it and gives it back without it returning to the pool, so
    the WAIT after the EXEC goes over the same connection."""

    def __init__(self, pool: ConnectionPool, conn: AbstractConnection) -> None:
        self.pool, self.conn = pool, conn

    def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        return self.conn

    def release(self, conn: AbstractConnection) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def execute_and_wait(pipe: Pipeline, *, raise_on_error: bool = True) -> tuple[list[Any], int | None]:
    """Execute the pipeline (its MULTI/EXEC), then, when its client waits for acknowledgements
    (`set_acks`), WAIT on the same connection: (the replies, replicas that acknowledged, or None when it
    does not wait). `require_acks` turns too few into NotReplicatedError. A pipeline of `held_transaction`
    executes and waits on its held connection."""
    pool = pipe.connection_pool
    replicas, timeout_ms = acks_of(pool)
    if replicas <= 0:
        return pipe.execute(raise_on_error=raise_on_error), None
    if not isinstance(pool, _HeldPool):  # EXEC and WAIT must share one connection: hold one for both
        with _holding(pipe):
            return execute_and_wait(pipe, raise_on_error=raise_on_error)
    results = pipe.execute(raise_on_error=raise_on_error)
    pool.conn.send_command("WAIT", replicas, timeout_ms)
    return results, int(pool.conn.read_response())


@contextmanager
def _holding(pipe: Pipeline) -> Iterator[None]:
    """Run `pipe` on one connection of its pool until the block ends (dropped on an error: its state is
    unknown), then reset the pipeline (UNWATCH when still watching on a live connection), give the
    connection back and restore the pipeline's pool."""
    pool = pipe.connection_pool
    conn = pool.get_connection()
    pipe.connection_pool = _HeldPool(pool, conn)  # type: ignore[assignment]
    try:
        yield
    except BaseException:
        conn.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pipe.reset()  # its release goes to the held pool (a no-op); after an EXEC already done, nothing to do
        pipe.connection_pool = pool
        pool.release(conn)


@contextmanager
def held_transaction(r: redis.Redis) -> Iterator[Pipeline]:
    """A transaction pipeline on one connection held until the block ends: a WATCH, the reads after it, the
    EXEC and execute_and_wait's WAIT all go over it. A failover between the reads and the EXEC breaks that
    connection (or demotes its server), so the EXEC is refused (WatchError, or a ConnectionError) rather
    than applied to another primary's data, which the reads never saw."""
    pipe = r.pipeline(transaction=True)
    with _holding(pipe):
        yield pipe


def require_acks(pool: ConnectionPool, acked: int | None, what: str) -> None:
    """Raise NotReplicatedError when `acked` (from execute_and_wait) is below what the pool waits for."""
    replicas, timeout_ms = acks_of(pool)
    if acked is not None and acked < replicas:
        raise NotReplicatedError(
            f"{what}: {acked} of {replicas} replicas acknowledged within {timeout_ms} ms (WAIT); "
            "not counted, retried"
        )


def execute_replicated(pipe: Pipeline, what: str, *, raise_on_error: bool = True) -> list[Any]:
    """execute_and_wait, then require_acks: the replies of a write that reached enough replicas."""
    pool = pipe.connection_pool
    results, acked = execute_and_wait(pipe, raise_on_error=raise_on_error)
    require_acks(pool, acked, what)
    return results


def replication_info(r: redis.Redis) -> dict[str, Any]:
    """INFO replication of r's server, keys and values as text."""
    info: dict[str, Any] = r.info("replication")
    return info
