"""Evaluation: greedy-decode the held-out prompts with the trainer's current weights and score them.

Single-turn only (a multi-turn task is scored on its first assistant turn). Prompts are encoded the way
producers encode them (`encode_prompt`: chat template or bos first) and decoded in batches.
"""

from __future__ import annotations

from consumers.trainer.distributed import DataParallel
from rollstream.config import PipelineConfig
from rollstream.model import BasePolicy
from rollstream.model.chat import encode_prompt
from rollstream.tasks import Prompt, Task, build_prompt_source, build_task


def validate(
    cfg: PipelineConfig, policy: BasePolicy, dp: DataParallel, recent_prompts: list[Prompt]
) -> dict[str, float]:
    """Greedy-decode the held-out prompts (`val/…`) and the newest trained prompts (`val/recent_train_…`:
    memorisation shows as a gap between the two). Under fsdp every rank decodes in step (the weights are
    sharded), on rank 0's prompts."""
    task = build_task(cfg)
    prompts = build_prompt_source(cfg, task).val_prompts()
    limit = cfg.data.max_response_length
    if dp.roles.sharded:
        rows = dp.broadcast_plain([[p.uid, p.text, p.answer] for p in recent_prompts])
        recent_prompts = [Prompt(uid=u, text=t, answer=a) for u, t, a in rows]
    batch = cfg.data.val_batch_size  # None: each set in one batch
    metrics = evaluate(policy, task, prompts, limit, batch or max(len(prompts), 1))
    recent = evaluate(policy, task, recent_prompts, limit, batch or max(len(recent_prompts), 1))
    metrics.update({k.replace("val/", "val/recent_train_"): v for k, v in recent.items()})
    return metrics


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
