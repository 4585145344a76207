"""Writes tests/data/old_rollouts/: schema-1 and schema-2 rollout entries written by commit c292fb6."""
import shutil
import sys
from pathlib import Path

import msgpack
import numpy as np

from producers.rollout import Trajectory, build_rollout_sample
from rollstream.bus.archive import Archive
from rollstream.tasks import RewardResult
from rollstream.testing.fakes import FakeTokenizer
from schemas import encode

out = Path(sys.argv[1])
rng = np.random.default_rng(7)

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


cases = {}
p = [5, 6, 7, 8]
cases["s2_shared_ragged_scores"] = (
    sample(
        "a",
        [traj(p, [9, 10, 11]), traj(p, []), traj(p, [12]), traj(p, [13, 14, 15, 16, 17])],
        30,
        scores=True,
    ),
    True,
)
cases["s2_tool_mask"] = (
    sample(
        "b",
        [traj(p, [9, 10, 11, 12], [1, 0, 0, 1]), traj(p, [20, 21], [1, 1]), traj(p, [22, 23, 24], [0, 1, 1])],
        30,
    ),
    True,
)
cases["s2_rows_prompts"] = (
    sample("c", [traj([5, 6], [9, 10]), traj([5, 6, 7, 8, 9], [11]), traj([4], [12, 13, 14])], 30),
    True,
)
cases["s2_full_big_vocab"] = (
    sample("d", [traj([70000, 99999], [65536, 3]), traj([70000, 99999], [255, 256])], 100000),
    True,
)
cases["s1_ragged_tool"] = (
    sample(
        "e", [traj(p, [9, 10, 11, 12], [1, 0, 0, 1]), traj(p, [], []), traj([3, 4], [20])], 30, scores=True
    ),
    False,
)
cases["s1_full"] = (sample("f", [traj(p, [9, 10]), traj(p, [11, 12])], 30), False)

def expected(s):
    t = s.full_batch.tensors
    am, R = t["attention_mask"], t["responses"].shape[1]
    P = t["input_ids"].shape[1] - R
    rows = []
    for i in range(s.n):
        plen, rlen = int(am[i, :P].sum()), int(am[i, P:].sum())
        row = {
            "prompt": t["input_ids"][i, P - plen : P].tolist(),
            "response": t["responses"][i, :rlen].tolist(),
            "response_mask": t["response_mask"][i, :rlen].tolist(),
            "rollout_log_probs": t["rollout_log_probs"][i, :rlen].tolist(),
            "reward": float(t["rewards"][i]),
        }
        if "token_level_scores" in t:
            row["token_level_scores"] = t["token_level_scores"][i, :rlen].tolist()
        rows.append(row)
    return {"sample_id": s.sample_id, "n": s.n, "tokens": s.num_tokens, "rows": rows}

entries = {}
for name, (s, compact) in cases.items():
    fields = encode(s, compact=compact)
    raw = {k.encode(): bytes(v) for k, v in fields.items()}
    assert raw[b"schema"] == (b"2" if compact else b"1"), (name, raw[b"schema"])
    entries[name] = {"fields": raw, "expected": expected(s)}
(out / "entries.msgpack").write_bytes(msgpack.packb(entries, use_bin_type=True))
arch = out / "archive"
shutil.rmtree(arch, ignore_errors=True)
a = Archive(arch).create()
with a.writer("rs:{old}:rollouts") as w:
    w.write(
        [(f"{i + 1}-0", entries[name]["fields"]) for i, name in enumerate(["s2_tool_mask", "s1_ragged_tool"])]
    )
    w.commit()
print(sorted(p.relative_to(out).as_posix() for p in out.rglob("*")))
