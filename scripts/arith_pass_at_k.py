"""SmolLM2-135M-Instruct on rg:basic_arithmetic, per kind of problem: greedy accuracy and pass@16 at
temperature 1 (what GRPO can reinforce: a kind no sample of 16 gets right gives no signal).

    .venv/bin/python scripts/arith_pass_at_k.py ["Answer with the number only."] [N]
    .venv/bin/python scripts/arith_pass_at_k.py --run RUN_DIR [--step STEP] [--val-seed SEED]

The first form: version 0 on N problems (default 120) of the SmolLM2 config's task (2 terms of 1-2 digits,
+ - *), drawn with seed 123, the chat template as in the pipeline, 24 new tokens, bfloat16, in process (no
Redis); ~4 minutes on 2 cores. The second: a run's trained weights (the checkpoint of global step STEP in
RUN_DIR/checkpoints, default the newest; STEP 0 = version 0) on the run's own held-out prompts (or those of
data.val_seed SEED: the run did not keep its training draws off them), through the pipeline's policy (its
config: dtype, LoRA, chat template), adding mean@16 (the share of right samples); ~1-2 minutes for 200
prompts; a calculator run (data.tool: calculator) greedy through the tool loop, per kind with its call rate.
Both need the model in the cache (`rollstream model build smollm2-135m-instruct`).
"""

from __future__ import annotations

import collections
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from arith_kinds import kind_of  # scripts/ is on sys.path when run as a script
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.tasks import CalculatorTask, Prompt
from rollstream.tasks.reasoning_gym import ReasoningGymTask

MODEL = "~/.cache/rollstream/models/smollm2-135m-instruct"
SETTINGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
            "allow_parentheses": False, "allow_negation": False}
K = 16


def kind(task: ReasoningGymTask, p: Prompt) -> str:
    """The problem's kind (arith_kinds.kind_of: add, sub_pos, sub_neg, mulAxB)."""
    a, op, b = task.item_of(p)["metadata"]["expression"].split()
    return kind_of(a, op, b)[0]


def tally(task: ReasoningGymTask, prompts: list[Prompt], generate: Callable[[list[Prompt], bool], list[str]],
          chunk: int) -> dict[str, list[int]]:
    """Per kind: [problems, greedy right, any of K samples right, samples right], `chunk` prompts at a time;
    `generate(prompts, greedy)` returns one response per prompt (greedy) or K (prompt-major)."""
    stats: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for i in range(0, len(prompts), chunk):
        part = prompts[i:i + chunk]
        greedy, sampled = generate(part, True), generate(part, False)
        for j, p in enumerate(part):
            s = stats[kind(task, p)]
            right = sum(task.reward(p, x).exact for x in sampled[j * K:(j + 1) * K])
            s[0] += 1
            s[1] += task.reward(p, greedy[j]).exact
            s[2] += right > 0
            s[3] += right
    return stats


def report(label: str, stats: dict[str, list[int]], seconds: float) -> None:
    """Print greedy accuracy, pass@K and mean@K overall and per kind."""
    n, greedy_right, passed, right = (sum(v[i] for v in stats.values()) for i in range(4))
    print(f"{label}: {seconds:.0f}s, {n} prompts: greedy {greedy_right / n:.3f} pass@{K} {passed / n:.3f} "
          f"mean@{K} {right / n / K:.3f}")
    for k, (m, g, hit, r) in sorted(stats.items()):
        print(f"{k} {m} greedy {g / m:.2f} pass@{K} {hit / m:.2f} mean@{K} {r / m / K:.2f}")


def of_run(run: Path, step: int | None, val_seed: int | None) -> None:
    """Print greedy accuracy, pass@K and mean@K over a run's held-out prompts (or data.val_seed `val_seed`'s),
    overall and per kind, of its checkpoint at global step `step` (None: the newest; 0: version 0)."""
    from safetensors.torch import load_file

    from consumers.trainer.checkpoint import list_checkpoints, read_checkpoint
    from rollstream.config import load_config
    from rollstream.model import build_policy
    from rollstream.model.chat import encode_prompt
    from rollstream.tasks import build_prompt_source, build_task
    from rollstream.weights.tensors import load_tensors_into

    held_out = [] if val_seed is None else [f"data.val_seed={val_seed}"]
    cfg = load_config(str(run / "pipeline.resolved.yaml"), ["run.device=cpu", *held_out])
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg)
    if step != 0:
        saved = dict(list_checkpoints(run / "checkpoints"))
        if not saved:
            raise SystemExit(f"{run}/checkpoints holds no checkpoint")
        step = max(saved) if step is None else step
        if step not in saved:
            raise SystemExit(f"--step {step}: {run}/checkpoints holds steps {sorted(saved)}")
        load_tensors_into(policy.module, read_checkpoint(load_file(str(saved[step])))[0])
    policy.eval()
    torch.set_num_threads(2)
    task = build_task(cfg)
    if isinstance(task, CalculatorTask):
        return of_tool_run(run, step, cfg, policy, task)
    if not isinstance(task, ReasoningGymTask):
        raise SystemExit(f"{run}: data.task={cfg.data.task!r} is not a reasoning-gym task")
    prompts = build_prompt_source(cfg, task).val_prompts()
    tok, limit = policy.tokenizer, cfg.data.max_response_length
    generator = torch.Generator().manual_seed(1)

    def generate(part: list[Prompt], greedy: bool) -> list[str]:
        ids = [encode_prompt(tok, p.text) for p in part]
        out = policy.generate(ids, n=1 if greedy else K, max_new_tokens=limit, greedy=greedy,
                              generator=generator)
        return [tok.decode(c.response_ids) for c in out]

    t0 = time.time()
    stats = tally(task, prompts, generate, 25)
    report(f"{run} step {step}, data.val_seed {cfg.data.val_seed}, held-out", stats, time.time() - t0)


def of_tool_run(run: Path, step: int | None, cfg: Any, policy: Any, task: CalculatorTask) -> None:
    """A calculator run (data.tool: calculator): greedy episodes through the tool loop over its held-out
    prompts, as its validation runs them; per kind the accuracy, the share that called and the share of calls
    holding the problem's expression (sampling through the tool loop is left out)."""
    from rollstream.model.chat import encode_prompt
    from rollstream.tasks import build_prompt_source
    from rollstream.tasks.episode import greedy_episodes

    prompts = build_prompt_source(cfg, task).val_prompts()
    tok = policy.tokenizer
    t0 = time.time()
    episodes = greedy_episodes(policy, task, [encode_prompt(tok, p.text) for p in prompts],
                               cfg.data.max_response_length, cfg.rollout.multi_turn.max_turns)
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
    for p, ep in zip(prompts, episodes, strict=True):
        m = task.reward(p, tok.decode(ep.response_ids)).metrics
        s = stats[kind(task.inner, p)]
        row = (1, m["acc"], m["called"], m["tool_calls"], m["wrong_expr"] + m["tool_errors"])
        for i, v in enumerate(row):
            s[i] += v
    n, right, called, calls, bad = (sum(v[i] for v in stats.values()) for i in range(5))
    print(f"{run} step {step}, data.val_seed {cfg.data.val_seed}, held-out with the tool: "
          f"{time.time() - t0:.0f}s, {n:.0f} prompts: greedy {right / n:.3f}, called {called / n:.3f}, "
          f"right expressions {(calls - bad) / calls if calls else 0:.3f} of calls")
    for k, (m_, r, c, cs, b) in sorted(stats.items()):
        print(f"{k} {m_:.0f} greedy {r / m_:.2f} called {c / m_:.2f} right expressions "
              f"{(cs - b) / cs if cs else 0:.2f}")


def main() -> None:
    """Print greedy accuracy and pass@K overall and per kind (`--run`: of a run's checkpoint)."""
    import os

    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        opts = dict(zip(sys.argv[3::2], sys.argv[4::2], strict=False))
        if len(sys.argv) < 3 or len(sys.argv) % 2 == 0 or not set(opts) <= {"--step", "--val-seed"}:
            raise SystemExit(__doc__)
        step, seed = opts.get("--step"), opts.get("--val-seed")
        of_run(Path(sys.argv[2]), None if step is None else int(step), None if seed is None else int(seed))
        return

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

    def generate(part: list[Prompt], greedy: bool) -> list[str]:
        per = 1 if greedy else K
        rendered = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                            tokenize=False) for p in part]
        batch = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=24, do_sample=not greedy, temperature=1.0, top_p=1.0,
                                 num_return_sequences=per, pad_token_id=tok.pad_token_id)
        return tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    t0 = time.time()
    report(instruction, tally(task, prompts, generate, 8), time.time() - t0)


if __name__ == "__main__":
    main()
