"""Supervised warm start of a HF model on generated tool-call traces (`data.tool: calculator`): writes a HF
model folder for `model.hf_path` and prints the warm start's own held-out figures (greedy, through the tool).

    .venv/bin/python scripts/tool_warm_start.py configs/smollm2-calculator.yaml [key=value ...] \
        --out runs/warm [--traces 16] [--steps 3] [--lr 3e-4] [--rank 16] [--no-eval]

At most 32 traces (training prompts only) and 60 s of training on 2 cores
(rollstream/tasks/tool_warmstart.py); the report line: traces, steps, loss, seconds, held-out accuracy,
call rate, share of right expressions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from rollstream.config import load_config
from rollstream.tasks.tool_warmstart import MAX_SECONDS, save_hf_model, tool_warm_start


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the warm start, write the model folder and its report; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="path to the pipeline config (data.tool: calculator, model.backend: hf)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (run.seed=1 …)")
    p.add_argument("--out", required=True, help="folder to write the HF model and tokenizer to")
    p.add_argument("--traces", type=int, default=16, help="generated tool-call traces (at most 32)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, each over all the traces")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate of the LoRA factors")
    p.add_argument("--rank", type=int, default=16,
                   help="LoRA rank, folded into the weights at the end (0: full fine-tuning)")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS, help="most seconds of training (<= 60)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out report (faster)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    policy, report = tool_warm_start(cfg, traces=args.traces, max_steps=args.steps, lr=args.lr,
                                     rank=args.rank, max_seconds=args.max_seconds, evaluate=not args.no_eval)
    out = save_hf_model(policy, args.out)
    (out / "warm_start.json").write_text(json.dumps({"seed": cfg.run.seed, **asdict(report)}, indent=1))
    head = (f"tool warm start (seed {cfg.run.seed}): {report.traces} traces, {report.steps} steps in "
            f"{report.train_s:.1f}s ({report.cpu_s:.0f} CPU s), loss {report.loss:.3f}")
    if args.no_eval:
        print(f"{head} -> {out} (held-out report: the run's validation of version 0)")
    else:
        print(f"{head}; held-out greedy with the tool: acc {report.val_acc:.3f}, call rate "
              f"{report.call_rate:.3f}, right expressions {report.right_expr:.3f} of calls, acc with a call "
              f"{report.acc_with_call:.3f}, without {report.acc_without_call:.3f} ({report.val_s:.0f}s) "
              f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
