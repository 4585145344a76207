"""The TensorBoard and wandb sinks with the real packages (installed by the test command): records written
from the `records` stream are read back with tensorboard's own event reader and from wandb's offline run
file (its LevelDB-style log of protobuf records)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumers.aggregator.sinks import Sinks, TensorBoardSink, WandbSink, build_sinks
from rollstream.bus import Publisher
from rollstream.config import load_config
from rollstream.keys import Keys
from schemas import SyncStepRecord

ROOT = Path(__file__).resolve().parent.parent
METRICS = {1: {"critic/rewards/mean": 0.25, "val/acc": 0.5}, 2: {"critic/rewards/mean": 0.75, "val/acc": 1.0}}


def publish_records(r: redis.Redis, keys: Keys) -> None:
    pub = Publisher(r, nomkstream=False)
    for step, metrics in METRICS.items():
        pub.publish(keys.records, SyncStepRecord(global_step=step, num_local_updates=2, metrics=metrics),
                    entry_id=f"{step}-1")


def wandb_records(path: Path) -> Iterator[bytes]:
    """Payloads of a wandb run file: a 7-byte `:W&B` header, then LevelDB log records in 32 KiB blocks
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


def test_tensorboard_and_wandb_sinks_write_what_their_own_readers_read_back(
    r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run lives in files only
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = load_config(ROOT / "pipeline.yaml", [
        f"run.name={keys.run}", f"run.redis_url={redis_url}", f"run.dir={tmp_path}",
        "aggregator.jsonl=false", "aggregator.tensorboard=true", "aggregator.wandb_project=rollstream-test",
    ])
    publish_records(r, keys)
    built = build_sinks(cfg, r, keys)
    assert [type(s) for s in built] == [TensorBoardSink, WandbSink]  # both packages are installed
    sinks = Sinks(r, keys, built)
    try:
        assert sinks.flush() == 4
        assert sinks.flush() == 0  # each step once per sink
    finally:
        sinks.close()
    run_dir = tmp_path / keys.run

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    for tag in ("critic/rewards/mean", "val/acc"):
        got = [(ev.step, ev.value) for ev in acc.Scalars(tag)]
        assert got == [(step, pytest.approx(m[tag])) for step, m in METRICS.items()]

    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(run_dir.glob(f"wandb/offline-run-*-{keys.run}/run-{keys.run}.wandb"))
    assert len(files) == 1
    history: dict[int, dict[str, float]] = {}
    project = None
    for payload in wandb_records(files[0]):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            project = rec.run.project
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in rec.history.item
            }
            history[int(row.pop("_step"))] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert project == "rollstream-test"
    assert history == METRICS
