"""The commands of a run's life: `config`, `run`, `stop`, `status`, `watch`."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.cli.targets import log_target, target
from rollstream.config import PipelineConfig, config_to_yaml, load_config
from rollstream.ops.run_target import mask_url, open_run

if TYPE_CHECKING:
    import redis

    from rollstream.ops.run_target import RunTarget


def cmd_config(args: argparse.Namespace) -> int:
    """`rollstream config`: validate pipeline.yaml with overrides and print the resolved config."""
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(config_to_yaml(cfg))
    return 0


def _ensure_pretrained(cfg: PipelineConfig) -> str | None:
    """Build model.pretrained into its cache folder when the run reads it from there and it is missing (once;
    `rollstream model build`); why it could not be built, or None."""
    m = cfg.model
    if m.pretrained is None or m.hf_path is None or Path(m.hf_path).is_dir():
        return None
    from rollstream.model.catalog import build_model
    from rollstream.model.gguf_convert import ConversionError
    from rollstream.pretrained import model_dir

    if Path(m.hf_path) != model_dir(m.pretrained):
        return f"model.hf_path={m.hf_path!r} does not exist"
    print(f"building model.pretrained={m.pretrained} into {m.hf_path} (once)", flush=True)
    try:
        build_model(m.pretrained, log=lambda line: print(f"rollstream model: {line}", flush=True))
    except (ValueError, ConversionError) as e:
        return f"model.pretrained={m.pretrained!r}: {e}"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    """`rollstream run`: start the run under supervisord, optionally wait for it or stay in the foreground."""
    from rollstream.ops import supervise
    from rollstream.ops.plan import SuperviseError, plan_run

    cfg = load_config(args.config, args.overrides)
    problem = _ensure_pretrained(cfg)
    if problem:
        print(f"rollstream run: {problem}", file=sys.stderr)
        return 1
    plan = plan_run(cfg)
    print(f"run {cfg.run.name}: {plan.run_dir} (redis {mask_url(plan.redis_url)})")
    proc = supervise.start_supervisord(plan, foreground=args.foreground)
    try:
        supervise.start_run(plan, cfg)
        print(f"started {', '.join(plan.workers)}; logs in {plan.run_dir / 'logs'}")
        if args.ready_timeout > 0:
            late = supervise.wait_for_producers(open_run(str(plan.resolved_config)), args.ready_timeout)
            if late:
                print(f"not ready after {args.ready_timeout:g}s (still starting): {', '.join(late)}")
        if args.wait_records:
            t = open_run(str(plan.resolved_config))
            supervise.wait_for_records(
                t,
                args.wait_records,
                args.wait_timeout,
                progress=lambda n: print(f"records: {n}", flush=True),
            )
        if proc is not None:
            fg = proc

            def forward(signum: int, frame: object) -> None:
                print("stopping: supervisord stops producers, trainer, aggregator, redis in turn", flush=True)
                fg.send_signal(signal.SIGTERM)

            signal.signal(signal.SIGINT, forward)
            signal.signal(signal.SIGTERM, forward)
            return 0 if proc.wait() == 0 else 1
    except KeyboardInterrupt:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        return 130
    except SuperviseError as e:
        print(f"rollstream run: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """`rollstream stop`: stop the run's workers and Redis in turn; 1 if any exited non-zero."""
    from rollstream.ops.plan import SuperviseError
    from rollstream.ops.supervise import stop_run

    run_dir = Path(args.run_dir) if args.run_dir else target(args).run_dir
    try:
        report = stop_run(run_dir)
    except SuperviseError as e:
        print(f"rollstream stop: {e}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    """`rollstream status`: the run's state once, refreshed (--watch), or as a health check (--check)."""
    from rollstream.ops.status import collect_status, format_status
    from rollstream.ops.supervise import failed_programs, process_states
    from rollstream.topology.cluster import pinned_slot

    t = log_target(args)
    r = t.connect()
    limit_s = t.cfg.trainer.heartbeat_stall_s
    while True:
        st = collect_status(r, t.keys, process_states(t.run_dir), limit_s, t.cfg.trainer.total_training_steps,
                            stopped=t.served, max_outstanding=t.cfg.max_outstanding)
        text = format_status(st, mask_url(t.redis_url))
        pinned = pinned_slot(r)
        if pinned is not None:
            text += f"\nredis cluster: the run's slot {pinned[0]} is served by the primary {pinned[1]}"
        repl = _replication_lines(t, r)
        if repl is not None:
            text += "\n\n" + "\n".join(repl[0])
        if args.check or not args.watch:
            print(text)
            failed = failed_programs(t.run_dir) if args.check and not t.served else []
            failed += repl[1] if repl is not None else []
            if args.check and (failed or not st.healthy):
                print("rollstream status --check: " + "; ".join(failed + st.problems()), file=sys.stderr)
                return 1
            return 0
        print("\033[H\033[2J" + time.strftime("%H:%M:%S ") + text, flush=True)
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _replication_lines(t: RunTarget, r: redis.Redis) -> tuple[list[str], list[str]] | None:
    """(status lines, problems) of a replicated run's topology; None for a single server."""
    from rollstream.ops.run_target import SECRETS_DIR
    from rollstream.topology.replicated import SENTINEL_PASSWORD_FILE
    from rollstream.topology.replication import is_sentinel_url
    from rollstream.topology.status import add_sentinel_view, format_replication, read_replication

    if t.served or not (t.cfg.run.redis.replicated or is_sentinel_url(t.redis_url)):
        return None
    st = read_replication(r)
    if is_sentinel_url(t.redis_url):
        pw_file = t.run_dir / SECRETS_DIR / SENTINEL_PASSWORD_FILE
        add_sentinel_view(st, t.redis_url, pw_file.read_text().strip() if pw_file.is_file() else None)
    bound = t.cfg.run.redis.replica_lag_bound_s
    return format_replication(st, bound), st.problems(bound)


def cmd_watch(args: argparse.Namespace) -> int:
    """`rollstream watch`: a progress line until val/acc reaches the target (0) or the time limit (2)."""
    from rollstream.ops.plan import SuperviseError
    from rollstream.ops.progress import watch_run
    from rollstream.ops.supervise import failed_programs

    t = target(args)

    def check() -> None:
        failed = failed_programs(t.run_dir)
        if failed:
            raise SuperviseError("; ".join(failed))

    try:
        curve = watch_run(t.connect(), t.keys, target_acc=args.until_val_acc, limit_s=args.limit_s,
                          since=args.since, hold_s=args.hold_s, check=check)
    except SuperviseError as e:
        print(f"rollstream watch: a worker failed: {e} (see {t.run_dir / 'logs'})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    best = curve.best("val/acc")
    step = curve.steps[-1] if curve.steps else 0
    if curve.reached_s is not None:
        print(
            f"val/acc >= {args.until_val_acc} after {curve.reached_s:.0f}s ({curve.reached_samples:.0f} "
            "samples "
            f"trained); best {best:.3f}, global step {step}"
        )
        return 0
    shown = f"{best:.3f}" if best is not None else "none yet"
    print(
        f"val/acc {args.until_val_acc} not reached in {args.limit_s:.0f}s: best {shown}, global step {step}"
    )
    return 2
