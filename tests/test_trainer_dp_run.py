"""A data-parallel trainer in a real `rollstream run` (supervisord, embedded redis, ACL users, torchrun with
2 gloo ranks on CPU):

- the demo runs end to end with `trainer.nproc_per_node=2` and `rollstream stop` ends every program with
  exit 0; each rank consumed as `trainer-r<k>`, emitted its own local updates of half a mini-batch, the
  records say `trainer/world_size` 2, `rollstream status` shows both ranks, and the audit holds;
- SIGKILL of one of the two ranks at seeded random moments, 3 times: torchrun restarts the group, every
  rank resumes from the last checkpoint, and the audit still shows every published sample_id trained,
  dropped or dead-lettered exactly once (or still pending), steps and records 1..N.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import P0

from rollstream.bus import iter_stream
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.ops.audit import audit_run, format_report
from rollstream.ops.embedded_redis import EmbeddedRedis
from rollstream.ops.run_target import open_run
from rollstream.ops.supervise import rpc
from schemas import StepMetrics, SyncStepRecord, decode

SEED = int(os.environ.get("ROLLSTREAM_FAULT_SEED", "7"))
TINY = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=2", "rollout.num_producers=2", "rollout.prompts_per_dispatch=2", "rollout.stats_every_s=1",
    "model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=24",
    "data.max_response_length=5", "data.reverse.max_digits=3", "data.epoch_size=256", "data.val_size=4",
    "trainer.test_freq=3", "trainer.save_freq=2", "trainer.total_training_steps=1000", "run.device=cpu",
    "bus.block_ms=200", "bus.claim_idle_s=5", "trainer.nproc_per_node=2", "trainer.max_restarts=10",
]
KILLS = 3


def rollstream(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s)


def _records(target: Any) -> int:
    r = target.connect(retries=0)
    try:
        return int(r.xlen(target.keys.records))
    finally:
        r.close()


def _wait_records(target: Any, count: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := _records(target)) < count:
        assert time.monotonic() < deadline, f"only {n} of {count} records after {timeout_s}s"
        time.sleep(0.2)
    return n


def _ranks(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the trainer's rank processes (torchrun's children)."""
    info = rpc(run_dir).supervisor.getProcessInfo("trainer")
    parent = int(info["pid"])
    out: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = dict(e.split("=", 1) for e in (proc / "environ").read_text().split("\0") if "=" in e)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(proc.name)
    return out


def _wait_ranks(run_dir: Path, avoid: set[int], timeout_s: float = 90) -> dict[int, int]:
    """Both ranks running, none of them a pid in `avoid` (the group was restarted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = _ranks(run_dir)
        if len(ranks) == 2 and not set(ranks.values()) & avoid:
            return ranks
        assert time.monotonic() < deadline, f"ranks {ranks} not restarted within {timeout_s}s"
        time.sleep(0.2)


def _audit(run_dir: Path, name: str) -> tuple[Any, list[StepMetrics], list[SyncStepRecord], list[str]]:
    """The run's redis restarted from its AOF: audit report, metrics events, records, trainer consumers."""
    with EmbeddedRedis(run_dir) as srv:
        r = redis.Redis.from_url(srv.url)
        keys = Keys(name)
        rep = audit_run(r, keys)
        events = [ev for _, f in iter_stream(r, keys.metrics) if isinstance(ev := decode(f), StepMetrics)]
        records = [ev for _, f in iter_stream(r, keys.records) if isinstance(ev := decode(f), SyncStepRecord)]
        consumers = sorted(c["name"].decode() for c in r.xinfo_consumers(keys.rollouts_of(P0), TRAINER_GROUP))  # type: ignore[union-attr]
        r.close()
    return rep, events, records, consumers


def _stop_clean(args: list[str]) -> str:
    stopped = rollstream("stop", *args, timeout_s=200)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    for name in ("rollout_00", "rollout_01", "trainer", "aggregator", "redis"):
        assert f"{name:<12} exit 0" in stopped.stdout, stopped.stdout
    return stopped.stdout


def test_two_rank_trainer_runs_the_demo_and_stops_cleanly(tmp_path: Path) -> None:
    args = ["pipeline.yaml", *TINY, f"run.dir={tmp_path}", "run.name=dp2"]
    run_dir = tmp_path / "dp2"
    temp = tmp_path / "tmp"  # the run's temp dir: nothing may be left in it after a clean stop
    temp.mkdir()
    try:
        started = subprocess.run([sys.executable, "-m", "rollstream.cli", "run", *args, "--wait-records", "5",
                                  "--wait-timeout", "150"], capture_output=True, text=True, timeout=200,
                                 env={**os.environ, "TMPDIR": str(temp)})
        assert started.returncode == 0, started.stdout + started.stderr
        status = rollstream("status", "--run-dir", str(run_dir), timeout_s=60)
        assert status.returncode == 0, status.stderr
        assert "trainer-r0 heartbeat" in status.stdout and "trainer-r1 heartbeat" in status.stdout, (
            status.stdout
        )
        assert "trainer consumers: trainer-r0 pending" in status.stdout, status.stdout
        assert sorted(_ranks(run_dir)) == [0, 1]
    finally:
        _stop_clean(args)
    # torchrun's torchelastic_*, torch's torchinductor_* stayed in the run dir
    assert list(temp.iterdir()) == []
    assert not (run_dir / "tmp").exists()  # and went with a clean stop
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "trainer-r0" in log and "trainer-r1" in log and "Traceback" not in log
    rep, events, records, consumers = _audit(run_dir, "dp2")
    assert rep.problems() == [], format_report(rep)
    assert consumers == ["trainer-r0", "trainer-r1"]
    updates = [e for e in events if e.type == "local_update"]
    assert {e.rank for e in updates} == {0, 1} and {e.sample_count for e in updates} == {1}  # 2 / 2 ranks
    ends = [e for e in events if e.type == "step_end"]
    assert ends and all(
        e.world_size == 2 and e.sample_count + e.metrics["fully_async/count/dropped_samples"] >= 4
        for e in ends
    )
    trained = [r for r in records if r.global_step > 0]
    assert trained and all(r.metrics["trainer/world_size"] == 2 and r.num_local_updates == 2 for r in trained)


def test_killing_one_of_two_ranks_loses_and_repeats_nothing(tmp_path: Path) -> None:
    args = ["pipeline.yaml", *TINY, f"run.dir={tmp_path}", "run.name=dpkill"]
    run_dir = tmp_path / "dpkill"
    rng = random.Random(SEED)
    victims = [0, 1, *(rng.choice([0, 1]) for _ in range(KILLS - 2))]  # each rank at least once
    rng.shuffle(victims)
    try:
        started = rollstream("run", *args, "--wait-records", "3", "--wait-timeout", "150", timeout_s=200)
        assert started.returncode == 0, started.stdout + started.stderr
        target = open_run(None, run_dir=str(run_dir))
        ranks = _wait_ranks(run_dir, set())
        for victim in victims:
            _wait_records(target, _records(target) + 1, timeout_s=120)  # training again since the last kill
            time.sleep(rng.uniform(0.1, 1.5))  # a random point of a step
            os.kill(ranks[victim], signal.SIGKILL)
            ranks = _wait_ranks(run_dir, set(ranks.values()))
        _wait_records(target, _records(target) + 3, timeout_s=120)
    finally:
        _stop_clean(args)
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert log.count("resumed from checkpoint") >= 2 * KILLS, "every rank of every restarted group resumes"
    rep, events, _, _ = _audit(run_dir, "dpkill")
    print(f"\nranks killed: {victims}\n{format_report(rep)}")
    assert rep.problems() == [], format_report(rep)
    assert rep.trained and len(rep.steps) >= 4, rep.steps
    assert {e.rank for e in events if e.type == "local_update"} == {0, 1}


@pytest.fixture(autouse=True)
def _no_leftover_supervisord(tmp_path: Path) -> Any:
    yield
    for pid_file in tmp_path.glob("*/supervisord.pid"):  # a failed stop: do not leave a supervisord behind
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
