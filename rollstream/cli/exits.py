"""The one mapping of a command's errors to the exit codes every rollstream command shares: a config error
prints one line and exits 2, an unreachable Redis or a log that cannot be served exits 3."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

from rollstream.bus import CONNECTION_ERRORS
from rollstream.config import ConfigError
from rollstream.ops.log_server import LogServerError


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run `func(args)` with `args.stack` open (what it enters closes after it); its errors become one line on
    stderr and the shared exit code (2: config, 3: Redis or the served log). BrokenPipeError propagates."""
    try:
        with contextlib.ExitStack() as args.stack:
            return int(func(args))
    except ConfigError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 2
    except CONNECTION_ERRORS as e:
        print(f"rollstream: redis not reachable: {e}", file=sys.stderr)
        return 3
    except LogServerError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 3
