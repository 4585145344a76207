"""The `rollstream` command: thin argument parsing that calls library code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rollstream.config import ConfigError, config_to_yaml, load_config


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(config_to_yaml(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="rollstream", description="Asynchronous RL post-training on Redis Streams")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("config", help="validate pipeline.yaml with overrides and print the resolved config")
    c.add_argument("config", help="path to pipeline.yaml")
    c.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.parameter_sync_step=2")
    c.set_defaults(func=_cmd_config)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollstream` console script; config errors print one line and exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 2
