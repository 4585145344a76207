"""In-process learning probe: the trainer's Learner on freshly generated groups, no Redis, one process.

    rollstream bench learn_probe [pipeline.yaml] [key=value ...] [--limit-s 420] [--eval-every 20]

For fast one-change-at-a-time experiments on what makes a policy learn (BENCHMARKS.md, "What was tried"):
the same warm start, policy, task, sampling (`rollout.temperature`), RolloutSample packing, batch assembly
and `Learner.update` as the pipeline, but strictly on-policy and synchronous (generate a global batch with
the current weights, train one update on it). Every `--eval-every` steps it prints held-out greedy exact
match overall and per answer length, and per-position accuracy per length (`pos-acc`: one digit per answer
position then the stop token, each the tenths of prompts right there, 9 = 90 % or more), which is what
shows an exploration collapse: a position stuck at 0 for every prompt of a length; and where each answer
position copies from (`src`: per length, for each answer position the prompt digit index its greedy digit
most often equals; the reversal is L-1..0, so `5:43310` means position 2 copies digit 3 instead of 2).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Sequence

import torch

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.evaluate import evaluate as evaluate_task
from consumers.trainer.learner import Learner
from producers.rollout import Trajectory, build_rollout_sample
from rollstream.config import PipelineConfig, load_config
from rollstream.model import BasePolicy, build_policy
from rollstream.model.chat import encode_prompt
from rollstream.tasks import Prompt, Task, build_prompt_source, build_task
from rollstream.tasks.warmstart import WarmMode, warm_start


def position_hits(answer: str, text: str, finished: bool) -> list[bool]:
    """Per answer position, then the stop token: whether the greedy answer `text` (stopped by the model when
    `finished`) has the right character there. The stop is right only where the model stopped: an answer
    that stops early is wrong from its stop on, one cut at the length limit is wrong at the stop."""
    hits = [j < len(text) and text[j] == want for j, want in enumerate(answer)]
    return [*hits, finished and len(text) == len(answer)]


def copy_sources(pairs: Sequence[tuple[str, str]]) -> str:
    """`L:k0k1..` per prompt length L: for each answer position j, the prompt digit index k (0-based, < 10)
    whose digit the answer's j-th character most often equals over the (prompt digits, answer) pairs
    ('-' when no answer reaches j); the correct reversal reads `L:(L-1)..0`."""
    by_len: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
    for digits, text in pairs:
        by_len[len(digits)].append((digits, text))
    out = []
    for n, group in sorted(by_len.items()):
        cells = ""
        for j in range(n):
            hits = [sum(j < len(t) and t[j] == d[k] for d, t in group) for k in range(n)]
            cells += str(max(range(n), key=lambda k: hits[k])) if any(hits) else "-"
        out.append(f"{n}:{cells}")
    return " ".join(out)


def evaluate(
    policy: BasePolicy, task: Task, val: list[Prompt], max_new: int
) -> tuple[float, dict[int, float], str, str]:
    """(exact match, exact match per answer length, per-position accuracy string, copy sources) of greedy
    answers."""
    tok = policy.tokenizer
    trajs = policy.generate([tok.encode(p.text, add_bos=True) for p in val], 1, max_new, greedy=True)
    exact: dict[int, list[bool]] = collections.defaultdict(list)
    pairs: list[tuple[str, str]] = []
    pos: dict[int, dict[int, list[bool]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for p, t in zip(val, trajs, strict=True):
        text = tok.decode(t.response_ids)
        exact[len(p.answer)].append(task.reward(p, text).exact)
        pairs.append((p.answer[::-1], text))
        for j, hit in enumerate(position_hits(p.answer, text, t.finished)):
            pos[len(p.answer)][j].append(hit)
    total = sum(sum(v) for v in exact.values()) / max(1, len(val))
    by_len = {k: sum(v) / len(v) for k, v in sorted(exact.items())}
    digits = " ".join(
        f"{n}:" + "".join(str(min(9, int(10 * sum(v) / len(v)))) for _, v in sorted(d.items()))
        for n, d in sorted(pos.items())
    )
    return total, by_len, digits, copy_sources(pairs)


class LaggedSampler:
    """The policy a step samples from: the learner's own (`lag` 0) or a copy holding the weights of `lag`
    updates ago (the first steps: the oldest there are), as in a pipeline that trains a batch while the
    next is generated."""

    def __init__(self, cfg: PipelineConfig, policy: BasePolicy, lag: int) -> None:
        """`policy` is the learner's; `lag` >= 0 updates behind it."""
        self.policy, self.lag = policy, lag
        self.sampler = build_policy(cfg, device=str(policy.device)) if lag > 0 else policy
        self.behind: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=lag + 1)
        self.updates = -1  # updates the learner's weights have had when before_step is called

    @property
    def version(self) -> int:
        """The version the sampler holds (= the samples' param_version)."""
        return max(0, self.updates - self.lag)

    def before_step(self) -> BasePolicy:
        """Call once per step before generating, while the learner holds the previous step's weights."""
        self.updates += 1
        if self.lag > 0:
            self.behind.append({k: v.detach().clone() for k, v in self.policy.module.state_dict().items()})
            self.sampler.module.load_state_dict(self.behind[0])
        return self.sampler


def probe(
    cfg: PipelineConfig,
    limit_s: float,
    eval_every: int,
    warm_mode: WarmMode = "reverse",
    warm_stop_at: float = 0.05,
    lag: int = 0,
    target: float | None = None,
) -> None:
    """Warm start (the tiny GPT only), then GRPO steps until `limit_s` (or the first evaluation at `target` or
    above), printing evaluations as it goes (any task but reverse: val/acc, from version 0 on); `lag` > 0
    generates step g's batch with the weights of `lag` updates ago, as a pipeline that trains one batch while
    the next is generated does (staleness `lag`)."""
    torch.manual_seed(cfg.run.seed)
    t0 = time.time()
    learner = Learner(cfg)
    if cfg.model.backend == "tiny":  # a pretrained model (backend=hf) starts as it is, as in demo.sh
        warm, rep = warm_start(cfg, mode=warm_mode, stop_at_acc=warm_stop_at)
        print(f"warm start: {rep.steps} steps, val exact {rep.val_acc:.3f}, {rep.seconds:.1f}s", flush=True)
        learner.policy.module.load_state_dict(warm.module.state_dict())
    task = build_task(cfg)
    source = build_prompt_source(cfg, task)
    val, tok = source.val_prompts(), learner.policy.tokenizer
    gen = torch.Generator().manual_seed(cfg.run.seed)
    B, n, max_new = cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length
    lagged = LaggedSampler(cfg, learner.policy, lag)
    g, trained = 0, 0
    if cfg.data.task != "reverse":  # version 0, as the pipeline's record 0
        acc = evaluate_task(learner.policy, task, val, max_new)["val/acc"]
        print(f"step 0 {time.time() - t0:.0f}s samples 0 val/acc {acc:.3f}", flush=True)
    while time.time() - t0 < limit_s:
        g += 1
        learner.begin_step(g)
        items = source.take(B)
        trajs = lagged.before_step().generate(
            [encode_prompt(tok, p.text) for _, _, p in items],
            n,
            max_new,
            temperature=cfg.rollout.temperature,
            generator=gen,
        )
        samples = []
        for i, (epoch, _, p) in enumerate(items):
            group = trajs[i * n : (i + 1) * n]
            agents = [
                Trajectory(
                    prompt_ids=t.prompt_ids,
                    response_ids=t.response_ids,
                    response_mask=[1] * len(t.response_ids),
                    log_probs=t.log_probs,
                    finished=t.finished,
                )
                for t in group
            ]
            rewards = [task.reward(p, tok.decode(t.response_ids)) for t in group]
            samples.append(
                build_rollout_sample(
                    sample_id=f"{g}-{i}",
                    epoch=epoch,
                    param_version=lagged.version,
                    producer="probe",
                    trajectories=agents,
                    rewards=rewards,
                    raw_prompt=p.text,
                    tokenizer=tok,
                    rollout_status={},
                    ground_truth=p.answer,
                )
            )
        batch, _ = assemble_batch_from_rollout_samples(samples)
        m = learner.update(batch)
        trained += len(samples)
        if g % eval_every == 0 and cfg.data.task != "reverse":
            acc = evaluate_task(learner.policy, task, val, max_new)["val/acc"]
            print(f"step {g} {time.time() - t0:.0f}s samples {trained} val/acc {acc:.3f} "
                  f"reward {m['critic/rewards/mean']:.3f} entropy {m['actor/entropy']:.3f}", flush=True)
        elif g % eval_every == 0:
            acc, by_len, pos, src = evaluate(learner.policy, task, val, max_new)
            lens = " ".join(f"{k}:{v:.2f}" for k, v in by_len.items())
            print(
                f"step {g} {time.time() - t0:.0f}s val/acc {acc:.3f} [{lens}] pos-acc [{pos}] "
                f"reward {m['critic/rewards/mean']:.3f} entropy {m['actor/entropy']:.3f} src [{src}]",
                flush=True,
            )
            if target is not None and acc >= target:
                print(f"target {target} reached at step {g}, {time.time() - t0:.0f}s", flush=True)
                return


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the probe."""
    p = argparse.ArgumentParser(prog="rollstream bench learn_probe", description=__doc__.splitlines()[0])
    p.add_argument(
        "config", nargs="?", default="pipeline.yaml", help="pipeline.yaml (default ./pipeline.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--limit-s", type=float, default=420.0, help="seconds to run (warm start included)")
    p.add_argument("--eval-every", type=int, default=20, help="global steps between evaluations")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--warm-mode", choices=["reverse", "format"], default="reverse", help="warm start targets")
    p.add_argument("--warm-stop-at", type=float, default=0.05, help="reverse warm start: stop at this exact")
    p.add_argument("--lag", type=int, default=0, help="generate with the weights of this many updates ago")
    p.add_argument("--target", type=float, default=None, help="stop at the first val/acc at or above this")
    args = p.parse_args(argv)
    if args.lag < 0:
        p.error(f"--lag must be >= 0 (updates behind), got {args.lag}")
    if "=" in args.config:
        args.overrides, args.config = [args.config, *args.overrides], "pipeline.yaml"
    torch.set_num_threads(args.threads)
    probe(
        load_config(args.config, args.overrides),
        args.limit_s,
        args.eval_every,
        args.warm_mode,
        args.warm_stop_at,
        args.lag,
        args.target,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
