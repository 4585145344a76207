"""Every weights <-> bytes conversion: tied tensors kept once, safetensors bytes in memory, files written and
read one tensor at a time, and an initial-weights file loaded into a policy. The Redis side (`params`, blobs,
chunks) is store.py.

A tensor shared by several state-dict names (tied weights: an embedding and its output head) is stored once,
under its first name; loading accepts it under any one of its names (`alias_groups`, `unique_tensors`).

In memory (`state_bytes`, `module_bytes`, `load_bytes_into`): the whole safetensors blob, fine for the
inline (Redis) path. For a 1 GB+ model the blob and a second deserialised copy would not fit, so the trainer
writes the module's tensors straight from their memory into the file (hashing them on the way,
`write_tensors` of `published_state`), and a producer hashes the file in blocks, then reads each tensor
straight into the memory of the parameter it belongs to (`load_file_into`). Peak extra memory is one tensor
(a dtype or device change) or nothing. The files are standard safetensors (`safetensors.safe_open` reads
them). With LoRA (rollstream.model.lora) a version is the factors alone (`published_state`).
"""

from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn
from torch.autograd.graph import increment_version

from rollstream.runtime.files import atomic_file, atomic_write


class HoldsModule(Protocol):
    """A policy as far as its weights go (rollstream.model.BasePolicy)."""

    module: nn.Module

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
HASH_BLOCK = 16 << 20


def _storage_key(t: Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    """(storage address, offset, shape) that tensors sharing memory have in common; None for a tensor with
    no storage of its own (empty), which aliases nothing."""
    ptr = t.untyped_storage().data_ptr()
    return None if ptr == 0 else (ptr, int(t.storage_offset()), tuple(int(d) for d in t.shape))


def alias_groups(state: Mapping[str, Tensor]) -> list[list[str]]:
    """State-dict names grouped by shared storage (tied weights), in state-dict order."""
    groups: dict[Any, list[str]] = {}
    for name, t in state.items():
        key = _storage_key(t)
        groups.setdefault(name if key is None else key, []).append(name)
    return list(groups.values())


def unique_tensors(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A state dict with tied tensors once (under the first name), detached, no copies."""
    return {names[0]: state[names[0]].detach() for names in alias_groups(state)}


def unique_state(module: nn.Module) -> dict[str, Tensor]:
    """The module's state dict with tied tensors once (under the first name), no copies."""
    return unique_tensors(module.state_dict())


def state_bytes(state: Mapping[str, Tensor]) -> bytes:
    """safetensors bytes of a state dict whose tied tensors appear once (see unique_tensors)."""
    return st_save({k: v.detach().contiguous() for k, v in state.items()})


def published_state(module: nn.Module) -> dict[str, Tensor]:
    """The weights a version publishes: the module's state dict with tied tensors once; with LoRA
    (rollstream.model.lora) its factors alone, the frozen base being what every process built itself. No
    copies."""
    return _published(module.state_dict())


def _published(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`published_state` of a module's state dict."""
    from rollstream.model.lora import is_factor

    unique = unique_tensors(state)
    factors = {name: t for name, t in unique.items() if is_factor(name)}
    return factors or unique


def module_bytes(module: nn.Module) -> bytes:
    """safetensors bytes of the module's published weights (`published_state`: tied tensors once; with LoRA
    the factors alone)."""
    return state_bytes(published_state(module))


def check_state_names(module: nn.Module, names: set[str], state: Mapping[str, Tensor] | None = None) -> None:
    """ValueError unless `names` are state-dict names of the module covering at least what it publishes
    (`published_state`: all of it, a tied tensor under any one of its names; with LoRA, its factors);
    `state` is the module's state dict when the caller has it."""
    state = module.state_dict() if state is None else state
    unexpected = sorted(names - set(state))
    if unexpected:
        raise ValueError(f"weights have unknown tensors: {unexpected[:5]}")
    covered = set(names)
    for group in alias_groups(state):
        if covered.intersection(group):
            covered.update(group)
    missing = sorted(set(_published(state)) - covered)
    if missing:
        raise ValueError(f"weights lack tensors: {missing[:5]}")


def load_tensors_into(module: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy tensors into the module in place; refuse unknown or missing (non-tied) names."""
    check_state_names(module, set(state))
    module.load_state_dict(state, strict=False)


def load_bytes_into(module: nn.Module, data: bytes) -> None:
    """Copy safetensors bytes (from `module_bytes`) into the module in place; refuse unknown or missing
    (non-tied) names."""
    load_tensors_into(module, st_load(data))


def _header(tensors: Mapping[str, Tensor]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes) of a file holding `tensors` in order."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        meta[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def file_bytes(tensors: Mapping[str, Tensor]) -> int:
    """Size in bytes of the safetensors file `write_tensors` makes of these tensors."""
    return len(_header(tensors)) + sum(t.numel() * t.element_size() for t in tensors.values())


def _raw(t: Tensor) -> Any:
    """A buffer over the bytes of a CPU tensor (no copy when it is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_pieces(tensors: Mapping[str, Tensor]) -> Iterator[Any]:
    """The bytes of the tensors' safetensors file in order: the header, then one buffer per tensor (its own
    memory when it is a contiguous CPU tensor; a GPU tensor is copied to the CPU alone)."""
    yield _header(tensors)
    for t in tensors.values():
        if t.numel():
            yield _raw(t.detach().cpu())


def write_tensors(tensors: Mapping[str, Tensor], path: Path) -> tuple[str, int]:
    """Write the tensors (e.g. `published_state(module)`) to `path` atomically (temp file, fsync, rename),
    one tensor at a time; returns (sha256 hex of the file, bytes). A second thread hashes each piece while
    this one writes and fsyncs it (hashlib and file writes release the GIL): SmolLM2's 269 MB take the longer
    of the two, not their sum."""
    digest = hashlib.sha256()
    pieces: queue.Queue[Any] = queue.Queue(maxsize=8)  # a few tensors ahead at most (a GPU's are copies)

    def hash_pieces() -> None:
        while (piece := pieces.get()) is not None:
            digest.update(piece)

    hasher = threading.Thread(target=hash_pieces, name="weights-sha256", daemon=True)
    hasher.start()
    size = 0
    try:
        with atomic_file(path) as f:
            for piece in tensor_pieces(tensors):
                pieces.put(piece)
                f.write(piece)
                size += memoryview(piece).nbytes
    finally:
        pieces.put(None)  # the hasher's last piece (it hashed the rest during the writes and the fsync)
        hasher.join()
    return digest.hexdigest(), size


def file_sha256(path: Path) -> str:
    """sha256 hex of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    buf = bytearray(HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def read_header(f: IO[bytes], file_bytes: int) -> tuple[dict[str, Any], int]:
    """(tensor name -> {dtype, shape, data_offsets}, offset of the data) of an open safetensors file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > file_bytes:
        raise ValueError(f"bad safetensors header length {n}")
    meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return meta, 8 + n


def _entries(
    meta: dict[str, Any], data_start: int, file_bytes: int
) -> Iterator[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, start, end) of each tensor in file order; ValueError on bad entries."""
    for name, e in sorted(meta.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = TORCH_DTYPES.get(e.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name}: unknown dtype {e.get('dtype')!r}")
        start, end = (data_start + int(x) for x in e["data_offsets"])
        shape = [int(s) for s in e["shape"]]
        numel = 1
        for s in shape:
            numel *= s
        if end > file_bytes or end - start != numel * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"tensor {name}: data_offsets do not match its shape and the file")
        yield name, dtype, shape, start, end


def load_file_into(module: nn.Module, path: Path) -> None:
    """Read a safetensors file into the module's tensors in place, one tensor at a time (straight into
    the parameter's memory when it is a contiguous CPU tensor of the file's dtype); refuses unknown,
    missing (non-tied) or misshapen tensors before writing anything."""
    sd = module.state_dict()
    file_bytes = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        meta, data_start = read_header(f, file_bytes)
        entries = list(_entries(meta, data_start, file_bytes))
        check_state_names(module, {e[0] for e in entries}, sd)
        for name, _, shape, _, _ in entries:
            if list(sd[name].shape) != shape:
                raise ValueError(
                    f"tensor {name}: shape {shape} in the file, {list(sd[name].shape)} in the model"
                )
        with torch.no_grad():
            for name, dtype, shape, start, end in entries:
                target = sd[name]
                direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
                buf = target if direct else torch.empty(shape, dtype=dtype)
                if direct:  # written behind autograd (even if the read fails part-way): bump the version
                    increment_version(target)  # that caches of it key on
                f.seek(start)
                view = memoryview(_raw(buf)) if buf.numel() else memoryview(b"")
                got = 0
                while got < end - start:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"tensor {name}: file ends early")
                    got += n
                if not direct:
                    target.copy_(buf)


def save_policy(policy: HoldsModule, path: str | Path) -> None:
    """Write the policy's weights as a safetensors file (what `model.init_from` reads), atomically."""
    atomic_write(Path(path), module_bytes(policy.module))


def load_init(policy: HoldsModule, path: str | Path) -> None:
    """Load a safetensors weights file (from `save_policy`, `model.init_from`) into the policy in place."""
    load_bytes_into(policy.module, Path(path).read_bytes())
