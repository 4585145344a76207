"""Generation benchmark: one producer with the config's policy, through the real loop and a real Redis.

A throwaway run namespace gets version 0 (the config's initial weights) and an unlimited lease; the
producer runs `warmup` dispatches, then `dispatches` measured ones. Reported: generated tokens per second
of generation time (`rollout.n` x `prompts_per_dispatch` rows per batch) and per CPU second of the process
(steadier than the wall clock on a shared box), and end-to-end samples per second (generation + scoring +
encode + publish). The namespace's keys are deleted afterwards.
Run: `rollstream bench generation pipeline.yaml [key=value ...] [--dispatches N] [--redis-url URL]`.

Engines side by side (`--engines builtin builtin-continuous vllm vllm-dispatch`): the same model, config and
prompts through each `rollout.name` in one run, one after the other, each also timed loading a newly published
version into the running engine (the swap); `vllm` serves continuously (`rollout.vllm.continuous`),
`vllm-dispatch` one batch per dispatch, `builtin` one batch per dispatch and `builtin-continuous` one running
batch (`rollout.continuous`). Also: the engine's busy share of the wall clock, its mean occupancy (rows in
flight over the rows a dispatch holds) while busy, the share of the rows it computes that are still in flight
(the built-in engines decode finished rows until they drop them), and the published responses' lengths.
`--preset llama-tail` gives a long-tailed response length (a random model over a 57-token vocabulary ends a
row with probability ~1/57 per token: median ~40 tokens, ~3 % reach the 192-token cap). `--preset qwen2-76m`
builds a random Qwen2 of that shape (hidden 768, 12 layers, 12 heads, 4 KV heads, BPE tokenizer) in a temp
dir and benchmarks it with 64 prompts x 8 samples x 32 tokens per dispatch (override any of it with
key=value).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import torch

from producers.worker import Producer, set_torch_threads
from rollstream.bus import connect, delete_run, setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import Keys, producer_names
from rollstream.model import build_policy
from rollstream.model.base import EngineClock
from rollstream.pacing.budget import lease_outright
from rollstream.runtime.process import WorkerContext
from rollstream.testing.hf_tiny import make_tiny_hf_model
from rollstream.weights.fingerprint import policy_probe
from rollstream.weights.store import (
    latest_param_version,
    load_weights,
    publish_module_weights,
    publish_weights,
)
from schemas import RolloutSample, decode

DEFAULT_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


#: Weights above this size go to a file in the benchmark's temp dir (one Redis value holds at most 512 MB).
INLINE_MAX_BYTES = 64 << 20


def unthrottled_producer(
    cfg: PipelineConfig, r: redis.Redis, keys: Keys, build: type[Producer] = Producer,
    weights_dir: Path | None = None,
) -> Producer:
    """Set a run up with version 0 = the config's initial weights (with the swap check's probe; above
    INLINE_MAX_BYTES as a file in `weights_dir`) and an unlimited lease, and return its `rollout_00` producer
    made by `build` (for benchmarks and calibration: no trainer needed)."""
    setup_run(r, keys, producer_names(cfg.rollout.num_producers))
    policy = build_policy(cfg)
    publish_module_weights(r, keys, 0, policy.module, global_step=0, inline_max_bytes=INLINE_MAX_BYTES,
                           file_dir=weights_dir, probe=policy_probe(policy))
    lease_outright(r, keys, "rollout_00", 1 << 30)
    ctx = WorkerContext(cfg=cfg, name="rollout_00", keys=keys, r=r)
    if cfg.rollout.name == "vllm":  # the producer starts its own engine on the checkpoint
        del policy
        return build(ctx)
    return build(ctx, policy=policy)


#: The engines `--engines` compares: rollout.name, with its continuous or per-dispatch generation.
ENGINES = ("builtin", "builtin-continuous", "vllm", "vllm-dispatch")

#: The engine comparison's dispatch: 64 prompts x 8 samples x 32 tokens (512 rows).
DISPATCH_512x32 = [
    "rollout.prompts_per_dispatch=64",
    "rollout.n=8",
    "data.max_response_length=32",
    "data.task=reverse",
    "rollout.vllm.max_model_len=256",
]

#: Model shapes `--preset` builds (random weights, BPE tokenizer) and the dispatch they are measured with.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-76m": dict(
        model=dict(
            arch="qwen2",
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=4,
            intermediate_size=3072,
            max_positions=256,
        ),
        overrides=DISPATCH_512x32,
    ),
    # SmolLM2-135M-Instruct's shape (Llama, 30 layers of 576, 9 heads, 3 KV heads, a tied 49152-token head)
    "smollm2-135m": dict(
        model=dict(
            arch="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
            max_positions=256, vocab_size=49152, tied=True,
        ),
        overrides=DISPATCH_512x32,
    ),
    "llama-tail": dict(
        model=dict(
            arch="llama", tokenizer="char", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
            max_positions=512,
        ),
        overrides=[
            "rollout.prompts_per_dispatch=16",
            "rollout.n=8",
            "data.max_response_length=192",
            "data.task=reverse",
            "rollout.vllm.max_model_len=256",
            "rollout.temperature=1.0",
        ],
    ),
}


def _swap_s(producer: Producer, r: redis.Redis, keys: Keys, weights_dir: Path) -> float:
    """Publish the producer's current weights again as a newer version and time loading it into its engine
    (the swap check included)."""
    pv = latest_param_version(r, keys)
    assert pv is not None
    blob = load_weights(r, pv)
    publish_weights(r, keys, pv.version + 1, blob, global_step=pv.version + 1,
                    inline_max_bytes=INLINE_MAX_BYTES, file_dir=weights_dir,
                    probe=(list(pv.probe_ids), list(pv.probe_logprobs)))
    if not producer.weights.refresh():
        raise RuntimeError("the producer did not load the newer version")
    return producer.weights.last_load_s


def bench_generation(cfg: PipelineConfig, redis_url: str, dispatches: int, warmup: int = 2) -> dict[str, Any]:
    """Run one producer for warmup + `dispatches` dispatches on a throwaway namespace; returns the figures
    (with the time to load a new version into its engine)."""
    run = f"bench-gen-{uuid.uuid4().hex[:8]}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run})})
    keys = Keys(run)
    r = connect(redis_url)
    tmp = tempfile.TemporaryDirectory(prefix="rollstream-bench-weights-")
    weights_dir = Path(tmp.name)
    try:
        producer = unthrottled_producer(cfg, r, keys, weights_dir=weights_dir)
        producer.run(max_dispatches=warmup)
        c0 = dict(vars(producer.counters))
        engine = producer.continuous.engine if producer.continuous is not None else producer.policy
        first = r.xlen(keys.rollouts_of("rollout_00"))
        clock: EngineClock = engine.clock
        before = dataclasses.replace(clock)
        t0, cpu0 = time.perf_counter(), time.process_time()
        producer.run(max_dispatches=dispatches)
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        busy, row_s = clock.busy_s - before.busy_s, clock.row_s - before.row_s
        batch_s = clock.batch_row_s - before.batch_row_s
        rows = cfg.rollout.n * cfg.rollout.prompts_per_dispatch
        c1 = vars(producer.counters)
        tokens, gen_s = c1["tokens"] - c0["tokens"], c1["gen_s"] - c0["gen_s"]
        samples = c1["published"] - c0["published"]
        swap_s = _swap_s(producer, r, keys, weights_dir)
        lengths = _response_lengths(r, keys, first)
        cap = cfg.data.max_response_length
        return {
            "gen_tokens_per_s": tokens / gen_s,
            "wall_tokens_per_s": tokens / wall_s,
            "cpu_tokens_per_s": tokens / cpu_s,
            "samples_per_s": samples / wall_s,
            "trajectories_per_s": samples * cfg.rollout.n / wall_s,
            "gen_share": gen_s / wall_s,
            "engine_busy_share": busy / wall_s if busy else float("nan"),
            "engine_occupancy": row_s / (busy * rows) if busy else float("nan"),
            "engine_live_share": row_s / batch_s if batch_s else float("nan"),
            "tokens": tokens,
            "samples": samples,
            "dispatches": dispatches,
            "rows_per_batch": cfg.rollout.n * cfg.rollout.prompts_per_dispatch,
            "max_new_tokens": cfg.data.max_response_length,
            "response_len_mean": sum(lengths) / max(1, len(lengths)),
            "response_len_p10": _quantile(lengths, 0.1),
            "response_len_p50": _quantile(lengths, 0.5),
            "response_len_p90": _quantile(lengths, 0.9),
            "response_len_at_cap": sum(1 for n in lengths if n >= cap) / max(1, len(lengths)),
            "swap_s": swap_s,
            "engine": cfg.rollout.name,
            "device": str(getattr(producer.policy, "device", cfg.run.device)),
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        }
    finally:
        delete_run(r, keys)
        tmp.cleanup()


def _response_lengths(r: redis.Redis, keys: Keys, first: int) -> list[int]:
    """The response length of every row rollout_00 published from its `first` sample on, sorted."""
    entries: Any = r.xrange(keys.rollouts_of("rollout_00"))
    samples = [decode(fields) for _, fields in entries[first:]]
    return sorted(out["response_length"] for s in samples if isinstance(s, RolloutSample)
                  for out in s.agent_loop_output_list)


def _quantile(sorted_values: Sequence[int], q: float) -> float:
    """The q-quantile of sorted values (nearest rank; nan when empty)."""
    if not sorted_values:
        return float("nan")
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


def compare_engines(
    cfg: PipelineConfig, redis_url: str, dispatches: int, warmup: int, engines: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """`bench_generation` for each engine on the same config, one after the other in this process."""
    out = {}
    for name in engines:
        engine, _, mode = name.partition("-")
        vllm = cfg.rollout.vllm.model_copy(update={"continuous": mode != "dispatch"})
        rollout = cfg.rollout.model_copy(
            update={"name": engine, "vllm": vllm, "continuous": engine == "builtin" and mode == "continuous"}
        )
        ecfg = cfg.model_copy(update={"rollout": rollout})
        out[name] = bench_generation(ecfg, redis_url, dispatches, warmup)
        gc.collect()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the generation figures of one producer (a line per figure, or JSON); with `--engines`, a
    table of each engine's figures and their ratios."""
    p = argparse.ArgumentParser(prog="rollstream bench generation", description=__doc__)
    p.add_argument("config", help="pipeline.yaml to benchmark")
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    p.add_argument("--dispatches", type=int, default=20, help="measured dispatches (after 2 warm-up ones)")
    p.add_argument("--redis-url", default=DEFAULT_URL, help="Redis to run against (a throwaway namespace)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured dispatches first (engine warm-up)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=None,
                   help="compare these rollout.name values on the same config in one run (vllm-dispatch: "
                        "vLLM with rollout.vllm.continuous=false; builtin-continuous: the built-in engine "
                        "with rollout.continuous=true)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="build a random HF model of this shape in a temp dir and benchmark it (model.backend=hf)",
    )
    args = p.parse_args(argv)
    base = load_config(args.config, args.overrides)
    if any(e.startswith("vllm") for e in args.engines or [base.rollout.name]):  # the same OpenMP for all
        from producers.engines.vllm import reexec_with_openmp

        reexec_with_openmp(base)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = list(args.overrides)
        if args.preset:
            preset = PRESETS[args.preset]
            model = make_tiny_hf_model(Path(tmp) / args.preset, **{"tokenizer": "bpe", **preset["model"]})
            overrides = ["model.backend=hf", f"model.hf_path={model}", *preset["overrides"], *overrides]
        cfg = load_config(args.config, overrides)
        set_torch_threads(cfg.rollout.torch_threads)
        if args.engines:
            return _print_comparison(
                compare_engines(cfg, args.redis_url, args.dispatches, args.warmup, args.engines), args.json
            )
        res = bench_generation(cfg, args.redis_url, args.dispatches, args.warmup)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:20s} {v:.3g}" if isinstance(v, float) else f"{k:20s} {v}")
    return 0


def _print_comparison(results: dict[str, dict[str, Any]], as_json: bool) -> int:
    """Print each engine's figures side by side, and each engine's tokens/s over the first one's."""
    if as_json:
        print(json.dumps(results))
        return 0
    names = list(results)
    rows = [
        "gen_tokens_per_s",
        "wall_tokens_per_s",
        "cpu_tokens_per_s",
        "samples_per_s",
        "trajectories_per_s",
        "gen_share",
        "engine_busy_share",
        "engine_occupancy",
        "engine_live_share",
        "swap_s",
        "tokens",
        "samples",
        "response_len_mean",
        "response_len_p10",
        "response_len_p50",
        "response_len_p90",
        "response_len_at_cap",
    ]
    print(f"{'':20s} " + " ".join(f"{n:>12s}" for n in names))
    for row in rows:
        print(f"{row:20s} " + " ".join(f"{results[n][row]:12.4g}" for n in names))
    first = results[names[0]]
    for n in names[1:]:
        gen, wall, cpu = (results[n][k] / first[k]
                          for k in ("gen_tokens_per_s", "wall_tokens_per_s", "cpu_tokens_per_s"))
        print(f"tokens/s {n} / {names[0]}: {gen:.2f}x while generating, {wall:.2f}x over the wall clock, "
              f"{cpu:.2f}x per CPU second")
    return 0
