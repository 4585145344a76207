"""Weight blobs: safetensors bytes under `weights:<version>` (small); above the inline limit a `file://` path
written atomically, or (`transport="redis"`) chunks `weights:<version>:<i>` in Redis for producers that share
no disk with the trainer (chunks.py); announced by a ParamVersion entry on `params`; loaded with a
sha256 check; old versions removed once no producer uses them.

A module's weights (`publish_module_weights`, `load_weights_into`) above `bus.weights_inline_max_bytes`
never exist as one blob in memory: the file or the chunks are written and read a tensor (a chunk) at a
time (tensors.py)."""

from __future__ import annotations

import hashlib
import io
import logging
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from rollstream.bus import Publisher, iter_stream, run_producers
from rollstream.bus.ids import IdError, count_or_none, parse_count, text
from rollstream.keys import Keys
from rollstream.runtime.files import atomic_write
from rollstream.weights.chunks import CHUNKS_SCHEME, ChunksError, chunks_uri, read_chunks, write_chunks
from schemas import DecodeError, ParamVersion, decode

#: Values of `bus.weights_transport`: where weights above the inline limit go.
FILE_TRANSPORT, REDIS_TRANSPORT = "file", "redis"
#: Default chunk size of the redis transport (bus.weights_chunk_bytes).
CHUNK_BYTES = 16 << 20
#: A swap-check probe (weights/fingerprint.py): its token ids and the publisher's log-probs of them.
Probe = tuple[list[int], list[float]]

if TYPE_CHECKING:  # torch stays out of processes that only read params (`rollstream status`)
    from torch import Tensor, nn

    from rollstream.model.base import BasePolicy

log = logging.getLogger(__name__)


class WeightsError(RuntimeError):
    """A weight blob is missing or its sha256 does not match its ParamVersion."""


def publish_weights(
    r: redis.Redis,
    keys: Keys,
    version: int,
    blob: bytes,
    *,
    global_step: int,
    inline_max_bytes: int,
    file_dir: Path | None = None,
    transport: str = FILE_TRANSPORT,
    chunk_bytes: int = CHUNK_BYTES,
    probe: Probe | None = None,
) -> ParamVersion:
    """Store the blob (inline, as a file, or as chunks with the redis transport) then XADD its ParamVersion
    (with the swap check's `probe`: token ids and the publisher's log-probs of them) to `params`; returns the
    event."""
    digest = hashlib.sha256(blob).hexdigest()
    if len(blob) <= inline_max_bytes:
        r.set(keys.weights(version), blob)
        uri = keys.weights(version)
    elif transport == REDIS_TRANSPORT:
        write_chunks(r, keys.weights(version), [blob], chunk_bytes)
        uri = chunks_uri(keys.weights(version), chunk_bytes)
    else:
        if file_dir is None:
            raise WeightsError(f"blob of {len(blob)} bytes > inline limit {inline_max_bytes} and no file_dir")
        path = _weights_path(file_dir, version)
        atomic_write(path, blob)
        uri = f"file://{path}"
    size, fields = len(blob), _probe_fields(probe)
    pv = ParamVersion(version=version, uri=uri, sha256=digest, bytes=size, global_step=global_step, **fields)
    Publisher(r, nomkstream=False).publish(keys.params, pv)
    log.info("published param_version %d (%d bytes, %s)", version, len(blob), uri)
    return pv


def _probe_fields(probe: Probe | None) -> dict[str, Any]:
    """The ParamVersion fields of a swap-check probe (none without one)."""
    if probe is None:
        return {}
    ids, logprobs = probe
    return {"probe_ids": list(ids), "probe_logprobs": list(logprobs)}


def _weights_path(file_dir: Path, version: int) -> Path:
    return (file_dir / f"weights-{version:08d}.safetensors").resolve()


def publish_module_weights(
    r: redis.Redis,
    keys: Keys,
    version: int,
    module: nn.Module,
    *,
    global_step: int,
    inline_max_bytes: int,
    file_dir: Path | None = None,
    transport: str = FILE_TRANSPORT,
    chunk_bytes: int = CHUNK_BYTES,
    probe: Probe | None = None,
) -> ParamVersion:
    """Publish a module's weights: safetensors bytes in Redis when they fit `inline_max_bytes` (or neither
    a file_dir nor the redis transport), else streamed tensor by tensor (no second copy in memory) into a
    file in file_dir, or with `transport="redis"` into chunks of chunk_bytes; then XADD the ParamVersion."""
    from rollstream.weights.tensors import (
        file_bytes,
        published_state,
        state_bytes,
        tensor_pieces,
        write_tensors,
    )

    tensors = published_state(module)  # the module's own tensors, no copies (with LoRA: its factors)
    chunked = transport == REDIS_TRANSPORT
    if (file_dir is None and not chunked) or file_bytes(tensors) <= inline_max_bytes:
        return publish_weights(
            r, keys, version, state_bytes(tensors), global_step=global_step,
            inline_max_bytes=inline_max_bytes, file_dir=file_dir, probe=probe,
        )
    if chunked:
        digest, size = write_chunks(r, keys.weights(version), tensor_pieces(tensors), chunk_bytes)
        uri = chunks_uri(keys.weights(version), chunk_bytes)
    else:
        assert file_dir is not None
        path = _weights_path(file_dir, version)
        digest, size = write_tensors(tensors, path)
        uri = f"file://{path}"
    pv = ParamVersion(
        version=version, uri=uri, sha256=digest, bytes=size, global_step=global_step, **_probe_fields(probe)
    )
    Publisher(r, nomkstream=False).publish(keys.params, pv)
    log.info("published param_version %d (%d bytes, %s, streamed)", version, size, pv.uri)
    return pv


def _gather_chunks(r: redis.Redis, pv: ParamVersion, folder: Path) -> Path:
    """Write the Redis chunks of `pv` (sha256 checked) to a safetensors file in `folder`; returns its path."""
    path = folder / "weights.safetensors"
    try:
        with open(path, "wb") as f:
            read_chunks(r, pv, f)
    except ChunksError as e:
        raise WeightsError(str(e)) from None
    return path


def load_weights_into(r: redis.Redis, pv: ParamVersion, policy: BasePolicy) -> None:
    """Load the weights a ParamVersion names into `policy` after checking their sha256: a file is hashed
    in blocks, then read a tensor at a time into the parameters; an inline blob via load_state_dict_bytes."""
    from rollstream.weights.tensors import file_sha256, load_file_into

    if pv.uri.startswith(CHUNKS_SCHEME):  # through a private temp file on this host's own disk
        with tempfile.TemporaryDirectory(prefix="rollstream-weights-") as tmp:
            load_file_into(policy.module, _gather_chunks(r, pv, Path(tmp)))
        return
    if not pv.uri.startswith("file://"):
        policy.load_state_dict_bytes(load_weights(r, pv))
        return
    path = Path(pv.uri.removeprefix("file://"))
    try:
        digest = file_sha256(path)
    except OSError as e:
        raise WeightsError(f"version {pv.version}: cannot read {pv.uri}: {e}") from e
    if digest != pv.sha256:
        raise WeightsError(f"version {pv.version}: sha256 {digest[:12]}… != announced {pv.sha256[:12]}…")
    try:
        load_file_into(policy.module, path)
    except OSError as e:  # removed between the hash and the read: an even newer version exists
        raise WeightsError(f"version {pv.version}: cannot read {pv.uri}: {e}") from e


def iter_weight_tensors(r: redis.Redis, pv: ParamVersion) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every tensor a ParamVersion names, for an engine that loads weights from an iterator
    (vLLM's reload_weights) without a second full copy in memory. Everything that can fail is checked before
    this returns (sha256, the file opened), so a consumer never sees a half-read version: an inline blob is
    deserialised at once; a file (or Redis chunks, gathered into a private temp file first) is hashed, opened,
    and then read one tensor at a time."""
    from safetensors import safe_open
    from safetensors.torch import load as st_load

    from rollstream.weights.tensors import file_sha256

    # into a private temp file, opened, then unlinked (the handle reads it)
    if pv.uri.startswith(CHUNKS_SCHEME):
        with tempfile.TemporaryDirectory(prefix="rollstream-weights-") as tmp:
            handle = safe_open(str(_gather_chunks(r, pv, Path(tmp))), framework="pt")
        return ((name, handle.get_tensor(name)) for name in handle.keys())
    if not pv.uri.startswith("file://"):
        return iter(st_load(load_weights(r, pv)).items())
    path = Path(pv.uri.removeprefix("file://"))
    try:
        digest = file_sha256(path)
        handle = safe_open(str(path), framework="pt")  # open now: a later unlink keeps it readable
    except OSError as e:
        raise WeightsError(f"version {pv.version}: cannot read {pv.uri}: {e}") from e
    if digest != pv.sha256:
        raise WeightsError(f"version {pv.version}: sha256 {digest[:12]}… != announced {pv.sha256[:12]}…")
    return ((name, handle.get_tensor(name)) for name in handle.keys())


#: Undecodable params entries already logged (a producer polls params every few ms; warn once each).
_BAD_PARAMS_SEEN: set[str] = set()
PARAMS_PAGE = 16


def latest_param_version(r: redis.Redis, keys: Keys) -> ParamVersion | None:
    """The newest valid ParamVersion on `params`, or None when there is none yet. Entries that do not
    decode as a ParamVersion (garbage written by someone else) are skipped with one warning each: a bad
    params entry must not stop a producer or the trainer."""
    for entry_id, fields in iter_stream(r, keys.params, page=PARAMS_PAGE, reverse=True):
        try:
            ev = decode(fields)
        except DecodeError as e:
            _warn_bad_params(entry_id, f"does not decode: {e}")
            continue
        if isinstance(ev, ParamVersion):
            return ev
        _warn_bad_params(entry_id, f"is a {ev.type}, not a param_version")
    return None


def _warn_bad_params(entry_id: str, why: str) -> None:
    if entry_id in _BAD_PARAMS_SEEN:
        return
    if len(_BAD_PARAMS_SEEN) > 10_000:
        _BAD_PARAMS_SEEN.clear()
    _BAD_PARAMS_SEEN.add(entry_id)
    log.error("params entry %s skipped: %s", entry_id, why)


def wait_for_param_version(
    r: redis.Redis, keys: Keys, newer_than: int = -1, timeout_s: float | None = None, stop: Any = None
) -> ParamVersion | None:
    """Block until a ParamVersion newer than `newer_than` exists (polls `params`); None on timeout/stop."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        pv = latest_param_version(r, keys)
        if pv is not None and pv.version > newer_than:
            return pv
        if stop is not None and stop.is_set():
            return None
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def load_weights(r: redis.Redis, pv: ParamVersion) -> bytes:
    """Fetch the blob a ParamVersion names and verify its sha256."""
    if pv.uri.startswith(CHUNKS_SCHEME):
        out = io.BytesIO()
        try:
            read_chunks(r, pv, out)
        except ChunksError as e:
            raise WeightsError(str(e)) from None
        return out.getvalue()
    if pv.uri.startswith("file://"):
        try:
            blob = Path(pv.uri.removeprefix("file://")).read_bytes()
        except OSError as e:
            raise WeightsError(f"version {pv.version}: cannot read {pv.uri}: {e}") from e
    else:
        got: Any = r.get(pv.uri)
        if got is None:
            raise WeightsError(f"version {pv.version}: blob {pv.uri} is gone")
        blob = bytes(got)
    digest = hashlib.sha256(blob).hexdigest()
    if digest != pv.sha256:
        raise WeightsError(f"version {pv.version}: sha256 {digest[:12]}… != announced {pv.sha256[:12]}…")
    return blob


def register_producer_version(r: redis.Redis, keys: Keys, producer: str, version: int) -> None:
    """Record which version a producer now generates with (for weight GC and `status`)."""
    r.set(keys.producer_version(producer), version)


#: A producer's claimed version pins its blob (gc_weights) only while it is within this many versions of the
#: newest: a stuck or lying producer (`version=0`) keeps at most this many blobs, never every one.
PIN_VERSIONS = 8


def producer_versions(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """Producer name -> the param_version it last reported using (values that are not a canonical count are
    left out: `producer_version_report` names them)."""
    return producer_version_report(r, keys)[0]


def producer_version_report(r: redis.Redis, keys: Keys) -> tuple[dict[str, int], dict[str, str]]:
    """(producer -> the version it reports using, producer -> why its `version` key was ignored). The run's
    producers (the `producers` set; a run never set up: every `producer:<name>:version` key, names without
    `:`); each value is the producer's input, parsed by the one canonical count parser."""
    rc: Any = r
    names = run_producers(r, keys)
    if not names:
        found = (keys.producer_of(text(k)) for k in rc.scan_iter(match=keys.producer_pattern("version")))
        names = sorted({n for n in found if ":" not in n})
    values = rc.mget([keys.producer_version(n) for n in names]) if names else []
    good: dict[str, int] = {}
    bad: dict[str, str] = {}
    for name, raw in zip(names, values, strict=True):
        if raw is None:
            continue
        try:
            good[name] = parse_count(raw, keys.producer_version(name))
        except IdError as e:
            bad[name] = f"{e}: ignored"
    return good, bad


def pinned_versions(claimed: Iterable[int], latest: int, window: int = PIN_VERSIONS) -> list[int]:
    """The claimed versions that pin a blob: ones the trainer published (<= latest) within `window` of it."""
    return sorted({v for v in claimed if latest - window <= v <= latest})


def gc_weights(
    r: redis.Redis, keys: Keys, latest: int, *, keep_last: int = 2, file_dir: Path | None = None
) -> list[int]:
    """Delete blobs (inline, chunks, and files in file_dir) older than the last `keep_last` and every
    version a producer uses (`pinned_versions`: a version it claims pins only if published, and for at most
    PIN_VERSIONS versions); returns the versions removed. A `version` key that is not a count is ignored."""
    good, bad = producer_version_report(r, keys)
    for name, why in bad.items():
        log.warning("weights GC: producer %s: %s", name, why)
    floor = min([latest - keep_last + 1, *pinned_versions(good.values(), latest)])
    removed = []
    prefix = keys.weights(0).rsplit(":", 1)[0] + ":"
    for key in r.scan_iter(match=prefix + "*", count=1000):
        v = count_or_none(key[len(prefix):].split(b":", 1)[0])  # weights:<v> or a chunk weights:<v>:<i>
        if v is not None and v < floor:
            r.delete(key)
            removed.append(v)
    if file_dir is not None and file_dir.is_dir():
        for path in file_dir.glob("weights-*.safetensors"):
            v = count_or_none(path.stem.split("-")[1].lstrip("0") or "0")  # weights-<v:08d> (zero-padded)
            if v is not None and v < floor:
                path.unlink(missing_ok=True)
                removed.append(v)
    return sorted(set(removed))
