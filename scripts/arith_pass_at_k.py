"""SmolLM2-135M-Instruct's starting point on rg:basic_arithmetic, per kind of problem: greedy accuracy and
pass@16 at temperature 1 (what GRPO can reinforce: a kind no sample of 16 gets right gives no signal).

    .venv/bin/python scripts/arith_pass_at_k.py ["Answer with the number only."] [N]

N problems (default 120) of the SmolLM2 config's task (2 terms of 1-2 digits, + - *), drawn with seed 123,
the chat template as in the pipeline, 24 new tokens, bfloat16, in process (no Redis). Needs the model in the
cache (`rollstream model build smollm2-135m-instruct`). ~4 minutes on 2 cores.
"""

from __future__ import annotations

import collections
import random
import sys
import time

import torch
from arith_kinds import kind_of  # scripts/ is on sys.path when run as a script
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.tasks import Prompt
from rollstream.tasks.reasoning_gym import ReasoningGymTask

MODEL = "~/.cache/rollstream/models/smollm2-135m-instruct"
SETTINGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
            "allow_parentheses": False, "allow_negation": False}
K = 16


def kind(task: ReasoningGymTask, p: Prompt) -> str:
    """The problem's kind (arith_kinds.kind_of: add, sub_pos, sub_neg, mulAxB)."""
    a, op, b = task.item_of(p)["metadata"]["expression"].split()
    return kind_of(a, op, b)[0]


def main() -> None:
    """Print greedy accuracy and pass@K overall and per kind."""
    import os

    path = os.path.expanduser(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    torch.set_num_threads(2)
    instruction = sys.argv[1] if len(sys.argv) > 1 else "Answer with the number only."
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 120
    task = ReasoningGymTask("basic_arithmetic", SETTINGS, instruction, "last_number")
    rng = random.Random(123)
    prompts = [task.make_prompt(rng) for _ in range(n)]

    def generate(texts: list[str], greedy: bool, per: int) -> list[str]:
        rendered = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            tokenize=False) for t in texts]
        batch = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=24, do_sample=not greedy, temperature=1.0, top_p=1.0,
                                 num_return_sequences=per, pad_token_id=tok.pad_token_id)
        return tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    stats: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    t0 = time.time()
    for i in range(0, n, 8):
        chunk = prompts[i:i + 8]
        greedy = generate([p.text for p in chunk], True, 1)
        sampled = generate([p.text for p in chunk], False, K)
        for j, p in enumerate(chunk):
            s = stats[kind(task, p)]
            s[0] += 1
            s[1] += task.reward(p, greedy[j]).exact
            s[2] += any(task.reward(p, x).exact for x in sampled[j * K:(j + 1) * K])
    total = [sum(v[i] for v in stats.values()) for i in range(3)]
    print(f"{instruction} {time.time() - t0:.0f}s greedy {total[1] / total[0]:.3f} "
          f"pass@{K} {total[2] / total[0]:.3f}")
    for k, v in sorted(stats.items()):
        print(f"{k} {v[0]} greedy {v[1] / v[0]:.2f} pass@{K} {v[2] / v[0]:.2f}")


if __name__ == "__main__":
    main()
