"""Redis connections: URL parsing (a `redis+sentinel://` URL reaches the primary through Sentinel, a
`redis+cluster://` URL the Cluster node serving the run's slot), passwords from env or file, and the one
retry policy every worker uses (`retry_on_connection`, and `retried`, the same for a named method): jittered
backoff until Redis answers."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from rollstream.topology.cluster import cluster_client, is_cluster_client, is_cluster_url
from rollstream.topology.replication import acks_of, is_sentinel_url, sentinel_client, set_acks

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")
P = ParamSpec("P")

#: Errors that mean "Redis is (temporarily) unreachable": retried with backoff, never fatal. READONLY is a
#: primary demoted in a failover (through Sentinel, redis-py reconnects to the new one; it also covers
#: NotReplicatedError, a ConnectionError: a write WAIT did not confirm).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.ReadOnlyError,
    ConnectionResetError,
    BrokenPipeError,
)

#: What retry_on_connection waits out: a lost connection, and a BUSY reply (a ResponseError; others re-raise).
_WAITED_OUT: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, redis.ResponseError)

#: Environment variables a worker reads its Redis password from (never from the command line).
PASSWORD_ENV = "ROLLSTREAM_REDIS_PASSWORD"
USERNAME_ENV = "ROLLSTREAM_REDIS_USERNAME"
PASSWORD_FILE_ENV = "ROLLSTREAM_REDIS_PASSWORD_FILE"
#: File with the Sentinels' own password (a `redis+sentinel://` URL whose Sentinels require one).
SENTINEL_PASSWORD_FILE_ENV = "ROLLSTREAM_SENTINEL_PASSWORD_FILE"


def backoff_delays(base_s: float = 0.05, cap_s: float = 5.0) -> Iterator[float]:
    """Endless full-jitter exponential backoff delays in seconds."""
    attempt = 0
    while True:
        yield random.uniform(0, min(cap_s, base_s * (2**attempt)))
        attempt = min(attempt + 1, 30)


def retry_on_connection(
    fn: Callable[[], T],
    what: str = "redis call",
    *,
    stop: threading.Event | None = None,
    on_retry: Callable[[], None] | None = None,
    timeout_s: float | None = None,
) -> T:
    """The one retry policy: call fn until it gets through. A connection loss (Redis restarting, AOF loading)
    is retried in place with jittered backoff, for as long as it takes (a second SIGTERM still ends the
    process), or, with `stop` / `timeout_s`, until stop is set or the next attempt would pass the timeout:
    then the last connection error is raised. A BUSY reply (a script running past Redis's
    busy-reply-threshold, until `watch_busy_scripts` kills it) is waited out the same way. `on_retry` runs
    after each loss (e.g. to re-read a reader's own pending entries). fn must be safe to repeat: its effect
    may have landed even when the reply was lost. A refused login (redis.AuthenticationError: the user
    switched off, as the flood fence does, or a wrong password) is raised at once: waiting cannot help."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delays = backoff_delays()
    while True:
        try:
            return fn()
        except _WAITED_OUT as e:
            if isinstance(e, redis.ResponseError) and not (is_busy(e) or isinstance(e, redis.ReadOnlyError)):
                raise
            if isinstance(e, redis.AuthenticationError):
                raise
            delay = next(delays)
            if (stop is not None and stop.is_set()) or (
                deadline is not None and time.monotonic() + delay > deadline
            ):
                raise
            log.warning("%s failed, redis unavailable (%s); retry in %.2fs", what, e, delay)
            if on_retry is not None:
                on_retry()
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)


def retried(
    what: str, *, until: str | None = None
) -> Callable[[Callable[Concatenate[S, P], T]], Callable[Concatenate[S, P], T]]:
    """The one retry policy for a method (an effect of a worker: safe to repeat): run it under
    `retry_on_connection`, named `what` (formatted with the method's arguments, e.g. "granting version
    {version}") in its retry warnings. With `until`, the name of an argument holding a time.monotonic()
    deadline, the effect is best-effort: retried until the deadline (at least 0.1 s), then given up with a
    warning, returning None. A refused login is raised at once."""

    def wrap(fn: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            name = what.format(**bound.arguments)
            left = None if until is None else max(bound.arguments[until] - time.monotonic(), 0.1)
            try:
                return retry_on_connection(lambda: fn(self, *args, **kwargs), name, timeout_s=left)
            except CONNECTION_ERRORS as e:
                if until is None:
                    raise  # a refused login (AuthenticationError): never retried, the process exits
                log.warning("%s: given up, redis unreachable until its deadline (%s)", name, e)
                return cast(T, None)

        return cast(Callable[Concatenate[S, P], T], run)

    return wrap


def is_busy(error: BaseException) -> bool:
    """True for Redis's BUSY reply: a script or function has run past busy-reply-threshold, and Redis answers
    nothing else until it ends or is killed."""
    return isinstance(error, redis.ResponseError) and str(error).startswith("BUSY ")


def watch_busy_scripts(r: redis.Redis, stop: threading.Event, period_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that PINGs every `period_s` until `stop` and answers BUSY with SCRIPT KILL, so
    a script that never ends (`EVAL "while true do end" 0` from any user allowed EVAL) stalls the run for
    at most busy-reply-threshold + period_s. The trainer runs it (its user may SCRIPT KILL). A script that
    already wrote cannot be killed (Redis refuses: only SHUTDOWN NOSAVE, an operator's, ends it): logged."""

    def watch() -> None:
        while not stop.wait(period_s):
            try:
                r.ping()
            except redis.ResponseError as e:
                if not is_busy(e):
                    continue
                try:
                    r.script_kill()
                    log.error("SCRIPT KILL: a script ran past busy-reply-threshold and blocked Redis")
                except redis.ResponseError as refused:
                    log.error(
                        "a script blocks Redis and cannot be killed (%s): an operator must SHUTDOWN NOSAVE",
                        refused,
                    )
            except CONNECTION_ERRORS:
                continue

    thread = threading.Thread(target=watch, name="busy-script-watch", daemon=True)
    thread.start()
    return thread


class RespPacker(PythonRespSerializer):
    """redis-py's pure-Python RESP command packer, with fewer pieces: every value under ZERO_COPY_MIN bytes
    (memoryviews included) is copied into one buffer per command, so an XADD of a sample's header fields,
    payload and small array fields is one socket write instead of one per memoryview; larger values go to
    the socket as they are (zero-copy). Values are encoded as redis-py encodes them (str as UTF-8, ints and
    floats by repr, bool and other types refused with DataError)."""

    #: Values at least this large are their own socket write (copying them would cost more than the write).
    ZERO_COPY_MIN = 64 * 1024

    def __init__(self) -> None:
        """UTF-8 strict encoding, bytes replies (as connect() uses it)."""
        super().__init__(6000, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        """The command as a list of buffers to write in order."""
        first = args[0]
        if isinstance(first, str):  # literal arguments in the command name ('XGROUP CREATE'), as redis-py
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        out: list[bytes | memoryview] = []
        pieces: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        big = self.ZERO_COPY_MIN
        for arg in args:
            kind = type(arg)
            if kind is bytes:
                size = len(arg)
            elif kind is str:
                arg = arg.encode()
                size = len(arg)
            elif kind is memoryview:
                size = arg.nbytes
            else:
                arg = self.encode(arg)
                size = arg.nbytes if isinstance(arg, memoryview) else len(arg)
            if size >= big:
                pieces.append(b"$%d\r\n" % size)
                out.append(b"".join(pieces))
                out.append(arg)
                pieces = [b"\r\n"]
            else:
                pieces += (b"$%d\r\n" % size, arg, b"\r\n")
        out.append(b"".join(pieces))
        return out


def read_password(password_file: str | None = None) -> str | None:
    """The Redis password from $ROLLSTREAM_REDIS_PASSWORD, or a file named by config or env (stripped)."""
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    path = password_file or os.environ.get(PASSWORD_FILE_ENV)
    if path:
        return Path(path).read_text().strip()
    return None


def connect(
    url: str,
    *,
    socket_timeout_s: float = 10.0,
    password: str | None = None,
    username: str | None = None,
    client_name: str | None = None,
    retries: int = 3,
    wait_replicas: int = 0,
    wait_timeout_ms: int = 1000,
    sentinel_password: str | None = None,
    run: str | None = None,
) -> redis.Redis:
    """A bytes-returning client for url (a `redis+sentinel://` URL: the primary, found through Sentinel) with
    socket timeout above any BLOCK. retries > 0: redis-py retries transparently (publishers); retries=0:
    errors surface so a GroupReader can re-read its own pending. wait_replicas > 0: writes sent through
    `execute_replicated` count only once that many replicas acknowledged them within wait_timeout_ms.
    sentinel_password: the Sentinels' own (else from the file $ROLLSTREAM_SENTINEL_PASSWORD_FILE names).
    run: the run whose keys the client reaches; required for a `redis+cluster://` URL, whose client is pinned
    to the node serving that run's slot (rollstream/topology/cluster.py), ignored otherwise."""
    kwargs: dict[str, Any] = dict(
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(socket_timeout_s, 5.0),
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries=retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError] if retries else [],
        health_check_interval=30,
        decode_responses=False,
        # hiredis' packer copies every memoryview to bytes and packs at ~280 MB/s here; ours (like redis-py's
        # pure-Python one) hands large values and memoryviews to the socket unchanged.
        # Measured: 4 MB samples at 0.49 -> 0.86 of the raw baseline (docs/history/BENCHMARKS-codec.md).
        command_packer=RespPacker(),
    )
    counter = _ConnectCounter()
    kwargs["redis_connect_func"] = counter
    if password is not None:
        kwargs["password"] = password
    if username is None:
        username = os.environ.get(USERNAME_ENV)
    if username is not None:
        kwargs["username"] = username
    if client_name:
        kwargs["client_name"] = client_name
    if is_sentinel_url(url):
        if sentinel_password is None and os.environ.get(SENTINEL_PASSWORD_FILE_ENV):
            sentinel_password = Path(os.environ[SENTINEL_PASSWORD_FILE_ENV]).read_text().strip()
        client = sentinel_client(url, sentinel_password=sentinel_password, **kwargs)
    elif is_cluster_url(url):
        client = cluster_client(url, run, **kwargs)
    else:
        client = redis.Redis.from_url(url, **kwargs)
    client.connection_pool.rollstream_connects = counter  # type: ignore[attr-defined]
    if wait_replicas:
        if wait_timeout_ms >= socket_timeout_s * 1000:
            raise ValueError(
                f"wait_timeout_ms={wait_timeout_ms} must be below the socket timeout ({socket_timeout_s} s)"
            )
        set_acks(client, wait_replicas, wait_timeout_ms)
    return client


class _ConnectCounter:
    """redis_connect_func that runs the normal handshake and counts a pool's re-connections: a connection
    opened again after its socket was lost (a new connection of a growing pool is not one)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, conn: redis.connection.AbstractConnection) -> None:
        conn.on_connect()  # type: ignore[no-untyped-call]
        if getattr(conn, "rollstream_connected_before", False):
            self.count += 1
        conn.rollstream_connected_before = True  # type: ignore[attr-defined]


def can_fail_over(r: redis.Redis) -> bool:
    """True when r's server can be replaced by a failover that loses writes it acknowledged: r waits for
    replicas (WAIT), finds its primary through Sentinel or is pinned to a Redis Cluster slot (a single Redis,
    its AOF fsynced on every write, keeps every acknowledged write through a restart)."""
    from redis.sentinel import SentinelConnectionPool

    pool = r.connection_pool
    return acks_of(pool)[0] > 0 or isinstance(pool, SentinelConnectionPool) or is_cluster_client(r)


def reconnect_count(r: redis.Redis) -> int:
    """How many times this client's pool opened a connection again after losing its socket (a reply may
    have been lost with it); -1 when the client was not made by connect()."""
    counter = getattr(r.connection_pool, "rollstream_connects", None)
    return counter.count if counter is not None else -1


def wait_until_ready(r: redis.Redis, timeout_s: float = 60.0, stop: threading.Event | None = None) -> None:
    """Ping with backoff until Redis answers; raise ConnectionError after timeout_s (or once stop is set)."""
    try:
        retry_on_connection(r.ping, "ping", stop=stop, timeout_s=timeout_s)
    except CONNECTION_ERRORS as e:
        raise redis.ConnectionError(f"redis not reachable after {timeout_s:.0f}s: {e}") from e
