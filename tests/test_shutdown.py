"""Graceful shutdown of each worker as a subprocess: the first SIGTERM finishes the current unit of work
and exits 0 (well within supervisord's stopwaitsecs); a second SIGTERM exits at once with EXIT_FORCED (3)
and leaves unfinished work unacked / unpublished; a SIGTERM that arrives while torch is still importing
is honoured (exit 0), not fatal (-15).

The trainer's and the aggregator's units of work (a tiny model's local update, one metrics batch) are
too short to land a second signal inside them reliably: they exit 0 within milliseconds of the first, and a
signal that arrives during interpreter teardown meets the default handler (-15). Their mid-work
second-signal path is the same WorkerContext handler as the producer's (tested mid-dispatch); the trainer's
second signal is also tested while it is still importing torch (the early handler)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from conftest import P0, PRODUCERS

from consumers.trainer.leaser import Leaser
from rollstream.bus import setup_run
from rollstream.config import load_config
from rollstream.keys import AGGREGATOR_GROUP, COMMITTED_STEP_FIELD, TRAINER_GROUP, TRAINING_STEP_FIELD, Keys
from rollstream.model import build_policy
from rollstream.ops.audit import audit_run
from rollstream.ops.plan import LATENCY_PRODUCER_MODULE, WORKER_STOPWAIT_S
from rollstream.pacing.budget import grant_budget
from rollstream.pacing.counters import dispatch_entries, rollout_counts
from rollstream.runtime.process import EXIT_FORCED, EXIT_OK, freeze_startup_heap
from rollstream.testing import fakes
from rollstream.testing.fakes import leased_fakes
from rollstream.weights.store import publish_weights
from schemas import StepMetrics, decode, encode
from schemas.text_entries import LEASE

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32"]
# a latency-model producer (the producer with a modelled decode injected, as `rollstream run` starts it for
# this config): one modelled dispatch = 1 prompt x 2 trajectories of 6 tokens at 2 tokens/s: ~3 s of
# "generation"
SLOW_PRODUCER = ["rollout.n=2", "rollout.num_producers=1", "data.max_response_length=6",
                 "bench.latency_model.enable=true", "bench.latency_model.tokens_per_s=2",
                 "bench.latency_model.length_median=6", "bench.latency_model.length_sigma=0"]


def common(keys: Keys, redis_url: str, tmp: Path) -> list[str]:
    return [f"run.name={keys.run}", f"run.redis_url={redis_url}", f"run.dir={tmp}", "run.device=cpu", *MODEL,
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            "async_training.trigger_parameter_sync_step=2",
            "trainer.test_freq=0", "data.val_size=4", "data.epoch_size=32", "bus.block_ms=200"]


class Worker(subprocess.Popen[bytes]):
    """A worker subprocess whose stderr goes to a file (read by the assertions)."""

    log: Path

    def stderr_text(self) -> str:
        return self.log.read_text(errors="replace")


def spawn(module: str, args: list[str], tmp: Path) -> Worker:
    log = tmp / f"{module}.{time.monotonic_ns()}.log"
    with log.open("wb") as f:
        proc = Worker([sys.executable, "-m", module, "pipeline.yaml", *args], cwd=ROOT,
                      stdout=subprocess.DEVNULL, stderr=f)
    proc.log = log
    return proc


def wait_until(cond: Callable[[], Any], proc: Worker, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, (
            f"exited early ({proc.returncode}) waiting for {what}: {proc.stderr_text()[-2000:]}"
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


FIRST_SIGNAL_SEEN = "finishing current work"


def terminate(proc: Worker, times: int) -> tuple[int, float]:
    """SIGTERM, and for times=2 a second one once the worker logged the first (signals sent back to back
    can merge into one); returns (exit code, seconds from the last signal until exit)."""
    proc.send_signal(signal.SIGTERM)
    if times == 2:
        wait_until(
            lambda: FIRST_SIGNAL_SEEN in proc.stderr_text(), proc, 10, "the first signal to be handled"
        )
        proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        code = proc.wait(WORKER_STOPWAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, time.monotonic() - t0


def torch_loading(pid: int) -> bool:
    """True once the process has mapped a torch shared library (it is importing torch)."""
    try:
        return "torch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# -- producer ---------------------------------------------------------------------------------------


def _start_run_for_producer(r: redis.Redis, keys: Keys, tmp: Path, args: list[str]) -> None:
    setup_run(r, keys, PRODUCERS)
    cfg = load_config("pipeline.yaml", args)
    publish_weights(r, keys, 0, build_policy(cfg).state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    grant_budget(r, keys, 0, cfg.max_outstanding)


def _taken(r: redis.Redis, keys: Keys) -> int:
    """Prompts leased to the producer so far."""
    return sum(e.amount for e in dispatch_entries(r, keys) if e.op == LEASE)


def _dispatching(r: redis.Redis, keys: Keys) -> bool:
    """The producer was leased prompts, and has had the time to begin generating them (a dispatch of
    SLOW_PRODUCER takes ~3 s; it reads its lease every 0.02 s)."""
    if _taken(r, keys) == 0:
        return False
    time.sleep(0.2)
    return True


def _in_flight(r: redis.Redis, keys: Keys) -> int:
    return rollout_counts(r, keys, ["rollout_00"]).in_flight


def test_producer_first_sigterm_publishes_the_dispatch_in_flight(r: redis.Redis, keys: Keys, redis_url: str,
                                                                 tmp_path: Path, leasing: Leaser) -> None:
    args = [*common(keys, redis_url, tmp_path), *SLOW_PRODUCER]
    _start_run_for_producer(r, keys, tmp_path, args)
    proc = spawn(LATENCY_PRODUCER_MODULE, [*args, "--name", "rollout_00"], tmp_path)
    wait_until(lambda: _dispatching(r, keys), proc, 60, "a dispatch")
    code, took = terminate(proc, 1)
    assert code == EXIT_OK, proc.stderr_text()[-2000:]
    assert took < WORKER_STOPWAIT_S
    # the dispatch in flight was finished and published
    assert r.xlen(keys.rollouts_of(P0)) == _taken(r, keys)
    assert _in_flight(r, keys) == 0


def test_producer_second_sigterm_exits_at_once_without_publishing(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, leasing: Leaser
) -> None:
    args = [*common(keys, redis_url, tmp_path), *SLOW_PRODUCER]
    _start_run_for_producer(r, keys, tmp_path, args)
    proc = spawn(LATENCY_PRODUCER_MODULE, [*args, "--name", "rollout_00"], tmp_path)
    wait_until(lambda: _dispatching(r, keys), proc, 60, "a dispatch")
    code, took = terminate(proc, 2)
    assert code == EXIT_FORCED and took < 1.0
    assert r.xlen(keys.rollouts_of(P0)) < _taken(r, keys)  # the unfinished dispatch was not published …
    assert _in_flight(r, keys) > 0  # … and is dispatched again on restart (its lease is kept)


def test_producer_sigterm_while_importing_torch_exits_0(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    proc = spawn("producers", [*common(keys, redis_url, tmp_path), "--name", "rollout_00"], tmp_path)
    wait_until(lambda: torch_loading(proc.pid), proc, 30, "torch to start loading")
    code, _ = terminate(proc, 1)
    assert code == EXIT_OK, proc.stderr_text()[-2000:]


# -- trainer ----------------------------------------------------------------------------------------


def _trainer_mid_step(r: redis.Redis, keys: Keys, redis_url: str, tmp: Path) -> Worker:
    """A trainer that ran step 1's first local update and now waits for the rest of the step."""
    proc = spawn(
        "consumers.trainer", [*common(keys, redis_url, tmp), "bus.block_ms=2000", "--name", "trainer"], tmp
    )
    wait_until(lambda: r.exists(keys.params), proc, 60, "version 0")
    for sample in leased_fakes(r, keys, 2, param_version=0, n=2, prompt_len=4, response_len=4):
        r.xadd(keys.rollouts_of(P0), encode(sample))  # type: ignore[arg-type]

    def updated() -> bool:
        return any(
            isinstance(ev := decode(f), StepMetrics) and ev.type == "local_update"
            for _, f in r.xrange(keys.metrics)
        )

    wait_until(updated, proc, 60, "the first local update")
    return proc


def test_trainer_first_sigterm_mid_step_exits_0_and_acks_nothing_unfinished(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    proc = _trainer_mid_step(r, keys, redis_url, tmp_path)
    code, took = terminate(proc, 1)
    assert code == EXIT_OK, proc.stderr_text()[-2000:]
    assert took < 10
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) is None
    # nothing ended or lost: both samples stay pending, retrained by the next trainer
    rep = audit_run(r, keys)
    assert rep.problems() == [] and rep.pending == {f"{P0}-0", f"{P0}-1"}
    assert not rep.trained | rep.dropped | rep.dead
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 2


def test_trainer_second_sigterm_while_starting_exits_forced(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    proc = spawn("consumers.trainer", [*common(keys, redis_url, tmp_path), "--name", "trainer"], tmp_path)
    wait_until(lambda: torch_loading(proc.pid), proc, 30, "torch to start loading")
    proc.send_signal(signal.SIGTERM)
    wait_until(
        lambda: "while starting" in proc.stderr_text() or FIRST_SIGNAL_SEEN in proc.stderr_text(),
        proc,
        10,
        # torch is still importing: the second lands before any work
        "the first signal to be recorded",
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == EXIT_FORCED
    assert not r.exists(keys.params)  # it never got as far as publishing version 0


def test_trainer_sigterm_while_importing_torch_exits_0(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    proc = spawn("consumers.trainer", [*common(keys, redis_url, tmp_path), "--name", "trainer"], tmp_path)
    wait_until(lambda: torch_loading(proc.pid), proc, 30, "torch to start loading")
    code, _ = terminate(proc, 1)
    assert code == EXIT_OK, proc.stderr_text()[-2000:]


# -- aggregator -------------------------------------------------------------------------------------


def _aggregator_with_open_step(r: redis.Redis, keys: Keys, redis_url: str, tmp: Path) -> Worker:
    """An aggregator that wrote step 1's record and holds step 2's first local update pending."""
    setup_run(r, keys, PRODUCERS)
    # the aggregator checks events against it
    r.hset(keys.trainer, mapping={COMMITTED_STEP_FIELD: 1, TRAINING_STEP_FIELD: 2})
    proc = spawn(
        "consumers.aggregator",
        [
            *common(keys, redis_url, tmp),
            "aggregator.jsonl=false",
            "aggregator.tensorboard=false",
            "bus.block_ms=2000",
            "--name",
            "aggregator",
        ],
        tmp,
    )
    for ev in (
        fakes.local_update(1, 1, 2, {"a": 1.0}),
        fakes.local_update(1, 2, 2, {"a": 3.0}),
        fakes.step_end(1, 2),
        fakes.local_update(2, 1, 2, {"a": 5.0}),
    ):
        r.xadd(keys.metrics, encode(ev))  # type: ignore[arg-type]
    wait_until(lambda: r.xlen(keys.records) == 1, proc, 30, "the record of step 1")
    wait_until(lambda: r.xpending(keys.metrics, AGGREGATOR_GROUP)["pending"] == 1, proc, 10, "step 1's acks")
    return proc


def test_aggregator_first_sigterm_exits_0_keeping_the_open_step_pending(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    proc = _aggregator_with_open_step(r, keys, redis_url, tmp_path)
    code, took = terminate(proc, 1)
    assert code == EXIT_OK, proc.stderr_text()[-2000:]
    assert took < 10
    # step 2's event, for the next aggregator
    assert r.xpending(keys.metrics, AGGREGATOR_GROUP)["pending"] == 1


def test_frozen_startup_heap_still_collects_later_garbage() -> None:
    """Worker mains freeze their start-up heap (full collections then skip it); cycles made afterwards,
    like a decoded sample's, are still collected."""
    import gc
    import weakref

    class Node:
        me: Any = None

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        node = Node()
        node.me = node
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
