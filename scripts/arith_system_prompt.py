"""SmolLM2-135M-Instruct's version-0 greedy accuracy on the SmolLM2 config's task under different system turns
(`model.system_prompt`), overall and per kind of problem, rendered exactly as the pipeline renders prompts.

    .venv/bin/python scripts/arith_system_prompt.py [N] ["a system prompt" ...]

N problems (default 200) drawn with seed 123; each system prompt given (none: the template's default and a
calculator's) is rendered with `encode_prompt` as producers and validation render it, then greedy decoding, 24
new tokens, bfloat16, in process (no Redis). Needs the model in the cache (`rollstream model build
smollm2-135m-instruct`). ~30 s per system prompt on one core with native bfloat16.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import time

import torch
from arith_kinds import kind_of  # scripts/ is on sys.path when run as a script
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.model.chat import encode_prompt
from rollstream.model.hf import HFTokenizer
from rollstream.tasks.reasoning_gym import ReasoningGymTask

MODEL = "~/.cache/rollstream/models/smollm2-135m-instruct"
SETTINGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
            "allow_parentheses": False, "allow_negation": False}
CALCULATOR = "You are a calculator. Reply with the exact result of the calculation."


def main() -> None:
    """Print greedy accuracy overall and per kind for each system prompt."""
    path = os.path.expanduser(MODEL)
    hf = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    systems: list[str | None] = list(sys.argv[2:]) or [None, CALCULATOR]
    task = ReasoningGymTask("basic_arithmetic", SETTINGS, "Answer with the number only.", "last_number")
    rng = random.Random(123)
    prompts = [task.make_prompt(rng) for _ in range(n)]
    for system in systems:
        tok = HFTokenizer(hf, system_prompt=system)
        right: collections.Counter[str] = collections.Counter()
        total: collections.Counter[str] = collections.Counter()
        t0 = time.time()
        for i in range(0, n, 16):
            chunk = prompts[i:i + 16]
            rows = [encode_prompt(tok, p.text) for p in chunk]
            width = max(map(len, rows))
            ids = torch.tensor([[tok.pad_id] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                     pad_token_id=tok.pad_id)
            for p, row in zip(chunk, out[:, width:].tolist(), strict=True):
                a, op, b = task.item_of(p)["metadata"]["expression"].split()
                kind = kind_of(a, op, b)[0]
                total[kind] += 1
                right[kind] += task.reward(p, tok.decode(row)).exact
        kinds = " ".join(f"{k} {right[k] / total[k]:.2f}" for k in sorted(total))
        acc = sum(right.values()) / n
        print(f"{system!r}: greedy {acc:.3f} ({time.time() - t0:.0f} s) {kinds}", flush=True)


if __name__ == "__main__":
    main()
