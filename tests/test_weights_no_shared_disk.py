"""A producer on a host that shares no disk with the trainer: its own run dir, never the trainer's weights
folder (with `bus.weights_transport=redis` the trainer writes none), an HF model above a lowered inline limit.
The trainer and a producer run as separate processes against one Redis; the producer loads every version it
generates with from Redis chunks."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

pytest.importorskip("transformers")

from rollstream.keys import Keys  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402
from rollstream.weights.store import producer_versions  # noqa: E402
from schemas import ParamVersion, decode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def test_a_producer_with_its_own_disk_gets_weights_through_redis(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    model = make_tiny_hf_model(tmp_path / "model", seed=0, arch="llama", tokenizer="char")
    trainer_host, producer_host = tmp_path / "trainer-host", tmp_path / "producer-host"
    common = [
        "pipeline.yaml",
        "model.backend=hf",
        f"model.hf_path={model}",
        f"run.name={keys.run}",
        f"run.redis_url={redis_url}",
        "run.device=cpu",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "async_training.trigger_parameter_sync_step=2",
        "rollout.n=2",
        "rollout.num_producers=1",
        "rollout.prompts_per_dispatch=2",
        "data.max_response_length=6",
        "data.reverse.max_digits=3",
        "data.val_size=4",
        "trainer.test_freq=0",
        f"trainer.total_training_steps={STEPS}",
        "bus.block_ms=100",
        "bus.weights_inline_max_bytes=1024",
        "bus.weights_transport=redis",
        "bus.weights_chunk_bytes=65536",
    ]
    producer = subprocess.Popen(
        [sys.executable, "-m", "producers", *common, f"run.dir={producer_host}", "--name", "rollout_00"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "consumers.trainer",
                *common,
                f"run.dir={trainer_host}",
                "--name",
                "trainer",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        producer.send_signal(signal.SIGTERM)
        err = producer.communicate(timeout=60)[1]
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert producer.returncode == 0, err[-3000:]
    versions = [ev for _, f in r.xrange(keys.params) if isinstance(ev := decode(f), ParamVersion)]
    assert [v.version for v in versions] == list(range(STEPS + 1))
    assert all(v.uri.startswith("redis-chunks://") and v.bytes > 1024 for v in versions)
    assert producer_versions(r, keys)["rollout_00"] >= STEPS - 1  # it followed the trainer's versions
    assert "loaded param_version 2" in err or "loaded param_version 3" in err
    # no weights folder the producer could have read
    assert not (trainer_host / keys.run / "weights").exists()
    assert not list(producer_host.rglob("*.safetensors"))  # its temp copies are gone
