# Over 400 lines on purpose: one benchmark's two runs, their measurements and its report together.
"""Async vs sync benchmark: the same RL workload trained synchronously and with rollstream's overlap.

    rollstream bench async [pipeline.yaml] [key=value ...] [--quick] [--steps N] [--json]

Workload: the config's prompts, tiny policy, seed, `--steps` global steps of train_batch_size samples.
Producers are **latency-model producers** (benchmarks/latency_producer.py): the real producer loop (budget
take,
dispatch, param_version stamping, weight sync, scoring, publish, pacing) with decoding replaced by sleeping
each prompt's modelled decode time (lognormal response lengths, long-tailed, truncated at
max_response_length; a prompt's n trajectories decode together, so it takes its longest one's time), in
`concurrency` slots per producer (an inference engine's continuous batching). This keeps the 2-core box
free for the **real trainer** (real CPU training of the tiny model), which would otherwise fight the
producers for the same cores. Every figure below comes from that setup.

1. Calibration (in-process, ~seconds): a producer with an instant latency model fills a throwaway
   namespace, then the real `Trainer` trains on it; training time per global step = mean of
   (timing_s/step - timing_s/gen) over steps 2.. . tokens_per_s is then set so that the mean generation
   work per batch (sum of per-prompt decode times / total slots) equals that training time:
   "generation and training cost the same". The long tail makes sync mode wait for the slowest
   prompt of every batch; async hides it.
2. sync: staleness_threshold=0 and trainer.sync_mode (the whole batch is collected before the first
   local update), so generation and training strictly alternate.
3. async: staleness_threshold=--staleness (default 1.0), streaming trainer, max_off_policy_threshold
   large enough that nothing is dropped.

Modes 2 and 3 run as users run them: `python -m benchmarks.latency_producer` (the producer with the modelled
decode injected, what `rollstream run` starts for such a config) x P and `python -m consumers.trainer`
subprocesses against one Redis, each mode in a fresh run namespace deleted afterwards. Wall time is
measured on the log itself, from the `params` entry of version 0 to that of version N (Redis entry-id
clock), so process start-up (torch import) is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from rollstream.bus import connect, delete_run
from rollstream.config import PipelineConfig, apply_overrides, config_to_yaml, load_config
from rollstream.keys import Keys, producer_names
from rollstream.ops.plan import producer_module
from rollstream.runtime.procfs import stat_fields
from schemas import ProducerStats, RolloutSample, StepMetrics, decode

DEFAULT_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[1]

#: The workload of the default size (overridable with key=value after the config path).
DEFAULT_OVERRIDES = [
    "model.d_model=128", "model.n_layer=4", "model.max_seq_len=64", "data.max_response_length=48",
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=4", "rollout.num_producers=2", "bench.latency_model.concurrency=8",
    "bench.latency_model.length_median=6", "bench.latency_model.length_sigma=1.0",
]
#: --quick: a tiny model and batch (the test runs this).
QUICK_OVERRIDES = [
    "model.d_model=64", "model.n_layer=2", "model.max_seq_len=48", "data.max_response_length=32",
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=4", "rollout.num_producers=2", "bench.latency_model.concurrency=4",
    "bench.latency_model.length_median=5", "bench.latency_model.length_sigma=1.0",
]
#: Always set: latency-model producers, no validation, every step timed alike, nothing dropped.
FIXED_OVERRIDES = [
    "bench.latency_model.enable=true", "trainer.test_freq=0", "trainer.num_warmup_batches=0",
    "rollout.stats_every_s=1.0",
]


@dataclass
class ModeResult:
    """The figures of one mode's run."""

    mode: str
    wall_s: float  # params v0 -> params vN on the Redis clock
    steps: int
    samples: int  # trained
    dropped: int
    samples_per_s: float
    step_s: float  # sum of timing_s/step
    wait_s: float  # sum of timing_s/gen: trainer waiting for samples (includes transport)
    train_s: float  # step_s - wait_s
    transport_s: float  # sum of timing_s/transport
    trainer_idle_ratio: float  # wait_s / step_s
    transport_share: float  # transport_s / step_s
    transport_ms_per_sample: float  # transport_s / samples read
    producer_idle_ratio: float  # slot-averaged idle / window, ProducerStats of versions < N
    gen_work_s: float  # sum over trained samples of their modelled decode time
    gen_per_slot_s: float  # gen_work_s / total slots
    ideal_s: float  # max(gen_per_slot_s, train_s): the overlap bound
    staleness_mean: float
    trainer_cpu_s: float = 0.0  # CPU seconds of the trainer process from version 0 to its exit (Linux /proc)
    producers_cpu_s: float = 0.0  # CPU seconds of all producer processes over the same interval


#: Prefix of the run names the benchmark creates (each run `<prefix>-<mode>-<random>`, deleted afterwards).
NAMESPACE = "bench-async"


def bench_config(
    config: str | None, overrides: Sequence[str], quick: bool, steps: int, staleness: float
) -> PipelineConfig:
    """The benchmark's resolved config: size defaults, then the user's overrides, then the fixed ones."""
    size = QUICK_OVERRIDES if quick else DEFAULT_OVERRIDES
    fixed = [
        *FIXED_OVERRIDES,
        f"trainer.total_training_steps={steps}",
        f"async_training.staleness_threshold={staleness}",
        f"trainer.max_off_policy_threshold={int(staleness) + 3}",
    ]
    return load_config(config, [*size, *overrides, *fixed])


def _with(cfg: PipelineConfig, overrides: Sequence[str]) -> PipelineConfig:
    """`cfg` with dotted overrides applied (validated)."""
    return PipelineConfig.model_validate(apply_overrides(cfg.model_dump(mode="json"), list(overrides)))


def _events(r: redis.Redis, stream: str) -> list[Any]:
    """Every entry of a stream decoded to its event (undecodable entries skipped)."""
    out = []
    rows: Any = r.xrange(stream)
    for _, fields in rows:
        out.append(decode(fields))
    return out


# ---- 1. calibration --------------------------------------------------------------------------------


def calibrate(
    cfg: PipelineConfig, redis_url: str, run_dir: str, steps: int = 3, namespace: str = NAMESPACE
) -> dict[str, float]:
    """Train `steps`+1 global steps in-process on pre-generated samples of the modelled lengths; returns
    the training time per step (mean of steps 2..) and the tokens_per_s that matches generation to it."""
    import torch

    from benchmarks.generation import unthrottled_producer
    from benchmarks.latency import LatencyModel
    from benchmarks.latency_producer import LatencyProducer
    from consumers.trainer.loop import Trainer

    keys = Keys(f"{namespace}-cal-{uuid.uuid4().hex[:8]}")
    tbs = cfg.data.train_batch_size
    ccfg = _with(
        cfg,
        [
            f"run.name={keys.run}",
            f"run.dir={run_dir}",
            f"trainer.total_training_steps={steps + 1}",
            "trainer.max_off_policy_threshold=1000",
            "bench.latency_model.tokens_per_s=1e9",
            "bench.latency_model.concurrency=1",
            "rollout.num_producers=1",
            f"rollout.prompts_per_dispatch={tbs}",
        ],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(max(getattr(ccfg.trainer, "torch_threads", 0), 0) or threads)
    r = connect(redis_url)
    try:
        unthrottled_producer(ccfg, r, keys, build=LatencyProducer).run(max_dispatches=steps + 1)
        Trainer(ccfg, r, keys, "trainer", threading.Event()).run()
        per_step = _step_times(_events(r, keys.metrics))
    finally:
        torch.set_num_threads(threads)
        delete_run(r, keys)
    train = [s - w for s, w, _ in per_step.values()][1:]
    train_step_s = sum(train) / len(train)
    lm = LatencyModel.from_config(cfg)
    slots = cfg.rollout.num_producers * cfg.bench.latency_model.concurrency
    tokens = lm.mean_dispatch_tokens(cfg.rollout.n, seed=cfg.run.seed)  # per prompt
    tokens_per_s = tbs * tokens / (slots * train_step_s)
    return {"train_step_s": train_step_s, "mean_prompt_tokens": tokens, "tokens_per_s": tokens_per_s}


def _step_times(events: list[Any]) -> dict[int, tuple[float, float, float]]:
    """global step -> (timing_s/step, waiting for samples, transport) from local_update and step_end
    events."""
    wait: dict[int, float] = {}
    transport: dict[int, float] = {}
    step: dict[int, float] = {}
    for ev in events:
        if not isinstance(ev, StepMetrics):
            continue
        g, m = ev.global_step, ev.metrics
        if ev.type == "local_update":
            wait[g] = wait.get(g, 0.0) + m.get("timing_s/gen", 0.0)
            transport[g] = transport.get(g, 0.0) + m.get("timing_s/transport", 0.0)
        elif ev.type == "step_end":
            step[g] = m.get("timing_s/step", 0.0)
    return {g: (step[g], wait.get(g, 0.0), transport.get(g, 0.0)) for g in sorted(step)}


# ---- 2./3. one mode as subprocesses ----------------------------------------------------------------


def run_mode(
    cfg: PipelineConfig,
    mode: str,
    redis_url: str,
    work_dir: Path,
    timeout_s: float,
    namespace: str = NAMESPACE,
) -> ModeResult:
    """Run producers + trainer as subprocesses in a fresh namespace; collect the figures; delete the keys."""
    keys = Keys(f"{namespace}-{mode}-{uuid.uuid4().hex[:8]}")
    mode_overrides = (
        ["async_training.staleness_threshold=0", "trainer.sync_mode=true"]
        if mode == "sync"
        else ["trainer.sync_mode=false"]
    )
    mcfg = _with(cfg, [f"run.name={keys.run}", f"run.dir={work_dir}", *mode_overrides])
    path = work_dir / f"{mode}.yaml"
    path.write_text(config_to_yaml(mcfg))
    env = {**os.environ, "ROLLSTREAM_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    logs = work_dir / f"{mode}-logs"
    logs.mkdir(exist_ok=True)
    r = connect(redis_url)
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(module: str, name: str) -> subprocess.Popen[bytes]:
        with (logs / f"{name}.log").open("wb") as out:  # the child holds its own copy of the file
            p = subprocess.Popen([sys.executable, "-m", module, str(path), "--name", name], cwd=ROOT, env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        for i in range(mcfg.rollout.num_producers):
            spawn(producer_module(mcfg), f"rollout_{i:02d}")
        trainer = spawn("consumers.trainer", "trainer")
        deadline = time.monotonic() + timeout_s
        while not r.exists(keys.params) and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        cpu0 = [_cpu_s(p.pid) for p in procs]  # at version 0: start-up (imports) excluded
        cpu1 = list(cpu0)
        while trainer.poll() is None and time.monotonic() < deadline:
            cpu1 = [_cpu_s(p.pid) for p in procs]  # the trainer's last reading before it exits
            time.sleep(0.05)
        cpu1[:-1] = [_cpu_s(p.pid) for p in procs[:-1]]
        try:
            rc = trainer.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{mode}: trainer did not finish in {timeout_s:.0f}s; logs in {logs}"
            ) from None
        if rc != 0:
            tail = (logs / "trainer.log").read_text()[-3000:]
            raise RuntimeError(f"{mode}: trainer exited {rc}:\n{tail}")
        _stop(procs)
        res = collect(r, keys, mcfg, mode)
        res.trainer_cpu_s = cpu1[-1] - cpu0[-1]
        res.producers_cpu_s = sum(b - a for a, b in zip(cpu0[:-1], cpu1[:-1], strict=True))
        return res
    finally:
        _stop(procs, sig=signal.SIGKILL)
        delete_run(r, keys)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0.0 where unavailable)."""
    fields = stat_fields(pid)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop(procs: list[subprocess.Popen[bytes]], sig: int = signal.SIGTERM, wait_s: float = 30.0) -> None:
    """Send `sig` to the still-running processes and wait for them (SIGKILL after wait_s)."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(sig)
    deadline = time.monotonic() + wait_s
    for p in alive:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def collect(r: redis.Redis, keys: Keys, cfg: PipelineConfig, mode: str) -> ModeResult:
    """The figures of a finished run, read from its log (params, metrics, fates, rollouts)."""
    N = cfg.trainer.total_training_steps
    slots = cfg.rollout.num_producers * cfg.bench.latency_model.concurrency
    # wall: params v0 -> vN, Redis entry-id milliseconds
    published: dict[int, int] = {}
    rows: Any = r.xrange(keys.params)
    for entry_id, fields in rows:
        published[int(fields[b"version"])] = int(entry_id.split(b"-")[0])
    wall_s = (published[N] - published[0]) / 1000
    # trainer: per-step timings
    events = _events(r, keys.metrics)
    per_step = _step_times(events)
    step_s = sum(s for s, _, _ in per_step.values())
    wait_s = sum(w for _, w, _ in per_step.values())
    transport_s = sum(t for _, _, t in per_step.values())
    # producers: slot-averaged idle over the windows of versions 0..N-1
    names = producer_names(cfg.rollout.num_producers)
    stats = [
        ev
        for stream in keys.stats_streams(names)
        for ev in _events(r, stream)
        if isinstance(ev, ProducerStats) and ev.param_version < N
    ]
    idle = sum(ev.metrics.get("producer/idle_s", 0.0) for ev in stats)
    window = sum(ev.metrics.get("producer/window_s", 0.0) for ev in stats)
    # generation work of the trained samples: each prompt's longest trajectory
    fates: Any = r.xrange(keys.fates)
    trained = {
        (f[b"sample_id"].decode(), f[b"source_id"].decode()): int(f[b"staleness"])
        for _, f in fates
        if f[b"fate"] == b"trained"
    }
    gen_work = 0.0
    rollouts: Any = [
        (p, entry_id, fields) for p in names for entry_id, fields in r.xrange(keys.rollouts_of(p)) or []
    ]
    trained_refs = {(sid.split("-", 1)[0], i) for sid, i in trained}  # sample ids are `<producer>-…`
    for p, entry_id, fields in rollouts:
        if (p, entry_id.decode()) in trained_refs:
            ev = decode(fields)
            assert isinstance(ev, RolloutSample)
            gen_work += max(ev.processing_times)
    train_s = step_s - wait_s
    samples = len(trained)
    return ModeResult(
        mode=mode,
        wall_s=wall_s,
        steps=N,
        samples=samples,
        dropped=len(fates) - samples,
        samples_per_s=samples / wall_s,
        step_s=step_s,
        wait_s=wait_s,
        train_s=train_s,
        transport_s=transport_s,
        trainer_idle_ratio=wait_s / step_s,
        transport_share=transport_s / step_s,
        transport_ms_per_sample=1000 * transport_s / max(len(fates), 1),
        producer_idle_ratio=idle / window if window else 0.0,
        gen_work_s=gen_work,
        gen_per_slot_s=gen_work / slots,
        ideal_s=max(gen_work / slots, train_s),
        staleness_mean=sum(trained.values()) / max(samples, 1),
    )


# ---- report ----------------------------------------------------------------------------------------


def summarize(cal: dict[str, Any], sync: ModeResult, asyn: ModeResult, cfg: PipelineConfig) -> dict[str, Any]:
    """Both modes, the calibration and the headline ratios as one JSON-able dict."""
    lm = cfg.bench.latency_model
    return {
        "producers": "latency-model (decode replaced by sleeping the modelled time; real producer loop)",
        "trainer": "real (CPU training of the tiny policy)",
        "workload": {
            "global_steps": cfg.trainer.total_training_steps,
            "train_batch_size": cfg.data.train_batch_size,
            "n": cfg.rollout.n,
            "producers": cfg.rollout.num_producers,
            "slots_per_producer": lm.concurrency,
            "length_median": lm.length_median,
            "length_sigma": lm.length_sigma,
            "max_response_length": cfg.data.max_response_length,
            "async_staleness_threshold": cfg.async_training.staleness_threshold,
            "model": f"d{cfg.model.d_model} L{cfg.model.n_layer}",
            "seed": cfg.run.seed,
        },
        "calibration": cal,
        "sync": asdict(sync),
        "async": asdict(asyn),
        "speedup": sync.wall_s / asyn.wall_s,
        "async_over_ideal": asyn.wall_s / asyn.ideal_s,
        "transport_share": asyn.transport_share,
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
                   f"{platform.python_version()}",
    }


def format_report(rep: dict[str, Any]) -> str:
    """A human-readable table of the summary."""
    w, c = rep["workload"], rep["calibration"]
    lines = [
        f"producers: {rep['producers']}; trainer: {rep['trainer']}",
        f"workload: {w['global_steps']} steps x {w['train_batch_size']} prompts x n={w['n']}, model "
        f"{w['model']}, "
        f"{w['producers']} producers x {w['slots_per_producer']} slots, lengths lognormal(median "
        f"{w['length_median']}, "
        f"sigma {w['length_sigma']}) <= {w['max_response_length']}",
        (
            f"calibration: training {c['train_step_s']:.3f} s/step -> tokens_per_s {c['tokens_per_s']:.1f} "
            f"(mean prompt {c['mean_prompt_tokens']:.1f} tokens)"
        )
        if c["train_step_s"] is not None
        else f"calibration skipped: tokens_per_s {c['tokens_per_s']:.1f}",
        "",
        f"{'mode':6s} {'wall_s':>7s} {'samples/s':>9s} {'trainer_idle':>12s} {'producer_idle':>13s} "
        f"{'train_s':>7s} {'gen/slot_s':>10s} {'ideal_s':>7s} {'transport':>9s} {'staleness':>9s} "
        f"{'dropped':>7s} "
        f"{'cpu_trainer':>11s} {'cpu_producers':>13s}",
    ]
    for mode in ("sync", "async"):
        m = rep[mode]
        lines.append(
            f"{mode:6s} {m['wall_s']:7.2f} {m['samples_per_s']:9.2f} {m['trainer_idle_ratio']:12.2f} "
            f"{m['producer_idle_ratio']:13.2f} {m['train_s']:7.2f} {m['gen_per_slot_s']:10.2f} "
            f"{m['ideal_s']:7.2f} "
            f"{m['transport_share']:9.2%} {m['staleness_mean']:9.2f} {m['dropped']:7d} "
            f"{m['trainer_cpu_s']:11.2f} "
            f"{m['producers_cpu_s']:13.2f}"
        )
    lines += [
        "",
        f"speedup async/sync: {rep['speedup']:.2f}x (target >= 2.5)",
        f"async wall / ideal-overlap bound: {rep['async_over_ideal']:.2f} (target <= 1.10)",
        f"transport share (async): {rep['transport_share']:.2%} (target < 2%); "
        f"{rep['async']['transport_ms_per_sample']:.2f} ms per sample read+decoded",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI of `rollstream bench async`: calibrate, run sync then async, print the report."""
    p = argparse.ArgumentParser(prog="rollstream bench async", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None, help="pipeline.yaml (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the workload")
    p.add_argument("--quick", action="store_true", help="tiny size (tests; ~30 s)")
    p.add_argument("--steps", type=int, default=None, help="global steps per mode (default 20, quick 4)")
    p.add_argument(
        "--staleness", type=float, default=1.0, help="async mode's async_training.staleness_threshold"
    )
    p.add_argument(
        "--calibration-steps", type=int, default=None, help="timed calibration steps (default 4, quick 2)"
    )
    p.add_argument(
        "--tokens-per-s", type=float, default=None, help="skip calibration and use this decode speed"
    )
    p.add_argument(
        "--redis-url", default=DEFAULT_URL, help="Redis to run against (fresh namespaces, deleted after)"
    )
    p.add_argument(
        "--namespace",
        default=NAMESPACE,
        help="prefix of the run names (Redis key namespaces) the bench creates",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a mode's trainer is given up")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.config is not None and "=" in args.config and not Path(args.config).is_file():
        args.config, args.overrides = None, [args.config, *args.overrides]
    steps = args.steps or (4 if args.quick else 20)
    cfg = bench_config(args.config, args.overrides, args.quick, steps, args.staleness)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        work = Path(tmp)
        cal: dict[str, Any]
        if args.tokens_per_s is None:
            cal = calibrate(
                cfg,
                args.redis_url,
                str(work / "cal"),
                args.calibration_steps or (2 if args.quick else 4),
                args.namespace,
            )
        else:
            cal = {"train_step_s": None, "mean_prompt_tokens": None, "tokens_per_s": args.tokens_per_s}
        cfg = _with(cfg, [f"bench.latency_model.tokens_per_s={cal['tokens_per_s']}"])
        sync = run_mode(cfg, "sync", args.redis_url, work, args.timeout, args.namespace)
        asyn = run_mode(cfg, "async", args.redis_url, work, args.timeout, args.namespace)
    rep = summarize(cal, sync, asyn, cfg)
    print(json.dumps(rep) if args.json else format_report(rep))
    return 0
