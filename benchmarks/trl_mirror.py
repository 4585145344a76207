"""What the TRL baseline (benchmarks/trl_grpo.py) takes from a rollstream config: GRPOConfig's and peft's
settings, the dataset rows and the reward function TRL calls, what TRL cannot mirror, and the curve
comparison. Imports neither TRL nor transformers, so the settings are checked without the bench-trl extra."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rollstream.config import PipelineConfig
from rollstream.tasks import Prompt, Task

#: What TRL's GRPOTrainer does differently, whatever its settings.
CANNOT_MIRROR = (
    "it samples and trains in series (ours: the producer samples version v+1's batch while the trainer "
    "updates on version v's, one core each), so its step is generation + update, ours the longer of the two",
    "it forwards every row, also a group whose rows all got one reward (advantage 0: ours skips them, "
    "actor.zero_advantage_rows=skip, the same update); that is most groups once the policy sharpens",
    "its PPO ratio is against the policy that just sampled (on-policy, ratio 1); ours is against the "
    "sampling policy one version behind (algorithm.rollout_correction.bypass_mode)",
    "peft computes LoRA as a side branch on every token (x W^T + (x A^T) B^T s); ours samples with one "
    "merged weight W + B A s (rollstream/model/lora.py)",
    "its own sampler: transformers' generate; ours the built-in KV-cache sampler (rollout.name=builtin)",
    "its random numbers: sampling is seeded by run.seed through transformers' set_seed, not draw for draw "
    "ours",
)
#: actor.loss_agg_mode -> TRL's loss_type with the same aggregation.
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


def _refuse_unmirrorable(cfg: PipelineConfig) -> None:
    """ValueError naming the first config field whose setting TRL's GRPOTrainer has no counterpart for."""
    refusals = {
        "algorithm.adv_estimator": (cfg.algorithm.adv_estimator, cfg.algorithm.adv_estimator != "grpo"),
        "algorithm.norm_adv_by_mean": (cfg.algorithm.norm_adv_by_mean, cfg.algorithm.norm_adv_by_mean),
        "actor.loss_agg_mode": (cfg.actor.loss_agg_mode, cfg.actor.loss_agg_mode not in LOSS_TYPES),
        "rollout.multi_turn.enable": (cfg.rollout.multi_turn.enable, cfg.rollout.multi_turn.enable),
        "model.backend": (cfg.model.backend, cfg.model.backend != "hf"),
        "model.lora_rank": (cfg.model.lora_rank, cfg.model.lora_rank < 1),
        "actor.entropy_decay_steps": (cfg.actor.entropy_decay_steps, cfg.actor.entropy_decay_steps > 0),
    }
    for name, (value, refused) in refusals.items():
        if refused:
            raise ValueError(f"{name}={value!r}: the TRL baseline has no counterpart for it")


def rows_per_step(cfg: PipelineConfig) -> int:
    """Responses per global step: prompts per step x group size."""
    return cfg.data.train_batch_size * cfg.rollout.n


def trl_settings(cfg: PipelineConfig, max_steps: int, output_dir: str) -> dict[str, Any]:
    """GRPOConfig's keyword arguments mirroring `cfg` (one optimizer step per global step over
    data.train_batch_size prompts x rollout.n responses); ValueError naming a field TRL cannot mirror."""
    _refuse_unmirrorable(cfg)
    rows = rows_per_step(cfg)
    micro = cfg.actor.micro_batch_size or rows
    if rows % micro:
        raise ValueError(f"actor.micro_batch_size={micro} must divide the {rows} responses of a step")
    actor, rollout = cfg.actor, cfg.rollout
    return {
        "output_dir": output_dir,
        "num_generations": rollout.n,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": rows // micro,  # TRL: generation batch = micro x accumulation = rows
        "num_iterations": actor.ppo_epochs,
        "max_steps": max_steps,
        "learning_rate": actor.optim.lr,
        "lr_scheduler_type": "constant",  # Trainer's default decays linearly to 0 over max_steps
        "warmup_steps": 0,
        "weight_decay": actor.optim.weight_decay,
        "max_grad_norm": actor.optim.clip_grad,
        "optim": "adamw_torch_fused" if actor.optim.fused is not False else "adamw_torch",
        "beta": actor.kl_loss_coef,  # 0: no reference model
        "epsilon": actor.clip_ratio,
        "epsilon_high": actor.clip_ratio_high,
        "entropy_coef": actor.entropy_coeff,
        "loss_type": LOSS_TYPES[actor.loss_agg_mode],
        "scale_rewards": "group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        "max_completion_length": cfg.data.max_response_length,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": 0 if rollout.top_k == -1 else rollout.top_k,  # TRL's 0 = every token (ours -1)
        "gradient_checkpointing": actor.gradient_checkpointing,  # GRPOConfig's default is on
        "bf16": False,  # weights in model.dtype's dtype (bfloat16 where faster), the LoRA factors float32
        "use_cpu": cfg.run.device == "cpu" or not torch.cuda.is_available(),
        "seed": cfg.run.seed,
        "shuffle_dataset": False,  # the prompts in the order our producer draws them
        "remove_unused_columns": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def lora_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """peft LoraConfig's keyword arguments for model.lora_rank / lora_alpha / target_modules ("all-linear":
    every Linear but the output head, in peft as in rollstream)."""
    targets = cfg.model.target_modules
    return {"r": cfg.model.lora_rank, "lora_alpha": cfg.model.lora_alpha, "lora_dropout": 0.0,
            "bias": "none", "target_modules": targets if isinstance(targets, str) else list(targets),
            "task_type": "CAUSAL_LM"}


def default_threads(cfg: PipelineConfig) -> int:
    """The cores our run of `cfg` holds: the trainer's threads plus every producer's (0 = all cores)."""
    trainer = cfg.trainer.torch_threads * cfg.trainer.world_size
    producers = cfg.rollout.torch_threads * cfg.rollout.num_producers
    if not cfg.trainer.torch_threads or not cfg.rollout.torch_threads:
        return torch.get_num_threads()
    return trainer + producers


def training_rows(cfg: PipelineConfig, prompts: Sequence[Prompt]) -> list[dict[str, Any]]:
    """TRL's dataset rows: the conversational prompt (one user turn, after model.system_prompt when set, as
    `encode_prompt` renders it) and the columns the reward needs to rebuild the Prompt."""
    system = cfg.model.system_prompt
    rows = []
    for p in prompts:
        turns = [{"role": "user", "content": p.text}]
        if system is not None:
            turns.insert(0, {"role": "system", "content": system})
        rows.append({"prompt": turns, "uid": p.uid, "question": p.text, "answer": p.answer})
    return rows


def make_reward(task: Task, tokenizer: Any, seen: list[float] | None = None) -> Callable[..., list[float]]:
    """The reward function TRL calls: our task's score of each response, decoded from its ids by our
    tokenizer (`tokenizer.decode`, as the producers decode before scoring); the scores of each call are
    appended to `seen` when given."""

    def rollstream_reward(completion_ids: Sequence[Sequence[int]], uid: Sequence[str],
                          question: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
        """One score per completion (TRL passes the dataset's columns, one value per completion)."""
        scores = [
            task.reward(Prompt(uid=u, text=q, answer=a), tokenizer.decode(list(ids))).score
            for ids, u, q, a in zip(completion_ids, uid, question, answer, strict=True)
        ]
        if seen is not None:
            seen.extend(scores)
        return scores

    return rollstream_reward


def zero_advantage_groups(scores: Sequence[float], n: int) -> float:
    """Share of the groups of `n` consecutive scores that all got one reward (advantage 0 for every row)."""
    groups = [scores[i : i + n] for i in range(0, len(scores), n)]
    return sum(1 for g in groups if max(g) == min(g)) / max(len(groups), 1)


def time_to(points: Sequence[tuple[float, float]], level: float) -> float | None:
    """Seconds of the first (seconds, accuracy) point at or above `level`, or None."""
    return next((t for t, acc in points if acc >= level - 1e-9), None)


def ahead_levels(ours: Sequence[tuple[float, float]], theirs: Sequence[tuple[float, float]]) -> list[float]:
    """The accuracy levels the peer's curve reaches before ours does (or ours never does): every running
    best of `theirs` above its first reading (version 0: nothing trained yet, and the clock counts only
    start-up there), checked against our first time at or above it."""
    out, best = [], theirs[0][1] if theirs else -math.inf
    for _, acc in theirs[1:]:
        if acc > best:
            best = acc
            ours_s, theirs_s = time_to(ours, acc), time_to(theirs, acc)
            if ours_s is None or (theirs_s is not None and theirs_s < ours_s):
                out.append(acc)
    return out
