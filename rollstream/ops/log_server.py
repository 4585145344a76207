"""Serve a stopped run's log from its own files, for the duration of one operator command.

A run with the embedded Redis keeps its whole log on disk after `rollstream stop`: the AOF in
`<run_dir>/redis/appendonlydir` (the hot window) and the archive (the rest). `serve_stopped_log` brings a
private redis-server up on that AOF, the command reads through it, and the server stops after:

- the private server lives in a fresh 0700 temp folder (unix socket 0700 inside it) that is removed after;
- the AOF is never written: the temp folder holds symlinks to the run's AOF files, a copy of the manifest
  with one extra, empty incremental file at the end, and redis appends only to that last file (with AOF
  rewrites off), so whatever the server writes (expired keys' deletions) lands in the temp folder;
- the reader connects as a `reader` ACL user that may run no write command and holds only read
  permission on keys (`%R~*`); the default user stays off with every permission, because redis 7.0
  replays the AOF's MULTI/EXEC blocks with the default user's rights.

The run's own `rollstream run` later resumes from the AOF, which the reader never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import redis

from rollstream.bus import CONNECTION_ERRORS
from rollstream.config import config_to_yaml
from rollstream.ops.embedded_redis import EmbeddedRedis, redis_server_binary, wait_for_redis
from rollstream.ops.plan import private_dir, write_private
from rollstream.ops.run_target import REDIS_URL_FILE, RESOLVED_CONFIG, SECRETS_DIR, RunTarget
from rollstream.runtime.files import PRIVATE_UMASK
from rollstream.topology.replicated import PRIMARY_DATA_FILE

#: AOF folder and manifest names of redis 7's multi-part AOF (redis' defaults, which the run uses).
AOF_DIR = "appendonlydir"
AOF_MANIFEST = "appendonly.aof.manifest"
#: ACL user of the private server: reads only.
READER_USER = "reader"


class LogServerError(RuntimeError):
    """The stopped run's log cannot be served (no AOF on disk, or the server did not come up)."""


def aof_dir(run_dir: Path) -> Path:
    """The run's AOF folder (embedded Redis): node 0's, or with replicas the one of the node that was the
    primary when the run was stopped (`rollstream stop` records it)."""
    recorded = run_dir / PRIMARY_DATA_FILE
    if recorded.is_file():
        return Path(recorded.read_text().strip()) / AOF_DIR
    return run_dir / "redis" / AOF_DIR


def _reader_manifest(manifest: str) -> tuple[list[str], str]:
    """(file names the reader's AOF folder links to, its manifest text): the base and incremental files
    of `manifest` in order, plus one new empty incremental file that receives every write."""
    files, lines, last_seq = [], [], 0
    for line in manifest.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[0] != "file":
            continue
        info = dict(zip(parts[::2], parts[1::2], strict=False))
        if info.get("type") not in ("b", "i"):
            continue  # history files are already folded into a newer base
        files.append(info["file"])
        lines.append(line)
        if info["type"] == "i":
            last_seq = max(last_seq, int(info["seq"]))
    if not files:
        raise LogServerError("the AOF manifest lists no base or incremental file")
    scratch = f"appendonly.aof.{last_seq + 1}.incr.aof"
    lines.append(f"file {scratch} seq {last_seq + 1} type i")
    return [*files, scratch], "\n".join(lines) + "\n"


class StoppedLogServer:
    """A private, read-only redis-server over a stopped run's AOF (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        """Plan the server for run_dir (nothing starts yet); LogServerError when it has no AOF."""
        self.source = aof_dir(Path(run_dir).resolve())
        if not (self.source / AOF_MANIFEST).is_file():
            raise LogServerError(
                f"{self.source / AOF_MANIFEST} not found: the run's log was never written here"
            )
        self.tmp: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.password = secrets.token_hex(16)
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> str:
        """Link the AOF into a temp folder, start redis-server on it, wait until the log is loaded; the
        URL."""
        self.tmp = Path(tempfile.mkdtemp(prefix="rollstream-log-"))  # 0700
        files, manifest = _reader_manifest((self.source / AOF_MANIFEST).read_text())
        linked = self.tmp / AOF_DIR
        linked.mkdir(mode=0o700)
        for name in files[:-1]:
            (linked / name).symlink_to(self.source / name)
        (linked / files[-1]).touch(mode=0o600)
        (linked / AOF_MANIFEST).write_text(manifest)
        acl = self.tmp / "users.acl"
        acl.write_text(f"user default off resetpass +@all ~*\n"
                       f"user {READER_USER} on >{self.password} +@all -@write %R~*\n")
        acl.chmod(0o600)
        sock = self.tmp / "redis.sock"
        argv = [redis_server_binary(), "--appendonly", "yes", "--appendfsync", "no",
                "--auto-aof-rewrite-percentage", "0", "--dir", str(self.tmp), "--save", "",
                "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                "--aclfile", str(acl), "--logfile", str(self.tmp / "redis.log")]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, umask=PRIVATE_UMASK
        )
        self.url = f"unix://{sock}?db=0"
        try:
            wait_for_redis(f"unix://{READER_USER}:{self.password}@{sock}?db=0", timeout_s)
        except RuntimeError as e:
            log = (
                (self.tmp / "redis.log").read_text(errors="replace")[-500:]
                if (self.tmp / "redis.log").is_file()
                else ""
            )
            self.stop()
            raise LogServerError(
                f"the run's log could not be loaded: {e}; redis said: {log.strip()}"
            ) from None
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove the temp folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def run_is_down(target: RunTarget) -> bool:
    """True when the run uses the embedded Redis, its socket does not answer, and its AOF is on disk."""
    if target.cfg.run.redis_url is not None or not (aof_dir(target.run_dir) / AOF_MANIFEST).is_file():
        return False
    try:
        r = target.connect(retries=0)
        try:
            r.ping()
        finally:
            r.close()
    except CONNECTION_ERRORS:
        return True
    return False


@contextlib.contextmanager
def serve_stopped_log(target: RunTarget) -> Iterator[RunTarget]:
    """The target unchanged while its Redis answers; for a stopped embedded run, a target pointed at a
    private read-only server over its own AOF, stopped (and its temp folder removed) on exit."""
    if not run_is_down(target):
        yield target
        return
    server = StoppedLogServer(target.run_dir)
    try:
        url = server.start()
        yield dataclasses.replace(target, redis_url=url, login=(READER_USER, server.password), served=True)
    finally:
        server.stop()


def _writable_server(run_dir: Path) -> EmbeddedRedis:
    """An embedded redis-server writing its own AOF in run_dir (created 0700): a replay's new run."""
    private_dir(run_dir)
    server = EmbeddedRedis(run_dir)
    acl = run_dir / SECRETS_DIR / "users.acl"
    if acl.is_file():
        server.argv += ["--aclfile", str(acl)]
    return server


@contextlib.contextmanager
def replay_destination(target: RunTarget, dst_run: str) -> Iterator[redis.Redis]:
    """Where a replay from `target` writes run `dst_run`: the run's own Redis while it answers; for a
    stopped run (served read-only), the new run's own embedded Redis in <run.dir>/<dst_run> (its AOF
    keeps the copy; the folder gets the resolved config and redis.url, so every operator command reads it
    like any stopped run, and `rollstream serve --write` serves it to a replayed trainer)."""
    if not target.served:
        r = target.connect()
        try:
            yield r
        finally:
            r.close()
        return
    cfg = target.cfg.model_copy(deep=True)
    cfg.run.name = dst_run
    run_dir = cfg.run_dir().resolve()
    server = _writable_server(run_dir)
    write_private(run_dir / RESOLVED_CONFIG, config_to_yaml(cfg))
    write_private(run_dir / REDIS_URL_FILE, server.url + "\n")
    r = server.start()
    try:
        yield r
    finally:
        r.close()
        server.stop()


@contextlib.contextmanager
def serve_run(target: RunTarget, write: bool = False) -> Iterator[RunTarget]:
    """A stopped embedded run's Redis for as long as the block lasts: read-only over its AOF, or with
    `write` its own embedded server (writes persist in its AOF: a replay copy a trainer retrains on).
    LogServerError when the run's Redis still answers or it has no AOF."""
    if not run_is_down(target):
        raise LogServerError(
            f"run {target.keys.run}: its Redis answers at {target.redis_url} (or it has no AOF "
            f"in {aof_dir(target.run_dir)}); serve is for a stopped run with the embedded Redis"
        )
    if not write:
        with serve_stopped_log(target) as served:
            yield served
        return
    server = _writable_server(target.run_dir)
    server.start().close()
    try:
        yield dataclasses.replace(target, redis_url=server.url, login=None, served=True)
    finally:
        server.stop()
