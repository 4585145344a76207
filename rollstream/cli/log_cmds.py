"""The commands that read a run's log: `audit`, `inspect`, `tail`, `replay`, `plot`, `serve`.

The runtime imports no worker package: `replay records` runs the aggregator's replay as its own process
(`python -m consumers.aggregator.replay`), and `replay trainer` copies a checkpoint by its file name alone
(rollstream/weights/checkpoints.py)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from rollstream.cli.targets import config_and_overrides, log_target, target
from rollstream.ops.run_target import mask_url


def cmd_audit(args: argparse.Namespace) -> int:
    """`rollstream audit`: check the log's guarantees; 1 when one is violated or an entry cannot be read."""
    from rollstream.bus import ArchiveError
    from rollstream.ops.audit import audit_run, format_report
    from schemas import DecodeError

    t = log_target(args)
    try:
        rep = audit_run(t.connect(), t.keys)
    except (DecodeError, ArchiveError) as e:
        print(f"rollstream audit: an entry of the log cannot be read: {e}", file=sys.stderr)
        return 1
    print(f"run {t.keys.run}")
    print(format_report(rep))
    return 1 if rep.problems() else 0


def _split_id(args: argparse.Namespace) -> None:
    from rollstream.ops.inspect import looks_like_id

    rest = list(args.rest)
    args.which = rest.pop(0) if rest and looks_like_id(rest[0]) else "-1"
    args.config = rest.pop(0) if rest and "=" not in rest[0] else None
    args.overrides = rest


def cmd_inspect(args: argparse.Namespace) -> int:
    """`rollstream inspect`: one stream entry as JSON."""
    from rollstream.bus import ArchiveError
    from rollstream.ops import inspect

    _split_id(args)
    t = log_target(args)
    r = t.connect()
    try:
        entry_id, fields = inspect.read_entry(r, inspect.stream_key(t.keys, args.stream), args.which)
    except (inspect.InspectError, ArchiveError) as e:
        print(f"rollstream inspect: {e}", file=sys.stderr)
        return 1
    tok = inspect.tokenizer_for(t.cfg)
    print(inspect.dumps(inspect.entry_to_json(args.stream, entry_id, fields, tok, args.full)))
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    """`rollstream tail`: a stream's last entries, then the new ones as they arrive."""
    from rollstream.ops import inspect

    t = log_target(args)
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


def cmd_replay_records(args: argparse.Namespace) -> int:
    """`rollstream replay records`: refold a run's metrics log into a new run's records, with the
    aggregator's own fold: `python -m consumers.aggregator.replay` runs with these arguments (the runtime
    imports no worker); its exit status is this command's."""
    argv = ["--from", args.src, "--to", args.dst, *([args.config] if args.config else []), *args.overrides]
    if args.run_dir:
        argv += ["--run-dir", args.run_dir]
    return subprocess.run([sys.executable, "-m", "consumers.aggregator.replay", *argv]).returncode


def cmd_replay_trainer(args: argparse.Namespace) -> int:
    """`rollstream replay trainer`: copy a run's rollouts into a new run and print the trainer command."""
    import shlex

    from rollstream.bus import ArchiveError
    from rollstream.keys import Keys
    from rollstream.ops.log_server import replay_destination
    from rollstream.ops.replay_copy import ReplayCopyError, copy_rollouts, copy_steps, parse_steps
    from rollstream.topology.cluster import require_one_slot
    from rollstream.weights.checkpoints import copy_checkpoint

    t = log_target(args)
    try:
        require_one_slot(t.redis_url, [args.src, args.dst], "rollstream replay trainer")
    except ValueError as e:
        print(f"rollstream replay trainer: {e}", file=sys.stderr)
        return 2
    r = t.connect()
    src, dst = Keys(args.src), Keys(args.dst)
    out = args.stack.enter_context(replay_destination(t, dst.run))
    extra: list[str] = []
    try:
        if args.steps:
            first, last = parse_steps(args.steps)
            n, kept_ids = copy_steps(r, src, dst, first, last, out=out)
            if first > 1:
                run_dir = Path(t.cfg.run.dir)
                try:
                    copy_checkpoint(
                        run_dir / src.run / "checkpoints", run_dir / dst.run / "checkpoints", first - 1
                    )
                except FileNotFoundError as e:
                    raise ReplayCopyError(str(e)) from None
            extra = [f"trainer.total_training_steps={last}"]
            what = f"the {n} rollouts steps {first}-{last} consumed" + (
                "" if kept_ids else " (new entry ids)"
            )
        else:
            n = copy_rollouts(r, src, dst, args.start, args.end, out=out)
            what = f"{n} rollouts"
    except (ReplayCopyError, ArchiveError) as e:
        print(f"rollstream replay trainer: {e}", file=sys.stderr)
        return 1
    config, overrides = config_and_overrides(args)
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


def cmd_plot(args: argparse.Namespace) -> int:
    """`rollstream plot`: reward and accuracy curves from the records (or records.jsonl) as a PNG."""
    from rollstream.ops import plot

    t = log_target(args)
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


def cmd_serve(args: argparse.Namespace) -> int:
    """`rollstream serve`: a stopped run's Redis up from its own files, for CMD or until Ctrl-C."""
    from rollstream.bus.connection import PASSWORD_ENV, USERNAME_ENV
    from rollstream.ops.log_server import serve_run
    from rollstream.runtime.process import REDIS_URL_ENV

    command = args.command_argv
    with serve_run(target(args), write=args.write) as t:
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
