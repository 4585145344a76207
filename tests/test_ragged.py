"""The ragged sample (schema 5): old schemas read into it, and encode -> decode -> assemble equals a direct
padded build for random ragged batches (no Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import padded_arrays
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.guard import unusable_reason
from producers.rollout import Trajectory, build_rollout_sample, ragged_batch
from rollstream.bus.archive import Archive
from rollstream.tasks import RewardResult
from rollstream.testing.fakes import FakeTokenizer, fake_rollout_sample
from schemas import RolloutSample, decode, decode_as, encode
from schemas.ragged import RaggedBatch, id_range_ok, ids_dtype

OLD = Path(__file__).parent / "data" / "old_rollouts"  # written by commit c292fb6 (make_old.py there)
SCHEMA3 = Path(__file__).parent / "data" / "schema3"  # written by commit d852c4c (make_schema3.py there)
SCHEMA4 = Path(__file__).parent / "data" / "schema4"  # written by commit b0225e4 (make_schema4.py here)
VOCAB_EDGES = (2, 255, 256, 257, 65535, 65536, 65537, (1 << 31) - 1, 1 << 31, (1 << 31) + 1)


def _rows(batch: RaggedBatch) -> list[dict[str, Any]]:
    """Each row's prompt, response and per-token values as lists."""
    po, ro, plen = batch.prompt_offsets(), batch.response_offsets(), batch.row_prompt_lens()
    out = []
    for i in range(len(batch)):
        row: dict[str, Any] = {
            "prompt": batch.prompt_ids[po[i] : po[i] + plen[i]].tolist(),
            "response": batch.response_ids[ro[i] : ro[i + 1]].tolist(),
        }
        mask = batch.tokens.get("response_mask")
        row["response_mask"] = [1] * (ro[i + 1] - ro[i]) if mask is None else mask[ro[i] : ro[i + 1]].tolist()
        for key in ("rollout_log_probs", "token_level_scores"):
            if key in batch.tokens:
                row[key] = batch.tokens[key][ro[i] : ro[i + 1]].tolist()
        row["reward"] = float(batch.rows["rewards"][i])
        out.append(row)
    return out


def _old_entries() -> dict[str, Any]:
    return msgpack.unpackb((OLD / "entries.msgpack").read_bytes(), raw=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(_old_entries()))
def test_schema_1_and_2_entries_decode_ragged(name: str) -> None:
    """Committed bytes of schema-1 (padded int64 arrays) and schema-2 (compact layout) entries decode into the
    ragged form with the values they were built from: ragged rows, an empty response, tool masks, per-row
    prompts, ids above 2**16."""
    entry = _old_entries()[name]
    assert entry["fields"][b"schema"] in (b"1", b"2")
    got = decode_as(entry["fields"], RolloutSample)
    want = entry["expected"]
    assert got.schema_version == RolloutSample.SCHEMA == 5
    assert (got.sample_id, got.n, got.num_tokens) == (want["sample_id"], want["n"], want["tokens"])
    assert _rows(got.full_batch) == want["rows"]


def _entries_3_and_4() -> dict[str, Any]:
    """The committed schema-3 and schema-4 entries by name (s3_..., s4_...)."""
    out: dict[str, Any] = {}
    for folder in (SCHEMA3, SCHEMA4):
        out.update(msgpack.unpackb((folder / "entries.msgpack").read_bytes(), raw=False))
    return out


@pytest.mark.parametrize("name", sorted(_entries_3_and_4()))
def test_schema_3_and_4_entries_decode(name: str) -> None:
    """Committed bytes of schema-3 entries (one flat array header per array) and schema-4 entries (the batch
    in an EXT_RAGGED_BATCH ext), inline and out-of-band, decode with the values, id dtype and per-row object
    arrays they were built from (their header's epoch, n and tokens still held to the payload)."""
    entry = _entries_3_and_4()[name]
    assert entry["fields"][b"schema"] == name[1].encode() and b"tokens" in entry["fields"]
    got = decode_as(entry["fields"], RolloutSample)
    want = entry["expected"]
    assert got.schema_version == RolloutSample.SCHEMA
    assert (got.sample_id, got.n, got.num_tokens) == (want["sample_id"], want["n"], want["tokens"])
    assert _rows(got.full_batch) == want["rows"]
    assert got.full_batch.response_ids.dtype.str == got.full_batch.prompt_ids.dtype.str == want["ids_dtype"]
    assert {k: v.tolist() for k, v in got.full_batch.non_tensors.items()} == want["non_tensors"]


def test_archived_old_entries_decode_ragged() -> None:
    """Entries a run's archive holds (segment files of schema-2 and schema-1 entries) read the same way."""
    entries = _old_entries()
    got = list(Archive(OLD / "archive").entries("rs:{old}:rollouts"))
    assert [i for i, _ in got] == ["1-0", "2-0"]
    for (_, fields), name in zip(got, ["s2_tool_mask", "s1_ragged_tool"], strict=True):
        event = decode_as(fields, RolloutSample)
        assert _rows(event.full_batch) == entries[name]["expected"]["rows"]


def test_ids_dtype_is_the_narrowest_that_holds_the_vocabulary() -> None:
    got = {v: ids_dtype(v).str for v in VOCAB_EDGES}
    assert got == {2: "|u1", 255: "|u1", 256: "|u1", 257: "<u2", 65535: "<u2", 65536: "<u2", 65537: "<i4",
                   (1 << 31) - 1: "<i4", 1 << 31: "<i4", (1 << 31) + 1: "<i8"}
    assert id_range_ok(np.array([255], np.uint8), 256) and not id_range_ok(np.array([255], np.uint8), 255)
    assert not id_range_ok(np.array([-1], np.int32), 10) and id_range_ok(np.array([9], ">i4"), 10)


def test_guard_names_ids_outside_the_vocabulary_and_long_rows() -> None:
    trajs = [Trajectory([1, 2, 3], [4, 5], [1, 1], [-0.5, -0.5]), Trajectory([1, 2, 3], [6], [1], [-0.1])]
    sample = _sample("g", trajs, 7)
    assert unusable_reason(sample, 7, None) is None
    assert (
        unusable_reason(sample, 6, None)
        == "response_ids holds token ids in [4, 6], outside the vocabulary [0, 6)"
    )
    assert unusable_reason(sample, 7, 4) == "rows are up to 5 tokens, over the model's max_seq_len 4"
    with pytest.raises(
        ValueError, match=r"trajectory 1: response_ids hold ids in \[6, 6\], outside the vocabulary"
    ):
        ragged_batch(trajs, 6)
    tool = _sample("t", [Trajectory([1, 2], [4, 5], [1, 0], [-0.5, 0.0])], 7)
    assert unusable_reason(tool, 7, None) is None
    tool.full_batch.tokens["response_mask"] = np.array([1, 2], np.uint8)
    assert unusable_reason(tool, 7, None) == "response_mask holds values in [1, 2], not 0/1"


def _sample(sid: str, trajs: list[Trajectory], vocab: int, scores: list[np.ndarray] | None = None,
            rewards: list[float] | None = None) -> RolloutSample:
    batch = ragged_batch(trajs, vocab, scores)
    n = len(trajs)
    batch.rows["rewards"] = np.asarray(rewards if rewards is not None else [0.5] * n, np.float32)
    batch.non_tensors["uid"] = np.array([sid] * n, dtype=object)
    return RolloutSample(sample_id=sid, epoch=0, param_version=0, full_batch=batch,
                         agent_loop_output_list=[{}] * n, processing_times=[0.0] * n,
                         param_version_start=[0] * n, param_version_end=[0] * n, producer="p")


def _direct(
    samples: list[tuple[list[Trajectory], list[np.ndarray] | None, list[float]]],
) -> dict[str, np.ndarray]:
    """The padded batch built straight from the trajectories, the obvious way (left-padded prompts,
    right-padded responses, zeros everywhere else)."""
    rows = [(t, None if s is None else s[i], r[i]) for trajs, s, r in samples for i, t in enumerate(trajs)]
    P = max(len(t.prompt_ids) for t, _, _ in rows)
    R = max(len(t.response_ids) for t, _, _ in rows)
    B = len(rows)
    out = {k: np.zeros((B, P + R), np.int64) for k in ("input_ids", "attention_mask")}
    out.update(
        {"response_mask": np.zeros((B, R), np.float32), "rollout_log_probs": np.zeros((B, R), np.float32)}
    )
    if samples[0][1] is not None:
        out["token_level_scores"] = np.zeros((B, R), np.float32)
    out["rewards"] = np.zeros(B, np.float32)
    for i, (t, score, reward) in enumerate(rows):
        p = len(t.prompt_ids)
        for j, tok in enumerate(t.prompt_ids):
            out["input_ids"][i, P - p + j] = tok
            out["attention_mask"][i, P - p + j] = 1
        for j, tok in enumerate(t.response_ids):
            out["input_ids"][i, P + j] = tok
            out["attention_mask"][i, P + j] = 1
            out["response_mask"][i, j] = t.response_mask[j]
            out["rollout_log_probs"][i, j] = np.float32(t.log_probs[j]) if t.response_mask[j] else 0.0
            if score is not None:
                out["token_level_scores"][i, j] = score[j]
        out["rewards"][i] = reward
    out["prompts"], out["responses"] = out["input_ids"][:, :P], out["input_ids"][:, P:]
    return out


@st.composite
def _batches(
    draw: st.DrawFn,
) -> tuple[int, list[tuple[list[Trajectory], list[np.ndarray] | None, list[float]]]]:
    """1-3 samples of 1-4 trajectories over one vocabulary at a dtype boundary: shared or per-row prompts,
    empty and one-token responses, tool-masked tokens, ids at 0 and vocab - 1."""
    vocab = draw(st.sampled_from(VOCAB_EDGES))
    ids = st.one_of(st.sampled_from([0, vocab - 1]), st.integers(0, vocab - 1))
    with_scores = draw(st.booleans())
    samples = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 4))
        shared = draw(st.booleans())
        first = draw(st.lists(ids, min_size=1, max_size=5))
        trajs = []
        for _ in range(n):
            prompt = first if shared else draw(st.lists(ids, min_size=1, max_size=5))
            length = draw(st.sampled_from([0, 1, draw(st.integers(0, 7))]))
            resp = draw(st.lists(ids, min_size=length, max_size=length))
            mask = draw(st.lists(st.sampled_from([0, 1, 1]), min_size=length, max_size=length))
            lp = draw(st.lists(st.floats(-30, 0, width=32), min_size=length, max_size=length))
            trajs.append(Trajectory(list(prompt), resp, mask, lp))
        scores = ([np.asarray(draw(st.lists(st.floats(-1, 1, width=32), min_size=len(t.response_ids),
                                             max_size=len(t.response_ids))), np.float32) for t in trajs]
                  if with_scores else None)
        rewards = draw(st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n))
        samples.append((trajs, scores, rewards))
    return vocab, samples


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_encode_decode_assemble_equals_a_direct_padded_build(
    case: tuple[int, list[tuple[list[Trajectory], list[np.ndarray] | None, list[float]]]],
) -> None:
    """Random ragged batches through the producer's builder, the wire (redis-style bytes) and the trainer's
    assembly give exactly (dtype, shape, values) the tensors of the obvious padded build."""
    vocab, groups = case
    samples = []
    for k, (trajs, scores, rewards) in enumerate(groups):
        sample = _sample(f"s{k}", trajs, vocab, scores, rewards)
        assert sample.full_batch.response_ids.dtype == ids_dtype(vocab)
        wire = {name.encode(): bytes(v) for name, v in encode(sample).items()}
        got = decode(wire)
        assert isinstance(got, RolloutSample) and unusable_reason(got, vocab, None) is None
        assert got.num_tokens == sum(sum(t.response_mask) for t in trajs)
        samples.append(got)
    want = _direct(groups)
    batch, _ = assemble_batch_from_rollout_samples(samples)
    got = padded_arrays(batch)
    assert set(got) == set(want)
    for key, arr in got.items():
        ref = want[key]
        assert arr.dtype == ref.dtype and arr.shape == ref.shape, key
        np.testing.assert_array_equal(arr, ref, err_msg=key)
    assert len(batch) == len(_flat_rows(groups))


def _flat_rows(groups: list[tuple[list[Trajectory], Any, Any]]) -> list[Trajectory]:
    return [t for trajs, _, _ in groups for t in trajs]


def _tampered_layout(name: str, **changes: Any) -> dict[bytes, bytes]:
    """A committed schema-2 entry whose compact layout has `changes` (None deletes the key)."""
    fields = dict(_old_entries()[name]["fields"])
    body = msgpack.unpackb(fields[b"payload"], raw=False)
    layout, tensors, non_tensors, meta = msgpack.unpackb(body["full_batch"].data, raw=False)
    for key, value in changes.items():
        if value is None:
            layout.pop(key)
        else:
            layout[key] = value
    body["full_batch"] = msgpack.ExtType(6, msgpack.packb([layout, tensors, non_tensors, meta]))
    fields[b"payload"] = msgpack.packb(body)
    return fields


@pytest.mark.parametrize(
    ("name", "changes", "needle"),
    [
        ("s2_shared_ragged_scores", {"n": 5}, "compact batch: plen has 4 values, expected 5"),
        ("s2_shared_ragged_scores", {"R": 2}, "compact batch: rlen holds 5, over R=2"),
        ("s2_shared_ragged_scores", {"shared": "yes"}, "compact batch: shared='yes'"),
        ("s2_shared_ragged_scores", {"n": -1}, "compact batch: n=-1 is not an int"),
        ("s2_rows_prompts", {"shared": True}, "compact batch: shared=True with prompt lengths [2, 5, 1]"),
        (
            "s2_tool_mask",
            {"response_mask": ["<i8", b"\x00"]},
            "compact batch: response_mask bits must be 2 uint8 bytes",
        ),
        ("s2_tool_mask", {"prompt": None}, "compact batch: prompt is NoneType"),
    ],
)
def test_hostile_schema_2_layouts_are_refused(name: str, changes: dict[str, Any], needle: str) -> None:
    """The schema-2 reader still checks every length and size against the layout, naming the field."""
    from schemas import DecodeError

    with pytest.raises(DecodeError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        decode(_tampered_layout(name, **changes))


@pytest.mark.parametrize("ragged", [False, True])
def test_a_fake_sample_is_what_the_producers_builder_makes_of_its_rows(ragged: bool) -> None:
    """rollstream/testing/fakes.py packs its samples without producers/: the same rows through
    build_rollout_sample encode to the same bytes, so the fakes cannot drift from what producers publish."""
    scores = [0.25, 0.5, 1.0]
    fake = fake_rollout_sample("s-1", param_version=3, n=3, response_len=5, seed=7, rewards=scores,
                               ragged=ragged, vocab=300)
    trajectories = [
        Trajectory(prompt_ids=row["prompt"], response_ids=row["response"], response_mask=row["response_mask"],
                   log_probs=row["rollout_log_probs"], finished=True, num_turns=1, version_start=3,
                   version_end=3, processing_time_s=0.01)
        for row in _rows(fake.full_batch)
    ]
    built = build_rollout_sample(
        sample_id="s-1", epoch=0, param_version=3, producer="fake", trajectories=trajectories,
        rewards=[RewardResult(score=s, exact=False) for s in scores],
        raw_prompt="", tokenizer=FakeTokenizer(300), rollout_status={"dispatched": 1},
    )
    built.created_at = fake.created_at
    assert encode(built) == encode(fake)
