"""The peer side by side: TRL's GRPOTrainer on a rollstream config's model, task, reward and held-out set,
with held-out greedy accuracy against seconds in a JSONL (issue 61, item 5).

    python -m benchmarks.trl_grpo [configs/smollm2-basic-arithmetic.yaml] [key=value ...]
        [--out runs/trl/trl.jsonl] [--eval-every 5] [--max-steps N] [--limit-s 1200] [--target ACC]
        [--threads N] [--report 0.5 0.6] [--ours RUN_DIR]
    (also `rollstream bench trl_grpo …`; needs `pip install -e '.[hf,rg,bench-trl]'`, the model in its cache)

Built from rollstream's own code, not copies: the policy (`build_policy` with LoRA off: the same checkpoint,
dtype and attention), the training prompts in the order our one producer draws them (`build_prompt_source`),
the reward (the task's `reward` on the response decoded by our tokenizer, as the producers score it), and the
held-out evaluation (the trainer's `evaluate`: greedy, the same 200 problems). TRL adds peft LoRA on the same
layers (every Linear but the head) and trains in series: generate, score, update, repeat.

Mirrored from the config (`trl_settings`): group size (rollout.n), prompts per step (data.train_batch_size),
micro-batches (actor.micro_batch_size rows, accumulated to one optimizer step per global step), learning rate,
constant schedule, AdamW weight decay and grad-norm clip, clip epsilon, KL weight (0: no reference model),
token-mean loss (TRL's `dapo`), group-std advantages, temperature, top-p, top-k, completion length, rank and
alpha, seed. Threads: `--threads` (default: the cores our run holds, trainer plus producers) for both phases.

What TRL cannot mirror (also written into the JSONL's settings line): `trl_mirror.CANNOT_MIRROR`.

The JSONL: one `settings` line, then `eval` lines (step, wall_s, train_s, samples, held_out_acc,
held_out_reward, eval_s, eval_cpu_s) at step 0 and every --eval-every steps, and `step` lines (step, wall_s,
samples, step_s, generate_s, update_s, their CPU seconds over all threads generate_cpu_s and update_cpu_s:
on a shared box the steadier figure, reward_mean, zero_advantage_groups). wall_s counts from the start (model
load included), train_s is wall_s less the evaluations; samples are prompt groups (our RolloutSample unit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.trl_mirror import (
    CANNOT_MIRROR,
    ahead_levels,
    default_threads,
    lora_settings,
    make_reward,
    time_to,
    training_rows,
    trl_settings,
    zero_advantage_groups,
)
from rollstream.config import PipelineConfig, load_config
from rollstream.tasks import Prompt, Task

DEFAULT_CONFIG = "configs/smollm2-basic-arithmetic.yaml"
INSTALL_HINT = "pip install -e '.[hf,rg,bench-trl]'"


class Bench:
    """One TRL run's clock, evaluations and JSONL (the trainer's callback calls `step_began`/`step_ended`)."""

    def __init__(self, cfg: PipelineConfig, out: Path, a: argparse.Namespace, t0: float) -> None:
        """Write to `out` (truncated); the clock started at `t0` (time.perf_counter). The policy, task and
        held-out prompts are set once the trainer is built (`build_trainer`)."""
        self.cfg, self.a, self.t0 = cfg, a, t0
        self.policy: Any = None
        self.task: Task | None = None
        self.val: list[Prompt] = []
        self.out = out.open("w", encoding="utf-8")
        self.scores: list[float] = []  # the rewards of the step's generation batch (make_reward appends)
        self.generate_s = 0.0  # this step's seconds generating and scoring (TimedGRPOTrainer adds)
        self.generate_cpu_s = 0.0  # and this process's CPU seconds (all threads) in them
        self.eval_s = 0.0  # every evaluation's seconds, so far
        self.began = self.began_cpu = 0.0
        self.points: list[tuple[float, float, float]] = []  # (wall_s, train_s, held_out_acc)
        self.steps: list[dict[str, float]] = []

    def write(self, record: dict[str, Any]) -> None:
        """One JSONL line, flushed."""
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def now(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.t0

    def evaluate(self, step: int) -> float:
        """Held-out greedy accuracy of the current weights (the trainer's `evaluate`), written as an `eval`
        line; returns it."""
        from consumers.trainer.evaluate import evaluate

        began, began_cpu = time.perf_counter(), time.process_time()
        batch = self.cfg.data.val_batch_size or max(len(self.val), 1)
        assert self.task is not None, "build_trainer sets the task"
        metrics = evaluate(self.policy, self.task, self.val, self.cfg.data.max_response_length, batch, 1)
        self.policy.module.train()  # evaluate leaves the module in eval mode; TRL trains it in train mode
        self.eval_s += time.perf_counter() - began
        wall = self.now()
        acc = metrics["val/acc"]
        self.points.append((wall, wall - self.eval_s, acc))
        self.write({"event": "eval", "step": step, "wall_s": round(wall, 3),
                    "train_s": round(wall - self.eval_s, 3),
                    "samples": step * self.cfg.data.train_batch_size, "held_out_acc": acc,
                    "held_out_reward": metrics["val/reward_mean"],
                    "eval_s": round(time.perf_counter() - began, 3),
                    "eval_cpu_s": round(time.process_time() - began_cpu, 3)})
        print(f"step {step}: held-out acc {acc:.3f} at {wall:.0f} s ({wall - self.eval_s:.0f} s training)",
              flush=True)
        return acc

    def step_began(self) -> None:
        """An optimizer step (generation, scoring, update) starts."""
        self.began, self.generate_s = time.perf_counter(), 0.0
        self.began_cpu, self.generate_cpu_s = time.process_time(), 0.0
        self.scores.clear()

    def step_ended(self, step: int) -> bool:
        """Write the step's line, evaluate when due; True when the run should stop (time limit, target)."""
        step_s, cpu_s = time.perf_counter() - self.began, time.process_time() - self.began_cpu
        record = {"step_s": step_s, "generate_s": self.generate_s, "update_s": step_s - self.generate_s,
                  "generate_cpu_s": self.generate_cpu_s, "update_cpu_s": cpu_s - self.generate_cpu_s}
        self.steps.append(record)
        scores = list(self.scores)
        self.write({"event": "step", "step": step, "wall_s": round(self.now(), 3),
                    "samples": step * self.cfg.data.train_batch_size,
                    **{k: round(v, 3) for k, v in record.items()},
                    "reward_mean": sum(scores) / max(len(scores), 1),
                    "zero_advantage_groups": zero_advantage_groups(scores, self.cfg.rollout.n),
                    "torch_threads": torch.get_num_threads()})
        acc = self.evaluate(step) if step % self.a.eval_every == 0 else None
        if self.a.target is not None and acc is not None and acc >= self.a.target:
            return True
        return self.now() - self.eval_s >= self.a.limit_s


def _trainer_class(bench: Bench) -> Any:
    """GRPOTrainer timing its generation and scoring into `bench.generate_s`."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]  # trl is untyped
        """GRPOTrainer whose generate-and-score phase is timed."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            """TRL's phase, timed: generation, rewards and advantages."""
            began, began_cpu = time.perf_counter(), time.process_time()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                bench.generate_s += time.perf_counter() - began
                bench.generate_cpu_s += time.process_time() - began_cpu

    return TimedGRPOTrainer


def _callback(bench: Bench) -> Any:
    """A TrainerCallback driving `bench` at each optimizer step's start and end."""
    from transformers import TrainerCallback

    class BenchCallback(TrainerCallback):  # type: ignore[misc]  # transformers is untyped
        """Step clock, evaluation and stop."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            """Clock a step."""
            bench.step_began()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            """Record the step; stop at the limit or target."""
            if bench.step_ended(state.global_step):
                control.should_training_stop = True

    return BenchCallback()


def build_trainer(cfg: PipelineConfig, bench: Bench | None, max_steps: int, workdir: str,
                  seen: list[float] | None = None) -> tuple[Any, Any, Task, list[Prompt]]:
    """(TRL trainer, our policy whose module it trains, task, held-out prompts) for `cfg`: the policy as
    `build_policy` builds it with LoRA off (peft adds its own), the first max_steps x data.train_batch_size
    training prompts in our producer's order. Refuses (ValueError) when TRL renders a prompt into other
    ids than ours."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from rollstream.model import build_policy
    from rollstream.model.chat import encode_prompt
    from rollstream.tasks import build_prompt_source, build_task

    task = build_task(cfg)
    source = build_prompt_source(cfg, task)
    prompts = [p for _, _, p in source.take(max_steps * cfg.data.train_batch_size)]
    plain = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora_rank": 0})})
    policy: Any = build_policy(plain)
    tok = policy.tokenizer
    reward: Any = make_reward(task, tok, seen)
    args = GRPOConfig(**trl_settings(cfg, max_steps, workdir))
    cls = _trainer_class(bench) if bench is not None else GRPOTrainer
    trainer = cls(
        model=policy.module, reward_funcs=reward, args=args,
        train_dataset=Dataset.from_list(training_rows(cfg, prompts)), processing_class=tok.hf,
        peft_config=LoraConfig(**lora_settings(cfg)),
        callbacks=[_callback(bench)] if bench is not None else None,
    )
    rows = training_rows(cfg, prompts[:4])
    theirs = trainer._tokenize_prompts([r["prompt"] for r in rows])[0]
    ours = [encode_prompt(tok, p.text) for p in prompts[:4]]
    if [list(x) for x in theirs] != ours:
        raise ValueError("TRL renders the prompts into other token ids than rollstream's encode_prompt")
    return trainer, policy, task, source.val_prompts()


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="trl_grpo", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="the rollstream config to mirror")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. run.seed=1)")
    p.add_argument("--out", default="runs/trl/trl.jsonl", help="the JSONL written (truncated first)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between evaluations (trainer.test_freq)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps (trainer.total_training_steps)")
    p.add_argument("--limit-s", type=float, default=1200.0,
                   help="stop after this many seconds, evaluations excluded (the demo's 20 minutes)")
    p.add_argument("--target", type=float, default=None, help="stop once held-out accuracy >= this")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for both phases (default: the cores our run holds, trainer + "
                        "producers)")
    p.add_argument("--report", type=float, nargs="*", default=[0.5, 0.6], help="accuracy levels to time")
    p.add_argument("--ours", default=None,
                   help="a finished demo.sh run folder of ours (runs/NAME) to set side by side")
    return p.parse_args(argv)


def _summary(bench: Bench, a: argparse.Namespace) -> None:
    """Time to each --report level (TRL: evaluations excluded) and per-step medians; against --ours when
    given, with the levels TRL reaches first."""
    theirs = [(train_s, acc) for _, train_s, acc in bench.points]
    steps = bench.steps[1:] or bench.steps  # the first step also warms up
    if steps:
        med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        which = "" if steps is bench.steps else " of steps 2+"
        print(f"TRL per step (median{which}): {med['step_s']:.1f} s = generate {med['generate_s']:.1f} s"
              f" + update {med['update_s']:.1f} s; CPU seconds (all threads): generate "
              f"{med['generate_cpu_s']:.1f} + update {med['update_cpu_s']:.1f}")
    ours: list[tuple[float, float]] = []
    if a.ours:
        from scripts.plot_demo_runs import curve

        ours = [(s, acc) for s, _, acc in curve(Path(a.ours))]
    print("| held-out level | TRL (s, evaluations excluded) |" + (" ours (s) | TRL / ours |" if ours else ""))
    print("|---|---|" + ("---|---|" if ours else ""))
    for level in a.report:
        t, o = time_to(theirs, level), time_to(ours, level)
        row = f"| {level:.0%} | {'-' if t is None else f'{t:.0f}'} |"
        if ours:
            ratio = f"{t / o:.2f}x" if t is not None and o else "-"
            row += f" {'-' if o is None else f'{o:.0f}'} | {ratio} |"
        print(row)
    if ours:
        ahead = ahead_levels(ours, theirs)
        print("TRL never ahead" if not ahead else f"TRL ahead at: {', '.join(f'{x:.1%}' for x in ahead)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run TRL's GRPOTrainer on the config until --limit-s, --max-steps or --target; 2 when trl is missing."""
    t0 = time.perf_counter()
    a = _args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local folder: never ask the hub
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import peft
        import trl
    except ImportError:
        print(f"trl_grpo: TRL or peft is not installed ({INSTALL_HINT})")
        return 2
    cfg = load_config(a.config, list(a.overrides))
    a.eval_every = a.eval_every or cfg.trainer.test_freq
    max_steps = a.max_steps or cfg.trainer.total_training_steps
    threads = a.threads or default_threads(cfg)
    torch.set_num_threads(threads)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as workdir:
        bench = Bench(cfg, out, a, t0)
        trainer, policy, bench.task, bench.val = build_trainer(cfg, bench, max_steps, workdir, bench.scores)
        bench.policy = policy
        torch.set_num_threads(threads)
        import transformers

        bench.write({"event": "settings", "config": a.config, "overrides": list(a.overrides),
                     "threads": threads, "dtype": str(next(policy.module.parameters()).dtype),
                     "attn_implementation": cfg.model.attn_implementation,
                     "grpo_config": {k: v for k, v in trl_settings(cfg, max_steps, "").items()
                                     if k != "output_dir"},
                     "lora": lora_settings(cfg), "eval_every": a.eval_every, "limit_s": a.limit_s,
                     "versions": {"trl": trl.__version__, "peft": peft.__version__,
                                  "transformers": transformers.__version__, "torch": torch.__version__},
                     "cannot_mirror": list(CANNOT_MIRROR)})
        bench.evaluate(0)
        trainer.train()
    bench.out.close()
    _summary(bench, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
