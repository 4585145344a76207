"""Events round trip, validation, upgrades, malformed input, and DataProto operations (no Redis)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import msgpack  # only to craft hostile payloads the codec itself would never produce
import numpy as np
import pytest
from pydantic import ValidationError

from schemas import (
    EVENT_MODELS,
    DataProto,
    DeadLetter,
    DecodeError,
    EventBase,
    Limits,
    ParamVersion,
    ProducerStats,
    RolloutSample,
    StepMetrics,
    SyncStepRecord,
    ValidateMetrics,
    decode,
    decode_as,
    decode_payload,
    encode,
    encode_payload,
    legacy,
)
from schemas.batch import object_array
from schemas.legacy import from_padded
from schemas.ragged import RaggedBatch

# --- helpers ------------------------------------------------------------------------------------


def as_redis(fields: Mapping[str, Any]) -> dict[bytes, bytes]:
    """What redis-py hands back for an entry written with these fields: bytes keys and values."""
    return {k.encode(): bytes(v) for k, v in fields.items()}


def assert_arrays_equal(a: Any, b: Any) -> None:
    """Same type, dtype, shape and bytes (NaN-safe) or, for object arrays, same values."""
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.hasobject:
        assert a.tolist() == b.tolist()
    else:
        assert a.tobytes() == b.tobytes()


def assert_batches_equal(a: DataProto, b: DataProto) -> None:
    """Field-for-field DataProto equality."""
    assert a.tensors.keys() == b.tensors.keys() and a.non_tensors.keys() == b.non_tensors.keys()
    for k in a.tensors:
        assert_arrays_equal(a.tensors[k], b.tensors[k])
    for k in a.non_tensors:
        assert_arrays_equal(a.non_tensors[k], b.non_tensors[k])
    assert a.meta_info.keys() == b.meta_info.keys()
    for k, v in a.meta_info.items():
        if isinstance(v, np.ndarray):
            assert_arrays_equal(v, b.meta_info[k])
        else:
            assert v == b.meta_info[k]


def assert_ragged_equal(a: RaggedBatch, b: RaggedBatch) -> None:
    """Field-for-field RaggedBatch equality."""
    for name in ("prompt_ids", "prompt_lens", "response_ids", "response_lens"):
        assert_arrays_equal(getattr(a, name), getattr(b, name))
    for part in ("tokens", "rows", "non_tensors"):
        pa, pb = getattr(a, part), getattr(b, part)
        assert pa.keys() == pb.keys(), part
        for k in pa:
            assert_arrays_equal(pa[k], pb[k])
    assert a.meta_info == b.meta_info


def assert_events_equal(a: EventBase, b: EventBase) -> None:
    """Field-for-field event equality."""
    assert type(a) is type(b)
    for name in type(a).model_fields:
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, DataProto):
            assert_batches_equal(va, vb)
        elif isinstance(va, RaggedBatch):
            assert_ragged_equal(va, vb)
        else:
            assert va == vb, name


def make_batch(n: int = 2, prompt_len: int = 3, resp_len: int = 4, seed: int = 0) -> RaggedBatch:
    """A small GRPO group with the standard keys (built padded, as verl would, then made ragged: each
    response one token shorter than resp_len)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 100, (n, prompt_len), dtype=np.int64)
    responses = rng.integers(0, 100, (n, resp_len), dtype=np.int64)
    response_mask = np.ones((n, resp_len), dtype=np.int64)
    response_mask[:, -1] = 0
    return from_padded(
        DataProto(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": np.concatenate([prompts, responses], axis=1),
                "attention_mask": np.concatenate([np.ones_like(prompts), response_mask], axis=1),
                "response_mask": response_mask,
                "rollout_log_probs": -rng.random((n, resp_len), dtype=np.float32),
                "rewards": rng.random(n, dtype=np.float32),
            },
            non_tensors={
                "uid": object_array([f"u{i}" for i in range(n)]),
                "extra": object_array([{"k": i} for i in range(n)]),
            },
            meta_info={"temperature": 1.0, "agent_name": "partial_single_turn_agent"},
        )
    )


def make_rollout(n: int = 2, resp_len: int = 4, **overrides: Any) -> RolloutSample:
    """A valid RolloutSample of n trajectories."""
    kwargs: dict[str, Any] = {
        "sample_id": "p0:17",
        "epoch": 1,
        "param_version": 5,
        "full_batch": make_batch(n, resp_len=resp_len),
        "agent_loop_output_list": [{"num_turns": 1, "response_length": resp_len, "reward": 0.5}] * n,
        "processing_times": [0.25] * n,
        "tool_calls": [0.1 * (i + 1) for i in range(n)],  # per trajectory
        "param_version_start": [5] * n,
        "param_version_end": [5] * (n - 1) + [6],
        "rollout_status": {"queue_size": 3, "idle_ratio": 0.1},
        "producer": "rollout_00",
    }
    kwargs.update(overrides)
    return RolloutSample(**kwargs)


def all_events() -> list[EventBase]:
    """One instance of every event type."""
    return [
        make_rollout(),
        make_rollout(n=3, resp_len=300),  # arrays large enough to travel out of band
        ParamVersion(
            version=3, uri="file:///tmp/w3.safetensors", sha256="ab" * 32, bytes=1234, global_step=3
        ),
        StepMetrics(
            type="local_update", global_step=2, local_step=1, sample_count=8, metrics={"actor/loss": 0.5}
        ),
        StepMetrics(type="step_end", global_step=2, local_step=4, sample_count=32, num_local_updates=4),
        SyncStepRecord(global_step=2, num_local_updates=4, metrics={"a": 1.0}, source_ids=["1-0", "2-0"]),
        ValidateMetrics(param_version=2, global_step=2, metrics={"val/acc": 0.75}),
        ProducerStats(
            producer="rollout_01",
            param_version=2,
            samples=10,
            tokens=999,
            gen_tokens_per_s=1.5e3,
            idle_ratio=0.2,
            versions_in_use=[1, 2],
            metrics={"x": -1.0},
        ),
        DeadLetter(
            source="rs:{run}:rollouts", source_id="5-0", reason="bad", fields={"payload": b"\x00" * 10}
        ),
        DeadLetter(
            source="s", source_id="6-0", reason="big", fields={"payload": bytes(range(256)) * 20, "a0": b""}
        ),
    ]


def tamper(event: EventBase, **changes: Any) -> dict[bytes, bytes]:
    """Encode a small event, rewrite its payload map with `changes` (None deletes a key), return fields."""
    fields = encode(event)
    assert "a0" not in fields, "tamper() needs an event without out-of-band arrays"
    body = decode_payload(bytes(fields["payload"]))
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    fields["payload"] = encode_payload(body)
    return as_redis(fields)


def reason_of(fields: Mapping[Any, Any], limits: Limits | None = None) -> str:
    """Decode, expecting DecodeError; return its reason."""
    with pytest.raises(DecodeError) as info:
        decode(fields) if limits is None else decode(fields, limits)
    return str(info.value)


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("event", all_events(), ids=lambda e: f"{e.type}")
def test_round_trip_every_event(event: EventBase) -> None:
    """decode(encode(x)) == x field for field, through redis-style bytes."""
    assert_events_equal(decode(as_redis(encode(event))), event)


@pytest.mark.parametrize("event", all_events(), ids=lambda e: f"{e.type}")
def test_round_trip_without_bytes_conversion(event: EventBase) -> None:
    """decode accepts encode's output directly (str keys, memoryview values)."""
    assert_events_equal(decode(encode(event)), event)


def test_header_fields_come_first_and_are_readable() -> None:
    """Rollout header: type, schema, sample_id, param_version, producer; then payload; then a0, a1, …"""
    event = make_rollout(n=3, resp_len=3000)
    fields = encode(event)
    keys = list(fields)
    assert keys[:6] == ["type", "schema", "sample_id", "param_version", "producer", "payload"]
    assert all(k.startswith("a") for k in keys[6:]) and len(keys) > 6
    assert fields["type"] == b"rollout" and fields["schema"] == b"5" and fields["sample_id"] == b"p0:17"
    assert all(isinstance(fields[k], memoryview) for k in keys[6:])
    metrics = encode(StepMetrics(type="step_end", global_step=7, local_step=4, sample_count=64))
    assert list(metrics)[:7] == [
        "type",
        "schema",
        "global_step",
        "local_step",
        "sample_count",
        "rank",
        "payload",
    ]
    assert metrics["type"] == b"step_end" and metrics["global_step"] == b"7"
    params = encode(ParamVersion(version=1, uri="u", sha256="s", bytes=9, global_step=1))
    assert list(params)[2:7] == ["version", "uri", "sha256", "bytes", "global_step"]
    dead = encode(DeadLetter(source="src", source_id="1-0", reason="why"))
    assert list(dead)[2:5] == ["source", "source_id", "reason"] and dead["reason"] == b"why"


def test_older_header_fields_still_decode_and_must_agree() -> None:
    """epoch, n and tokens, which encoders up to b0225e4 wrote, still decode and are still held to the
    payload; any other extra field is refused."""
    event = make_rollout(n=3, resp_len=300)
    fields = as_redis(encode(event))
    old = {**fields, b"epoch": b"1", b"n": b"3", b"tokens": str(event.num_tokens).encode()}
    assert_events_equal(decode(old), event)
    assert "header n=b'4' != payload n=b'3'" in reason_of({**old, b"n": b"4"})
    assert "header tokens=" in reason_of({**old, b"tokens": b"1"})
    assert "header epoch=" in reason_of({**fields, b"epoch": b"0"})
    assert "unknown field 'num_tokens'" in reason_of({**fields, b"num_tokens": b"1"})


def test_rollout_properties() -> None:
    """n, and num_tokens: the response_mask's ones when it is there, else every response token."""
    event = make_rollout(n=2, resp_len=4)
    assert event.n == 2 and event.num_tokens == 6 and "response_mask" not in event.full_batch.tokens
    batch = make_batch()
    batch.tokens["response_mask"] = np.array([1, 0, 1, 0, 0, 1], np.uint8)  # tool tokens
    assert make_rollout(full_batch=batch).num_tokens == 3


def test_created_at_and_schema_defaults() -> None:
    """Timestamps come from a default factory; schema_version defaults to SCHEMA, also where a model bumped
    it; a subclass that bumps SCHEMA without its default is refused when the class is made."""
    a = ValidateMetrics(param_version=1, global_step=1)
    b = ValidateMetrics(param_version=1, global_step=1)
    assert a.schema_version == ValidateMetrics.SCHEMA == 1
    assert 0 < a.created_at <= b.created_at
    assert StepMetrics(type="step_end", global_step=1, local_step=1, sample_count=1).schema_version == 2
    assert make_rollout().schema_version == RolloutSample.SCHEMA == 5
    for model in EVENT_MODELS.values():
        assert model.model_fields["schema_version"].default == model.SCHEMA, model.__name__
    with pytest.raises(TypeError, match="Bumped.SCHEMA is 3 but schema_version defaults to 1"):

        class Bumped(EventBase):
            SCHEMA: ClassVar[int] = 3
            type: Literal["bumped"] = "bumped"


# --- model validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"processing_times": [1.0]}, "processing_times has 1 entries"),
        ({"tool_calls": [1.0, 2.0, 3.0]}, "tool_calls has 3 entries"),
        ({"param_version_start": [7, 5]}, "param_version_start[0]=7 > param_version_end[0]=5"),
        ({"agent_loop_output_list": []}, "agent_loop_output_list has 0 entries"),
        ({"extra_field": 1}, "extra_field"),
    ],
)
def test_rollout_validation(overrides: dict[str, Any], needle: str) -> None:
    """Inconsistent rollouts are refused at construction."""
    with pytest.raises(ValidationError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        make_rollout(**overrides)


def test_rollout_rejects_nan_logprobs_rewards_and_size_mismatch() -> None:
    """Behaviour log-probs and rewards must be finite; every array's size agrees with the lengths; n >= 1."""
    batch = make_batch()
    batch.tokens["rollout_log_probs"] = batch.tokens["rollout_log_probs"].copy()
    batch.tokens["rollout_log_probs"][1] = np.nan
    with pytest.raises(ValidationError, match="rollout_log_probs contains NaN/inf"):
        make_rollout(full_batch=batch)
    batch.tokens["rollout_log_probs"][1] = -np.inf
    with pytest.raises(ValidationError, match="rollout_log_probs contains NaN/inf"):
        make_rollout(full_batch=batch)
    batch = make_batch()
    batch.rows["rewards"] = np.array([1.0, np.inf], dtype=np.float32)
    with pytest.raises(ValidationError, match="rewards contains NaN/inf"):
        make_rollout(full_batch=batch)
    b = make_batch()
    with pytest.raises(ValueError, match=r"tokens\['rollout_log_probs'\] has 2 values, response_lens say 6"):
        RaggedBatch(
            b.prompt_ids, b.prompt_lens, b.response_ids, b.response_lens, {"rollout_log_probs": np.zeros(2)}
        )
    with pytest.raises(ValueError, match="response_ids has 6 ids, the lengths say 7"):
        RaggedBatch(b.prompt_ids, b.prompt_lens, b.response_ids, np.array([3, 4], np.int32))
    with pytest.raises(ValueError, match="prompt_lens has 3 entries"):
        RaggedBatch(np.zeros(3, np.int64), np.array([1, 1, 1]), b.response_ids, b.response_lens)
    with pytest.raises(ValueError, match="negative length"):
        RaggedBatch(b.prompt_ids, b.prompt_lens, b.response_ids, np.array([7, -1]))
    with pytest.raises(ValidationError, match="no trajectories"):
        make_rollout(
            n=1,
            full_batch=RaggedBatch(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64),
                                   np.zeros(0, np.int32)),
            agent_loop_output_list=[],
            processing_times=[],
            param_version_start=[],
            param_version_end=[],
        )


def test_other_model_validation() -> None:
    """Negative versions, wrong metrics type literal, wrong schema version are refused."""
    with pytest.raises(ValidationError):
        ParamVersion(version=-1, uri="u", sha256="s", bytes=1, global_step=0)
    with pytest.raises(ValidationError):
        StepMetrics(type="record", global_step=1, local_step=1, sample_count=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="schema_version 0"):
        ValidateMetrics(param_version=1, global_step=1, schema_version=0)


# --- malformed input ----------------------------------------------------------------------------


def small_rollout() -> RolloutSample:
    """A rollout whose arrays all travel inline (so its payload can be rewritten)."""
    return make_rollout(n=2, resp_len=4)


def test_garbage_and_truncated_payload() -> None:
    """Random bytes and cut-off msgpack are DecodeErrors, as is a missing payload."""
    assert "payload" in reason_of({b"type": b"rollout"})
    assert reason_of({b"payload": b"\xc1\xc1\xc1 not msgpack"})
    good = as_redis(encode(small_rollout()))
    for cut in (1, len(good[b"payload"]) // 2, len(good[b"payload"]) - 1):
        truncated = {**good, b"payload": good[b"payload"][:cut]}
        assert reason_of(truncated)
    assert "not a map" in reason_of({b"payload": encode_payload([1, 2, 3])})
    assert "entry fields must be a mapping" in reason_of([1, 2])  # type: ignore[arg-type]


def test_wrong_field_type_names_the_field() -> None:
    """A str field holding an int: reason names the field."""
    reason = reason_of(tamper(small_rollout(), sample_id=123))
    assert "sample_id" in reason and "RolloutSample" in reason


def test_missing_field_names_the_field() -> None:
    """A required field absent from the payload."""
    reason = reason_of(tamper(small_rollout(), producer=None))
    assert "producer" in reason and "required" in reason.lower()


def test_extra_field_refused() -> None:
    """extra='forbid' holds on the wire too."""
    assert "surprise" in reason_of(tamper(small_rollout(), surprise=1))


def test_schema_versions() -> None:
    """A future version, an old one without upgrade, and a missing version are refused."""
    event = ValidateMetrics(param_version=1, global_step=1)
    assert "newer than supported" in reason_of(tamper(event, schema_version=99))
    assert "no upgrade from schema_version 0" in reason_of(tamper(event, schema_version=0))
    assert "schema_version" in reason_of(tamper(event, schema_version="1"))


def test_unknown_and_disagreeing_types() -> None:
    """Unknown type in payload; header type that disagrees with the payload."""
    event = ValidateMetrics(param_version=1, global_step=1)
    assert "unknown event type" in reason_of({**tamper(event, type="nope"), b"type": b"nope"})
    fields = as_redis(encode(event))
    fields[b"type"] = b"rollout"
    assert "header type" in reason_of(fields)


def test_oversized_bin_with_small_limits() -> None:
    """Limits are enforced: a bin over max_bin_len is refused."""
    fields = as_redis(encode(small_rollout()))
    assert "max_bin_len" in reason_of(fields, Limits(max_bin_len=16))
    assert "max_str_len" in reason_of(fields, Limits(max_str_len=4))
    assert "over the 10 limit" in reason_of(fields, Limits(max_payload_bytes=10))
    big = as_redis(encode(make_rollout(resp_len=300)))
    assert "field 'a0' is 4784 bytes, over the 100 limit" in reason_of(big, Limits(max_field_bytes=100))
    assert decode_as(fields, RolloutSample, Limits()).sample_id == "p0:17"


def test_nan_logprobs_on_the_wire() -> None:
    """A payload carrying NaN behaviour log-probs is refused on decode."""
    batch = make_batch()
    batch.tokens["rollout_log_probs"] = np.full(6, np.nan, dtype=np.float32)
    assert "rollout_log_probs contains NaN/inf" in reason_of(tamper(small_rollout(), full_batch=batch))


def test_lengths_disagree_on_the_wire() -> None:
    """Per-trajectory list length != n, and ragged arrays whose sizes disagree with the lengths."""
    assert "param_version_end has 3 entries" in reason_of(
        tamper(small_rollout(), param_version_end=[5, 5, 5])
    )
    body = make_batch()
    body.rows["rewards"] = np.zeros(3, dtype=np.float32)  # after the constructor's check
    assert "rows['rewards'] has 3 values (12 bytes of <f4), the lengths say 2" in reason_of(
        tamper(small_rollout(), full_batch=body))
    body = make_batch()
    body.response_lens = np.array([3, 4], np.int32)
    assert "response_ids has 6 values (48 bytes of <i8), the lengths say 7" in reason_of(
        tamper(small_rollout(), full_batch=body)
    )
    body = make_batch()
    body.tokens["token_level_scores"] = np.zeros(5, np.float32)
    assert "tokens['token_level_scores'] has 5 values" in reason_of(tamper(small_rollout(), full_batch=body))


def array_ext(dtype: str, shape: list[int], ref: bytes | int) -> msgpack.ExtType:
    """A hand-made array ExtType (code 1), for hostile inputs."""
    return msgpack.ExtType(1, msgpack.packb([dtype, shape, ref]))


def hostile(meta_value: Any, **extra_fields: bytes) -> dict[bytes, bytes]:
    """A rollout entry whose full_batch.meta_info['x'] is the given (raw msgpack-able) value."""
    fields = tamper(small_rollout())
    body = msgpack.unpackb(fields[b"payload"])
    body["full_batch"][7]["x"] = meta_value  # the ragged batch's meta_info (schema 5: a list in the payload)
    fields[b"payload"] = msgpack.packb(body)
    fields.update({k.encode(): v for k, v in extra_fields.items()})
    return fields


def test_hostile_arrays() -> None:
    """Huge declared shapes, short buffers, bad dtypes, missing fields, unknown ext codes."""
    assert decode_as(hostile(array_ext("<f4", [2, 2], b"\x00" * 16)), RolloutSample).full_batch.meta_info[
        "x"
    ].shape == (2, 2)
    huge = hostile(array_ext("<f4", [1 << 40, 1 << 40], 0), a0=b"\x00" * 16)
    assert "needs 4835703278458516698824704 bytes, got 16" in reason_of(huge)
    assert "needs 16 bytes, got 15" in reason_of(hostile(array_ext("<f4", [4], b"\x00" * 15)))
    assert "negative" in reason_of(hostile(array_ext("<f4", [-1], b"")))
    assert "at most 32" in reason_of(hostile(array_ext("<f4", [1] * 40, b"\x00" * 4)))
    for bad in ("|O", "<U4", "|V8", "float32", "nonsense", "[('a','<i4')]"):
        assert "dtype" in reason_of(hostile(array_ext(bad, [1], b"\x00" * 4))), bad
    assert "missing array field 'a7'" in reason_of(hostile(array_ext("<f4", [1], 7)))
    assert "unknown torch dtype" in reason_of(hostile(array_ext("torch.nn", [1], b"\x00")))
    assert "unknown msgpack ext type 42" in reason_of(hostile(msgpack.ExtType(42, b"")))
    assert "malformed array ext" in reason_of(hostile(msgpack.ExtType(1, msgpack.packb([1]))))
    assert "has 1 values" in reason_of(hostile(msgpack.ExtType(2, msgpack.packb([[1 << 60], ["a"]]))))
    nested = msgpack.ExtType(3, msgpack.packb([{}, {}, {}]))
    for _ in range(10):
        nested = msgpack.ExtType(3, msgpack.packb([{}, {}, {"x": nested}]))
    assert "deeper than" in reason_of(hostile(nested))


# --- upgrades -----------------------------------------------------------------------------------


@pytest.fixture
def param_version_v0_upgrade(monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema 0 of param_version called the size field `size`; an upgrade renames it to `bytes`."""

    def v0_to_v1(data: dict[str, Any]) -> dict[str, Any]:
        """Rename size -> bytes."""
        data["bytes"] = data.pop("size")
        return data

    monkeypatch.setitem(legacy._UPGRADES, ("param_version", 0), v0_to_v1)
    monkeypatch.setitem(legacy._OLDEST, "param_version", 0)


def test_upgrade_hook_applied(param_version_v0_upgrade: None) -> None:
    """An old payload is upcast in sequence and then validated."""
    event = ParamVersion(version=4, uri="u", sha256="s", bytes=77, global_step=4)
    old = tamper(event, schema_version=0, bytes=None, size=77)
    old[b"schema"] = b"0"
    upgraded = decode(old)
    assert isinstance(upgraded, ParamVersion)
    assert upgraded.bytes == 77 and upgraded.schema_version == 1 and upgraded.created_at == event.created_at


def test_a_schema_older_than_the_oldest_decoded_is_refused() -> None:
    event = ParamVersion(version=4, uri="u", sha256="s", bytes=77, global_step=4)
    assert "no upgrade" in reason_of(tamper(event, schema_version=0, bytes=None, size=77))


# --- import hygiene -----------------------------------------------------------------------------


def test_import_pulls_no_torch_or_redis() -> None:
    """`import schemas` must not import torch or redis."""
    code = "import sys, schemas; assert 'torch' not in sys.modules and 'redis' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- DataProto ----------------------------------------------------------------------------------


def small_proto() -> DataProto:
    """Three rows with hand-checkable values."""
    return DataProto(
        tensors={
            "x": np.array([[0, 1], [10, 11], [20, 21]]),
            "y": np.array([0.0, 1.0, 2.0], dtype=np.float32),
        },
        non_tensors={"uid": object_array(["a", "b", "c"])},
        meta_info={"m": 1},
    )


def test_dataproto_len() -> None:
    """len counts the rows; object arrays stay object arrays."""
    dp = small_proto()
    assert len(dp) == 3 and len(DataProto()) == 0
    assert dp.non_tensors["uid"].dtype == object


def test_dataproto_validation_names_the_key() -> None:
    """Mismatched first dims, non-arrays, 0-d arrays and object tensors are refused with the key named."""
    with pytest.raises(ValueError, match=r"\['b'\] has first dim 2, expected 3"):
        DataProto({"a": np.zeros(3), "b": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\['uid'\] has first dim 1"):
        DataProto({"a": np.zeros(3)}, {"uid": np.array(["x"], dtype=object)})
    with pytest.raises(ValueError, match=r"\['a'\] is list"):
        DataProto({"a": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"\['a'\] is 0-d"):
        DataProto({"a": np.array(1)})
    with pytest.raises(ValueError, match="object dtype"):
        DataProto({"a": np.array(["x"], dtype=object)})


def test_decode_as_requires_the_type() -> None:
    """decode_as narrows the union and refuses other event types."""
    fields = as_redis(encode(ValidateMetrics(param_version=1, global_step=1)))
    assert decode_as(fields, ValidateMetrics).param_version == 1
    assert "expected RolloutSample, got ValidateMetrics" in str(
        pytest.raises(DecodeError, decode_as, fields, RolloutSample).value
    )
