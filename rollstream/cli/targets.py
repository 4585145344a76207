"""Which run a command talks to, from its arguments: a config with overrides, or a run dir."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollstream.ops.run_target import RunTarget, open_run


def config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The optional config path and the overrides (a first `key=value` is an override, not a path)."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]
    return config, overrides


def target(args: argparse.Namespace) -> RunTarget:
    """The run the arguments name (config and overrides, or --run-dir)."""
    config, overrides = config_and_overrides(args)
    return open_run(config, overrides, getattr(args, "run_dir", None))


def log_target(args: argparse.Namespace) -> RunTarget:
    """The run to read: while its Redis answers, that Redis; a stopped run with the embedded Redis is served
    read-only from its own files until the command ends (ops/log_server.py)."""
    from rollstream.ops.log_server import serve_stopped_log

    t: RunTarget = args.stack.enter_context(serve_stopped_log(target(args)))
    if t.served:
        print(f"run {t.keys.run} is stopped: reading its log from {t.run_dir} (read-only, for this command)",
              file=sys.stderr)
    return t
