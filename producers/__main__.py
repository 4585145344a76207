"""`python -m producers pipeline.yaml [key=value ...] [--name rollout_NN] [--burst] [--max-dispatches N]`:
one rollout producer (producers/worker.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rollstream.runtime.process import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_REFUSED,
    WorkerContext,
    install_early_signal_handlers,
)

if TYPE_CHECKING:
    from producers.worker import Producer

log = logging.getLogger("producers")


def main(argv: Sequence[str] | None = None, build: Callable[[WorkerContext], Producer] | None = None,
         role: str = "producers") -> int:
    """Start the worker (config, logging, signals, Redis), then dispatch until stopped; returns the exit code.
    `build` makes the producer (default: `Producer(ctx)`; the latency-model benchmark passes its own) and
    `role` names the command in usage and logs."""
    install_early_signal_handlers()  # a SIGTERM during the torch import below must not kill us
    import redis

    from producers.engines import EngineError, EngineStartError
    from producers.worker import Producer, lower_priority, set_torch_threads
    from rollstream.bus import RunNotSetUpError
    from rollstream.runtime.process import freeze_startup_heap, start_worker
    from rollstream.weights.store import WeightsError

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(
        "--max-dispatches", type=int, default=None, help="exit after this many dispatches (tests)"
    )
    known, rest = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    ctx, args = start_worker(role, rest)
    if ctx.cfg.rollout.name == "vllm" and build is None:
        from producers.engines.vllm import reexec_with_openmp

        reexec_with_openmp(ctx.cfg)  # returns unless it restarts this process with Intel OpenMP preloaded
    set_torch_threads(ctx.cfg.rollout.torch_threads)
    lower_priority(ctx.cfg.rollout.nice)
    try:
        producer = (build or Producer)(ctx)
    except ValueError as e:  # e.g. a name whose index exceeds rollout.num_producers
        log.error("%s", e)
        return EXIT_CONFIG
    except EngineStartError as e:  # one line naming the model path and the cause, not a traceback
        log.error("%s", e)
        return EXIT_CONFIG
    freeze_startup_heap()
    if ctx.stop.is_set():  # stopped while the engine started: nothing dispatched, nothing to finish
        log.info("producer %s: stopped while starting, exiting", ctx.name)
        return EXIT_OK
    try:
        done = producer.run(max_dispatches=known.max_dispatches, burst=args.burst)
    except (RunNotSetUpError, WeightsError, EngineError) as e:  # EngineError: a failed swap, a broken engine
        log.error("%s", e)
        return EXIT_ERROR
    except redis.AuthenticationError as e:  # the trainer's flood fence switched our user off
        log.error("producer %s: redis refused its login (%s): fenced (`rollstream status` says why); exiting",
                  ctx.name, e)
        return EXIT_REFUSED
    log.info("producer %s: %d dispatches, exiting", ctx.name, done)
    return EXIT_OK


def exit_now(code: int) -> None:
    """Leave with `code` without the interpreter's teardown (flushing logs and stdio first): everything a
    producer owes Redis is written by then, and an in-process vLLM engine's teardown can outlast
    supervisord's stopwaitsecs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
