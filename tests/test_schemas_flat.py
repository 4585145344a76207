"""The flat array wire format: header layout, hostile headers, ragged batch parts, older writers,
finite checks."""

from __future__ import annotations

import struct
from pathlib import Path
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


EXT_RAGGED_BATCH_3, EXT_RAGGED_BATCH = 7, 8
SCHEMA3 = Path(__file__).parent / "data" / "schema3" / "entries.msgpack"  # committed schema-3 entries
SCHEMA4 = Path(__file__).parent / "data" / "schema4" / "entries.msgpack"  # committed schema-4 entries


def full_batch_parts(fields: dict[bytes, bytes]) -> tuple[dict[str, Any], list[Any]]:
    """The payload map and the raw parts of an entry's full_batch (schema 5: the payload's list itself,
    schema 4: the EXT_RAGGED_BATCH's list, both [prompt_lens, response_lens, prompt_ids, response_ids,
    tokens, rows, non_tensors, meta_info]; schema 3: [prompt_lens, prompt_ids, response_lens, response_ids,
    tokens, rows, non_tensors, meta_info])."""
    body = msgpack.unpackb(fields[b"payload"])
    batch = body["full_batch"]
    return body, list(batch) if type(batch) is list else msgpack.unpackb(batch.data)


def with_parts(fields: dict[bytes, bytes], body: dict[str, Any], parts: list[Any],
               code: int | None = None) -> dict[bytes, bytes]:
    """The entry with its full_batch rebuilt from parts: the list itself (schema 5), or an ext of `code`."""
    body["full_batch"] = parts if code is None else msgpack.ExtType(code, msgpack.packb(parts))
    return {**fields, b"payload": msgpack.packb(body)}


def test_ragged_batch_layout() -> None:
    """Schema 5: the batch is a list in the payload (no ext); lengths are int lists, ids and per-token arrays
    [dtype code, data] (out-of-band ones name their field, small ones carry their bytes), 1-d per-row arrays
    [dtype code, data] too, a 1-d object array its values."""
    event = make_rollout(n=2, resp_len=300)
    fields = as_redis(encode(event))
    body, (plen, rlen, prompt, resp, tokens, rows, non_tensors, _meta) = full_batch_parts(fields)
    assert type(body["full_batch"]) is list and body["schema_version"] == 5
    b = event.full_batch
    assert (plen, rlen) == ([3, 3], [299, 299])  # each row's own prompt
    assert prompt == [WIRE_DTYPES.index("<i8"), b.prompt_ids.tobytes()]
    assert WIRE_DTYPES[resp[0]] == "<i8" and fields[f"a{resp[1]}".encode()] == b.response_ids.tobytes()
    lp = tokens["rollout_log_probs"]
    assert lp[0] == F4 and fields[f"a{lp[1]}".encode()] == b.tokens["rollout_log_probs"].tobytes()
    assert rows["rewards"] == [F4, b.rows["rewards"].tobytes()]
    assert non_tensors["uid"] == ["u0", "u1"]


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
    """Schema 5: every check of RaggedBatch.check, made where decode reads the part, refuses a bad part with a
    reason naming the field and its value: lengths (type, sign, count), ids and token sizes against the
    lengths, dtypes, per-row arrays' first dimension, rows numeric, maps and keys."""
    fields = as_redis(encode(make_rollout(n=2, resp_len=300)))
    body, parts = full_batch_parts(fields)
    i4 = WIRE_DTYPES.index("<i4")

    def swap(i: int, value: Any) -> dict[bytes, bytes]:
        return with_parts(fields, dict(body), [*parts[:i], value, *parts[i + 1 :]])

    assert "response_lens must be a list of ints in [0, 2**31), got [299, -1]" in reason_of(
        swap(1, [299, -1])
    )
    assert "response_lens must be a list of ints in [0, 2**31), got [299.0, 299]" in reason_of(
        swap(1, [299.0, 299])
    )
    assert "prompt_lens must be a list of ints in [0, 2**31), got [2147483648]" in reason_of(
        swap(0, [1 << 31])
    )
    assert "response_lens must be a list of ints in [0, 2**31), got 'x'" in reason_of(swap(1, "x"))
    assert "prompt_lens has 3 entries, expected 1 (shared) or n=2" in reason_of(swap(0, [3, 3, 3]))
    assert "response_ids has 598 values (4784 bytes of <i8), the lengths say 599" in reason_of(
        swap(1, [299, 300])
    )
    assert "prompt_ids has 6 values (48 bytes of <i8), the lengths say 7" in reason_of(swap(0, [3, 4]))
    assert "response_ids must be a 1-d integer array, got dtype code 10 (<f4)" in reason_of(
        swap(3, [F4, parts[3][1]])
    )
    assert "prompt_ids must be a 1-d integer array, got dtype code 250" in reason_of(swap(2, [250, b""]))
    assert "prompt_ids must be [dtype code, data], got str" in reason_of(swap(2, "not an array"))
    assert "missing array field 'a9'" in reason_of(swap(3, [parts[3][0], 9]))
    assert "tokens['rollout_log_probs'] has 3 values (12 bytes of <f4), the lengths say 598" in reason_of(
        swap(4, {"rollout_log_probs": [F4, b"\x00" * 12]})
    )
    assert "tokens['x'] must be a 1-d numeric array, got dtype code 99" in reason_of(
        swap(4, {"x": [99, b""]})
    )
    assert "tokens key b'x' is not a str" in reason_of(swap(4, {b"x": [F4, b""]}))
    assert "needs 12 bytes, got 8" in reason_of(
        swap(5, dict(parts[5], rewards=flat(F4, [3], data=b"\x00" * 8)))
    )
    assert "rows['rewards'] must have first dimension n=2 and a numeric dtype, got <f4[3]" in reason_of(
        swap(5, dict(parts[5], rewards=flat(F4, [3], data=b"\x00" * 12)))
    )
    assert "rows['rewards'] must have first dimension n=2 and a numeric dtype, got |O[2]" in reason_of(
        swap(5, dict(parts[5], rewards=msgpack.ExtType(2, msgpack.packb([[2], ["a", "b"]]))))
    )
    assert "rows['rewards'] must be a 1-d numeric array, got dtype code 1.0" in reason_of(
        swap(5, dict(parts[5], rewards=[1.0, 2.0]))
    )
    assert "rows['rewards'] has 3 values (12 bytes of <f4), the lengths say 2" in reason_of(
        swap(5, dict(parts[5], rewards=[F4, b"\x00" * 12]))
    )
    assert "rows key b'r' is not a str" in reason_of(swap(5, {b"r": [F4, b"\x00" * 8]}))
    assert "non_tensors['uid'] must have first dimension n=2, got 3 values" in reason_of(
        swap(6, dict(parts[6], uid=["a", "b", "c"]))
    )
    two = decode_as(swap(5, dict(parts[5], scores=flat(F4, [2, 2], data=b"\x00" * 16))), RolloutSample)
    assert two.full_batch.rows["scores"].shape == (2, 2)  # rows of other shapes: flat headers
    assert "non_tensors['uid'] must have first dimension n=2, got <i4[1]" in reason_of(
        swap(6, dict(parts[6], uid=flat(i4, [1], data=b"\x00" * 4)))
    )
    assert "non_tensors['uid'] must have first dimension n=2, got str" in reason_of(
        swap(6, dict(parts[6], uid="ab"))
    )
    assert "tokens and meta_info must be maps" in reason_of(swap(4, []))
    assert "rows must be a map" in reason_of(swap(5, []))
    assert "non_tensors must be a map" in reason_of(swap(6, []))
    assert "full_batch has 7 parts, not 8" in reason_of(with_parts(fields, dict(body), parts[:7]))
    assert "full_batch: Input should be an instance of RaggedBatch" in reason_of(
        swap_batch(fields, body, "x")
    )
    one = decode_as(swap(6, dict(parts[6], uid=[["x"], {"k": 1}])), RolloutSample).full_batch.non_tensors[
        "uid"
    ]
    assert one.shape == (2,) and one.tolist() == [["x"], {"k": 1}]  # values kept as they are, never broadcast


def swap_batch(fields: dict[bytes, bytes], body: dict[str, Any], batch: Any) -> dict[bytes, bytes]:
    """The entry with its payload's full_batch replaced by `batch`."""
    return {**fields, b"payload": msgpack.packb({**body, "full_batch": batch})}


def test_hostile_schema_4_ragged_parts() -> None:
    """Schema 4 (still read: the batch in an EXT_RAGGED_BATCH ext) makes the same checks, each naming the
    part; a schema-4 entry whose batch is a bare list (schema 5's form) is refused."""
    fields = msgpack.unpackb(SCHEMA4.read_bytes())["s4_big_vocab_out_of_band"]["fields"]
    body, parts = full_batch_parts(fields)
    assert body["full_batch"].code == EXT_RAGGED_BATCH and body["schema_version"] == 4

    def swap(i: int, value: Any) -> dict[bytes, bytes]:
        return with_parts(fields, dict(body), [*parts[:i], value, *parts[i + 1 :]], EXT_RAGGED_BATCH)

    assert decode_as(swap(0, parts[0]), RolloutSample).n == 2
    assert "response_lens must be a list of ints in [0, 2**31), got [600, -1]" in reason_of(
        swap(1, [600, -1])
    )
    assert "response_ids has 602 values (2408 bytes of <i4), the lengths say 603" in reason_of(
        swap(1, [600, 3])
    )
    assert "tokens key b'x' is not a str" in reason_of(swap(4, {b"x": [F4, b""]}))
    short = with_parts(fields, dict(body), parts[:7], EXT_RAGGED_BATCH)
    assert "malformed ragged batch ext" in reason_of(short)
    bare = with_parts(fields, dict(body), parts)  # schema 5's list in a schema-4 payload
    assert "full_batch: Input should be an instance of RaggedBatch" in reason_of(bare)


def test_hostile_schema_3_ragged_parts() -> None:
    """Schema 3 (still read): a bad flat array, sizes that disagree with the lengths, an object array whose
    shape disagrees, and parts of the wrong kind are refused, each with a reason naming the part."""
    fields = msgpack.unpackb(SCHEMA3.read_bytes())["s3_big_vocab_out_of_band"]["fields"]
    body, parts = full_batch_parts(fields)
    assert body["full_batch"].code == EXT_RAGGED_BATCH_3

    def swap(i: int, value: Any) -> dict[bytes, bytes]:
        return with_parts(fields, dict(body), [*parts[:i], value, *parts[i + 1 :]], EXT_RAGGED_BATCH_3)

    assert decode_as(swap(0, parts[0]), RolloutSample).n == 2
    assert "needs 12 bytes, got 8" in reason_of(
        swap(5, dict(parts[5], rewards=flat(F4, [3], data=b"\x00" * 8)))
    )
    assert "rows['rewards'] must have first dimension n=2" in reason_of(
        swap(5, dict(parts[5], rewards=flat(F4, [3], data=b"\x00" * 12)))
    )
    assert "tokens['rollout_log_probs'] has 3 values" in reason_of(
        swap(4, {"rollout_log_probs": flat(F4, [3], data=b"\x00" * 12)})
    )
    lens = flat(WIRE_DTYPES.index("<i4"), [2], data=np.array([600, 3], "<i4").tobytes())
    assert "response_ids has 602 ids, the lengths say 603" in reason_of(swap(2, lens))
    floats = flat(F4, [2], data=b"\x00" * 8)
    assert "response_lens must be a 1-d integer array" in reason_of(swap(2, floats))
    odd = dict(parts[6], uid=[[3], ["a", "b"]])
    assert "has 2 values" in reason_of(swap(6, odd))
    assert "malformed object array" in reason_of(swap(6, dict(parts[6], uid=[[2]])))
    assert "prompt_ids is str, not an array" in reason_of(swap(1, "not an array"))
    assert "tokens and rows must be maps" in reason_of(swap(4, []))
    assert "parts must be maps" in reason_of(swap(6, []))
    assert "malformed ragged batch ext" in reason_of(
        with_parts(fields, dict(body), parts[:7], EXT_RAGGED_BATCH_3)
    )


def test_older_msgpack_array_ext_still_decodes() -> None:
    """Entries from writers that used msgpack-bodied array ExtTypes (code 1/2) decode to the same event."""
    event = make_rollout(n=2, resp_len=300)
    fields = as_redis(encode(event))
    body, parts = full_batch_parts(fields)
    b = event.full_batch

    def old(v: np.ndarray) -> msgpack.ExtType:
        return msgpack.ExtType(1, msgpack.packb([v.dtype.str, list(v.shape), v.tobytes()]))

    old_parts = [
        old(b.prompt_lens),
        old(b.prompt_ids),
        old(b.response_lens),
        old(b.response_ids),
        {k: old(v) for k, v in b.tokens.items()},
        {k: old(v) for k, v in b.rows.items()},
        {
            "uid": msgpack.ExtType(2, msgpack.packb([[2], parts[6]["uid"]])),
            "extra": msgpack.ExtType(2, msgpack.packb([[2], parts[6]["extra"]])),
        },
        parts[7],
    ]
    body["schema_version"] = 3  # (a schema-3 writer's layout)
    entry = with_parts({**fields, b"schema": b"3"}, body, old_parts, EXT_RAGGED_BATCH_3)
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


@pytest.mark.filterwarnings("error")  # the finite check must not warn (check_finite: vdot, no np.errstate)
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


@pytest.mark.filterwarnings("error")  # an overflow in the finite check's one pass must not warn either
def test_large_finite_values_accepted() -> None:
    """Huge but finite values (whose float32 sum of squares overflows) are not mistaken for inf."""
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
    from rollstream.testing.fakes import fake_rollout_sample

    good = fake_rollout_sample("s", prompt_len=4, response_len=6)
    bad = good.model_copy()
    bad.full_batch.response_ids = good.full_batch.response_ids.astype(np.float32)
    assert "response_ids must be a 1-d integer array" in reason_of(as_redis(encode(bad)))
