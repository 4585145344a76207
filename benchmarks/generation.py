"""Generation benchmark: one producer with the config's policy, through the real loop and a real Redis.

A throwaway run namespace gets version 0 (the config's initial weights) and an unlimited budget; the
producer runs `warmup` dispatches, then `dispatches` measured ones. Reported: generated tokens per second
of generation time (`rollout.n` x `prompts_per_dispatch` rows per batch), and end-to-end samples per
second (generation + scoring + encode + publish). The namespace's keys are deleted afterwards.
Run: `rollstream bench generation pipeline.yaml [key=value ...] [--dispatches N] [--redis-url URL]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
import torch

from producers.worker import Producer, set_torch_threads
from rollstream.bus import connect, delete_run, setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.factory import build_policy
from rollstream.names import Keys
from rollstream.pacing import grant_budget
from rollstream.weights import publish_weights
from rollstream.worker import WorkerContext

DEFAULT_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def unthrottled_producer(cfg: PipelineConfig, r: redis.Redis, keys: Keys, build: type[Producer] = Producer) -> Producer:
    """Set a run up with version 0 = the config's initial weights and an unlimited budget, and return its
    `rollout_00` producer made by `build` (for benchmarks and calibration: no trainer needed)."""
    setup_run(r, keys)
    policy = build_policy(cfg)
    publish_weights(r, keys, 0, policy.state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    grant_budget(r, keys, 0, 1 << 30)
    ctx = WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=r)
    if cfg.rollout.engine == "vllm":  # the producer starts its own engine on the checkpoint
        del policy
        return build(ctx)
    return build(ctx, policy=policy)


def bench_generation(cfg: PipelineConfig, redis_url: str, dispatches: int, warmup: int = 2) -> dict[str, Any]:
    """Run one producer for warmup + `dispatches` dispatches on a throwaway namespace; returns the figures."""
    run = f"bench-gen-{uuid.uuid4().hex[:8]}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run})})
    keys = Keys(run)
    r = connect(redis_url)
    try:
        producer = unthrottled_producer(cfg, r, keys)
        producer.run(max_dispatches=warmup)
        c0 = dict(vars(producer.counters))
        t0 = time.perf_counter()
        producer.run(max_dispatches=dispatches)
        wall_s = time.perf_counter() - t0
        c1 = vars(producer.counters)
        tokens, gen_s = c1["tokens"] - c0["tokens"], c1["gen_s"] - c0["gen_s"]
        samples = c1["published"] - c0["published"]
        return {
            "gen_tokens_per_s": tokens / gen_s,
            "samples_per_s": samples / wall_s,
            "trajectories_per_s": samples * cfg.rollout.n / wall_s,
            "gen_share": gen_s / wall_s,
            "tokens": tokens,
            "samples": samples,
            "dispatches": dispatches,
            "rows_per_batch": cfg.rollout.n * cfg.rollout.prompts_per_dispatch,
            "max_new_tokens": cfg.data.max_response_length,
            "engine": cfg.rollout.engine,
            "device": str(getattr(producer.policy, "device", cfg.run.device)),
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        }
    finally:
        delete_run(r, keys)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the generation figures of one producer (a line per figure, or JSON)."""
    p = argparse.ArgumentParser(prog="rollstream bench generation", description=__doc__)
    p.add_argument("config", help="pipeline.yaml to benchmark")
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    p.add_argument("--dispatches", type=int, default=20, help="measured dispatches (after 2 warm-up ones)")
    p.add_argument("--redis-url", default=DEFAULT_URL, help="Redis to run against (a throwaway namespace)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    set_torch_threads(cfg.rollout.torch_threads)
    res = bench_generation(cfg, args.redis_url, args.dispatches)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:20s} {v:.3g}" if isinstance(v, float) else f"{k:20s} {v}")
    return 0
