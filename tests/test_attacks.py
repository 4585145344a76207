"""A malicious producer: what it can put on `rollouts` with valid credentials goes to `dead`
with a reason naming the field and value, and the trainer goes on training the real samples."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from consumers.trainer.loop import Trainer
from rollstream.audit import audit_run
from rollstream.bus import setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.fakes import fake_rollout_sample
from rollstream.names import Keys
from rollstream.weights import publish_weights
from schemas import DeadLetter, RolloutSample, decode, encode

MAX_ENTRY_BYTES = 256 << 10


def tiny_cfg(keys: Keys, tmp: Path) -> PipelineConfig:
    return load_config("pipeline.yaml", [
        f"run.name={keys.run}", f"run.dir={tmp}", "run.device=cpu", "model.d_model=16", "model.n_layer=1",
        "model.n_head=2", "model.max_seq_len=32", "data.train_batch_size=2", "actor.ppo_mini_batch_size=1",
        "trainer.parameter_sync_step=2", "trainer.test_freq=0", "trainer.total_global_steps=1000",
        "rollout.n=2", "bus.block_ms=20", f"bus.max_entry_bytes={MAX_ENTRY_BYTES}",
    ])


def sample_fields(sid: str, version: int = 0) -> dict[bytes, bytes]:
    ev = fake_rollout_sample(sid, param_version=max(version, 0), n=2, prompt_len=4, response_len=5)
    fields = {k.encode(): bytes(v) for k, v in encode(ev).items()}
    if version < 0:  # what a producer that skips the model would write
        fields[b"param_version"] = str(version).encode()
        body = fields[b"payload"]
        # fixint 0 -> -5
        fields[b"payload"] = body.replace(b"\xadparam_version\x00", b"\xadparam_version\xfb")
    return fields


@pytest.fixture
def trainer(r: redis.Redis, keys: Keys, tmp_path: Path) -> Iterator[Trainer]:
    t = Trainer(tiny_cfg(keys, tmp_path), r, keys, "trainer", threading.Event())
    t.resume()
    yield t


def dead_reasons(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """source entry id -> reason of every dead letter about rollouts."""
    out = {}
    for _, f in r.xrange(keys.dead):  # type: ignore[union-attr]
        ev = decode(f)
        assert isinstance(ev, DeadLetter)
        if ev.source == keys.rollouts:
            out[ev.source_id] = ev.reason
    return out


def test_forged_rollouts_are_dead_lettered_with_the_field_and_value(
    r: redis.Redis, keys: Keys, trainer: Trainer
) -> None:
    attacks: dict[str, tuple[dict[bytes, Any], str]] = {}
    tag = uuid.uuid4().hex[:6]
    attacks["future"] = (sample_fields(f"future-{tag}", 10**9),
                         "invalid: param_version=1000000000 is newer than the newest published version 0")
    attacks["negative"] = (sample_fields(f"neg-{tag}", -5),
                           "param_version: Input should be greater than or equal to 0")
    mismatch = sample_fields(f"payload-{tag}")
    mismatch[b"sample_id"] = f"header-{tag}".encode()
    attacks["mismatch"] = (
        mismatch,
        f"header sample_id=b'header-{tag}' != payload sample_id=b'payload-{tag}'",
    )
    schema = sample_fields(f"schema-{tag}")
    schema[b"schema"] = b"999"
    attacks["schema"] = (schema, f"header schema='999' != payload schema_version={RolloutSample.SCHEMA}")
    extra = sample_fields(f"extra-{tag}")
    extra[b"junk"] = b"x" * (50 << 10)
    attacks["unknown"] = (extra, "unknown field 'junk' in a 'rollout' entry")
    big = sample_fields(f"big-{tag}")
    big[b"payload"] = big[b"payload"] + b"\0" * MAX_ENTRY_BYTES
    attacks["oversized"] = (big, f"over the max_entry_bytes={MAX_ENTRY_BYTES} limit")
    absurd = fake_rollout_sample(f"reward-{tag}", n=2, prompt_len=4, response_len=5)
    absurd.full_batch.rows["rewards"] = np.array([3e38, 0.5], dtype=np.float32)
    attacks["reward"] = (
        {k.encode(): bytes(v) for k, v in encode(absurd).items()},  # issue 24: loss inf, grad NaN
        "out of domain: rewards hold values in [0.5, 3.00",
    )
    nameless = fake_rollout_sample("", n=2, prompt_len=4, response_len=5)
    attacks["empty id"] = (
        {k.encode(): bytes(v) for k, v in encode(nameless).items()},
        "out of domain: sample_id is empty",
    )

    ids = {}
    for name, (fields, _) in attacks.items():
        ids[name] = r.xadd(keys.rollouts, fields).decode()  # type: ignore[union-attr]
    goods = [f"good-{tag}-{i}" for i in range(2)]
    for sid in goods:
        r.xadd(keys.rollouts, sample_fields(sid))  # type: ignore[arg-type]
    guard = threading.Timer(30, trainer.stop.set)
    guard.start()
    try:
        assert trainer.train_step(1)
    finally:
        guard.cancel()

    dead = dead_reasons(r, keys)
    for name, (_, reason) in attacks.items():
        assert reason in dead[ids[name]], (name, dead[ids[name]])
    fates = [f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)]  # type: ignore[union-attr]
    assert sorted(fates) == goods
    rep = audit_run(r, keys)  # the header's sample_id is what the audit sees: it ended in `dead`, not lost
    assert f"header-{tag}" in rep.dead and not rep.lost and not rep.duplicated, rep.problems()


def test_versions_published_before_a_restart_are_not_from_the_future(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """A trainer that restarts from an older checkpoint finds versions published by the steps its crash
    abandoned; samples stamped with them are real (seen in the fault test), only newer ones are invalid."""
    setup_run(r, keys)
    for v in (0, 1, 2):  # published by a previous trainer process that never checkpointed
        publish_weights(r, keys, v, b"w" * 16, global_step=v, inline_max_bytes=1 << 20)
    trainer = Trainer(tiny_cfg(keys, tmp_path), r, keys, "trainer", threading.Event())
    trainer.resume()
    assert trainer.global_step == 0 and trainer.newest_published == 2
    tag = uuid.uuid4().hex[:6]
    future = r.xadd(keys.rollouts, sample_fields(f"v3-{tag}", 3)).decode()  # type: ignore[arg-type,union-attr]
    for i in range(2):
        r.xadd(keys.rollouts, sample_fields(f"v2-{tag}-{i}", 2))  # type: ignore[arg-type]
    assert trainer.train_step(1)
    assert dead_reasons(r, keys) == {
        future: "invalid: param_version=3 is newer than the newest published version 2"
    }
    assert sorted(f[b"sample_id"].decode() for _, f in r.xrange(keys.fates)) == [f"v2-{tag}-0", f"v2-{tag}-1"]  # type: ignore[union-attr]
