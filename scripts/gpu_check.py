"""CUDA check: a tiny random HF model runs N global steps through producers and trainer on the GPU.

    bash scripts/gpu_check.sh                      # needs CUDA; prints tokens/s and samples/s, audits the log
    bash scripts/gpu_check.sh --allow-cpu          # no GPU: the same run on the CPU (float32), clearly
    labelled
    bash scripts/gpu_check.sh --steps 5 rollout.n=16   # key=value overrides go to `rollstream run`
    bash scripts/gpu_check.sh --engine vllm        # producers generate with vLLM (the `vllm` extra on CUDA)
    bash scripts/gpu_check.sh --engine vllm --lora-rank 8   # LoRA: each version reaches vLLM merged

What runs: a Qwen2-architecture model (random init, `--hidden-size`, `--layers`) with a byte-level BPE
tokenizer and chat template built locally (rollstream.testing.hf_tiny; nothing is downloaded) is saved to a
temp dir; `rollstream run pipeline.yaml model.backend=hf model.hf_path=DIR run.device=cuda` starts
supervisord, an embedded Redis, 2 producers, the trainer and the aggregator (model.dtype=auto: bfloat16 on
CUDA); weights go through the streamed file:// path (bus.weights_inline_max_bytes=0). After N global steps
with every producer on version N, it prints the rates read back from the log, the largest difference
between the producers' behaviour log-probs and the trainer's recompute on version-0 samples (float32: must
be < 1e-5, or < 1e-4 with vLLM's kernels; bfloat16: shown for information) and, with `--engine vllm`, the mean
time to load a new version into a running engine (the swap), stops the run and audits
the log (every sample trained or dropped once, steps and records consecutive). Exit 0 when all holds.

Needs a Python with a CUDA build of torch plus rollstream's dependencies (`pip install -e '.[hf]'`) and
redis-server on PATH; PYTHON=... picks the interpreter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch
from runcheck import (  # scripts/ is on sys.path when run as a script
    behaviour_logprob_error,
    producer_stats,
    swap_checks,
    throughput,
    wait_for_steps,
)

from producers.worker import swap_check_bound
from rollstream.keys import Keys
from rollstream.model.base import resolve_dtype
from rollstream.ops.audit import audit_run
from rollstream.ops.embedded_redis import EmbeddedRedis
from rollstream.ops.run_target import open_run
from rollstream.testing.hf_tiny import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
ALLOW_CPU_ENV = "ROLLSTREAM_GPU_CHECK_ALLOW_CPU"
RUN = [
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=8",
    "rollout.num_producers=2", "rollout.prompts_per_dispatch=8", "rollout.stats_every_s=1",
    "data.max_response_length=12", "data.val_size=16", "trainer.test_freq=0", "rollout.torch_threads=0",
    "trainer.torch_threads=0", "bus.weights_inline_max_bytes=0", "actor.micro_batch_size=32",
    "actor.gradient_checkpointing=true", "async_training.staleness_threshold=1.0",
]


def cli(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`rollstream …` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def mean_swap_s(r: redis.Redis, keys: Keys) -> float | None:
    """Mean `producer/weight_swap_s` over the producers' stats (None when no swap was reported)."""
    values = [
        ev.metrics["producer/weight_swap_s"]
        for ev in producer_stats(r, keys)
        if "producer/weight_swap_s" in ev.metrics
    ]
    return sum(values) / len(values) if values else None


def main(argv: list[str]) -> int:
    """Parse flags, run the check, print the figures; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="global steps to run")
    p.add_argument("--hidden-size", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument(
        "--allow-cpu", action="store_true", help=f"run on the CPU when no GPU is there (or {ALLOW_CPU_ENV}=1)"
    )
    p.add_argument(
        "--dir", default=None, help="keep the model and run dir here (default: a temp dir, removed)"
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up when the steps take longer")
    p.add_argument(
        "--engine", choices=("builtin", "vllm"), default="builtin", help="rollout.name of the producers"
    )
    p.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA rank to train (model.lora_rank; 0: the whole model)"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides for `rollstream run`")
    args = p.parse_args(argv)
    if args.lora_rank < 0:
        p.error(f"--lora-rank must be >= 0, got {args.lora_rank}")

    if torch.cuda.is_available():
        device, label = "cuda", f"cuda ({torch.cuda.get_device_name(0)}, torch {torch.__version__})"
    elif args.allow_cpu or os.environ.get(ALLOW_CPU_ENV) == "1":
        device, label = "cpu", "cpu (no CUDA device: CPU fallback, float32; these are not GPU figures)"
    else:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); pass --allow-cpu to run the "
            "same "
            "check on the CPU",
            file=sys.stderr,
        )
        return 2
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        return check(Path(args.dir), device, label, args)
    with tempfile.TemporaryDirectory() as tmp:
        return check(Path(tmp), device, label, args)


def check(work: Path, device: str, label: str, args: argparse.Namespace) -> int:
    """Build the model, run the pipeline, print figures, stop, audit."""
    lora = f", LoRA rank {args.lora_rank}" if args.lora_rank else ""
    print(f"gpu_check: device {label}, engine {args.engine}{lora}", flush=True)
    model = make_tiny_hf_model(work / "model", seed=0, hidden_size=args.hidden_size, arch="qwen2",
                               tokenizer="bpe", chat_template=True, num_layers=args.layers)
    name = f"gpu-check-{int(time.time())}"
    run_args = ["pipeline.yaml", "model.backend=hf", f"model.hf_path={model}", *RUN,
                f"trainer.total_training_steps={args.steps}", f"run.device={device}", f"run.dir={work}",
                f"run.name={name}", f"rollout.name={args.engine}"]
    if args.lora_rank:  # alpha / rank = 2, as the SmolLM2 config trains it (the overrides follow: theirs win)
        run_args += [f"model.lora_rank={args.lora_rank}", f"model.lora_alpha={2 * args.lora_rank}"]
    run_args += args.overrides
    run_dir = work / name
    t0 = time.perf_counter()
    ok = True
    try:
        started = cli("run", *run_args, timeout_s=420)  # waits for the producers' engines
        if started.returncode != 0:
            print(started.stdout + started.stderr, file=sys.stderr)
            return 1
        target = open_run(None, run_dir=str(run_dir))
        wait_for_steps(target, args.steps, args.timeout_s)
        wall = time.perf_counter() - t0
        r = target.connect()
        rates = throughput(r, target.keys)
        error, tokens = behaviour_logprob_error(r, target.keys, target.cfg, version=0)
        swap_s = mean_swap_s(r, target.keys)
        checks = swap_checks(r, target.keys)
        r.close()
        dtype = str(resolve_dtype(target.cfg.model.dtype, torch.device(device))).removeprefix("torch.")
        print(
            f"gpu_check: {args.steps} global steps in {wall:.1f}s from `rollstream run` (model load "
            "included); "
            f"weights {dtype}"
        )
        print(f"gpu_check: samples/s {rates.samples_per_s:.2f}  tokens/s {rates.tokens_per_s:.0f}  "
              f"(trained, steps 2..{args.steps}, {rates.window_s:.2f}s); producer decode tokens/s "
              f"{rates.gen_tokens_per_s:.0f}")
        exact = dtype == "float32"
        bound = 1e-5 if args.engine == "builtin" else 1e-4
        print(
            f"gpu_check: behaviour vs trainer log-probs, version 0: max |diff| {error:.2e} over {tokens} "
            "tokens"
            f" ({f'must be < {bound:g}' if exact else 'bfloat16: for information'})"
        )
        if swap_s is not None:
            print(
                f"gpu_check: weight swap (a new version into the running engine): {swap_s * 1e3:.1f} ms mean"
            )
        worst_check = max(checks.values(), default=float("inf"))
        check_bound = swap_check_bound(target.cfg, dtype)
        newest = max((v for _, v in checks), default=-1)
        print(
            f"gpu_check: swap check: {len(checks)} (producer, version) checks up to version {newest}, "
            f"worst mean |log-prob diff| per probe token {worst_check:.2e} (bound {check_bound:g})"
        )
        ok = tokens > 0 and (error < bound or not exact) and worst_check <= check_bound and newest >= 1
    finally:
        stopped = cli("stop", *run_args, timeout_s=180)
        print(stopped.stdout.rstrip())
    ok = ok and stopped.returncode == 0
    with EmbeddedRedis(run_dir) as srv:
        rep = audit_run(redis.Redis.from_url(srv.url), Keys(name))
    print(f"gpu_check: audit: {rep.summary()}")
    clean = not rep.problems() and bool(rep.trained) and rep.steps == list(range(1, args.steps + 1))
    print("gpu_check: " + ("OK" if ok and clean else f"FAILED {rep.problems()}"))
    return 0 if ok and clean else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
