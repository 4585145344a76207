"""Build the policy, task and prompt source a config describes (shared by producers and the trainer)."""

from __future__ import annotations

import torch

from rollstream.config import PipelineConfig
from rollstream.model import BasePolicy, CharTokenizer, GPTConfig, load_policy
from rollstream.model.base import resolve_device, resolve_dtype
from rollstream.tasks import PromptSource, Task, make_task


def build_task(cfg: PipelineConfig) -> Task:
    """The task named by data.task with its settings (reverse: digits; rg:<dataset>: task_args, instruction,
    answer_extract, sign and magnitude credit)."""
    if cfg.data.task == "reverse":
        return make_task(
            "reverse",
            min_digits=cfg.data.reverse.min_digits,
            max_digits=cfg.data.reverse.max_digits,
            fixed_width=cfg.data.reverse.fixed_width,
        )
    if cfg.data.task.startswith("rg:"):
        return make_task(cfg.data.task, settings=cfg.data.task_args, instruction=cfg.data.instruction,
                         extract=cfg.data.answer_extract, sign_credit=cfg.data.sign_credit,
                         magnitude_credit=cfg.data.magnitude_credit)
    return make_task(cfg.data.task)


def build_prompt_source(cfg: PipelineConfig, task: Task | None = None) -> PromptSource:
    """Training prompts (fresh draws or a fixed set cycled by epochs, seeded) plus the held-out validation
    split."""
    # the char vocabulary is checked only where the tiny GPT's tokenizer must cover it
    if cfg.data.prompts_file:
        return PromptSource.from_jsonl(cfg.data.prompts_file, seed=cfg.run.seed, val_size=cfg.data.val_size,
                                       vocab_check=cfg.model.backend == "tiny")
    make = PromptSource.fresh_from_task if cfg.data.fresh_prompts else PromptSource.from_task
    return make(
        task or build_task(cfg), seed=cfg.run.seed, epoch_size=cfg.data.epoch_size, val_size=cfg.data.val_size
    )


def build_policy(cfg: PipelineConfig, device: str | None = None, dtype: str | None = None) -> BasePolicy:
    """The policy with initial weights from run.seed (identical on every process for the same seed), its
    weights in model.dtype, its forward passes under model.autocast; with `dtype` (a producer's
    rollout.dtype) its weights in that dtype, computing in it."""
    m = cfg.model
    dev = resolve_device(device or cfg.run.device)
    policy = _load(cfg, dev, resolve_dtype(dtype or m.dtype, dev))
    autocast = None if dtype else m.autocast
    policy.autocast_dtype = resolve_dtype(autocast, dev) if autocast else None
    return policy


def _load(cfg: PipelineConfig, dev: torch.device, dtype: torch.dtype) -> BasePolicy:
    """The policy of model.backend on `dev` with weights in `dtype` (tiny: seeded from run.seed)."""
    m = cfg.model
    if m.backend == "hf":
        return load_policy("hf", path=m.hf_path, device=str(dev), dtype=dtype, chat_template=m.chat_template)
    gcfg = GPTConfig(
        vocab_size=CharTokenizer().vocab_size,
        d_model=m.d_model,
        n_layer=m.n_layer,
        n_head=m.n_head,
        max_seq_len=m.max_seq_len,
        position=m.position,
    )
    policy = load_policy("tiny", cfg=gcfg, seed=cfg.run.seed, device=str(dev))
    if dtype != torch.float32:
        policy.module.to(dtype)
    return policy
