"""The flat array wire format: header layout, hostile headers, DataProto maps, older writers, finite checks."""

from __future__ import annotations

import struct
from typing import Any

import msgpack  # only to read and craft payloads the codec itself would never produce
import numpy as np
import pytest
from test_schemas import as_redis, hostile, make_batch, make_rollout, reason_of, tamper

from schemas import DataProto, Limits, RolloutSample, decode, decode_as, encode
from schemas.arrays import WIRE_DTYPES

EXT_FLAT_ARRAY = 5
F4 = WIRE_DTYPES.index("<f4")


def flat(
    code: int, dims: list[int], *, index: int | None = None, data: bytes = b"", ndim: int | None = None
) -> bytes:
    """A hand-made flat header: uint8 code, ndim, kind; uint64 dims; then a uint32 index or inline data."""
    head = struct.pack(
        f"<BBB{len(dims)}Q", code, len(dims) if ndim is None else ndim, 0 if index is None else 1, *dims
    )
    return head + (data if index is None else struct.pack("<I", index))


def flat_ext(*args: Any, **kwargs: Any) -> msgpack.ExtType:
    """flat() wrapped as the array ExtType found outside DataProto tensors."""
    return msgpack.ExtType(EXT_FLAT_ARRAY, flat(*args, **kwargs))


def full_batch_parts(fields: dict[bytes, bytes]) -> tuple[dict[str, Any], list[Any]]:
    """The payload map and the raw [tensors, non_tensors, meta_info] of an entry's full_batch."""
    body = msgpack.unpackb(fields[b"payload"])
    return body, msgpack.unpackb(body["full_batch"].data)


def with_parts(fields: dict[bytes, bytes], body: dict[str, Any], parts: list[Any]) -> dict[bytes, bytes]:
    """The entry with its full_batch ext rebuilt from parts."""
    body["full_batch"] = msgpack.ExtType(3, msgpack.packb(parts))
    return {**fields, b"payload": msgpack.packb(body)}


def test_tensors_travel_as_flat_headers() -> None:
    """Out-of-band tensors are a fixed-size header naming their field; small ones carry their bytes inline."""
    event = make_rollout(n=2, resp_len=300)
    fields = as_redis(encode(event))
    _, (tensors, non_tensors, _meta) = full_batch_parts(fields)
    responses = event.full_batch.tensors["responses"]
    code, ndim, kind, rows, cols, index = struct.unpack("<BBB2QI", tensors["responses"])
    assert (WIRE_DTYPES[code], ndim, kind, (rows, cols)) == ("<i8", 2, 1, responses.shape)
    assert fields[f"a{index}".encode()] == responses.tobytes()
    rewards = event.full_batch.tensors["rewards"]
    assert tensors["rewards"] == struct.pack("<BBBQ", F4, 1, 0, 2) + rewards.tobytes()
    assert non_tensors["uid"] == [[2], ["u0", "u1"]]


def test_hostile_flat_headers() -> None:
    """Every malformed header is a DecodeError with a reason; declared sizes never allocate."""
    assert decode_as(hostile(flat_ext(F4, [2], data=b"\x00" * 8)), RolloutSample).full_batch.meta_info[
        "x"
    ].tolist() == [0.0, 0.0]
    assert "short header" in reason_of(hostile(msgpack.ExtType(EXT_FLAT_ARRAY, b"\x01")))
    assert "unknown array dtype code 250" in reason_of(hostile(flat_ext(250, [1], data=b"\x00")))
    assert "at most 32" in reason_of(hostile(flat_ext(F4, [1] * 33, data=b"\x00" * 4)))
    bad_kind = bytearray(flat(F4, [1], data=b"\x00" * 4))
    bad_kind[2] = 7
    assert "bad kind or length" in reason_of(hostile(msgpack.ExtType(EXT_FLAT_ARRAY, bytes(bad_kind))))
    assert "bad kind or length" in reason_of(hostile(flat_ext(F4, [2, 2], ndim=3, data=b"")))
    assert "bad kind or length" in reason_of(
        hostile(msgpack.ExtType(EXT_FLAT_ARRAY, flat(F4, [1], index=0) + b"x"))
    )
    assert "needs 16 bytes, got 15" in reason_of(hostile(flat_ext(F4, [4], data=b"\x00" * 15)))
    huge = hostile(flat_ext(F4, [1 << 40, 1 << 40], index=0), a0=b"\x00" * 16)
    assert "needs 4835703278458516698824704 bytes, got 16" in reason_of(huge)
    assert "needs 4 bytes, got 16" in reason_of(hostile(flat_ext(F4, [1], index=0), a0=b"\x00" * 16))
    assert "missing array field 'a9'" in reason_of(hostile(flat_ext(F4, [1], index=9)))
    assert "field 'a0'" in reason_of(
        hostile(flat_ext(F4, [4], index=0), a0=b"\x00" * 16), Limits(max_field_bytes=8)
    )
    assert "max_bin_len" in reason_of(hostile(flat_ext(F4, [4], data=b"\x00" * 16)), Limits(max_bin_len=8))


def test_hostile_dataproto_maps() -> None:
    """A bad flat tensor, an object array whose shape disagrees, and first dims that disagree are refused."""
    fields = as_redis(encode(make_rollout(n=2, resp_len=300)))
    body, (tensors, non_tensors, meta) = full_batch_parts(fields)
    bad = dict(tensors, rewards=flat(F4, [3], data=b"\x00" * 8))
    assert "needs 12 bytes, got 8" in reason_of(with_parts(fields, dict(body), [bad, non_tensors, meta]))
    rows = dict(tensors, rewards=flat(F4, [3], data=b"\x00" * 12))
    assert "first dim 3, expected 2" in reason_of(with_parts(fields, dict(body), [rows, non_tensors, meta]))
    odd = dict(non_tensors, uid=[[3], ["a", "b"]])
    assert "has 2 values" in reason_of(with_parts(fields, dict(body), [tensors, odd, meta]))
    assert "malformed object array" in reason_of(
        with_parts(fields, dict(body), [tensors, dict(non_tensors, uid=[[2]]), meta])
    )
    text = dict(tensors, rewards="not an array")
    assert "not a numpy array" in reason_of(with_parts(fields, dict(body), [text, non_tensors, meta]))
    assert "parts must be maps" in reason_of(with_parts(fields, dict(body), [[], non_tensors, meta]))


def test_older_msgpack_array_ext_still_decodes() -> None:
    """Entries from writers that used msgpack-bodied array ExtTypes (code 1/2) decode to the same event."""
    event = make_rollout(n=2, resp_len=300)
    fields = as_redis(encode(event))
    body, (tensors, non_tensors, meta) = full_batch_parts(fields)
    old_tensors = {
        k: msgpack.ExtType(1, msgpack.packb([v.dtype.str, list(v.shape), v.tobytes()]))
        for k, v in event.full_batch.tensors.items()
    }
    old_uid = msgpack.ExtType(2, msgpack.packb(non_tensors["uid"]))
    old_extra = msgpack.ExtType(2, msgpack.packb(non_tensors["extra"]))
    old = with_parts(fields, body, [old_tensors, {"uid": old_uid, "extra": old_extra}, meta])
    old = {k: v for k, v in old.items() if not k.startswith(b"a")}  # every array is inline now
    got = decode_as(old, RolloutSample)
    for key, arr in event.full_batch.tensors.items():
        assert got.full_batch.tensors[key].tobytes() == arr.tobytes()
    assert got.full_batch.non_tensors["extra"].tolist() == [{"k": 0}, {"k": 1}]


def test_encoding_a_mutated_batch_names_the_key() -> None:
    """A DataProto changed after construction so that it is invalid never reaches the wire."""
    event = make_rollout()
    event.full_batch.tensors["rewards"] = [0.5, 0.5]  # type: ignore[assignment]
    with pytest.raises(ValueError, match="rewards"):
        encode(event)
    event = make_rollout()
    event.full_batch.non_tensors["uid"] = ["u0", "u1"]  # type: ignore[assignment]
    with pytest.raises(ValueError, match="uid"):
        encode(event)


@pytest.mark.parametrize("size", [2, 16, 17, 5000])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_non_finite_log_probs_and_rewards_refused(size: int, bad: float, dtype: type) -> None:
    """NaN/±inf anywhere in log-probs or rewards is refused, small or large, any float width."""
    batch = make_batch(n=2, resp_len=size)
    lp = batch.tensors["rollout_log_probs"].astype(dtype)
    lp[-1, -1] = bad
    batch.tensors["rollout_log_probs"] = lp
    assert "rollout_log_probs contains NaN/inf" in reason_of(tamper(make_rollout(), full_batch=batch))
    batch = make_batch(n=2)
    batch.tensors["rewards"] = np.array([0.0, bad], dtype=dtype)
    assert "rewards contains NaN/inf" in reason_of(tamper(make_rollout(), full_batch=batch))


def test_large_finite_values_accepted() -> None:
    """Huge but finite values (whose sum would overflow) are not mistaken for inf."""
    big = np.finfo(np.float32).max
    batch = make_batch(n=2, resp_len=4000)
    batch.tensors["rollout_log_probs"] = np.full((2, 4000), -big, dtype=np.float32)
    batch.tensors["rewards"] = np.array([big, big], dtype=np.float32)
    event = make_rollout(full_batch=batch)
    got = decode_as(as_redis(encode(event)), RolloutSample)
    assert got.full_batch.tensors["rollout_log_probs"].min() == -big


def test_str_keyed_fields_and_memoryviews_decode() -> None:
    """encode()'s own output (str keys, memoryview values) decodes the same as redis-py's bytes."""
    event = make_rollout(n=2, resp_len=300)
    got = decode(encode(event))
    assert isinstance(got, RolloutSample) and isinstance(got.full_batch, DataProto)
    assert np.array_equal(got.full_batch.tensors["responses"], event.full_batch.tensors["responses"])


def test_rollout_layout_is_checked_at_decode() -> None:
    """Widths that disagree (input_ids != P + R) and float token arrays are refused by the schema itself."""
    import numpy as np

    from rollstream.fakes import fake_rollout_sample
    from schemas import DecodeError, decode, encode

    good = fake_rollout_sample("s", prompt_len=4, response_len=6)
    t = dict(good.full_batch.tensors)
    narrow = {**t, "input_ids": t["input_ids"][:, :-1], "attention_mask": t["attention_mask"][:, :-1]}
    floats = {**t, "responses": t["responses"].astype(np.float32)}
    for tensors, needle in ((narrow, "expected width 10"), (floats, "2-D integer array")):
        bad = good.model_copy(update={"full_batch": type(good.full_batch)(tensors, good.full_batch.non_tensors, {})})
        fields = encode(bad)  # encode does not validate the model again; decode must
        try:
            decode(fields)
        except DecodeError as e:
            assert needle in str(e)
        else:
            raise AssertionError(f"decode accepted a sample that should fail with {needle!r}")
