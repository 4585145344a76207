"""Evaluation: greedy-decode the held-out prompts with the trainer's current weights and score them.

Prompts are encoded the way producers encode them (`encode_prompt`: chat template or bos first) and decoded
in batches. With a tool (`rollout.multi_turn.enable` and a multi-turn task) each prompt is an episode as the
producers run it: a turn cut at its call, the tool's result as the template's tool turn, up to
`rollout.multi_turn.max_turns` turns (`greedy_episodes`), and the whole response is scored.
"""

from __future__ import annotations

from consumers.trainer.distributed import DataParallel
from rollstream.config import PipelineConfig
from rollstream.model import BasePolicy
from rollstream.model.chat import encode_prompt
from rollstream.tasks import Prompt, Task, build_prompt_source, build_task
from rollstream.tasks.calculator import tool_ratios
from rollstream.tasks.episode import greedy_episodes


def validate(
    cfg: PipelineConfig, policy: BasePolicy, dp: DataParallel, recent_prompts: list[Prompt]
) -> dict[str, float]:
    """Greedy-decode the held-out prompts (`val/…`) and the newest trained prompts (`val/recent_train_…`:
    memorisation shows as a gap between the two). Under fsdp every rank decodes in step (the weights are
    sharded), on rank 0's prompts."""
    task = build_task(cfg)
    prompts = build_prompt_source(cfg, task).val_prompts()
    limit = cfg.data.max_response_length
    rows = dp.broadcast_if_sharded([[p.uid, p.text, p.answer] for p in recent_prompts])  # fsdp: rank 0's
    recent_prompts = [Prompt(uid=u, text=t, answer=a) for u, t, a in rows]
    batch = cfg.data.val_batch_size  # None: each set in one batch
    turns = cfg.rollout.multi_turn.max_turns if cfg.rollout.multi_turn.enable else 1
    metrics = evaluate(policy, task, prompts, limit, batch or max(len(prompts), 1), turns)
    recent = evaluate(policy, task, recent_prompts, limit, batch or max(len(recent_prompts), 1), turns)
    metrics.update({k.replace("val/", "val/recent_train_"): v for k, v in recent.items()})
    return metrics


def evaluate(
    policy: BasePolicy,
    task: Task,
    prompts: list[Prompt],
    max_new_tokens: int,
    batch_size: int = 64,
    max_turns: int = 1,
) -> dict[str, float]:
    """`val/reward_mean` (mean score) and `val/acc` (share exact) over prompts, each greedy through the tool
    loop when `max_turns` > 1 and the task has a tool; with a tool also the task's tool metrics
    (`val/called`, `val/tool_calls`, `val/acc_with_call`, … : rollstream/tasks/calculator.py); {} when there
    are no prompts."""
    if not prompts:
        return {}
    tok = policy.tokenizer
    scores: list[float] = []
    exact: list[float] = []
    sums: dict[str, float] = {}
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids = [encode_prompt(tok, p.text) for p in chunk]
        limit = policy.max_seq_len
        new_tokens = max_new_tokens
        if limit is not None:
            new_tokens = max(1, min(max_new_tokens, limit - max(len(x) for x in ids)))
        episodes = greedy_episodes(policy, task, ids, new_tokens, max_turns)
        for prompt, ep in zip(chunk, episodes, strict=True):
            res = task.reward(prompt, tok.decode(ep.response_ids))
            scores.append(res.score)
            exact.append(1.0 if res.exact else 0.0)
            if task.multi_turn and max_turns > 1:
                for name, value in res.metrics.items():
                    sums[name] = sums.get(name, 0.0) + value
    n = len(scores)
    out = {"val/reward_mean": sum(scores) / n, "val/acc": sum(exact) / n}
    tool = {f"val/{k}": v / n for k, v in sums.items() if k not in ("acc", "score")}
    return {**out, **tool, **tool_ratios(tool, "val/")}
