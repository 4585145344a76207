"""Weights above the inline limit through Redis, in chunks (`bus.weights_transport=redis`): for producers on
hosts that share no disk with the trainer.

The trainer writes the safetensors file's bytes (header, then each tensor straight from its memory, as
tensors.py streams them) into string keys `weights:<v>:<i>` of `bus.weights_chunk_bytes` each,
hashing on the way, then announces `redis-chunks://<weights:v key>?chunk_bytes=N` on `params`. A producer
GETs the chunks one at a time into a private temp file on its own disk (its TMPDIR: the run dir's `tmp`
under supervisord), checking the sha256, and loads that file a tensor at a time (tensors.py). Extra
memory: one chunk on the trainer, about three on a producer (the reply, the client's read buffer, the
write); measured in BENCHMARKS.md, Weight sync at scale. Redis holds every version not yet garbage-collected:
the last
`keep_last` versions and any a producer still uses (`store.gc_weights`), i.e. about (keep_last + versions
in use by lagging producers) × the model's size, on top of `bus.redis_max_bytes`; with AOF on, the AOF also
grows by the model's size per version until Redis rewrites it. The chunk keys fall under the producers'
existing ACL (`GET` on `weights:*`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit

import redis

from schemas import ParamVersion

#: URI scheme of chunked weights on `params`.
CHUNKS_SCHEME = "redis-chunks://"


class ChunksError(RuntimeError):
    """A chunk is missing, or the chunks do not add up to the announced size and sha256."""


def chunks_uri(base_key: str, chunk_bytes: int) -> str:
    """The ParamVersion uri of weights stored as chunks `<base_key>:<i>`."""
    return f"{CHUNKS_SCHEME}{base_key}?chunk_bytes={chunk_bytes}"


def parse_chunks_uri(uri: str) -> tuple[str, int]:
    """(base key, chunk size in bytes) of a chunks uri; ValueError naming the uri when it is not one."""
    if not uri.startswith(CHUNKS_SCHEME):
        raise ValueError(f"uri {uri!r} is not a {CHUNKS_SCHEME} uri")
    parts = urlsplit(uri)
    base = uri[len(CHUNKS_SCHEME):].split("?", 1)[0]
    try:
        chunk_bytes = int(parse_qs(parts.query)["chunk_bytes"][0])
    except (KeyError, ValueError):
        raise ValueError(f"uri {uri!r}: no integer chunk_bytes") from None
    if chunk_bytes <= 0:
        raise ValueError(f"uri {uri!r}: chunk_bytes={chunk_bytes} must be positive")
    return base, chunk_bytes


def chunk_key(base_key: str, index: int) -> str:
    """The key of chunk `index` of the weights at `base_key`."""
    return f"{base_key}:{index}"


def write_chunks(r: redis.Redis, base_key: str, pieces: Iterable[Any], chunk_bytes: int) -> tuple[str, int]:
    """SET the concatenated bytes of `pieces` as chunks of chunk_bytes (the last one shorter) through one
    reused buffer; returns (sha256 hex, total bytes)."""
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    digest, size, fill, index = hashlib.sha256(), 0, 0, 0
    for piece in pieces:
        mv = memoryview(piece).cast("B")
        digest.update(mv)
        size += mv.nbytes
        while mv.nbytes:
            n = min(chunk_bytes - fill, mv.nbytes)
            view[fill : fill + n] = mv[:n]
            fill, mv = fill + n, mv[n:]
            if fill == chunk_bytes:
                r.set(chunk_key(base_key, index), view)
                fill, index = 0, index + 1
    if fill:
        r.set(chunk_key(base_key, index), view[:fill])
    return digest.hexdigest(), size


def read_chunks(r: redis.Redis, pv: ParamVersion, out: IO[bytes]) -> None:
    """Write the chunks of `pv` to `out` one at a time, checking each is there, their total size and the
    sha256; ChunksError naming the version otherwise."""
    base, chunk_bytes = parse_chunks_uri(pv.uri)
    count = math.ceil(pv.bytes / chunk_bytes)
    digest, size = hashlib.sha256(), 0
    for i in range(count):
        got: Any = r.get(chunk_key(base, i))
        if got is None:
            raise ChunksError(f"version {pv.version}: chunk {i} of {count} ({chunk_key(base, i)}) is gone")
        digest.update(got)
        out.write(got)
        size += len(got)
    if size != pv.bytes:
        raise ChunksError(f"version {pv.version}: chunks hold {size} bytes, announced {pv.bytes}")
    if digest.hexdigest() != pv.sha256:
        raise ChunksError(
            f"version {pv.version}: sha256 {digest.hexdigest()[:12]}… != announced {pv.sha256[:12]}…"
        )
