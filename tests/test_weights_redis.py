"""Weights above the inline limit through Redis chunks (`bus.weights_transport=redis`): a producer on a host
that shares no disk with the trainer loads them (sha256 checked, a chunk at a time), a missing or corrupt
chunk is
refused before the model changes, and garbage collection keeps only the versions still in use."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis
import torch

from rollstream.keys import Keys
from rollstream.weights.chunks import chunk_key, parse_chunks_uri
from rollstream.weights.store import (
    WeightsError,
    gc_weights,
    load_weights,
    load_weights_into,
    publish_module_weights,
    register_producer_version,
)
from rollstream.weights.tensors import file_bytes, unique_state
from schemas import ParamVersion
from tests.test_weights_io import Holder, Tied, same

CHUNK = 1024


def publish(r: redis.Redis, keys: Keys, version: int, module: torch.nn.Module) -> ParamVersion:
    """Publish over a 0-byte inline limit with the redis transport, no file dir at all."""
    return publish_module_weights(r, keys, version, module, global_step=version, inline_max_bytes=0,
                                  transport="redis", chunk_bytes=CHUNK)


def test_chunks_carry_the_weights_to_a_producer_without_the_trainers_disk(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    trainer, producer = Tied(seed=1), Tied(seed=2)
    pv = publish(r, keys, 3, trainer)
    base, chunk_bytes = parse_chunks_uri(pv.uri)
    assert pv.uri.startswith("redis-chunks://") and base == keys.weights(3) and chunk_bytes == CHUNK
    assert pv.bytes == file_bytes(unique_state(trainer))
    count = math.ceil(pv.bytes / CHUNK)
    assert count > 2 and r.exists(chunk_key(base, count - 1)) and not r.exists(chunk_key(base, count))
    assert not same(trainer, producer)
    load_weights_into(r, pv, Holder(producer))  # type: ignore[arg-type]
    assert same(trainer, producer)
    assert len(load_weights(r, pv)) == pv.bytes  # the whole blob too (benchmarks)
    assert not list(tmp_path.iterdir())  # nothing was written to any weights folder


def test_a_missing_or_corrupt_chunk_is_refused_before_the_model_changes(r: redis.Redis, keys: Keys) -> None:
    trainer, producer = Tied(seed=1), Tied(seed=2)
    before = {k: v.clone() for k, v in producer.state_dict().items()}
    pv = publish(r, keys, 1, trainer)
    r.setrange(chunk_key(keys.weights(1), 1), 10, b"\x00\xff")
    with pytest.raises(WeightsError, match="sha256"):
        load_weights_into(r, pv, Holder(producer))  # type: ignore[arg-type]
    r.delete(chunk_key(keys.weights(1), 2))
    with pytest.raises(WeightsError, match=r"chunk 2 of \d+ .* is gone"):
        load_weights_into(r, pv, Holder(producer))  # type: ignore[arg-type]
    assert all(torch.equal(before[k], v) for k, v in producer.state_dict().items())


def test_gc_keeps_only_the_versions_still_in_use(r: redis.Redis, keys: Keys) -> None:
    m = Tied(seed=1)
    for v in range(6):
        publish(r, keys, v, m)
    register_producer_version(r, keys, "rollout_00", 2)  # a lagging producer
    assert gc_weights(r, keys, 5, keep_last=2) == [0, 1]
    prefix = keys.weights(0).rsplit(":", 1)[0] + ":"
    held = {int(k[len(prefix):].split(b":")[0]) for k in r.scan_iter(match=prefix + "*")}
    assert held == {2, 3, 4, 5}
    register_producer_version(r, keys, "rollout_00", 5)
    assert gc_weights(r, keys, 5, keep_last=2) == [2, 3]
    held = {int(k[len(prefix):].split(b":")[0]) for k in r.scan_iter(match=prefix + "*")}
    assert held == {4, 5}


def test_a_bad_chunks_uri_is_named() -> None:
    with pytest.raises(ValueError, match="no integer chunk_bytes"):
        parse_chunks_uri("redis-chunks://rs:{x}:weights:1")
    with pytest.raises(ValueError, match="is not a redis-chunks:// uri"):
        parse_chunks_uri("file:///x")
