"""Soak benchmark: a bounded soak of the whole pipeline with retention (on by default), a small Redis budget.

Starts `rollstream run` (embedded redis, ACLs, supervisord) with up to 8 latency-model producers (decoding
replaced by sleeping its modelled time, benchmarks/latency_producer.py), a tiny trainer and the aggregator,
with
`bus.redis_max_bytes` = `--budget-mib` so that retention moves most of the log to the archive. Every
`--sample-every-s` it samples redis `INFO memory` used_memory, the bytes of the run's archive on disk, the
trainer's RSS (/proc/<pid>/status VmRSS), the rollouts stream's length and the trainer group's lag and
pending count, and the trainer's global step. At the end it stops the run and reports: the samples as a
markdown table, min/max of each curve, bytes per global step in Redis and in the archive, the retention
passes' times (from the trainer's log), whether Redis memory stayed bounded (the second half's peak within
`--growth-limit` x the first half's), whether the archive grew linearly (bytes per step of the second half
within `--growth-limit` of the first half's, either way) and whether the retention byte cap ever bit (the
trainer logs "RETENTION CAP BIT" when it had to move entries a group had not read).

    rollstream bench soak [--duration-s 300] [--producers 8] [--sample-every-s 10] [key=value ...]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.bus import ArchiveError, run_archive, run_producers
from rollstream.config import load_config
from rollstream.keys import TRAINER_GROUP
from rollstream.ops import supervise
from rollstream.ops.plan import SuperviseError, plan_run
from rollstream.ops.run_target import open_run

SOAK_CONFIG = [
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=4",
    "model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32",
    "data.reverse.max_digits=3",
    "data.epoch_size=256", "data.val_size=4", "data.max_response_length=6", "trainer.test_freq=0",
    "trainer.total_training_steps=1000000", "trainer.save_freq=10", "run.device=cpu",
    "bench.latency_model.enable=true", "rollout.torch_threads=1", "trainer.torch_threads=1",
    "bus.trim_every_s=5", f"bus.max_stream_bytes={64 << 20}",
]
CAP_BIT = "RETENTION CAP BIT"
#: The trainer's log line of a retention pass that moved entries (rollstream/bus/retention.py).
PASS_LINE = re.compile(r"retention: archived (\d+) entries .*?, trimmed (\d+), in (\d+) ms")


@dataclass
class Sample:
    """One measurement during the soak."""

    t_s: float
    redis_used_mb: float
    archive_mb: float
    trainer_rss_mb: float
    rollouts_len: int
    trainer_lag: int
    trainer_pending: int
    global_step: int


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def archive_bytes(r: Any, target: Any) -> int:
    """Committed bytes of the run's archive on disk, over every stream (0 before anything was archived)."""
    arc = run_archive(r, target.keys.fates)
    if arc is None:
        return 0
    streams = [*target.keys.all_streams(run_producers(r, target.keys)), *(k.decode() for k in r.scan_iter(
        match=target.keys.producer_pattern("dispatch_log")))]
    try:
        return sum(arc.index(k).bytes for k in streams)
    except ArchiveError:
        return 0


def take_sample(r: Any, target: Any, run_dir: Path, t_s: float) -> Sample:
    """Measure redis memory, the archive's size, trainer RSS, the rollouts backlog and the trainer's step."""
    info = r.info("memory")
    pid = int(supervise.rpc(run_dir).supervisor.getProcessInfo("trainer")["pid"])
    rollouts = target.keys.rollouts_streams(run_producers(r, target.keys))
    trainer_groups = [
        g for stream in rollouts for g in r.xinfo_groups(stream) if g["name"].decode() == TRAINER_GROUP
    ]
    step = r.hget(target.keys.trainer, "global_step")
    return Sample(
        t_s=t_s,
        redis_used_mb=int(info["used_memory"]) / 2**20,
        archive_mb=archive_bytes(r, target) / 2**20,
        trainer_rss_mb=rss_mb(pid) if pid else 0.0,
        rollouts_len=sum(int(r.xlen(stream)) for stream in rollouts),
        trainer_lag=sum(int(g.get("lag") or 0) for g in trainer_groups),
        trainer_pending=sum(int(g.get("pending") or 0) for g in trainer_groups),
        global_step=int(step or 0),
    )


def table(samples: list[Sample]) -> str:
    """The samples as a markdown table, then a min/max row per column."""
    head = (
        "| t (s) | redis used_memory (MiB) | archive (MiB) | trainer RSS (MiB) | rollouts entries | trainer "
        "lag "
        "| trainer pending | global step |"
    )
    rows = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in samples:
        rows.append(f"| {s.t_s:.0f} | {s.redis_used_mb:.1f} | {s.archive_mb:.1f} | {s.trainer_rss_mb:.0f} | "
                    f"{s.rollouts_len} | {s.trainer_lag} | {s.trainer_pending} | {s.global_step} |")
    for name, fn in (("min", min), ("max", max)):
        rows.append(f"| **{name}** | {fn(s.redis_used_mb for s in samples):.1f} | "
                    f"{fn(s.archive_mb for s in samples):.1f} | "
                    f"{fn(s.trainer_rss_mb for s in samples):.0f} | {fn(s.rollouts_len for s in samples)} | "
                    f"{fn(s.trainer_lag for s in samples)} | {fn(s.trainer_pending for s in samples)} | |")
    return "\n".join(rows)


def bounded(values: list[float], growth_limit: float) -> bool:
    """True when the second half's peak is within growth_limit x the first half's peak."""
    half = max(1, len(values) // 2)
    return max(values[half:] or values) <= growth_limit * max(values[:half])


def archiving(samples: list[Sample]) -> list[Sample]:
    """The samples from the last one before the archive started growing: the steady state, once Redis
    reached its budget (all samples when nothing was archived)."""
    first = next((i for i, s in enumerate(samples) if s.archive_mb > 0), 0)
    return samples[max(0, first - 1):]


def per_step_kib(a: Sample, b: Sample, attr: str) -> float:
    """KiB per global step that `attr` (a MiB figure) grew by from sample a to sample b."""
    return (getattr(b, attr) - getattr(a, attr)) * 1024 / max(1, b.global_step - a.global_step)


def linear(samples: list[Sample], growth_limit: float) -> bool:
    """True when, once archiving started, the archive grew by about as many bytes per global step in the
    second half as in the first (ratio within growth_limit either way)."""
    steady = archiving(samples)
    half = len(steady) // 2
    if len(steady) < 3:
        return False
    first = per_step_kib(steady[0], steady[half], "archive_mb")
    second = per_step_kib(steady[half], steady[-1], "archive_mb")
    return first > 0 and second > 0 and 1 / growth_limit <= second / first <= growth_limit


def pass_times(trainer_log: str) -> list[float]:
    """Milliseconds of each retention pass that moved entries, from the trainer's log."""
    return [float(m.group(3)) for m in PASS_LINE.finditer(trainer_log)]


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollstream bench soak`."""
    p = argparse.ArgumentParser(prog="rollstream bench soak", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides on top of the soak's")
    p.add_argument("--config", default="pipeline.yaml", help="base config file")
    p.add_argument("--duration-s", type=float, default=300.0, help="how long to soak after the first record")
    p.add_argument("--producers", type=int, default=8, help="latency-model producer processes (1-8)")
    p.add_argument("--sample-every-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument(
        "--growth-limit", type=float, default=1.5, help="allowed ratio of late to early memory peaks"
    )
    p.add_argument("--budget-mib", type=float, default=16.0, help="bus.redis_max_bytes of the soak, in MiB")
    p.add_argument("--run-dir", default=None, help="parent folder of the run dir (default: a temp dir)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; print the table and verdicts; exit 1 when memory grew, the archive did not grow
    linearly, or the retention cap bit."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 1 <= args.producers <= 8:
        print("rollstream bench soak: --producers must be 1..8", file=sys.stderr)
        return 2
    parent = Path(args.run_dir or tempfile.mkdtemp(prefix="rollstream-soak-"))
    cfg = load_config(
        args.config,
        [
            *SOAK_CONFIG,
            f"bus.redis_max_bytes={int(args.budget_mib * 2**20)}",
            f"rollout.num_producers={args.producers}",
            f"run.dir={parent}",
            "run.name=soak",
            *args.overrides,
        ],
    )
    plan = plan_run(cfg)
    print(f"soak: {args.producers} producers for {args.duration_s:.0f}s; run dir {plan.run_dir}", flush=True)
    supervise.start_supervisord(plan)
    samples: list[Sample] = []
    lengths: dict[str, tuple[int, int]] = {}
    try:
        supervise.start_run(plan, cfg)
        target = open_run(None, run_dir=str(plan.run_dir))
        supervise.wait_for_records(target, 1, timeout_s=300)
        r = target.connect()
        t0 = time.monotonic()
        while True:
            t = time.monotonic() - t0
            samples.append(take_sample(r, target, plan.run_dir, t))
            s = samples[-1]
            print(f"t={t:5.0f}s redis={s.redis_used_mb:.1f}MiB archive={s.archive_mb:.1f}MiB "
                  f"trainer={s.trainer_rss_mb:.0f}MiB "
                  f"rollouts={s.rollouts_len} lag={s.trainer_lag} step={s.global_step}", flush=True)
            if t >= args.duration_s:
                streams = target.keys.all_streams(run_producers(r, target.keys))
                lengths = {
                    k.removeprefix(target.keys.prefix): (int(r.xlen(k)),
                                                         int(r.memory_usage(k, samples=0) or 0))
                    for k in streams
                    if r.exists(k)
                }
                break
            time.sleep(min(args.sample_every_s, max(0.0, args.duration_s - t)))
            failed = supervise.failed_programs(plan.run_dir)
            if failed:
                raise SuperviseError("; ".join(failed))
        r.close()
    finally:
        report = supervise.stop_run(plan.run_dir)
    trainer_log = (plan.run_dir / "logs" / "trainer.log").read_text(errors="replace")
    cap_bits = trainer_log.count(CAP_BIT)
    passes = pass_times(trainer_log)
    steps = samples[-1].global_step - samples[0].global_step
    backlog_ok = bounded([float(s.rollouts_len) for s in samples], args.growth_limit * 4)
    mem_ok = bounded([s.redis_used_mb for s in samples], args.growth_limit)
    rss_ok = bounded([s.trainer_rss_mb for s in samples], args.growth_limit)
    archive_ok = linear(samples, args.growth_limit)
    print()
    print(table(samples))
    print()
    print("streams in Redis at the end, entries / MiB: "
          + ", ".join(f"{k} {n} / {b / 2**20:.2f}" for k, (n, b) in lengths.items()))
    steady = archiving(samples)
    print(
        f"once archiving started (t >= {steady[0].t_s:.0f}s, "
        f"{steady[-1].global_step - steady[0].global_step} steps), "
        "growth per global step: redis used_memory "
        f"{per_step_kib(steady[0], steady[-1], 'redis_used_mb'):.2f} KiB, "
        f"archive {per_step_kib(steady[0], steady[-1], 'archive_mb'):.2f} KiB"
    )
    if passes:
        print(
            f"retention passes that moved entries: {len(passes)}, median {statistics.median(passes):.0f} ms, "
            f"max {max(passes):.0f} ms"
        )
    print(f"global steps during the soak: {steps} ({steps / max(samples[-1].t_s, 1e-9):.2f}/s)")
    print(
        f"redis used_memory bounded: {mem_ok}; archive linear: {archive_ok}; trainer RSS bounded: {rss_ok}; "
        f"rollouts backlog bounded: {backlog_ok}; retention cap bit {cap_bits} times"
    )
    print("programs: " + ", ".join(report.lines()))
    ok = mem_ok and archive_ok and rss_ok and backlog_ok and cap_bits == 0 and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
