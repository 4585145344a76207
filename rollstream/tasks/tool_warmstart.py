"""A supervised warm start of a HF model on tool-call traces (`data.tool: calculator`): the call format only.

Version 0 of SmolLM2-135M-Instruct makes a well-formed call in 0.2 % of samples (issue 60), so RL from it
would mostly reinforce answering directly. A few supervised steps on generated episodes teach the format:

    prompt | [calc: 26 - 92]<eos> (trained) | tool turn holding [=-66] (masked) | -66<eos> (trained)

Each trace is the episode the agent loop would put on the log for a right call (the same ids: the template's
tool turn starts with the eos that ends the model's call turn; here that eos is the model's, trained), built
from the task's own generator on training prompts only (none of the held-out problems: `holdout_key`),
at most `traces` of them, the loss on the model's tokens alone. It stops after `max_steps` steps or
`max_seconds` of training, whichever comes first, and is kept small on purpose so that RL is what teaches
the tool.
The report is the warm start's alone: held-out greedy accuracy through the tool loop, the call rate, and the
share of calls that held the right expression.

    policy, report = tool_warm_start(cfg)
    save_hf_model(policy, "runs/x/warm")   # the pipeline starts from it: model.hf_path=runs/x/warm
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rollstream.config import PipelineConfig
from rollstream.model import BasePolicy, build_batch, build_policy, pad_right
from rollstream.model.chat import encode_prompt, encode_tool_result
from rollstream.model.lora import LoRALinear
from rollstream.tasks import Prompt, build_prompt_source, build_task, holdout_key
from rollstream.tasks.calculator import CalculatorTask, trace_texts
from rollstream.tasks.episode import greedy_episodes

log = logging.getLogger(__name__)

#: Offset added to run.seed for the warm start's prompts (disjoint from the RL streams' draws).
TOOL_WARM_SEED_OFFSET = 20_011
#: The issue's bound: at most this many traces, and this many seconds of training on 2 cores.
MAX_TRACES = 32
MAX_SECONDS = 60.0


@dataclass(frozen=True)
class ToolWarmStartReport:
    """What a tool warm start did and reached on the held-out set, greedy through the tool loop."""

    traces: int
    steps: int
    loss: float  # mean cross-entropy per trained token at the last step
    train_s: float  # wall seconds of training
    cpu_s: float  # CPU seconds of training, all threads (the bounded part: at most 2 x 60)
    val_acc: float  # held-out greedy exact match with the tool
    call_rate: float  # share of held-out episodes with a call
    right_expr: float  # share of calls whose value is the answer (the problem's expression)
    acc_with_call: float  # accuracy of the episodes that called
    acc_without_call: float  # accuracy of those that did not (0 when every episode called)
    val_s: float


def trace_rows(
    task: CalculatorTask, policy: BasePolicy, prompts: list[Prompt]
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(prompt ids, response ids, loss mask) of each prompt's right tool episode: the call and its eos, the
    tool turn after that eos (mask 0), the answer and its eos."""
    tok = policy.tokenizer
    p_ids, r_ids, masks = [], [], []
    for p in prompts:
        call, result, answer = trace_texts(task, p)
        tool = encode_tool_result(tok, result)
        turn_end = 1 if tool and tool[0] == tok.eos_id else 0  # the call turn's own end, trained
        first = tok.encode(call) + tool[:turn_end]
        second = tok.encode(answer) + [tok.eos_id]
        p_ids.append(encode_prompt(tok, p.text))
        r_ids.append(first + tool[turn_end:] + second)
        masks.append([1] * len(first) + [0] * (len(tool) - turn_end) + [1] * len(second))
    return p_ids, r_ids, masks


def trace_loss(policy: BasePolicy, p_ids: list[list[int]], r_ids: list[list[int]],
               masks: list[list[int]]) -> torch.Tensor:
    """Mean cross-entropy over the trained tokens of the traces (teacher forcing; tool tokens masked)."""
    ids, attn, R = build_batch(p_ids, r_ids, policy.tokenizer.pad_id)
    logp, _ = policy.forward_logprobs_entropy(ids, attn, R)  # [B, R]
    weight = pad_right(masks, R).to(logp.device)  # [B, R]
    return -(logp * weight).sum() / weight.sum()


def training_prompts(cfg: PipelineConfig, task: CalculatorTask, count: int) -> list[Prompt]:
    """`count` prompts from the task's generator (run.seed + TOOL_WARM_SEED_OFFSET), none a held-out
    problem."""
    held_out = {holdout_key(p) for p in build_prompt_source(cfg, task).val_prompts()}
    rng = random.Random(cfg.run.seed + TOOL_WARM_SEED_OFFSET)
    out: list[Prompt] = []
    while len(out) < count:
        p = task.make_prompt(rng)
        if holdout_key(p) not in held_out:
            out.append(p)
    return out


def tool_val_scores(policy: BasePolicy, cfg: PipelineConfig, task: CalculatorTask) -> dict[str, float]:
    """Held-out greedy episodes through the tool loop: acc, call rate, right-expression share, accuracy with
    and without a call."""
    prompts = build_prompt_source(cfg, task).val_prompts()
    tok = policy.tokenizer
    episodes = greedy_episodes(policy, task, [encode_prompt(tok, p.text) for p in prompts],
                               cfg.data.max_response_length, cfg.rollout.multi_turn.max_turns)
    sums: dict[str, float] = {}
    for p, ep in zip(prompts, episodes, strict=True):
        for k, v in task.reward(p, tok.decode(ep.response_ids)).metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    calls = sums.get("tool_calls", 0.0)
    called = sums.get("called", 0.0)
    n = max(len(prompts), 1)
    return {
        "acc": sums.get("acc", 0.0) / n,
        "call_rate": called / n,
        "right_expr": (calls - sums.get("wrong_expr", 0.0) - sums.get("tool_errors", 0.0)) / calls if calls
        else 0.0,
        "acc_with_call": sums.get("right_called", 0.0) / called if called else 0.0,
        "acc_without_call": sums.get("right_uncalled", 0.0) / (n - called) if n > called else 0.0,
    }


def tool_warm_start(
    cfg: PipelineConfig,
    traces: int = 16,
    max_steps: int = 3,
    lr: float = 3e-4,
    rank: int = 16,
    max_seconds: float = MAX_SECONDS,
    micro_batch: int = 8,
    evaluate: bool = True,
) -> tuple[BasePolicy, ToolWarmStartReport]:
    """LoRA (`rank`, alpha 2 x rank, every Linear but the head; rank 0: full fine-tuning; float32, AdamW) on
    `traces` generated tool episodes for at most `max_steps` steps (each over all the traces, in
    micro-batches) and `max_seconds` of training on 2 cores (2 x max_seconds of the process's CPU time: a
    busy machine slows the clock, not the work), then the factors folded into the weights; ValueError naming
    the field for a config without the calculator or a budget past the issue's bound."""
    if cfg.data.tool != "calculator" or cfg.model.backend != "hf":
        raise ValueError(f"the tool warm start needs data.tool=calculator and model.backend=hf (got "
                         f"data.tool={cfg.data.tool!r}, model.backend={cfg.model.backend!r})")
    if not 1 <= traces <= MAX_TRACES:
        raise ValueError(f"traces={traces} must be in [1, {MAX_TRACES}]")
    if not 0 < max_seconds <= MAX_SECONDS:
        raise ValueError(f"max_seconds={max_seconds} must be in (0, {MAX_SECONDS}]")
    task = build_task(cfg)
    assert isinstance(task, CalculatorTask)
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0 (0: full fine-tuning)")
    model = cfg.model.model_copy(update={"lora_rank": rank, "lora_alpha": 2.0 * max(rank, 1),
                                         "dtype": "float32", "autocast": None})
    policy = build_policy(cfg.model_copy(update={"model": model}))
    prompts = training_prompts(cfg, task, traces)
    p_ids, r_ids, masks = trace_rows(task, policy, prompts)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    steps, loss_value = 0, float("nan")
    policy.train()
    while steps < max_steps and time.process_time() - c0 < 2 * max_seconds:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(prompts), micro_batch):
            sl = slice(i, i + micro_batch)
            loss = trace_loss(policy, p_ids[sl], r_ids[sl], masks[sl])
            share = len(p_ids[sl]) / len(p_ids)
            (loss * share).backward()
            total += float(loss.detach()) * share
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        steps += 1
        loss_value = total
        log.info("tool warm start step %d: loss %.4f (%.1f s)", steps, total, time.perf_counter() - t0)
    train_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    fold_lora(policy.module)
    policy.eval()
    scores = {"acc": float("nan"), "call_rate": float("nan"), "right_expr": float("nan"),
              "acc_with_call": float("nan"), "acc_without_call": float("nan")}
    v0 = time.perf_counter()
    if evaluate:
        with torch.no_grad():
            scores = tool_val_scores(policy, cfg, task)
    report = ToolWarmStartReport(len(prompts), steps, loss_value, train_s, cpu_s, scores["acc"],
                                 scores["call_rate"],
                                 scores["right_expr"], scores["acc_with_call"], scores["acc_without_call"],
                                 time.perf_counter() - v0)
    return policy, report


def fold_lora(module: torch.nn.Module) -> int:
    """Fold every LoRA layer's factors into its weight (W <- W + B A * scale) and make every Linear a plain
    Linear again, trainable, so the module saves and loads as the model it was; returns the layers folded."""
    folded = 0
    for m in module.modules():
        if isinstance(m, LoRALinear):
            with torch.no_grad():
                m.weight.copy_(m.merged_weight())
            del m.lora
            m._merged = None
            folded += 1
        if isinstance(m, torch.nn.Linear):
            m.__class__ = torch.nn.Linear
    module.requires_grad_(True)
    return folded


def save_hf_model(policy: BasePolicy, out: str | Path) -> Path:
    """Write the policy's HF model and tokenizer to the folder `out` (what `model.hf_path` reads)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    module = getattr(policy, "module", None)
    hf_tok = getattr(policy.tokenizer, "hf", None)
    if module is None or hf_tok is None or not hasattr(module, "save_pretrained"):
        raise ValueError("save_hf_model needs a HF policy (model.backend=hf)")
    module.save_pretrained(str(folder))
    hf_tok.save_pretrained(str(folder))
    return folder
