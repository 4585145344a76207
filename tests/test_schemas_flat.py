"""The flat array wire format: header layout, hostile headers, ragged batch parts, older writers,
finite checks."""

from __future__ import annotations

import struct
from typing import Any

import msgpack  # only to read and craft payloads the codec itself would never produce
import numpy as np
import pytest
from test_schemas import as_redis, hostile, make_batch, make_rollout, reason_of, tamper

from schemas import Limits, RolloutSample, decode, decode_as, encode
from schemas.arrays import WIRE_DTYPES
from schemas.ragged import RaggedBatch

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
    """The payload map and the raw [prompt_lens, prompt_ids, response_lens, response_ids, tokens, rows,
    non_tensors, meta_info] of an entry's full_batch."""
    body = msgpack.unpackb(fields[b"payload"])
    return body, msgpack.unpackb(body["full_batch"].data)


def with_parts(fields: dict[bytes, bytes], body: dict[str, Any], parts: list[Any]) -> dict[bytes, bytes]:
    """The entry with its full_batch ext rebuilt from parts."""
    body["full_batch"] = msgpack.ExtType(7, msgpack.packb(parts))
    return {**fields, b"payload": msgpack.packb(body)}


def test_tensors_travel_as_flat_headers() -> None:
    """Out-of-band arrays are a fixed-size header naming their field; small ones carry their bytes inline."""
    event = make_rollout(n=2, resp_len=300)
    fields = as_redis(encode(event))
    _, (plen, _prompt, rlen, resp, tokens, rows, non_tensors, _meta) = full_batch_parts(fields)
    responses = event.full_batch.response_ids
    code, ndim, kind, size, index = struct.unpack("<BBBQI", resp)
    assert (WIRE_DTYPES[code], ndim, kind, size) == ("<i8", 1, 1, 2 * 299)
    assert fields[f"a{index}".encode()] == responses.tobytes()
    assert (
        rlen
        == struct.pack("<BBBQ", WIRE_DTYPES.index("<i4"), 1, 0, 2) + np.array([299, 299], "<i4").tobytes()
    )
    rewards = event.full_batch.rows["rewards"]
    assert rows["rewards"] == struct.pack("<BBBQ", F4, 1, 0, 2) + rewards.tobytes()
    assert set(tokens) == {"rollout_log_probs"} and len(plen) == 3 + 8 + 2 * 4  # each row's own prompt
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


def test_hostile_ragged_parts() -> None:
    """A bad flat array, sizes that disagree with the lengths, an object array whose shape disagrees, and
    parts of the wrong kind are refused, each with a reason naming the part."""
    fields = as_redis(encode(make_rollout(n=2, resp_len=300)))
    body, parts = full_batch_parts(fields)

    def swap(i: int, value: Any) -> dict[bytes, bytes]:
        return with_parts(fields, dict(body), [*parts[:i], value, *parts[i + 1 :]])

    assert "needs 12 bytes, got 8" in reason_of(
        swap(5, dict(parts[5], rewards=flat(F4, [3], data=b"\x00" * 8)))
    )
    assert "rows['rewards'] must have first dimension n=2" in reason_of(
        swap(5, dict(parts[5], rewards=flat(F4, [3], data=b"\x00" * 12))))
    assert "tokens['rollout_log_probs'] has 3 values" in reason_of(
        swap(4, {"rollout_log_probs": flat(F4, [3], data=b"\x00" * 12)}))
    lens = flat(WIRE_DTYPES.index("<i4"), [2], data=np.array([299, 300], "<i4").tobytes())
    assert "response_ids has 598 ids, the lengths say 599" in reason_of(swap(2, lens))
    floats = flat(F4, [2], data=b"\x00" * 8)
    assert "response_lens must be a 1-d integer array" in reason_of(swap(2, floats))
    odd = dict(parts[6], uid=[[3], ["a", "b"]])
    assert "has 2 values" in reason_of(swap(6, odd))
    assert "malformed object array" in reason_of(swap(6, dict(parts[6], uid=[[2]])))
    assert "prompt_ids is str, not an array" in reason_of(swap(1, "not an array"))
    assert "tokens and rows must be maps" in reason_of(swap(4, []))
    assert "parts must be maps" in reason_of(swap(6, []))
    assert "malformed ragged batch ext" in reason_of(with_parts(fields, dict(body), parts[:7]))


def test_older_msgpack_array_ext_still_decodes() -> None:
    """Entries from writers that used msgpack-bodied array ExtTypes (code 1/2) decode to the same event."""
    event = make_rollout(n=2, resp_len=300)
    fields = as_redis(encode(event))
    body, parts = full_batch_parts(fields)
    b = event.full_batch

    def old(v: np.ndarray) -> msgpack.ExtType:
        return msgpack.ExtType(1, msgpack.packb([v.dtype.str, list(v.shape), v.tobytes()]))

    old_parts = [old(b.prompt_lens), old(b.prompt_ids), old(b.response_lens), old(b.response_ids),
                 {k: old(v) for k, v in b.tokens.items()}, {k: old(v) for k, v in b.rows.items()},
                 {"uid": msgpack.ExtType(2, msgpack.packb(parts[6]["uid"])),
                  "extra": msgpack.ExtType(2, msgpack.packb(parts[6]["extra"]))}, parts[7]]
    entry = with_parts(fields, body, old_parts)
    entry = {k: v for k, v in entry.items() if not k.startswith(b"a")}  # every array is inline now
    got = decode_as(entry, RolloutSample)
    assert got.full_batch.response_ids.tobytes() == b.response_ids.tobytes()
    assert got.full_batch.tokens["rollout_log_probs"].tobytes() == b.tokens["rollout_log_probs"].tobytes()
    assert got.full_batch.non_tensors["extra"].tolist() == [{"k": 0}, {"k": 1}]


def test_encoding_a_mutated_batch_names_the_key() -> None:
    """A batch changed after construction so that it is invalid never reaches the wire."""
    event = make_rollout()
    event.full_batch.rows["rewards"] = [0.5, 0.5]  # type: ignore[assignment]
    with pytest.raises(ValueError, match="rewards"):
        encode(event)
    event = make_rollout()
    event.full_batch.tokens["rollout_log_probs"] = [0.5]  # type: ignore[assignment]
    with pytest.raises(ValueError, match="rollout_log_probs"):
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
    lp = batch.tokens["rollout_log_probs"].astype(dtype)
    lp[-1] = bad
    batch.tokens["rollout_log_probs"] = lp
    assert "rollout_log_probs contains NaN/inf" in reason_of(tamper(make_rollout(), full_batch=batch))
    batch = make_batch(n=2)
    batch.rows["rewards"] = np.array([0.0, bad], dtype=dtype)
    assert "rewards contains NaN/inf" in reason_of(tamper(make_rollout(), full_batch=batch))


def test_large_finite_values_accepted() -> None:
    """Huge but finite values (whose float32 sum would overflow) are not mistaken for inf."""
    big = np.finfo(np.float32).max
    batch = make_batch(n=2, resp_len=4000)
    batch.tokens["rollout_log_probs"] = np.full(2 * 3999, -big, dtype=np.float32)
    batch.rows["rewards"] = np.array([big, big], dtype=np.float32)
    event = make_rollout(full_batch=batch)
    got = decode_as(as_redis(encode(event)), RolloutSample)
    assert got.full_batch.tokens["rollout_log_probs"].min() == -big
    batch.tokens["rollout_log_probs"] = np.full(2 * 3999, -np.finfo(np.float64).max, dtype=np.float64)
    assert decode_as(as_redis(encode(make_rollout(full_batch=batch))), RolloutSample).n == 2


def test_str_keyed_fields_and_memoryviews_decode() -> None:
    """encode()'s own output (str keys, memoryview values) decodes the same as redis-py's bytes."""
    event = make_rollout(n=2, resp_len=300)
    got = decode(encode(event))
    assert isinstance(got, RolloutSample) and isinstance(got.full_batch, RaggedBatch)
    assert np.array_equal(got.full_batch.response_ids, event.full_batch.response_ids)


def test_rollout_layout_is_checked_at_decode() -> None:
    """Float token ids are refused by the batch itself, at decode."""
    from rollstream.fakes import fake_rollout_sample

    good = fake_rollout_sample("s", prompt_len=4, response_len=6)
    bad = good.model_copy()
    bad.full_batch.response_ids = good.full_batch.response_ids.astype(np.float32)
    assert "response_ids must be a 1-d integer array" in reason_of(as_redis(encode(bad)))
