"""Evaluation: greedy-decode the held-out prompts with the trainer's current weights and score them.

Single-turn only (a multi-turn task is scored on its first assistant turn). Prompts are encoded the way
producers encode them (`encode_prompt`: chat template or bos first) and decoded in batches.
"""

from __future__ import annotations

from rollstream.model import BasePolicy
from rollstream.model.chat import encode_prompt
from rollstream.tasks import Prompt, Task


def evaluate(
    policy: BasePolicy, task: Task, prompts: list[Prompt], max_new_tokens: int, batch_size: int = 64
) -> dict[str, float]:
    """`val/reward_mean` (mean score) and `val/acc` (share exact) over prompts; {} when there are none."""
    if not prompts:
        return {}
    tok = policy.tokenizer
    scores: list[float] = []
    exact: list[float] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids = [encode_prompt(tok, p.text) for p in chunk]
        limit = policy.max_seq_len
        new_tokens = max_new_tokens
        if limit is not None:
            new_tokens = max(1, min(max_new_tokens, limit - max(len(x) for x in ids)))
        trajs = policy.generate(ids, n=1, max_new_tokens=new_tokens, greedy=True)
        for prompt, traj in zip(chunk, trajs, strict=True):
            res = task.reward(prompt, tok.decode(traj.response_ids))
            scores.append(res.score)
            exact.append(1.0 if res.exact else 0.0)
    return {"val/reward_mean": sum(scores) / len(scores), "val/acc": sum(exact) / len(exact)}
