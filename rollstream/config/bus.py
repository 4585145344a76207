"""`bus:`: the Redis Streams transport, its retention and memory bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rollstream.config.base import Section


class BusConfig(Section):
    """Redis Streams transport."""

    block_ms: int = Field(1000, ge=1, description="XREADGROUP BLOCK time")
    read_count: int = Field(64, ge=1, description="Entries per XREADGROUP call")
    claim_idle_s: float = Field(
        60.0, gt=0, description="XAUTOCLAIM entries idle longer than this from dead consumers"
    )
    max_deliveries: int = Field(5, ge=1, description="Deliveries before an entry goes to dead")
    socket_timeout_s: float = Field(10.0, gt=0, description="Socket timeout (must exceed block_ms)")
    max_stream_bytes: int = Field(
        2 << 30,
        ge=1 << 20,
        description="Safety-net cap per stream: beyond it even unread entries go to the archive (logged "
        "loudly when it bites)",
    )
    retention: bool = Field(
        True,
        description="Move old entries of the log from Redis to the archive (off: the whole log stays in "
        "Redis)",
    )
    redis_max_bytes: int = Field(
        2 << 30,
        ge=1 << 16,
        description="Budget of the run's streams in Redis: over it, read entries go to the archive; unread "
        "data over it paces producers to one step per version",
    )
    archive_uri: str | None = Field(
        None, description="Folder (local path or file:// URI) of the log archive; null = <run dir>/archive"
    )
    trim_every_s: float = Field(
        10.0, gt=0, description="Seconds between retention passes (when retention is on)"
    )
    audit_maxlen: int = Field(
        100_000,
        ge=100,
        description="With retention on: newest entries kept in Redis in fates, dispatch_log and params "
        "(older ones archived)",
    )
    records_maxlen: int = Field(
        0,
        ge=0,
        description="With retention on: newest records kept in Redis (0 = as the budget allows; older ones "
        "archived)",
    )
    weights_inline_max_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Weight blobs up to this size go in Redis as one string; larger ones per "
        "bus.weights_transport",
    )
    weights_transport: Literal["file", "redis"] = Field(
        "file",
        description="Weights above the inline limit: `file` = the trainer's run dir (producers must share "
        "that disk); "
        "`redis` = chunks in Redis (producers on hosts with no shared disk; Redis holds the versions still "
        "in use)",
    )
    weights_chunk_bytes: int = Field(
        16 << 20,
        ge=1 << 10,
        le=512 << 20,
        description="Size of one weights chunk in Redis (weights_transport=redis); also a producer's extra "
        "memory",
    )
    max_entry_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Largest stream entry (all fields together) accepted on decode; larger ones go to dead",
    )

    redis_maxmemory_bytes: int = Field(
        0,
        ge=0,
        description="maxmemory of the embedded Redis (policy noeviction: a write past it is refused, nothing "
        "evicted); 0 = from the budget: 3 x redis_max_bytes + 4 x weights_inline_max_bytes + 256 MiB (with "
        "weights_transport=redis or retention off none: set it, the chunks or the whole log come on top); "
        "either way capped at half the host's memory when rollstream run starts the Redis",
    )
    producer_max_bytes: int = Field(
        0,
        ge=0,
        description="Per-producer memory bound: past it (MEMORY USAGE of its two streams, sampled, or over "
        "PRODUCER_KEYS_MAX_BYTES in its four keys) the trainer fences the producer (ACL user off, "
        "connections killed); 0 = 1.25 x redis_max_bytes + max_entry_bytes (retention keeps all streams "
        "near redis_max_bytes, so one honest producer's never passes it; with retention off only its keys "
        "are bounded)",
    )

    def maxmemory(self) -> int | None:
        """maxmemory for the embedded Redis in bytes, or None for none (see redis_maxmemory_bytes)."""
        if self.redis_maxmemory_bytes:
            return self.redis_maxmemory_bytes
        if self.weights_transport == "redis" or not self.retention:
            return None  # chunks on top, or the whole log kept in Redis: not boundable from the budget
        return 3 * self.redis_max_bytes + 4 * self.weights_inline_max_bytes + (256 << 20)

    def producer_bound(self) -> int | None:
        """The per-producer bound on its streams in bytes (see producer_max_bytes); None (its keys are still
        bounded) with retention off and no explicit bound: the whole log then stays in Redis."""
        if self.producer_max_bytes:
            return self.producer_max_bytes
        if not self.retention:
            return None
        return self.redis_max_bytes + self.redis_max_bytes // 4 + self.max_entry_bytes

    @model_validator(mode="after")
    def _memory_bounds(self) -> BusConfig:
        if self.redis_maxmemory_bytes and self.redis_maxmemory_bytes < 2 * self.redis_max_bytes:
            raise ValueError(
                f"redis_maxmemory_bytes={self.redis_maxmemory_bytes} must be 0 (from the budget) or at least "
                f"2 x redis_max_bytes={self.redis_max_bytes}: the streams' budget needs headroom"
            )
        return self

    @model_validator(mode="after")
    def _archive_local(self) -> BusConfig:
        uri = self.archive_uri
        if uri is not None and "://" in uri and not uri.startswith("file://"):
            raise ValueError(f"archive_uri={uri!r}: only a local path or a file:// URI is supported")
        return self

    def archive_dir(self, run_dir: Path) -> Path:
        """The log archive's folder: archive_uri (file:// stripped) or <run dir>/archive."""
        return Path(self.archive_uri.removeprefix("file://")) if self.archive_uri else run_dir / "archive"

    @model_validator(mode="after")
    def _timeouts(self) -> BusConfig:
        if self.socket_timeout_s * 1000 <= self.block_ms:
            raise ValueError(
                f"socket_timeout_s={self.socket_timeout_s} must exceed block_ms={self.block_ms} ms"
            )
        return self

