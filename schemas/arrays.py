"""Arrays <-> (dtype string, shape, raw bytes): the zero-copy half of the codec (no msgpack here).

numpy arrays use the numpy dtype string (`'<f4'`); torch tensors use `'torch.<name>'` (`'torch.bfloat16'`)
and travel as their raw native-endian bytes. Decoding never copies: it views the given buffer.

The codec's flat array header (`pack_head` / `array_from_flat`) describes an array in a few fixed-size bytes:
uint8 dtype code (index into WIRE_DTYPES), uint8 ndim, uint8 kind (0: the data follows inline, 1: a uint32
index of the out-of-band field follows), then ndim little-endian uint64 dims.
"""

from __future__ import annotations

import math
import struct
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from schemas.errors import DecodeError

TORCH_PREFIX = "torch."
MAX_NDIM = 32
# numpy kinds allowed on the wire: bool, signed, unsigned, float, complex (never object/void/str).
WIRE_KINDS = "biufc"
# Without torch installed, torch dtypes decode to these numpy dtypes (bf16 as its raw uint16 bits).
TORCH_TO_NUMPY = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2", "int32": "<i4",
    "uint32": "<u4", "int64": "<i8", "uint64": "<u8", "float16": "<f2", "float32": "<f4",
    "float64": "<f8", "complex64": "<c8", "complex128": "<c16", "bfloat16": "<u2",
}  # fmt: skip


# Dtype codes of the flat array header. Append only: a code's meaning is part of the wire format.
WIRE_DTYPES: tuple[str, ...] = (
    "|b1", "|i1", "|u1",
    "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
    ">i2", ">i4", ">i8", ">u2", ">u4", ">u8", ">f2", ">f4", ">f8", ">c8", ">c16",
    *(TORCH_PREFIX + name for name in TORCH_TO_NUMPY),
)  # fmt: skip
WIRE_DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(WIRE_DTYPES)}
# Per code: (numpy dtype or None for torch, itemsize, wire name).
_CODES: tuple[tuple[np.dtype | None, int, str], ...] = tuple(
    (None, np.dtype(TORCH_TO_NUMPY[name[len(TORCH_PREFIX) :]]).itemsize, name)
    if name.startswith(TORCH_PREFIX)
    else (np.dtype(name), np.dtype(name).itemsize, name)
    for name in WIRE_DTYPES
)
HEAD_INLINE, HEAD_FIELD = 0, 1
_HEADS_INLINE = tuple(struct.Struct(f"<BBB{n}Q") for n in range(MAX_NDIM + 1))
_HEADS_FIELD = tuple(struct.Struct(f"<BBB{n}QI") for n in range(MAX_NDIM + 1))


def is_torch_tensor(obj: object) -> bool:
    """True when obj is a torch.Tensor; never imports torch (a tensor implies torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def array_to_wire(obj: Any) -> tuple[str, list[int], memoryview]:
    """Return (dtype string, shape, flat byte view) of a numpy array or torch tensor, copying only if
    needed."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in WIRE_KINDS or obj.dtype.fields is not None:
            raise TypeError(f"cannot encode numpy dtype {obj.dtype} (allowed kinds: {WIRE_KINDS})")
        if obj.size and obj.flags.c_contiguous:  # (memoryview.cast refuses shapes with a 0 in them)
            return obj.dtype.str, list(obj.shape), memoryview(obj).cast("B")  # type: ignore[arg-type]
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)  # (makes 0-d 1-d: keep obj.shape)
        return arr.dtype.str, list(obj.shape), arr.reshape(-1).view(np.uint8).data
    if is_torch_tensor(obj):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix(TORCH_PREFIX)
        raw = t.reshape(-1).view(sys.modules["torch"].uint8) if t.numel() else None
        data = memoryview(raw.numpy()) if raw is not None else memoryview(b"")
        return TORCH_PREFIX + name, list(t.shape), data
    raise TypeError(f"not an array: {type(obj).__name__}")


def check_shape(shape: Any) -> tuple[int, ...]:
    """Validate a decoded shape: a short list of non-negative ints."""
    if type(shape) is not list and not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise DecodeError(f"array shape must be a list of at most {MAX_NDIM} ints")
    for d in shape:
        if type(d) is not int or d < 0:
            raise DecodeError(f"array shape has a negative or non-int dim: {list(shape)[:8]}")
    return tuple(shape)


#: Flat header code of each numpy dtype that has one (the encoder's lookup without building dtype strings).
NUMPY_CODES: dict[np.dtype, int] = {dt: code for code, (dt, _, _) in enumerate(_CODES) if dt is not None}
#: The numpy dtype of each code that has one (torch codes have none).
CODE_DTYPES: dict[int, np.dtype] = {code: dt for dt, code in NUMPY_CODES.items()}


def flat_array(arr: np.ndarray, field: int | None) -> tuple[bytes, memoryview] | None:
    """(flat header, data view) of a non-empty C-contiguous numpy array whose dtype has a code, as
    pack_head(*array_to_wire(arr)) gives them; None for any other array (then take the general path)."""
    ndim = arr.ndim
    if not (arr.size and arr.flags.c_contiguous) or ndim > MAX_NDIM:
        return None
    code = NUMPY_CODES.get(arr.dtype)
    if code is None:
        return None
    data = memoryview(arr).cast("B")  # type: ignore[arg-type]
    if field is None:
        return _HEADS_INLINE[ndim].pack(code, ndim, HEAD_INLINE, *arr.shape), data
    return _HEADS_FIELD[ndim].pack(code, ndim, HEAD_FIELD, *arr.shape, field), data


def pack_head(dtype_str: str, shape: list[int], field: int | None) -> bytes | None:
    """Flat header of an array (field=None: data follows inline); None when the dtype or ndim has no code."""
    code = WIRE_DTYPE_CODES.get(dtype_str)
    ndim = len(shape)
    if code is None or ndim > MAX_NDIM:
        return None
    if field is None:
        return _HEADS_INLINE[ndim].pack(code, ndim, HEAD_INLINE, *shape)
    return _HEADS_FIELD[ndim].pack(code, ndim, HEAD_FIELD, *shape, field)


def array_from_flat(body: bytes, field: Callable[[int], Any], max_inline: int) -> Any:
    """Decode a flat-header array ext body without copying: the data is the rest of the body (at most
    max_inline bytes) or `field(index)` (bytes or a byte-format memoryview of an out-of-band field)."""
    size = len(body)
    if size < 3:
        raise DecodeError("malformed array ext: short header")
    code, ndim, kind = body[0], body[1], body[2]
    if ndim > MAX_NDIM:
        raise DecodeError(f"array shape must be a list of at most {MAX_NDIM} ints")
    if code >= len(_CODES):
        raise DecodeError(f"unknown array dtype code {code}")
    end = 3 + 8 * ndim
    if kind == HEAD_FIELD and size == end + 4:
        head = _HEADS_FIELD[ndim].unpack(body)
        data = field(head[-1])
        shape = head[3:-1]
    elif kind == HEAD_INLINE and size >= end:
        if size - end > max_inline:
            raise DecodeError(f"inline array of {size - end} bytes exceeds max_bin_len({max_inline})")
        data = memoryview(body)[end:]
        shape = _HEADS_INLINE[ndim].unpack_from(body)[3:]
    else:
        raise DecodeError("malformed array ext: bad kind or length")
    dtype, itemsize, name = _CODES[code]
    if dtype is None:
        return _torch_from_wire(name[len(TORCH_PREFIX) :], shape, memoryview(data))
    if math.prod(shape) * itemsize != len(data):
        _check_nbytes(memoryview(data), shape, itemsize, name)
    return np.ndarray(shape, dtype, data)  # a read-only view of data (faster than frombuffer + reshape)


def _numpy_dtype(dtype_str: str) -> np.dtype:
    """Parse a numpy dtype string and allow only plain numeric/bool kinds."""
    try:
        dt = np.dtype(dtype_str)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"unknown array dtype {dtype_str[:40]!r}") from exc
    if dt.kind not in WIRE_KINDS or dt.fields is not None or dt.subdtype is not None or dt.str != dtype_str:
        raise DecodeError(f"array dtype {dtype_str[:40]!r} not allowed on the wire")
    return dt


def _check_nbytes(buf: memoryview, shape: tuple[int, ...], itemsize: int, dtype_str: str) -> None:
    """Reject a buffer whose length is not prod(shape) * itemsize (computed with unbounded ints)."""
    want = math.prod(shape) * itemsize
    if buf.nbytes != want:
        raise DecodeError(f"array {dtype_str}{list(shape)[:8]} needs {want} bytes, got {buf.nbytes}")


def array_from_wire(dtype_str: Any, shape_in: Any, data: Any) -> Any:
    """View `data` (bytes-like) as an array of dtype/shape without copying; torch dtypes give tensors."""
    if not isinstance(dtype_str, str):
        raise DecodeError("array dtype must be a string")
    shape = check_shape(shape_in)
    try:
        buf = memoryview(data).cast("B")
    except TypeError as exc:
        raise DecodeError(f"array data is {type(data).__name__}, not bytes") from exc
    if dtype_str.startswith(TORCH_PREFIX):
        return _torch_from_wire(dtype_str.removeprefix(TORCH_PREFIX), shape, buf)
    dt = _numpy_dtype(dtype_str)
    _check_nbytes(buf, shape, dt.itemsize, dtype_str)
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def _torch_from_wire(name: str, shape: tuple[int, ...], buf: memoryview) -> Any:
    """Decode a torch tensor zero-copy; without torch, fall back to a numpy view (bf16 as uint16)."""
    try:
        import torch
    except ImportError:
        if name not in TORCH_TO_NUMPY:
            raise DecodeError(f"torch dtype {name[:40]!r} cannot be decoded without torch") from None
        dt = np.dtype(TORCH_TO_NUMPY[name])
        _check_nbytes(buf, shape, dt.itemsize, TORCH_PREFIX + name)
        return np.frombuffer(buf, dtype=dt).reshape(shape)
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"unknown torch dtype {name[:40]!r}")
    _check_nbytes(buf, shape, dtype.itemsize, TORCH_PREFIX + name)
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.frombuffer(buf, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write to it
        t = torch.from_numpy(raw)
    return t.view(dtype).reshape(shape)
