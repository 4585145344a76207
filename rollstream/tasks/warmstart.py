"""Supervised warm starts for the digit-reversal demo (teacher forcing on `bos + prompt -> target + eos`).

RL from random weights spends most of its budget discovering the answer *format* (digits only, as many
as the prompt has, then eos): a random char-level policy emits one of ~70 symbols per position, so the
per-position partial credit is almost never earned and GRPO groups are mostly all-zero. Two warm starts:

  format   targets are fresh random digit strings of the answer's length: teaches the format and nothing
           about the reversal (exact match of a random target is 10^-len).
  reverse  targets are the true reversals, and training stops as soon as the greedy exact match on the warm
           start's own probe prompts reaches `stop_at_acc` (default 5%), never at or above `max_acc` (10%):
           the demo's allowed "short supervised warm start that itself ends under 10% exact match".

    policy, report = warm_start(cfg, mode="reverse")
    save_policy(policy, "warm.safetensors")   # rollstream.weights.tensors; the trainer starts from it with
                                              # model.init_from=warm.safetensors
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Literal

import torch

from rollstream.config import PipelineConfig
from rollstream.model import BasePolicy, build_batch, build_policy
from rollstream.model.chat import encode_prompt
from rollstream.tasks import Prompt, Task, build_prompt_source, build_task

log = logging.getLogger(__name__)

#: Offset added to run.seed for the warm start's own prompts and targets (disjoint from the RL streams).
WARM_SEED_OFFSET = 10_007

WarmMode = Literal["format", "reverse"]


@dataclass(frozen=True)
class WarmStartReport:
    """What a warm start reached: steps, final loss, and greedy validation on the held-out prompts."""

    mode: str  # "format" or "reverse"
    steps: int
    loss: float
    val_acc: float  # share of exact reversals (must stay < 0.1 for the demo)
    val_reward_mean: float  # mean partial credit
    format_ok: float  # share of greedy answers that are digits only with the prompt's length
    seconds: float


def format_targets(digits: str, rng: random.Random) -> str:
    """A random digit string as long as `digits` (the format of the answer, none of its content)."""
    return "".join(rng.choice("0123456789") for _ in digits)


def format_loss(policy: BasePolicy, prompts: list[str], targets: list[str]) -> torch.Tensor:
    """Mean cross-entropy of `target + eos` after `bos + prompt` (teacher forcing), over response tokens."""
    tok = policy.tokenizer
    p_ids = [encode_prompt(tok, p) for p in prompts]  # as producers encode them (chat template or bos)
    r_ids = [tok.encode(t) + [tok.eos_id] for t in targets]
    ids, mask, R = build_batch(p_ids, r_ids, tok.pad_id)  # [B, P+R], [B, P+R]
    logp, _ = policy.forward_logprobs_entropy(ids, mask, R)  # [B, R]
    resp_mask = mask[:, -R:].to(logp.device).float()  # [B, R]
    return -(logp * resp_mask).sum() / resp_mask.sum()


def greedy_scores(policy: BasePolicy, cfg: PipelineConfig) -> tuple[float, float, float]:
    """(exact-match share, mean partial credit, format share) of greedy answers on the held-out prompts."""
    task = build_task(cfg)
    prompts = build_prompt_source(cfg, task).val_prompts()
    tok = policy.tokenizer
    ids = [encode_prompt(tok, p.text) for p in prompts]
    trajs = policy.generate(ids, n=1, max_new_tokens=cfg.data.max_response_length, greedy=True)
    exact = score = fmt = 0.0
    for p, t in zip(prompts, trajs, strict=True):
        text = tok.decode(t.response_ids)
        res = task.reward(p, text)
        exact += float(res.exact)
        score += res.score
        fmt += float(t.finished and text.isdigit() and len(text) == len(p.answer))
    k = max(1, len(prompts))
    return exact / k, score / k, fmt / k


def _greedy_exact(policy: BasePolicy, task: Task, prompts: list[Prompt], max_new_tokens: int) -> float:
    """Share of prompts whose greedy answer is exact."""
    tok = policy.tokenizer
    trajs = policy.generate(
        [encode_prompt(tok, p.text) for p in prompts], n=1, max_new_tokens=max_new_tokens, greedy=True
    )
    return sum(
        task.reward(p, tok.decode(t.response_ids)).exact for p, t in zip(prompts, trajs, strict=True)
    ) / len(prompts)


def warm_start(
    cfg: PipelineConfig,
    mode: WarmMode = "format",
    max_steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    stop_at_acc: float = 0.05,
    max_acc: float = 0.1,
    eval_every: int = 10,
) -> tuple[BasePolicy, WarmStartReport]:
    """Supervised warm start of the config's freshly initialised policy (run.seed), AdamW, teacher forcing.

    mode "format":  targets are random digit strings of the right length + eos (no reversal knowledge);
                    runs `max_steps` steps.
    mode "reverse": targets are the true reversals + eos; every `eval_every` steps the greedy exact match
                    on the warm start's own prompts (not the validation set) is measured, and training stops
                    once it reaches `stop_at_acc`; a snapshot that reached `max_acc` or more is replaced by
                    the previous one, so the result stays under `max_acc`.
    """
    t0 = time.perf_counter()
    policy = build_policy(cfg)
    task = build_task(cfg)
    rng = random.Random(cfg.run.seed + WARM_SEED_OFFSET)
    probe = [task.make_prompt(rng) for _ in range(256)]
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    prev, prev_loss = policy.state_dict_bytes(), float("nan")
    loss = torch.zeros(())
    step = 0
    while step < max_steps:
        policy.train()
        prompts = [task.make_prompt(rng) for _ in range(batch_size)]
        if mode == "format":
            targets = [format_targets(p.answer, rng) for p in prompts]
        else:
            targets = [p.answer for p in prompts]
        loss = format_loss(policy, [p.text for p in prompts], targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(policy.parameters()), 1.0)
        opt.step()
        step += 1
        if mode == "reverse" and step % eval_every == 0:
            acc = _greedy_exact(policy, task, probe, cfg.data.max_response_length)
            log.info("warm start step %d: loss %.4f probe exact %.3f", step, float(loss.detach()), acc)
            if acc >= max_acc:  # overshot: keep the previous snapshot (and report its loss)
                policy.load_state_dict_bytes(prev)
                loss = torch.tensor(prev_loss)
                step -= eval_every
                break
            if acc >= stop_at_acc:
                break
            prev, prev_loss = policy.state_dict_bytes(), float(loss.detach())
    policy.eval()
    acc, reward, fmt = greedy_scores(policy, cfg)
    report = WarmStartReport(mode, step, float(loss.detach()), acc, reward, fmt, time.perf_counter() - t0)
    return policy, report

