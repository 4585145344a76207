"""Array transport: every dtype and shape, inline and out of band, torch tensors, and zero-copy decoding."""

from __future__ import annotations

import sys
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schemas import as_redis, make_rollout

from schemas import (
    INLINE_MAX_BYTES,
    DataProto,
    DeadLetter,
    DecodeError,
    Limits,
    RolloutSample,
    decode,
    decode_as,
    decode_payload,
    encode,
    encode_payload,
)
from schemas.batch import object_array
from schemas.ragged import RaggedBatch

DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="?"),
    hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(sizes=(16, 32, 64), endianness="?"),
    hnp.complex_number_dtypes(endianness="?"),
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=24)


def carrier(value: Any) -> RolloutSample:
    """A rollout whose full_batch.meta_info carries `value` (any array: 0-d, 0-size, any dtype)."""
    event = make_rollout()
    event.full_batch.meta_info["x"] = value
    return event


def assert_same_array(got: Any, want: np.ndarray) -> None:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(DTYPES, SHAPES))
def test_numpy_round_trip_any_dtype_and_shape(arr: np.ndarray) -> None:
    """Any numeric dtype/shape survives both an entry (inline or out of band) and a standalone payload."""
    got = decode_as(as_redis(encode(carrier(arr))), RolloutSample).full_batch.meta_info["x"]  # type: ignore[union-attr]
    assert_same_array(got, arr)
    assert_same_array(decode_payload(encode_payload({"x": arr}))["x"], arr)


@pytest.mark.parametrize("nbytes", [0, 8, INLINE_MAX_BYTES - 8, INLINE_MAX_BYTES, 64 * INLINE_MAX_BYTES])
def test_inline_below_threshold_out_of_band_above(nbytes: int) -> None:
    """Arrays under INLINE_MAX_BYTES ride in the payload; the rest get their own a<i> field."""
    baseline = len(encode(carrier(None))["payload"])
    fields = encode(carrier(np.arange(nbytes // 8, dtype=np.float64)))
    assert ("a0" in fields) == (nbytes >= INLINE_MAX_BYTES)
    if nbytes >= INLINE_MAX_BYTES:
        assert len(fields["payload"]) < baseline + 32 and memoryview(fields["a0"]).nbytes == nbytes
    else:
        assert len(fields["payload"]) >= baseline + nbytes


def test_non_contiguous_and_big_endian_arrays() -> None:
    """Views (strided, transposed, Fortran) and big-endian arrays round trip by value."""
    base = np.arange(600, dtype=np.int32).reshape(20, 30)
    for arr in (base[::2, ::3], base.T, np.asfortranarray(base), base.astype(">f8")):
        assert_same_array(
            decode_as(as_redis(encode(carrier(arr))), RolloutSample).full_batch.meta_info["x"],
            np.ascontiguousarray(arr),
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 700)])
def test_torch_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Torch tensors (bf16 included) come back as torch tensors with the same dtype, shape and values."""
    t = (torch.randn(shape) * 4).to(dtype)
    for got in (
        decode_as(as_redis(encode(carrier(t))), RolloutSample).full_batch.meta_info["x"],
        decode_payload(encode_payload({"t": t}))["t"],
    ):
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got, t)


def test_torch_non_contiguous_and_grad() -> None:
    """Transposed tensors and tensors requiring grad encode by value."""
    t = torch.randn(40, 30, requires_grad=True)
    got = decode_payload(encode_payload({"t": t.T}))["t"]
    assert torch.equal(got, t.detach().T.contiguous())


def test_bf16_without_torch_decodes_to_uint16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch cannot be imported, bf16 arrives as a numpy uint16 view of its bits."""
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    data = encode_payload(t)
    monkeypatch.setitem(sys.modules, "torch", None)
    got = decode_payload(data)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint16
    assert got.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()


def test_decoded_arrays_share_memory_with_entry_bytes() -> None:
    """Out-of-band arrays are views of the bytes redis returned: no copy."""
    event = make_rollout(n=4, resp_len=4096)
    fields = as_redis(encode(event))
    got = decode(fields)
    assert isinstance(got, RolloutSample)
    raw = {k: np.frombuffer(v, dtype=np.uint8) for k, v in fields.items() if k.startswith(b"a")}
    b = got.full_batch
    for key, arr in (("response_ids", b.response_ids), ("rollout_log_probs", b.tokens["rollout_log_probs"])):
        assert not arr.flags.writeable and not arr.flags.owndata
        assert any(np.shares_memory(arr, r) for r in raw.values()), key
    # A huge array decodes in O(1): the bytes object is the array's buffer.
    big = np.ones(8 << 20, dtype=np.uint8)
    fields = as_redis(encode(carrier(big)))
    x = decode_as(fields, RolloutSample).full_batch.meta_info["x"]
    assert np.shares_memory(x, np.frombuffer(fields[b"a0"], dtype=np.uint8))


def test_decoded_torch_shares_memory_with_entry_bytes() -> None:
    """Out-of-band torch tensors are views of the entry bytes too."""
    t = torch.randn(1024, dtype=torch.float32).to(torch.bfloat16)
    fields = as_redis(encode(carrier(t)))
    got = decode_as(fields, RolloutSample).full_batch.meta_info["x"]
    start = np.frombuffer(fields[b"a0"], dtype=np.uint8).ctypes.data
    assert got.data_ptr() == start and torch.equal(got, t)


def test_object_arrays_and_numpy_scalars() -> None:
    """Object arrays (strings, dicts, None, nested arrays) and numpy scalars round trip."""
    obj = np.empty((2, 2), dtype=object)
    obj[:] = [["a", {"k": [1, 2]}], [None, 3.5]]
    value = {
        "obj": obj,
        "i": np.int64(7),
        "f": np.float32(0.5),
        "b": np.bool_(True),
        "s": np.str_("z"),
        "nested": np.array([np.arange(3), "x"], dtype=object),
    }
    got = decode_payload(encode_payload(value))
    assert got["obj"].dtype == object and got["obj"].tolist() == obj.tolist()
    assert got["i"] == 7 and got["f"] == 0.5 and got["b"] is True and got["s"] == "z"
    assert got["nested"][0].tolist() == [0, 1, 2] and got["nested"][1] == "x"


def test_dataproto_payload_and_dead_letter_bytes() -> None:
    """DataProto and RaggedBatch through encode_payload; dead-letter originals (large ones out of band) stay
    bytes."""
    dp = DataProto({"x": np.arange(4).reshape(2, 2)}, {"uid": object_array(["u0", "u1"])})
    got = decode_payload(encode_payload(dp))
    assert isinstance(got, DataProto) and got.non_tensors["uid"].tolist() == ["u0", "u1"]
    ragged = decode_payload(encode_payload(make_rollout().full_batch))
    assert isinstance(ragged, RaggedBatch) and ragged.non_tensors["uid"].tolist() == ["u0", "u1"]
    original = {"payload": b"\xff" * 5000, "type": b"rollout"}
    fields = as_redis(encode(DeadLetter(source="s", source_id="1-0", reason="r", fields=original)))
    assert b"a0" in fields
    dead = decode(fields)
    assert isinstance(dead, DeadLetter) and dead.fields == original
    assert isinstance(dead.fields["payload"], bytes)


def test_unencodable_values_raise_type_error() -> None:
    """Encoding something that is not a msgpack value, array or DataProto is a TypeError (a bug, not
    input)."""
    with pytest.raises(TypeError, match="cannot encode"):
        encode_payload({"x": object()})
    with pytest.raises(TypeError, match="dtype"):
        encode_payload(np.array(["a"], dtype="U1"))


def test_entry_size_limit_counts_names_and_values_of_any_field_type() -> None:
    """max_entry_bytes bounds the names and values together: bytes as Redis returns them, str and memoryview
    values as a caller may hand them (their len()), a value without len() counted 0; over it by one byte is
    refused naming the total, at it the entry goes on to the payload's checks."""
    fields = as_redis(encode(make_rollout()))
    size = sum(len(k) + len(v) for k, v in fields.items())
    assert decode(fields, Limits(max_entry_bytes=size)).type == "rollout"
    with pytest.raises(DecodeError, match=f"entry is {size} bytes, over the max_entry_bytes={size - 1}"):
        decode(fields, Limits(max_entry_bytes=size - 1))
    mixed: dict[Any, Any] = {"type": "rollout", b"payload": memoryview(fields[b"payload"]), "n": 7, "e": "é"}
    total = len("type") + len("rollout") + len(b"payload") + len(fields[b"payload"]) + 1 + 1 + 1
    with pytest.raises(DecodeError, match=f"entry is {total} bytes, over the max_entry_bytes={total - 1}"):
        decode(mixed, Limits(max_entry_bytes=total - 1))
    with pytest.raises(DecodeError) as exc:  # at the limit: the size passes, the payload's checks refuse it
        decode(mixed, Limits(max_entry_bytes=total))
    assert "max_entry_bytes" not in str(exc.value)
