"""Where records go besides Redis: a JSONL file always, TensorBoard and wandb when installed and asked for.

The sinks read the `records` stream (from each sink's last written step, independent of the fold) and
write each global step once, at `step = global_step`. The JSONL sink finds its last step in its own file
(a torn last line from a crash is cut off); TensorBoard and wandb keep their last step in the
`Keys.sink_cursor` hash. Either way a restart never writes a step twice.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import redis

from rollstream.bus import iter_stream
from rollstream.config import PipelineConfig
from rollstream.keys import Keys
from rollstream.runtime.files import private_dir
from schemas import DecodeError, SyncStepRecord, decode_as

log = logging.getLogger(__name__)
Counts = dict[str, dict[str, float]]  # dict-valued metrics of a record: name -> {key: count}

READ_CHUNK = 256  # records per XRANGE


class Sink(Protocol):
    """One destination of records."""

    name: str

    def last_step(self) -> int:
        """The last global step written (-1 when none)."""
        ...

    def write(self, step: int, metrics: dict[str, float], counts: Counts | None = None) -> None:
        """Write one step's metrics and its dict metrics (`counts`, name -> {key: count})."""
        ...

    def close(self) -> None:
        """Flush and release."""
        ...


def _last_jsonl_step(path: Path) -> int:
    """The `step` of the last complete line of a JSONL file (-1 when none); cuts off a torn last line."""
    if not path.exists():
        return -1
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        chunk = 4096
        while True:
            start = max(0, size - chunk)
            f.seek(start)
            tail = f.read(size - start)
            body = tail[:-1] if tail.endswith(b"\n") else tail
            newline = body.rfind(b"\n")
            if newline < 0 and start > 0:  # the last line is longer than the chunk
                chunk *= 4
                continue
            if body is tail and tail:  # no final newline: a write cut short by a crash
                cut = start + newline + 1
                log.warning("%s: cutting a torn last line (%d bytes)", path, size - cut)
                f.truncate(cut)
                size = cut
                continue
            line = body[newline + 1 :]
            return int(json.loads(line)["step"]) if line.strip() else -1


class JsonlSink:
    """Appends `{"step": g, ...metrics}` lines to <run_dir>/records.jsonl."""

    name = "jsonl"

    def __init__(self, path: Path) -> None:
        """Open (create) the file and find its last step."""
        private_dir(path.parent)
        self.path = path
        self._last = _last_jsonl_step(path)
        self._f = path.open("a", encoding="utf-8")

    def last_step(self) -> int:
        """Last step in the file."""
        return self._last

    def write(self, step: int, metrics: dict[str, float], counts: Counts | None = None) -> None:
        """Append one line (dict metrics as nested objects) and flush it."""
        self._f.write(json.dumps({"step": step, **metrics, **(counts or {})}) + "\n")
        self._f.flush()
        self._last = step

    def close(self) -> None:
        """Close the file."""
        self._f.close()


class _CursorSink:
    """A sink whose last step lives in the Redis sink_cursor hash."""

    name = "cursor"

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r: Any = r
        self.keys = keys

    def last_step(self) -> int:
        """Last step from the cursor hash."""
        raw = self.r.hget(self.keys.sink_cursor, self.name)
        return int(raw) if raw is not None else -1

    def _advance(self, step: int) -> None:
        self.r.hset(self.keys.sink_cursor, self.name, step)


class TensorBoardSink(_CursorSink):
    """Scalars under <run_dir>/tensorboard via torch.utils.tensorboard."""

    name = "tensorboard"

    def __init__(self, r: redis.Redis, keys: Keys, log_dir: Path, writer_cls: Any) -> None:
        """Open a SummaryWriter."""
        super().__init__(r, keys)
        self.writer = writer_cls(log_dir=str(log_dir))

    def write(self, step: int, metrics: dict[str, float], counts: Counts | None = None) -> None:
        """One scalar per metric (a dict metric: one per key, `name/key`) at `step`, then advance the
        cursor."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        for name, by_key in (counts or {}).items():
            for sub, value in by_key.items():
                self.writer.add_scalar(f"{name}/{sub}", value, global_step=step)
        self.writer.flush()
        self._advance(step)

    def close(self) -> None:
        """Close the writer."""
        self.writer.close()


class WandbSink(_CursorSink):
    """One wandb.log per step, resuming the run named after the rollstream run."""

    name = "wandb"

    def __init__(self, r: redis.Redis, keys: Keys, wandb: Any, project: str, run_dir: Path) -> None:
        """wandb.init(project, id=run name, resume="allow")."""
        super().__init__(r, keys)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=keys.run, id=keys.run, resume="allow", dir=str(run_dir))

    def write(self, step: int, metrics: dict[str, float], counts: Counts | None = None) -> None:
        """Log at `step` (dict metrics as nested dicts), then advance the cursor."""
        self.run.log({**metrics, **(counts or {})}, step=step)
        self._advance(step)

    def close(self) -> None:
        """Finish the wandb run."""
        self.run.finish()


def _tensorboard_writer() -> Any:
    """torch's SummaryWriter class, or None when tensorboard is not installed (checked before importing
    torch)."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def _wandb() -> Any:
    """The wandb module, or None when it is not installed."""
    if importlib.util.find_spec("wandb") is None:
        return None
    try:
        import wandb
    except ImportError:
        return None
    return wandb


def build_sinks(cfg: PipelineConfig, r: redis.Redis, keys: Keys) -> list[Sink]:
    """The sinks the config asks for that can run here (missing packages are skipped with one log line)."""
    run_dir = cfg.run_dir()
    sinks: list[Sink] = []
    agg = cfg.aggregator
    if agg.jsonl:
        sinks.append(JsonlSink(run_dir / "records.jsonl"))
    if agg.tensorboard:
        writer_cls = _tensorboard_writer()
        if writer_cls is None:
            log.info("tensorboard is not installed; TensorBoard sink skipped")
        else:
            sinks.append(TensorBoardSink(r, keys, run_dir / "tensorboard", writer_cls))
    if agg.wandb_project:
        wandb = _wandb()
        if wandb is None:
            log.warning("aggregator.wandb_project is set but wandb is not installed; wandb sink skipped")
        else:
            sinks.append(WandbSink(r, keys, wandb, agg.wandb_project, run_dir))
    return sinks


class Sinks:
    """Copies new records from the `records` stream to every sink, each from its own last step."""

    def __init__(self, r: redis.Redis, keys: Keys, sinks: list[Sink]) -> None:
        """Sinks built by `build_sinks` (or any objects with the Sink interface)."""
        self.r: Any = r
        self.keys = keys
        self.sinks = sinks
        self.written = 0

    def flush(self) -> int:
        """Write every record some sink has not written yet; returns the number of (sink, step) writes."""
        if not self.sinks:
            return 0
        lasts = {s.name: s.last_step() for s in self.sinks}
        start = min(lasts.values())
        writes = 0
        for entry_id, fields in iter_stream(
            self.r, self.keys.records, f"({start}-1" if start >= 0 else "-", page=READ_CHUNK
        ):
            try:
                rec = decode_as(fields, SyncStepRecord)
            except DecodeError as e:
                log.error("records entry %s does not decode (%s); not written to sinks", entry_id, e)
                continue
            for sink in self.sinks:
                if rec.global_step > lasts[sink.name]:
                    sink.write(rec.global_step, rec.metrics, rec.counts)
                    lasts[sink.name] = rec.global_step
                    writes += 1
        self.written += writes
        return writes

    def close(self) -> None:
        """Close every sink."""
        for sink in self.sinks:
            sink.close()
