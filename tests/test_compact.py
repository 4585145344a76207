"""The compact batch layout (RolloutSample schema 2) against the plain one (schema 1): the same DataProto.

Property test over random shapes, dtypes, padding, shared and per-row prompts, masks with holes, log-probs
with and without stray values; bytes per token; hostile layouts are DecodeErrors naming field and value.
"""

from __future__ import annotations

from typing import Any

import msgpack  # only to read and craft payloads the codec itself would never produce
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schemas import as_redis

from rollstream.fakes import fake_rollout_sample
from schemas import DataProto, DecodeError, RolloutSample, decode_as, encode
from schemas.arrays import array_from_flat
from schemas.codec import EXT_COMPACT_BATCH, EXT_DATAPROTO

TOKEN_DTYPES = ["<i8", "<i4", "<u4", "<i2", ">i8"]
MASK_DTYPES = ["<i8", "<i4", "|b1", "|i1", "|u1"]
FLOAT_DTYPES = ["<f4", "<f2", "<f8", ">f4"]


def wire_bytes(fields: dict[str, Any]) -> int:
    """Bytes an entry's names and values take."""
    return sum(len(k) + memoryview(v).nbytes for k, v in fields.items())


def batch_ext(fields: dict[str, Any]) -> int:
    """The ext code the batch travels as (EXT_COMPACT_BATCH or EXT_DATAPROTO)."""
    payload = msgpack.unpackb(bytes(fields["payload"]), raw=False)
    return payload["full_batch"].code  # type: ignore[no-any-return]


def assert_same_batch(got: DataProto, want: DataProto) -> None:
    """Same keys, dtypes, shapes and bytes (so -0.0 and NaN bits count), non-tensors and meta_info."""
    assert got.tensors.keys() == want.tensors.keys()
    for key, w in want.tensors.items():
        g = got.tensors[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert g.tobytes() == w.tobytes(), key
        assert not g.flags.writeable, key  # decoded arrays are read-only, as views of wire bytes are
    assert got.non_tensors.keys() == want.non_tensors.keys()
    for key, w in want.non_tensors.items():
        assert got.non_tensors[key].dtype == w.dtype and got.non_tensors[key].tolist() == w.tolist(), key
    assert got.meta_info == want.meta_info


@st.composite
def batches(draw: st.DrawFn) -> DataProto:
    """A producer-like batch with random n, P, R, dtypes, padding, pad id, masks and log-probs."""
    n, P, R = draw(st.integers(1, 6)), draw(st.integers(0, 9)), draw(st.integers(0, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids_dt, mask_dt = (
        np.dtype(draw(st.sampled_from(TOKEN_DTYPES))),
        np.dtype(draw(st.sampled_from(MASK_DTYPES))),
    )
    hi = {2: 2**15, 4: 2**31 if ids_dt.kind == "i" else 2**32}.get(ids_dt.itemsize, 2**40)
    pad = int(draw(st.sampled_from([0, 1, hi - 1])))
    plen = rng.integers(0, P + 1, n) if draw(st.booleans()) else np.full(n, P)
    rlen = rng.integers(0, R + 1, n) if draw(st.booleans()) else np.full(n, R)
    pbits, rbits = np.arange(P) >= (P - plen)[:, None], np.arange(R) < rlen[:, None]
    prompt = rng.integers(0, hi, (1 if draw(st.booleans()) else n, P), dtype=np.int64)
    prompt = np.broadcast_to(prompt, (n, P))
    ids = np.concatenate([np.where(pbits, prompt, pad), np.where(rbits, rng.integers(0, hi, (n, R)), pad)], 1)
    mask = np.concatenate([pbits, rbits], 1)
    if draw(st.integers(0, 9)) == 0 and mask.size:  # a hole in the attention mask: nothing compact
        mask.flat[rng.integers(mask.size)] ^= True
    tensors: dict[str, np.ndarray] = {"input_ids": ids.astype(ids_dt), "attention_mask": mask.astype(mask_dt)}
    tensors["prompts"] = ids[:, :P].astype(draw(st.sampled_from(TOKEN_DTYPES)))
    tensors["responses"] = ids[:, P:].astype(draw(st.sampled_from(TOKEN_DTYPES)))
    rmask = draw(st.sampled_from(["same", "holes", "garbage", "none"]))
    if rmask != "none":
        rm = rbits & (rng.random((n, R)) < 0.7) if rmask == "holes" else rbits.copy()
        rm = rm.astype(draw(st.sampled_from(MASK_DTYPES)))
        if rmask == "garbage" and rm.size and rm.dtype.kind != "b":
            rm.flat[0] = 2
        tensors["response_mask"] = rm
    lp_kind = draw(st.sampled_from(["zero", "stray", "negzero", "none"]))
    if lp_kind != "none":
        lp = np.where(rbits, -rng.random((n, R)), 0.0).astype(draw(st.sampled_from(FLOAT_DTYPES)))
        if lp_kind != "zero" and (~rbits).any():
            lp[~rbits] = -0.0 if lp_kind == "negzero" else -1.5
        tensors["rollout_log_probs"] = lp
    tensors["rewards"] = rng.random(n).astype(np.float32)
    if draw(st.booleans()):
        tensors["token_level_scores"] = (rng.random((n, R)) * rbits).astype(np.float32)
    non_tensors = {
        "uid": np.array(["g"] * n, dtype=object),
        "raw_prompt": np.array(["2+2="] * n, dtype=object),
        "response_text": np.array([f"r{i}" for i in range(n)], dtype=object),
        "ground_truth": np.array(["4"] * n, dtype=object),
        "agent_name": np.array(["partial_single_turn_agent"] * n, dtype=object),
    }
    return DataProto(tensors, non_tensors, {"temperature": 1.0})


def rollout_of(batch: DataProto) -> RolloutSample:
    """A RolloutSample carrying the batch."""
    n = len(batch)
    return RolloutSample(
        sample_id="s", epoch=0, param_version=1, full_batch=batch, producer="p",
        agent_loop_output_list=[{}] * n, processing_times=[0.1] * n,
        param_version_start=[1] * n, param_version_end=[1] * n,
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(batches())
def test_compact_and_plain_decode_to_the_same_dataproto(batch: DataProto) -> None:
    """Schema 2 (compact) and schema 1 (plain) entries of the same sample decode to identical batches."""
    event = rollout_of(batch)
    new, old = encode(event), encode(event, compact=False)
    assert (new["schema"], old["schema"]) == (b"2", b"1")
    got_new = decode_as(as_redis(new), RolloutSample)
    got_old = decode_as(as_redis(old), RolloutSample)
    assert_same_batch(got_new.full_batch, got_old.full_batch)
    assert_same_batch(got_new.full_batch, batch)
    assert got_new.schema_version == got_old.schema_version == 2
    assert got_new.num_tokens == got_old.num_tokens
    assert wire_bytes(new) <= wire_bytes(old) + 200


def test_a_producer_batch_travels_compact() -> None:
    """Padded prompts and responses, a multi-turn response mask: compact, and the same batch."""
    event = fake_rollout_sample("a", n=4, prompt_len=5, response_len=7, ragged=True)
    tensors = dict(event.full_batch.tensors)
    rm = tensors["response_mask"].copy()
    rm[0, 0] = 0  # a tool token
    tensors["response_mask"] = rm
    event = rollout_of(DataProto(tensors, event.full_batch.non_tensors))
    fields = encode(event)
    assert batch_ext(fields) == EXT_COMPACT_BATCH
    assert batch_ext(encode(event, compact=False)) == EXT_DATAPROTO
    assert_same_batch(decode_as(as_redis(fields), RolloutSample).full_batch, event.full_batch)


@pytest.mark.parametrize("vocab", [151_936, 2**32 - 1])
def test_bytes_per_token_targets(vocab: int) -> None:
    """<= 9 bytes per response token per row and <= 4 per prompt token per group (n = 8, as a real run);
    ids past int32 travel as uint32 and still take 4 bytes."""

    def size(prompt_len: int, response_len: int) -> int:
        return wire_bytes(
            encode(
                fake_rollout_sample("b", n=8, prompt_len=prompt_len, response_len=response_len, vocab=vocab)
            )
        )

    per_response = (size(512, 2048) - size(512, 1024)) / (8 * 1024)
    per_prompt = (size(1024, 1024) - size(512, 1024)) / 512
    assert per_response <= 9 and per_prompt <= 4, (per_response, per_prompt)
    old = encode(fake_rollout_sample("b", n=8, prompt_len=512, response_len=2048), compact=False)
    assert wire_bytes(old) / (8 * 2048) >= 36


def compact_parts(fields: dict[bytes, bytes]) -> tuple[dict[str, Any], list[Any]]:
    """(payload map, [layout, tensors, non_tensors, meta]) of a compact entry, other exts left packed."""
    body = msgpack.unpackb(fields[b"payload"], raw=False)
    ext = body["full_batch"]
    assert ext.code == EXT_COMPACT_BATCH
    return body, msgpack.unpackb(ext.data, raw=False)


def with_layout(fields: dict[bytes, bytes], **changes: Any) -> dict[bytes, bytes]:
    """The entry with layout fields changed."""
    body, parts = compact_parts(fields)
    parts[0].update(changes)
    body["full_batch"] = msgpack.ExtType(EXT_COMPACT_BATCH, msgpack.packb(parts, use_bin_type=True))
    return {**fields, b"payload": msgpack.packb(body, use_bin_type=True)}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"n": -1}, "n=-1 is not an int"),
        ({"P": "7"}, "P='7' is not an int"),
        ({"n": 1 << 20, "R": 1 << 20}, "exceed max_batch_cells"),
        ({"pad": 1.5}, "pad=1.5 is not an int"),
        ({"pad": 300, "input_ids": "|u1"}, "pad=300 does not fit input_ids dtype |u1"),
        ({"input_ids": "<U4"}, "input_ids dtype '<U4'"),
        ({"attention_mask": 3}, "attention_mask dtype 3"),
        ({"shared": "yes"}, "shared='yes'"),
        ({"response_mask": ["<i8", b"\x00"]}, "response_mask"),
        ({"rollout_log_probs": 1.5}, "rollout_log_probs must be a 1-d float array"),
    ],
)
def test_hostile_layouts_are_decode_errors(changes: dict[str, Any], reason: str) -> None:
    """Each bad layout field is refused with a reason naming it."""
    fields = as_redis(encode(fake_rollout_sample("h", n=2, prompt_len=3, response_len=4, ragged=True)))
    with pytest.raises(DecodeError, match="compact batch") as err:
        decode_as(with_layout(fields, **changes), RolloutSample)
    assert reason in str(err.value)


def test_ids_that_do_not_fit_the_claimed_dtype_are_decode_errors() -> None:
    """Token ids past the input_ids dtype the layout claims are refused, not wrapped."""
    sample = fake_rollout_sample("h", n=2, prompt_len=3, response_len=64, vocab=151_936)
    fields = as_redis(encode(sample))
    with pytest.raises(
        DecodeError,
        match=r"compact batch: (prompt|resp) holds ids in \[\d+, \d+\], outside input_ids dtype <i2",
    ):
        decode_as(with_layout(fields, input_ids="<i2"), RolloutSample)


def test_lengths_out_of_range_are_decode_errors() -> None:
    """A response length past R names the field and the value."""
    fields = as_redis(encode(fake_rollout_sample("h", n=2, prompt_len=3, response_len=4)))
    body, parts = compact_parts(fields)
    layout = parts[0]
    rlen = msgpack.packb(
        np.array([9, 4], dtype="<i4"),
        default=lambda a: msgpack.ExtType(5, bytes([4, 1, 0]) + (2).to_bytes(8, "little") + a.tobytes()),
    )
    layout["rlen"] = msgpack.unpackb(rlen)
    with pytest.raises(DecodeError, match=r"rlen holds 9, outside \[0, 4\]"):
        decode_as(with_layout(fields, **layout), RolloutSample)


def test_a_producer_built_sample_with_tool_tokens_and_token_scores_travels_compact() -> None:
    """build_rollout_sample's batch (ragged responses, tool tokens, token_level_scores, ground_truth, every
    non-tensor) goes compact and decodes to the batch the plain layout gives."""
    from rollstream.model.tokenizer import CharTokenizer
    from rollstream.rollout import Trajectory, build_rollout_sample
    from rollstream.tasks.base import RewardResult

    tok = CharTokenizer()
    trajectories = []
    for i, text in enumerate(["12", "3456", "7"]):
        t = Trajectory(prompt_ids=tok.encode("2+2=", add_bos=True), finished=True, num_turns=1 + i % 2)
        t.extend(tok.encode(text), [-0.25] * len(text), generated=True)
        if i == 1:
            t.extend(tok.encode("tool"), None, generated=False)
            t.extend(tok.encode("9"), [-0.5], generated=True)
        trajectories.append(t)
    rewards = [
        RewardResult(score=1.0, exact=True, char_scores=(0.5,) * 2),
        RewardResult(score=0.0, exact=False, char_scores=(0.0,) * 9),
        RewardResult(score=0.5, exact=False, char_scores=(0.5,)),
    ]
    event = build_rollout_sample(
        sample_id="p", epoch=0, param_version=3, producer="p0", trajectories=trajectories, rewards=rewards,
        raw_prompt="2+2=", tokenizer=tok, rollout_status={}, ground_truth="4",
    )  # fmt: skip
    assert "token_level_scores" in event.full_batch.tensors
    fields = encode(event)
    assert batch_ext(fields) == EXT_COMPACT_BATCH
    body, parts = compact_parts(as_redis(fields))
    assert "response_mask" in parts[0] and "rollout_log_probs" in parts[0]  # tool tokens: mask as bits
    assert set(parts[1]) == {"rewards", "token_level_scores"}  # everything else travels as before
    got = decode_as(as_redis(fields), RolloutSample).full_batch
    assert_same_batch(got, decode_as(as_redis(encode(event, compact=False)), RolloutSample).full_batch)
    assert_same_batch(got, event.full_batch)


@pytest.mark.parametrize("low", [-5, 0, 2**31, -(2**40), 2**40])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("ids_dtype", "step"), [("<i8", 1), (">i8", 1), (">i8", 2**32)])
def test_ids_of_any_sign_and_range_travel_exactly(low: int, padded: bool, ids_dtype: str, step: int) -> None:
    """The one-pass range check of token ids (an unsigned view's max) falls back to min/max for negative ids and
    ids past int32; every range decodes to the same batch and picks a wire dtype that holds it. Big-endian ids
    of 2**40 + k * 2**32 would look small read in the wrong byte order."""
    n, P, R = 3, 4, 6
    ids = (low + np.arange(n * (P + R), dtype=np.int64) * step).reshape(n, P + R).astype(ids_dtype)
    mask = np.ones((n, P + R), np.int64)
    if padded:
        mask[0, :2], mask[1, -3:] = 0, 0
        ids[mask == 0] = low  # every unattended position holds the one pad id
    tensors = {"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :P], "responses": ids[:, P:],
               "response_mask": mask[:, P:].copy()}  # fmt: skip
    event = rollout_of(DataProto(tensors))
    fields = as_redis(encode(event))
    assert batch_ext(encode(event)) == EXT_COMPACT_BATCH
    body, parts = compact_parts(fields)
    lo, hi = int(ids.min()), int(ids.max())
    want = "<i4" if -(2**31) <= lo and hi < 2**31 else ("<u4" if lo >= 0 and hi < 2**32 else "<i8")
    resp = array_from_flat(parts[0]["resp"].data, lambda i: fields[f"a{i}".encode()], 1 << 30)
    assert resp.dtype.str == want
    got = decode_as(fields, RolloutSample)
    assert_same_batch(got.full_batch, event.full_batch)
    assert fields[b"tokens"] == str(int(tensors["response_mask"].sum())).encode()


@pytest.mark.parametrize("kind", ["same", "holes", "none", "odd"])
def test_the_header_counts_response_tokens_as_num_tokens(kind: str) -> None:
    """The header's `tokens` (taken from the compact layout's lengths when they prove it) equals num_tokens for
    every kind of response_mask: the attention mask's part, one with tool-token holes, none, or one that does
    not fit the layout (values other than 0/1)."""
    event = fake_rollout_sample("t", n=4, prompt_len=5, response_len=9, ragged=True)
    tensors = dict(event.full_batch.tensors)
    if kind == "none":
        del tensors["response_mask"]
    elif kind != "same":
        rm = tensors["response_mask"].copy()
        rm[1, 0] = 0 if kind == "holes" else 3
        tensors["response_mask"] = rm
    event = rollout_of(DataProto(tensors, event.full_batch.non_tensors))
    fields = as_redis(encode(event))
    assert fields[b"tokens"] == str(event.num_tokens).encode()
    assert decode_as(fields, RolloutSample).num_tokens == event.num_tokens


def test_a_mask_attended_at_both_ends_with_a_hole_is_not_compact() -> None:
    """First and last columns all ones only make the all-ones check worth trying: a hole inside still sends the
    batch plain, and it decodes to the same arrays."""
    event = fake_rollout_sample("h", n=3, prompt_len=4, response_len=6)
    tensors = dict(event.full_batch.tensors)
    mask = tensors["attention_mask"].copy()
    mask[1, 5] = 0
    tensors["attention_mask"] = mask
    event = rollout_of(DataProto(tensors, event.full_batch.non_tensors))
    assert batch_ext(encode(event)) == EXT_DATAPROTO
    assert_same_batch(decode_as(as_redis(encode(event)), RolloutSample).full_batch, event.full_batch)


def test_total_of_a_broadcast_mask_equals_its_sum() -> None:
    """num_tokens' sum reads a zero-stride (broadcast) axis once and gives what numpy's sum gives."""
    from schemas.events import total

    one = np.ones(1, np.int64)
    for arr in (
        np.ndarray((4, 1000), np.int64, one, strides=(0, 0)),
        np.broadcast_to(np.arange(5), (3, 5)),
        np.broadcast_to(np.arange(3)[:, None], (3, 7)),
        np.arange(12).reshape(3, 4),
        np.zeros((0, 5), np.int64),
    ):
        assert total(arr) == int(arr.sum())


def test_total_falls_back_to_numpys_sum_where_the_exact_total_would_not_fit() -> None:
    """A broadcast int64 mask of huge values: numpy's sum wraps, and total() must give what decode's dense sum
    gives, else the header and the payload would disagree."""
    from schemas.events import total

    big = np.ndarray((2, 4), np.int64, np.array([2**62], np.int64), strides=(0, 0))
    assert total(big) == int(big.sum()) == int(np.ascontiguousarray(big).sum())
