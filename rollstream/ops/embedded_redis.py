"""The run's own redis-server (when run.redis_url is null): AOF on, data in <run_dir>/redis, reached over a
unix socket in the run dir (or a free loopback port when the socket path is too long).

The AOF fsync policy is the caller's: `rollstream run` asks for `always` (ops/plan.py: a redis killed
with SIGKILL loses nothing it acknowledged); `EmbeddedRedis` (tests, scripts) keeps redis' `everysec`."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollstream.runtime.files import PRIVATE_UMASK, private_dir

log = logging.getLogger(__name__)

#: Longest unix socket path the kernel accepts (sun_path is 108 bytes with the NUL).
MAX_UNIX_SOCKET_PATH = 100


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    """Path of redis-server; RuntimeError with a hint when it is not installed."""
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("redis-server not found on PATH (install redis, or set run.redis_url)")
    return found


#: Share of the host's physical memory an embedded Redis may use (its maxmemory never exceeds it).
HOST_MEMORY_SHARE = 0.5


def host_memory_bytes() -> int | None:
    """The host's physical memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def fit_to_host(maxmemory: int | None, host_bytes: int | None = None) -> int | None:
    """The embedded Redis' maxmemory: `maxmemory` (the config's, from the retention budget) capped at
    HOST_MEMORY_SHARE of the host's memory, and that share where the config sets none (retention off, weight
    chunks in Redis), so a flood ends in refused writes before it takes the host's memory. `host_bytes`:
    the host's memory (default: read from the OS; None there leaves `maxmemory` as it is)."""
    host = host_memory_bytes() if host_bytes is None else host_bytes
    if host is None:
        return maxmemory
    share = int(host * HOST_MEMORY_SHARE)
    if maxmemory is not None and maxmemory > share:
        log.warning("maxmemory %d bytes is over %.0f%% of this host's %d bytes: %d", maxmemory,
                    HOST_MEMORY_SHARE * 100, host, share)
    return share if maxmemory is None else min(maxmemory, share)


def plan_embedded(
    run_dir: Path, appendfsync: str = "everysec", maxmemory: int | None = None
) -> tuple[list[str], str]:
    """(redis-server argv, URL clients use) for a run dir, fsyncing the AOF per `appendfsync` (always,
    everysec or no), with `maxmemory` bytes and policy noeviction when given; creates <run_dir>/redis for the
    AOF files."""
    run_dir = run_dir.resolve()
    data_dir = run_dir / "redis"
    private_dir(data_dir)
    argv = [
        redis_server_binary(),
        "--appendonly", "yes",
        "--appendfsync", appendfsync,
        "--dir", str(data_dir),
        "--save", "",
        "--protected-mode", "yes",
    ]
    if maxmemory is not None:
        if maxmemory <= 0:
            raise ValueError(f"maxmemory={maxmemory!r} must be > 0 bytes (or None for none)")
        argv += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "noeviction"]
    sock = run_dir / "redis.sock"
    if len(str(sock)) <= MAX_UNIX_SOCKET_PATH:
        argv += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
        return argv, f"unix://{sock}?db=0"
    port = free_port()
    argv += ["--port", str(port), "--bind", "127.0.0.1"]
    return argv, f"redis://127.0.0.1:{port}/0"


def no_retry() -> Retry:
    """The retry policy of a client whose caller polls by itself: none. redis-py (6 and later) retries a
    refused connection, or an AUTH error, 3 times with a backoff of 1 s and more by default, so one PING of a
    server still starting took 2-5 s, where the caller meant to poll every 50 ms."""
    return Retry(NoBackoff(), 0)


def wait_for_redis(url: str, timeout_s: float = 30.0) -> redis.Redis:
    """Ping url until it answers (RuntimeError after timeout_s); returns a client (redis-py's default
    retries: the pings themselves have none, see no_retry)."""
    deadline = time.monotonic() + timeout_s
    probe = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=1, retry=no_retry())
    while True:
        try:
            probe.ping()
            probe.close()
            return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=1)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, FileNotFoundError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis at {url} did not answer within {timeout_s:.0f}s: {e}") from e
            time.sleep(0.05)


class EmbeddedRedis:
    """A redis-server child process for a run dir, outside supervisord (tests, scripts, replay)."""

    def __init__(self, run_dir: Path) -> None:
        """Plan the server for run_dir (nothing starts yet)."""
        self.run_dir = Path(run_dir)
        self.argv, self.url = plan_embedded(self.run_dir)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> redis.Redis:
        """Start redis-server, wait until it answers, return a client."""
        # private like the run folder (a replay's run, a test's): the log 0600, and redis-server's AOF files
        # and appendonlydir under umask 077 (0600 / 0700), whatever the caller's umask
        path = self.run_dir / "redis.log"
        log = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        path.chmod(0o600)
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, umask=PRIVATE_UMASK)
        log.close()
        try:
            return wait_for_redis(self.url, timeout_s)
        except RuntimeError:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (redis flushes the AOF and exits 0), then wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        """Start on entering a with block."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop on leaving it."""
        self.stop()
