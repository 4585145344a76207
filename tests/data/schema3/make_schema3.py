"""Writes tests/data/schema3/entries.msgpack: schema-3 rollout entries (ragged batch, one flat array header
per array) as commit d852c4c wrote them. Run from a checkout of that commit:
`python tests/data/schema3/make_schema3.py OUT_DIR`."""
import sys
from pathlib import Path

import msgpack
import numpy as np

from producers.rollout import Trajectory, build_rollout_sample
from rollstream.tasks import RewardResult
from rollstream.testing.fakes import FakeTokenizer
from schemas import encode

out = Path(sys.argv[1])
rng = np.random.default_rng(11)


def traj(prompt, resp, mask=None):
    mask = mask if mask is not None else [1] * len(resp)
    lp = [(-float(rng.random()) if m else 0.0) for m in mask]
    return Trajectory(
        prompt_ids=list(prompt),
        response_ids=list(resp),
        response_mask=list(mask),
        log_probs=lp,
        finished=True,
        num_turns=1,
        version_start=3,
        version_end=3,
        processing_time_s=0.5,
    )


def sample(sid, trajs, vocab, scores=False):
    rw = [
        RewardResult(score=0.25 * i, exact=False, char_scores=(0.25 * i,) if scores else None)
        for i in range(len(trajs))
    ]
    return build_rollout_sample(
        sample_id=sid,
        epoch=0,
        param_version=3,
        producer="old",
        trajectories=trajs,
        rewards=rw,
        raw_prompt="p",
        tokenizer=FakeTokenizer(vocab),
        rollout_status={"x": 1},
    )


p = [5, 6, 7, 8]
long = rng.integers(3, 70000, size=600).tolist()  # int32 ids, 2.4 KB: an out-of-band field
cases = {
    "s3_shared_ragged_scores": sample(
        "a",
        [traj(p, [9, 10, 11]), traj(p, []), traj(p, [12]), traj(p, [13, 14, 15, 16, 17])],
        30,
        scores=True,
    ),
    "s3_tool_mask": sample(
        "b",
        [traj(p, [9, 10, 11, 12], [1, 0, 0, 1]), traj(p, [20, 21], [1, 1]), traj(p, [22, 23, 24], [0, 1, 1])],
        30,
    ),
    "s3_rows_prompts_u16": sample(
        "c", [traj([5, 6], [9, 10]), traj([5, 6, 7, 8, 9], [11]), traj([4], [12, 13, 14])], 60000
    ),
    "s3_big_vocab_out_of_band": sample(
        "d", [traj([70000, 99999], long), traj([70000, 99999], [255, 256])], 100000
    ),
}
entries = {}
for name, s in cases.items():
    raw = {k.encode(): bytes(v) for k, v in encode(s).items()}
    assert raw[b"schema"] == b"3", (name, raw[b"schema"])
    b = s.full_batch
    po, ro, plen = b.prompt_offsets(), b.response_offsets(), b.row_prompt_lens()
    rows = []
    for i in range(s.n):
        row = {
            "prompt": b.prompt_ids[po[i] : po[i] + plen[i]].tolist(),
            "response": b.response_ids[ro[i] : ro[i + 1]].tolist(),
        }
        mask = b.tokens.get("response_mask")
        row["response_mask"] = [1] * (ro[i + 1] - ro[i]) if mask is None else mask[ro[i] : ro[i + 1]].tolist()
        for key in ("rollout_log_probs", "token_level_scores"):
            if key in b.tokens:
                row[key] = b.tokens[key][ro[i] : ro[i + 1]].tolist()
        row["reward"] = float(b.rows["rewards"][i])
        rows.append(row)
    expected = {
        "sample_id": s.sample_id,
        "n": s.n,
        "tokens": s.num_tokens,
        "rows": rows,
        "ids_dtype": b.response_ids.dtype.str,
        "non_tensors": {k: v.tolist() for k, v in b.non_tensors.items()},
    }
    entries[name] = {"fields": raw, "expected": expected}
(out / "entries.msgpack").write_bytes(msgpack.packb(entries, use_bin_type=True))
print({name: sorted(k.decode() for k in e["fields"]) for name, e in entries.items()})
