"""A Redis restart (SIGKILL, AOF, same port) is ridden out in place by every worker:
trainer, producer and aggregator keep their PIDs, go on to more records, exit 0 on SIGTERM, and the log
audits clean (nothing lost, nothing trained twice, records equal to replay)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import PRODUCERS

from consumers.aggregator.replay import replay_records
from rollstream.bus import iter_stream, setup_run
from rollstream.keys import Keys
from rollstream.ops.audit import audit_run
from schemas import decode

ROOT = Path(__file__).resolve().parent.parent
CONFIG = [
    "run.device=cpu",
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.max_seq_len=24",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "async_training.trigger_parameter_sync_step=2",
    "rollout.n=2",
    "rollout.num_producers=1",
    "rollout.prompts_per_dispatch=2",
    "rollout.stats_every_s=1",
    "data.max_response_length=5",
    "data.reverse.max_digits=3",
    "data.epoch_size=256",
    "data.val_size=4",
    "trainer.test_freq=0",
    "trainer.save_freq=2",
    "trainer.total_training_steps=1000",
    "bus.block_ms=200",
    "bus.socket_timeout_s=2",
]


def diff(a: Any, b: Any) -> str:
    """What differs between two records (metrics and source ids)."""
    if b is None:
        return "missing from the replay"
    keys = sorted(k for k in set(a.metrics) | set(b.metrics) if a.metrics.get(k) != b.metrics.get(k))
    pairs = [(k, a.metrics.get(k), b.metrics.get(k)) for k in keys]
    return f"metrics {pairs}, sources {a.source_ids} vs {b.source_ids}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A private redis-server with an AOF fsynced on every write, restartable on the same port."""

    def __init__(self, tmp: Path) -> None:
        self.dir, self.port = tmp / "redis", free_port()
        self.dir.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    srv.start()
    yield srv
    if srv.proc is not None and srv.proc.poll() is None:
        srv.proc.terminate()
        srv.proc.wait(10)


def xlen(url: str, stream: str) -> int:
    """XLEN through a fresh connection, riding out a restart."""
    try:
        return int(redis.Redis.from_url(url, socket_timeout=2).xlen(stream))
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
        return -1


def wait_records(
    url: str, keys: Keys, n: int, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while xlen(url, keys.records) < n:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited ({p.returncode}): {(ROOT / 'x').name}"
        assert time.monotonic() < deadline, f"fewer than {n} records after {timeout_s}s"
        time.sleep(0.2)


def test_redis_restart_every_worker_reconnects_in_place(server: Server, tmp_path: Path) -> None:
    keys = Keys("reconnect")
    setup_run(redis.Redis.from_url(server.url), keys, PRODUCERS)
    args = [
        "pipeline.yaml",
        *CONFIG,
        f"run.name={keys.run}",
        f"run.dir={tmp_path}",
        f"run.redis_url={server.url}",
    ]
    modules = {
        "aggregator": "consumers.aggregator",
        "trainer": "consumers.trainer",
        "rollout_00": "producers",
    }
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in modules}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {name: subprocess.Popen([sys.executable, "-m", mod, *args, "--name", name], cwd=ROOT, env=env,
                                    stdout=logs[name], stderr=subprocess.STDOUT)
             for name, mod in modules.items()}
    try:
        wait_records(server.url, keys, 2, procs, 120)
        pids = {name: p.pid for name, p in procs.items()}
        server.kill()
        time.sleep(1.5)  # every worker notices: reads time out, connections are refused
        server.start()
        before = xlen(server.url, keys.records)
        wait_records(server.url, keys, before + 3, procs, 120)
        assert {name: p.pid for name, p in procs.items()} == pids
        assert all(p.poll() is None for p in procs.values()), "a worker died instead of reconnecting"
    finally:
        for name in ("rollout_00", "trainer", "aggregator"):
            if procs[name].poll() is None:
                procs[name].send_signal(signal.SIGTERM)
            try:
                procs[name].wait(60)
            except subprocess.TimeoutExpired:
                procs[name].kill()
                procs[name].wait()
        for f in logs.values():
            f.close()
    texts = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in modules}
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exit {p.returncode}: {texts[name][-3000:]}"
        assert "Traceback" not in texts[name], texts[name][-3000:]
    r = redis.Redis.from_url(server.url)
    rep = audit_run(r, keys)
    assert rep.trained and not rep.lost and not rep.duplicated, rep.problems()
    assert rep.steps_consecutive and rep.records_consecutive, rep.problems()
    replay = Keys("reconnect-replay")
    replay_records(r, keys, replay)
    live, rebuilt = dict(iter_stream(r, keys.records)), dict(iter_stream(r, replay.records))
    assert live
    for i, fields in live.items():
        a, b = decode(fields), decode(rebuilt[i]) if i in rebuilt else None
        assert a == b, f"record {i} differs from the replay: {diff(a, b)}"
