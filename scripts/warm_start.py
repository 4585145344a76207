"""Supervised warm start for the reversal demo: writes a safetensors file for `model.init_from`.

    .venv/bin/python scripts/warm_start.py pipeline.yaml [key=value ...] --out runs/warm_s0.safetensors
        [--mode reverse|format] [--stop-at-acc 0.05] [--max-steps 3000]

Prints the warm start's own held-out greedy exact match (`val_acc`), which must stay under 10% for the demo.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from rollstream.config import load_config
from rollstream.tasks.warmstart import warm_start
from rollstream.weights.tensors import save_policy


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the warm start, write the weights, print the report; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="path to pipeline.yaml")
    p.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides (run.seed=1, model.d_model=128 …)"
    )
    p.add_argument("--out", required=True, help="safetensors file to write")
    p.add_argument(
        "--mode",
        choices=["reverse", "format"],
        default="reverse",
        help="targets: true reversals or random digits",
    )
    p.add_argument(
        "--stop-at-acc",
        type=float,
        default=0.05,
        help="reverse mode: stop once probe exact match reaches this",
    )
    p.add_argument("--max-steps", type=int, default=3000, help="most optimizer steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    policy, report = warm_start(cfg, mode=args.mode, max_steps=args.max_steps, stop_at_acc=args.stop_at_acc)
    save_policy(policy, args.out)
    print(
        f"warm start ({report.mode}, seed {cfg.run.seed}): {report.steps} steps in {report.seconds:.1f}s, "
        f"loss {report.loss:.3f}, val exact {report.val_acc:.3f}, val partial credit "
        f"{report.val_reward_mean:.3f}, "
        f"format ok {report.format_ok:.3f} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
