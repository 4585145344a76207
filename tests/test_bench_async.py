"""`rollstream bench async` and what it relies on: latency-model producer slots, the trainer's sync mode and
its transport metric, and the benchmark's report at a tiny size (fields and sane values, no timing ratios)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import P0, PRODUCERS

from benchmarks.latency_producer import LatencyProducer
from consumers.trainer.loop import Trainer
from producers.worker import Producer
from rollstream.bus import connect, setup_run
from rollstream.cli.main import main as cli_main
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import Keys
from rollstream.model import build_policy
from rollstream.pacing.budget import lease_outright
from rollstream.runtime.process import WorkerContext
from rollstream.testing.fakes import leased_fakes
from rollstream.weights.store import latest_param_version, publish_weights
from schemas import RolloutSample, StepMetrics, decode, encode

TINY_MODEL = [
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.max_seq_len=32",
    "run.device=cpu",
]


def events(r: redis.Redis, stream: str) -> list[Any]:
    return [decode(f) for _, f in r.xrange(stream)]


def local_updates(r: redis.Redis, keys: Keys) -> list[StepMetrics]:
    return [ev for ev in events(r, keys.metrics) if isinstance(ev, StepMetrics) and ev.type == "local_update"]


def wait_for(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def trainer_cfg(keys: Keys, tmp_path: Path, sync_mode: bool) -> PipelineConfig:
    return load_config(
        None,
        [
            *TINY_MODEL,
            f"run.name={keys.run}",
            f"run.dir={tmp_path}",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "async_training.trigger_parameter_sync_step=2",
            "trainer.total_training_steps=1",
            "trainer.test_freq=0",
            "trainer.num_warmup_batches=0",
            "bus.block_ms=100",
            f"trainer.sync_mode={str(sync_mode).lower()}",
        ],
    )


def publish_fake(r: redis.Redis, keys: Keys, i: int) -> None:
    """Publish rollout_00's sample number `i` (leased outright, as the trainer would lease it)."""
    [sample] = leased_fakes(r, keys, 1, param_version=0, n=2, prompt_len=4, response_len=6)
    assert sample.sample_id == f"{P0}-{i}"
    r.xadd(keys.rollouts_of(P0), encode(sample))  # type: ignore[arg-type]


@pytest.mark.parametrize("sync_mode", [True, False])
def test_sync_mode_trains_only_once_the_whole_global_batch_is_in(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, sync_mode: bool
) -> None:
    cfg = trainer_cfg(keys, tmp_path, sync_mode)
    trainer = Trainer(cfg, connect(redis_url), keys, "trainer", threading.Event())
    t = threading.Thread(target=trainer.run, daemon=True)
    t.start()
    wait_for(lambda: latest_param_version(r, keys) is not None)
    for i in range(3):  # one short of train_batch_size=4 (two mini-batches of 2)
        publish_fake(r, keys, i)
    if sync_mode:
        time.sleep(1.0)
        assert local_updates(r, keys) == [], "sync mode trained before the global batch was complete"
    else:
        wait_for(lambda: len(local_updates(r, keys)) == 1)  # streaming: the first mini-batch trains at once
    publish_fake(r, keys, 3)
    t.join(timeout=60)
    assert not t.is_alive()
    first, second = local_updates(r, keys)
    assert 0 < first.metrics["timing_s/transport"] <= first.metrics["timing_s/gen"]
    if sync_mode:  # all the waiting happened before the first update ...
        assert first.metrics["timing_s/gen"] >= 0.9 > second.metrics["timing_s/gen"]
        # ... and blocked waiting is not transport: it waited > 0.9 s and moved only 4 small samples
        assert first.metrics["timing_s/transport"] < 0.25 * first.metrics["timing_s/gen"]


def test_latency_model_producer_slots_run_side_by_side(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    # sigma 0: every trajectory is 10 tokens (9 digits + eos) and every prompt decodes for 10/40 = 0.25 s
    cfg = load_config(
        None,
        [
            *TINY_MODEL,
            f"run.name={keys.run}",
            "rollout.num_producers=1",
            "rollout.n=3",
            "data.max_response_length=16",
            "bench.latency_model.enable=true",
            "bench.latency_model.concurrency=4",
            "bench.latency_model.tokens_per_s=40",
            "bench.latency_model.length_median=10",
            "bench.latency_model.length_sigma=0",
        ],
    )
    setup_run(r, keys, PRODUCERS)
    policy = build_policy(cfg)
    publish_weights(r, keys, 0, policy.state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    lease_outright(r, keys, "rollout_00", 8)
    producer = LatencyProducer(
        WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=connect(redis_url)), policy=policy
    )
    t0 = time.monotonic()
    assert producer.run(burst=True) == 8  # one prompt per dispatch, until the lease of 8 is used up
    elapsed = time.monotonic() - t0
    assert elapsed < 1.5, f"8 prompts x 0.25 s on 4 slots took {elapsed:.2f} s (serial would be 2 s)"
    samples = [ev for ev in events(r, keys.rollouts_of(P0)) if isinstance(ev, RolloutSample)]
    assert len(samples) == 8 and len({s.sample_id for s in samples}) == 8
    for s in samples:
        assert s.param_version == 0
        assert [o["response_length"] for o in s.agent_loop_output_list] == [10, 10, 10]
        assert s.processing_times == pytest.approx([0.25] * 3)
        assert s.num_tokens == s.full_batch.response_ids.size == 30
    assert producer.counters.dispatched == 8 and producer.counters.published == 8
    assert int(r.get(keys.dispatched) or 0) == 8


def test_the_production_producer_refuses_a_latency_model_config(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """`python -m producers` never silently decodes for real when the config asks for the latency model."""
    cfg = load_config(None, [*TINY_MODEL, f"run.name={keys.run}", "bench.latency_model.enable=true"])
    with pytest.raises(ValueError, match="benchmarks.latency_producer"):
        Producer(WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=connect(redis_url)))


def test_bench_async_quick_reports_every_figure(
    r: redis.Redis, redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # this test's own runs: a bench running beside it is not counted
    ns = f"bench-async-t{uuid.uuid4().hex[:8]}"
    assert cli_main(["bench", "async", "--quick", "--json", "--steps", "3", "--redis-url", redis_url,
                     "--namespace", ns]) == 0
    rep = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert "latency-model" in rep["producers"] and rep["trainer"].startswith("real")
    cal = rep["calibration"]
    assert cal["train_step_s"] > 0 and cal["tokens_per_s"] > 0
    tbs = rep["workload"]["train_batch_size"]
    for mode in ("sync", "async"):
        m = rep[mode]
        assert m["steps"] == 3 and m["samples"] == 3 * tbs and m["dropped"] == 0
        assert m["wall_s"] > 0 and m["samples_per_s"] == pytest.approx(m["samples"] / m["wall_s"])
        assert 0 <= m["trainer_idle_ratio"] <= 1 and 0 <= m["producer_idle_ratio"] <= 1
        assert 0 < m["transport_share"] < 1 and m["transport_s"] <= m["wait_s"]
        assert m["train_s"] > 0 and m["gen_work_s"] > 0
        assert m["ideal_s"] == pytest.approx(max(m["gen_per_slot_s"], m["train_s"]))
        assert m["wall_s"] >= 0.5 * m["ideal_s"]  # nothing finishes far below its own work
    assert rep["sync"]["staleness_mean"] == 1.0  # strictly alternating: always on-policy
    assert rep["speedup"] == pytest.approx(rep["sync"]["wall_s"] / rep["async"]["wall_s"])
    assert not list(r.scan_iter(match=f"rs:{{{ns}-*"))  # every namespace it made is deleted
