"""A finished run stays readable: after `rollstream stop`, the commands of docs/OPERATIONS.md read
the run's log from its own files (a private read-only Redis over its AOF, plus the archive), change no byte of
it, leave nothing behind, and `rollstream run` on the same name still resumes the run."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis

from rollstream.ops.embedded_redis import EmbeddedRedis
from rollstream.ops.log_server import LogServerError, StoppedLogServer, _reader_manifest
from tests.test_cli_launch import TINY, WORKERS_MISSING, rollstream
from tests.test_ops_supervise import private_violations


def _digests(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of the run's AOF and archive."""
    files = [p for d in ("redis", "archive") for p in sorted((run_dir / d).rglob("*")) if p.is_file()]
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _temp_leftovers() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rollstream-log-*")}


def test_reader_manifest_appends_one_scratch_file_after_the_last_incremental() -> None:
    manifest = ("file appendonly.aof.3.base.rdb seq 3 type b\n"
                "file appendonly.aof.2.incr.aof seq 2 type h\n"
                "file appendonly.aof.4.incr.aof seq 4 type i\n"
                "file appendonly.aof.5.incr.aof seq 5 type i\n")
    files, text = _reader_manifest(manifest)
    assert files == ["appendonly.aof.3.base.rdb", "appendonly.aof.4.incr.aof", "appendonly.aof.5.incr.aof",
                     "appendonly.aof.6.incr.aof"]
    assert text.splitlines()[-1] == "file appendonly.aof.6.incr.aof seq 6 type i"
    assert "type h" not in text
    with pytest.raises(LogServerError, match="no base or incremental"):
        _reader_manifest("file x seq 1 type h\n")


def test_a_run_dir_without_an_aof_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(LogServerError, match="appendonly.aof.manifest not found"):
        StoppedLogServer(tmp_path)


@pytest.mark.skipif(WORKERS_MISSING, reason="worker packages not there yet")
def test_readme_inspection_commands_work_after_stop_and_change_nothing(tmp_path: Path) -> None:
    # retention on with a tiny budget, so part of the log is in the archive and part in Redis
    args = ["pipeline.yaml", *TINY, f"run.dir={tmp_path}", "run.name=done", "bus.redis_max_bytes=65536",
            "bus.trim_every_s=0.5"]
    run_dir = tmp_path / "done"
    try:
        started = rollstream("run", *args, "--wait-records", "4", "--wait-timeout", "200", timeout_s=260)
        assert started.returncode == 0, started.stdout + started.stderr
    finally:
        stopped = rollstream("stop", *args, timeout_s=200)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not (run_dir / "redis.sock").exists()
    before, temp_before = _digests(run_dir), _temp_leftovers()
    assert any(k.startswith("archive/") for k in before), (
        "the tiny budget should have archived part of the log"
    )

    audit = rollstream("audit", "--run-dir", str(run_dir), timeout_s=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "is stopped: reading its log" in audit.stderr
    record = rollstream("inspect", "records", "2", *args, timeout_s=120)
    assert record.returncode == 0, record.stderr
    assert json.loads(record.stdout)["event"]["global_step"] == 2
    sample = rollstream("inspect", "rollouts:rollout_00", "-1", *args, timeout_s=120)
    assert sample.returncode == 0 and '"sample_id"' in sample.stdout, sample.stderr
    # piped into a reader that is gone before it writes (`… | head` once head has its lines): a quiet exit 0,
    # not "redis not reachable"
    cli = shlex.join([sys.executable, "-m", "rollstream.cli", "inspect", "rollouts:rollout_00", "-1", *args])
    piped = subprocess.run(["bash", "-c", f"set -o pipefail; {cli} | true"], capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert piped.returncode == 0 and "not reachable" not in piped.stderr, piped.stderr
    # nothing more can come: it returns
    tail = rollstream("tail", "metrics", *args, "--count", "3", timeout_s=120)
    assert tail.returncode == 0 and len(tail.stdout.strip().splitlines()) == 3, tail.stdout + tail.stderr
    status = rollstream("status", *args, timeout_s=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "rollouts" in status.stdout and "archived" in status.stdout
    plot = rollstream("plot", *args, "--out", str(tmp_path / "reward.png"), timeout_s=120)
    assert plot.returncode == 0 and (tmp_path / "reward.png").stat().st_size > 0, plot.stderr
    replayed = rollstream(
        "replay", "records", "--from", "done", "--to", "done-replay", "--run-dir", str(run_dir), timeout_s=120
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    copied = rollstream("replay", "trainer", "--from", "done", "--to", "done-dbg", "--steps", "1-2", *args,
                        timeout_s=120)
    assert copied.returncode == 0, copied.stdout + copied.stderr
    assert "rollstream serve --write --run-dir" in copied.stdout

    assert _digests(run_dir) == before  # reading never modifies the run's AOF or archive
    assert _temp_leftovers() == temp_before
    # the replay's records are a run of their own, read the same way; equal to the live ones
    live = json.loads(rollstream("inspect", "records", "3", *args, timeout_s=120).stdout)
    again = rollstream("inspect", "records", "3", "--run-dir", str(tmp_path / "done-replay"), timeout_s=120)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["event"]["metrics"] == live["event"]["metrics"]
    # the trainer replay's copy is served writable to the printed command
    served = rollstream(
        "serve",
        "--write",
        "--run-dir",
        str(tmp_path / "done-dbg"),
        "--",
        sys.executable,
        "-c",
        "import os, redis; r = redis.Redis.from_url(os.environ['ROLLSTREAM_REDIS_URL']);"
        "print(sum(r.xlen(f'rs:{{done-dbg}}:rollouts:rollout_0{i}') for i in (0, 1)))",
        timeout_s=120,
    )
    assert served.returncode == 0 and int(served.stdout.strip()) == 8, served.stdout + served.stderr
    for made in ("done-replay", "done-dbg"):  # issue 41: what the replays and serve created is private too
        assert private_violations(tmp_path / made) == []

    try:  # the stopped run resumes under its own name
        resumed = rollstream("run", *args, "--wait-records", "6", "--wait-timeout", "200", timeout_s=260)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    finally:
        stopped = rollstream("stop", *args, timeout_s=200)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    audit = rollstream("audit", "--run-dir", str(run_dir), timeout_s=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_an_embedded_redis_writes_private_files_whatever_the_umask(tmp_path: Path) -> None:
    """Issue 41: a replay's run folder had its AOF files and redis.log at 0644 and appendonlydir at 0755
    (only the 0700 parent kept them private). Every file of a redis-server a command starts is 0600, every
    folder 0700, under a permissive umask too."""
    old = os.umask(0o022)
    try:
        with EmbeddedRedis(tmp_path / "replayed") as srv:
            redis.Redis.from_url(srv.url).set("k", "v")
    finally:
        os.umask(old)
    assert any((tmp_path / "replayed").rglob("*.aof")) and (tmp_path / "replayed" / "redis.log").is_file()
    assert private_violations(tmp_path / "replayed") == []


def test_serve_refuses_a_run_whose_redis_answers(tmp_path: Path, redis_url: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollstream.cli",
            "serve",
            "pipeline.yaml",
            f"run.dir={tmp_path}",
            f"run.redis_url={redis_url}",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3 and "serve is for a stopped run" in done.stderr
