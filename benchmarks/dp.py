"""Data-parallel trainer benchmark: samples/s of 1 vs N gloo ranks on the same recorded samples, and the time
of their collectives per global step.

    rollstream bench dp [pipeline.yaml] [key=value ...] [--ranks 1 2] [--steps 20] [--warmup-steps 2]
                        [--redis-url URL] [--json]

For each rank count, a throwaway run namespace on the Redis at --redis-url gets (warmup + steps) *
train_batch_size recorded samples (rollstream.testing.fakes: the config's n, its max_response_length, a
7-token prompt like the demo's), then that many trainer ranks (spawned processes, gloo, one torch thread
each: the real trainer loop, `Trainer.train_step`, in burst mode) train them; no producers run, so the
figures are the trainer's alone. Timed over the steps after the warmup ones (rank 0's clock):

  samples/s        steps * train_batch_size / wall seconds
  step ms          wall / steps
  grad all-reduce  DDP's gradient all-reduce, timed by a comm hook doing the same all-reduce and average
                   synchronously (gloo on CPU hardly overlaps it with backward anyway)
  loop collectives the loop's own: the loss-count all-reduce of every update, the collection rounds'
                   all-gathers (they include waiting for the slower rank), the step-end ledger gather
  share            (grad all-reduce + loop collectives) / step time

The default config is pipeline.yaml (the demo's model and batch sizes); checkpoints follow its save_freq.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PROMPT_LEN = 7  # "  1234>" of the demo's fixed-width reverse task
VOCAB = 20  # fake token ids in [3, 20): inside every tokenizer's vocabulary


def _timed_allreduce(state: dict[str, Any], bucket: Any) -> Any:
    """DDP comm hook: all-reduce the bucket and average it (DDP's default), timed."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    buf = bucket.buffer()
    dist.all_reduce(buf)
    buf.div_(state["world"])
    state["s"] += time.perf_counter() - t0
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _rank(
    rank: int, world: int, init_file: str, url: str, config: str, overrides: list[str], warmup: int, out: str
) -> None:
    """One spawned rank: join gloo, resume, train warmup + timed steps, rank 0 writes the figures."""
    import redis
    import torch
    import torch.distributed as dist

    from consumers.trainer.distributed import DataParallel, RankInfo, consumer_name
    from consumers.trainer.loop import Trainer
    from rollstream.config import load_config
    from rollstream.keys import Keys

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    info = RankInfo(rank, world, rank)
    dp = DataParallel(info, torch.device("cpu"))
    try:
        cfg = load_config(config, overrides)
        r = redis.Redis.from_url(url)
        trainer = Trainer(
            cfg, r, Keys(cfg.run.name), consumer_name("trainer", info), threading.Event(), burst=True, dp=dp
        )
        hook = {"s": 0.0, "world": world}
        if world > 1:  # DDP checks the hook's annotations as objects (this module's are strings)
            _timed_allreduce.__annotations__ = {"state": dict, "bucket": dist.GradBucket,
                                                "return": torch.futures.Future[torch.Tensor]}
            trainer.learner.train_module.register_comm_hook(hook, _timed_allreduce)  # type: ignore[operator]
        trainer.resume()
        for g in range(1, warmup + 1):
            trainer.train_step(g)
        dp.barrier()
        hook["s"], dp.collective_s = 0.0, 0.0
        t0 = time.perf_counter()
        total = cfg.trainer.total_training_steps
        while trainer.global_step < total and trainer.train_step(trainer.global_step + 1):
            pass
        wall = time.perf_counter() - t0
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "wall_s": wall,
                        "steps": trainer.global_step - warmup,
                        "grad_allreduce_s": hook["s"],
                        "collectives_s": dp.collective_s,
                    }
                )
            )
        r.close()
    finally:
        dp.close()


def measure(
    config: str, overrides: list[str], ranks: int, steps: int, warmup: int, url: str
) -> dict[str, float]:
    """Publish the samples, train them with `ranks` spawned ranks; the figures of the timed steps."""
    import redis
    import torch.multiprocessing as mp

    from rollstream.bus import Publisher, delete_run, setup_run
    from rollstream.config import load_config
    from rollstream.keys import Keys, producer_names
    from rollstream.testing.fakes import leased_fakes

    producer = producer_names(1)[0]  # one producer's stream carries every sample

    run = f"bench-dp-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="rs-bench-dp-") as tmp:
        every = [
            *overrides,
            f"run.name={run}",
            f"run.dir={tmp}",
            "run.device=cpu",
            f"trainer.nproc_per_node={ranks}",
            f"trainer.total_training_steps={warmup + steps}",
            "trainer.test_freq=0",
            "trainer.max_off_policy_threshold=1000000",
            "trainer.num_warmup_batches=0",
        ]
        cfg = load_config(config, every)
        keys, r = Keys(run), redis.Redis.from_url(url)
        try:
            setup_run(r, keys, producer_names(cfg.rollout.num_producers))
            count = (warmup + steps) * cfg.data.train_batch_size
            samples = leased_fakes(  # leased outright: the trainer checks every sample against its lease
                r,
                keys,
                count,
                producer,
                n=cfg.rollout.n,
                prompt_len=PROMPT_LEN,
                response_len=cfg.data.max_response_length,
                ragged=True,
                vocab=VOCAB,
            )
            Publisher(r).publish_many(keys.rollouts_of(producer), samples)
            out = Path(tmp) / "result.json"
            mp.spawn(
                _rank,
                args=(ranks, str(Path(tmp) / "init"), url, config, every, warmup, str(out)),
                nprocs=ranks,
                join=True,
            )
            res = json.loads(out.read_text())
        finally:
            delete_run(r, keys)
            r.close()
    steps_done = max(res["steps"], 1)
    step_s = res["wall_s"] / steps_done
    comm = (res["grad_allreduce_s"] + res["collectives_s"]) / steps_done
    return {
        "ranks": ranks,
        "samples_per_s": steps_done * cfg.data.train_batch_size / res["wall_s"],
        "step_ms": 1000 * step_s,
        "grad_allreduce_ms": 1000 * res["grad_allreduce_s"] / steps_done,
        "collectives_ms": 1000 * res["collectives_s"] / steps_done,
        "comm_share": comm / step_s if step_s else 0.0,
        "steps": steps_done,
        "train_batch_size": cfg.data.train_batch_size,
    }


def format_table(rows: list[dict[str, float]]) -> str:
    """Markdown table of the figures, with each row's samples/s relative to the first row's."""
    base = rows[0]["samples_per_s"] if rows else 1.0
    lines = [
        "| ranks | samples/s | vs first | step ms | grad all-reduce ms/step | loop collectives ms/step | "
        "share of step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['ranks']} | {row['samples_per_s']:.1f} | {row['samples_per_s'] / base:.2f}x | "
                     f"{row['step_ms']:.1f} | {row['grad_allreduce_ms']:.2f} | {row['collectives_ms']:.2f} | "
                     f"{100 * row['comm_share']:.0f} % |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark for each --ranks count and print the table (or --json)."""
    p = argparse.ArgumentParser(prog="rollstream bench dp", description=__doc__.splitlines()[0])
    p.add_argument(
        "config", nargs="?", default="pipeline.yaml", help="pipeline.yaml (default ./pipeline.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="trainer rank counts to compare")
    p.add_argument("--steps", type=int, default=20, help="timed global steps per rank count")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed global steps first")
    p.add_argument("--redis-url", default=DEFAULT_URL, help="Redis for the throwaway namespaces")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    rows = [
        measure(args.config, args.overrides, n, args.steps, args.warmup_steps, args.redis_url)
        for n in args.ranks
    ]
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0
