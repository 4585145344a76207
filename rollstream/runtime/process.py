"""What every worker process shares: argv -> config, its name, logging, two-stage SIGTERM, a Redis client.

A worker runs in the foreground under supervisord. The first SIGTERM/SIGINT sets `stop` (finish the
current unit of work, ack, exit 0); the second exits at once with EXIT_FORCED, acking nothing unfinished.

Importing this module is cheap (no redis, pydantic or torch at import) so that a worker's `__main__` can
call `install_early_signal_handlers()` first thing: a SIGTERM that arrives while torch is still importing
is then recorded (and honoured by `start_worker`) instead of killing the process with the default handler.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

from rollstream.keys import Keys

if TYPE_CHECKING:
    import redis

    from rollstream.config import PipelineConfig

log = logging.getLogger(__name__)

# Named exit codes a supervisor (or a test) can read.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_FORCED = 3  # second SIGTERM: left at once
EXIT_REDIS = 4  # Redis never became reachable
EXIT_HUNG = 5  # a producer's generation passed rollout.generate_timeout_s (its prompts published as failures)
EXIT_REFUSED = 6  # Redis refused the login: the ACL user is off (fenced by the trainer) or a bad password

#: Environment variable holding the Redis URL when `run.redis_url` is null (set by `rollstream run`).
REDIS_URL_ENV = "ROLLSTREAM_REDIS_URL"


#: Signals received before start_worker installed the real handlers (see install_early_signal_handlers).
_early_signals: list[int] = []


def install_early_signal_handlers() -> None:
    """Record SIGTERM/SIGINT until start_worker takes over (call first thing in a worker's __main__,
    before heavy imports); a second early signal exits at once with EXIT_FORCED."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _early_signals.append(signum)
        if len(_early_signals) >= 2:
            os.write(2, f"second signal {signum} while starting: exiting now\n".encode())
            os._exit(EXIT_FORCED)
        os.write(2, f"signal {signum} while starting: will exit once started\n".encode())

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def setup_logging(name: str, level: str | None = None) -> None:
    """Log lines to stderr as `time level name: message` (called by worker mains, never at import)."""
    logging.basicConfig(
        level=level or os.environ.get("ROLLSTREAM_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def redis_url_for(cfg: PipelineConfig) -> str:
    """The URL to use: run.redis_url, else $ROLLSTREAM_REDIS_URL, else the default local Redis."""
    return cfg.run.redis_url or os.environ.get(REDIS_URL_ENV) or "redis://127.0.0.1:6379/0"


@dataclass
class WorkerContext:
    """A started worker: config, name, keys, Redis client and the stop flag its loops watch."""

    cfg: PipelineConfig
    name: str
    keys: Keys
    r: redis.Redis
    stop: threading.Event = field(default_factory=threading.Event)
    signals: int = 0

    def install_signal_handlers(self) -> None:
        """First SIGTERM/SIGINT sets stop; the second exits immediately with EXIT_FORCED. Signals
        recorded by install_early_signal_handlers count as received."""
        self.signals += len(_early_signals)
        _early_signals.clear()
        if self.signals:
            self.stop.set()

        def handler(signum: int, frame: FrameType | None) -> None:
            self.signals += 1
            if self.signals >= 2:
                os.write(2, f"{self.name}: second signal {signum}: exiting now\n".encode())
                os._exit(EXIT_FORCED)
            os.write(2, f"{self.name}: signal {signum}: finishing current work then exiting\n".encode())
            self.stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def parse_worker_args(prog: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse `<prog> pipeline.yaml [key=value ...] [--name NAME] [--burst]`."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("config", help="path to pipeline.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    p.add_argument("--name", default=None, help="worker name (default: $SUPERVISOR_PROCESS_NAME or the role)")
    p.add_argument("--burst", action="store_true", help="exit once there is nothing left to do (tests)")
    return p.parse_intermixed_args(argv)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (modules, config, model, clients) out of the cyclic
    garbage collector's reach (`gc.freeze`); called by worker mains once built, before their loop. Without
    it every full collection re-scans the start-up heap (with torch, ~0.2-0.6 s per full collection in the
    traced trainers of docs/history/BENCHMARKS-codec.md, issue 17), a pause that lands wherever the allocation
    that triggers
    it happens, decoding included."""
    import gc

    gc.collect()
    gc.freeze()


# glibc malloc thresholds the workers set (see tune_allocator): buffers up to this size come from the heap
# (32 MiB: the most a 64-bit glibc before 2.35 accepts) ...
MALLOC_MMAP_THRESHOLD = 32 << 20
# ... and up to this much freed memory stays in the process for the next ones.
MALLOC_TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)


def tune_allocator() -> dict[str, int]:
    """Let freed sample buffers be reused instead of returned to the kernel (glibc only; a no-op elsewhere);
    returns the thresholds set, by name. glibc serves every allocation over 128 KB (the size grows only as
    such
    buffers are freed) with a fresh mmap and returns freed heap space above 128 KB: while a trainer holds one
    batch of decoded samples and decodes the next, each new array costs a page fault per 4 KB page (decode of
    a 4 MB
    sample 2.0 ms instead of 1.1 ms, docs/history/BENCHMARKS-codec.md, issue 17). Called by worker mains at
    start; glibc's own
    settings win: a MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variable or the matching
    GLIBC_TUNABLES entry. The trim threshold is set only after the mmap one was accepted."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return {}
    done: dict[str, int] = {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for env, tunable, param, value in (
        ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold", _M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD),
        ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold", _M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD),
    ):
        if env in os.environ or tunable in tunables:
            continue  # the user's own setting
        if libc.mallopt(param, value) != 1:
            # (setting only the trim threshold would switch off glibc's dynamic mmap threshold: worse than
            # nothing)
            break
        done[env] = value
    return done


def start_worker(
    role: str, argv: Sequence[str] | None = None, *, client_retries: int = 0, name_suffix: str = ""
) -> tuple[WorkerContext, argparse.Namespace]:
    """Parse args, load config (exit 2 on a bad one), set umask 077, set up logging and signals, connect
    with backoff. `name_suffix` is appended to the worker name (a data-parallel trainer rank's `-r<rank>`)."""
    import redis

    from rollstream.bus import connect, read_password, wait_until_ready
    from rollstream.config import ConfigError, config_to_yaml, load_config

    install_early_signal_handlers()  # covers config loading and connecting (no-op if already recorded)
    os.umask(0o077)  # checkpoints, sinks and weight files are the run's user's only
    args = parse_worker_args(f"python -m {role}", argv)
    name = (args.name or os.environ.get("SUPERVISOR_PROCESS_NAME") or role.rsplit(".", 1)[-1]) + name_suffix
    setup_logging(name)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    log.info("resolved config:\n%s", config_to_yaml(cfg))
    tuned = tune_allocator()
    if tuned:
        log.info("malloc thresholds: %s", ", ".join(f"{k}={v}" for k, v in tuned.items()))
    r = connect(
        redis_url_for(cfg),
        socket_timeout_s=cfg.bus.socket_timeout_s,
        password=read_password(cfg.run.password_file),
        client_name=f"{cfg.run.name}:{name}",
        retries=client_retries,
        wait_replicas=cfg.run.redis.acks_needed(),
        wait_timeout_ms=cfg.run.redis.wait_timeout_ms,
        run=cfg.run.name,
    )
    ctx = WorkerContext(cfg=cfg, name=name, keys=Keys(cfg.run.name), r=r)
    ctx.install_signal_handlers()
    try:
        wait_until_ready(r, timeout_s=120, stop=ctx.stop)
    except redis.AuthenticationError as e:
        log.error("redis refused %s's login (%s): its user is switched off (fenced: `rollstream status` says "
                  "why) or its password is wrong; not retrying", name, e)
        raise SystemExit(EXIT_REFUSED) from None
    except redis.ConnectionError as e:
        log.error("%s", e)
        raise SystemExit(EXIT_REDIS) from None
    return ctx, args
