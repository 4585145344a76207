"""An independent in-process GRPO loop on the SmolLM2 config's task: none of the pipeline's sampler, learner
or Redis, only transformers and torch. The baseline the pipeline's per-step learning is compared against
(docs/history/BENCHMARKS-real-model.md, "against an independent in-process loop").

    .venv/bin/python scripts/plain_grpo.py [--steps 10] [--source-prompts] [--reward exact|score|credit]

Per step: 16 training prompts, 8 samples each with `model.generate` (T = 1; transformers' default top-k 50
unless --top-k 0), reward per sample, advantage (r - mean) / (std + 1e-6) per group, loss = token-mean of
-advantage x log-prob over the responses (up to and including the first eos), grad norm clipped, one AdamW
step; float32 weights, bfloat16 autocast. Held-out greedy accuracy (the config's 200 validation problems)
at step 0 and every --eval-every steps. --source-prompts draws the training prompts as the pipeline does
(its prompt source, seeded by run.seed); without it they come from random.Random(seed).
Needs the model in the cache (`rollstream model build smollm2-135m-instruct`); ~25 s a step on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.config import load_config
from rollstream.pretrained import model_dir
from rollstream.tasks import Prompt, build_prompt_source, build_task

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-basic-arithmetic.yaml"
PROMPTS, N, MAX_NEW, MICRO = 16, 8, 24, 32


def main() -> None:
    """Run the loop and print one line per step (reward, grad norm, seconds, val accuracy when evaluated)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps")
    ap.add_argument("--top-k", type=int, default=50, help="sample among the k most likely (0: all tokens)")
    ap.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    ap.add_argument("--clip", type=float, default=1.0, help="max grad norm")
    ap.add_argument("--reward", default="exact", choices=["exact", "score", "credit"],
                    help="exact: the verifier's 0/1; score: its score with its substring credit; credit: the "
                         "config's sign and magnitude credit")
    ap.add_argument("--source-prompts", action="store_true",
                    help="training prompts from the pipeline's source")
    ap.add_argument("--eval-every", type=int, default=5, help="steps between held-out evaluations")
    ap.add_argument("--seed", type=int, default=0, help="run.seed: validation split, prompts, sampling")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    overrides = [f"run.seed={a.seed}"]
    if a.reward == "score":
        overrides += ["data.sign_credit=0", "data.magnitude_credit=0"]
    cfg = load_config(str(CONFIG), overrides)
    task = build_task(cfg)
    source = build_prompt_source(cfg, task)
    path = model_dir(cfg.model.pretrained or "")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # fused, as the learner's AdamW (actor.optim.fused)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, fused=True)

    def generate(prompts: list[Prompt], greedy: bool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                         tokenize=False) for p in prompts]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = {"do_sample": False} if greedy else {
            "do_sample": True, "temperature": 1.0, "top_k": a.top_k or None, "top_p": 1.0}
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(  # type: ignore[misc]  # transformers types generate on a mixin
                **batch, max_new_tokens=MAX_NEW, num_return_sequences=n, pad_token_id=tok.pad_token_id,
                **sampling)
        assert isinstance(out, torch.Tensor)  # no return_dict_in_generate: the token ids
        return batch["attention_mask"].repeat_interleave(n, 0), out

    val = source.val_prompts()

    def evaluate() -> float:
        right = 0
        for i in range(0, len(val), 50):
            chunk = val[i:i + 50]
            mask, out = generate(chunk, True, 1)
            texts = tok.batch_decode(out[:, mask.shape[1]:], skip_special_tokens=True)
            right += sum(task.reward(p, t).exact for p, t in zip(chunk, texts, strict=True))
        return right / len(val)

    def reward(p: Prompt, text: str) -> float:
        r = task.reward(p, text)
        return float(r.exact) if a.reward == "exact" else r.score

    t0 = time.time()
    print(f"step 0 val {evaluate():.3f} t={time.time() - t0:.0f}s", flush=True)
    rng = random.Random(a.seed)
    for step in range(1, a.steps + 1):
        prompts = ([p for _, _, p in source.take(PROMPTS)] if a.source_prompts
                   else [task.make_prompt(rng) for _ in range(PROMPTS)])
        prompt_mask, out = generate(prompts, False, N)
        width = prompt_mask.shape[1]
        resp = out[:, width:]
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        rewards = torch.tensor([reward(prompts[i // N], t) for i, t in enumerate(texts)]).view(PROMPTS, N)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        is_eos = (resp == tok.eos_token_id).int()
        resp_mask = ((is_eos.cumsum(1) - is_eos) == 0).float()  # up to and including the first eos
        attention = torch.cat([prompt_mask, resp_mask.long()], 1)
        tokens = resp_mask.sum()
        model.train()
        opt.zero_grad()
        for rows in (slice(i, i + MICRO) for i in range(0, PROMPTS * N, MICRO)):
            if not adv[rows].any():
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=out[rows], attention_mask=attention[rows]).logits
            logp = torch.log_softmax(logits[:, width - 1:-1].float(), -1).gather(-1, resp[rows, :, None])
            (-(adv[rows, None] * logp.squeeze(-1) * resp_mask[rows]).sum() / tokens).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        line = f"step {step} reward {rewards.mean():.3f} grad_norm {norm:.2f} t={time.time() - t0:.0f}s"
        if step % a.eval_every == 0:
            line += f" val {evaluate():.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
