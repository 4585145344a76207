"""The one mapping of a command's errors to the exit codes every rollstream command shares: a config error
prints one line and exits 2, an unreachable Redis or a log that cannot be served exits 3."""

from __future__ import annotations

import argparse
import contextlib
import select
import sys
from collections.abc import Callable

from rollstream.bus import CONNECTION_ERRORS
from rollstream.config import ConfigError
from rollstream.ops.log_server import LogServerError


def stdout_gone() -> bool:
    """Whether our standard output is a pipe whose reader has gone (its BrokenPipeError is then ours, not a
    Redis connection's): its buffer cannot be flushed, or the pipe reports an error (Linux: POLLERR)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):  # closed or not a real file: nothing of ours broke
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run `func(args)` with `args.stack` open (what it enters closes after it); its errors become one line on
    stderr and the shared exit code (2: config, 3: Redis or the served log). A BrokenPipeError of our own
    output (`… | head`) propagates: main() ends quietly."""
    try:
        with contextlib.ExitStack() as args.stack:
            return int(func(args))
    except ConfigError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 2
    except CONNECTION_ERRORS as e:
        if isinstance(e, BrokenPipeError) and stdout_gone():  # `rollstream inspect … | head`: not Redis
            raise
        print(f"rollstream: redis not reachable: {e}", file=sys.stderr)
        return 3
    except LogServerError as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 3
