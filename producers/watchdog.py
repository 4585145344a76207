"""A deadline on one generation: an engine that never returns (a hung vLLM engine core, a dead GPU, a
deadlocked tool) must not hang its producer with leased prompts that never reach the log.

    with GenerationWatchdog(timeout_s, on_expire) as dog:
        trajs = generate(batch)          # may never return
    # leaving the block claims the result; GenerationHung when the watchdog claimed it first

When `timeout_s` passes before the block is left, the watchdog thread claims the dispatch and runs
`on_expire` (the producer publishes the dispatch's prompts as rollout failures and then exits the process, so
its supervisor restarts it with a fresh engine: Python cannot interrupt a thread stuck in native code).
Exactly one side wins the claim, under a lock: a generation that returns after the deadline finds the
dispatch taken and raises GenerationHung instead of publishing the same prompts a second time.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import TracebackType

from rollstream.runtime.procfs import descendants


class GenerationHung(RuntimeError):
    """The generation returned after its watchdog had published its prompts as failures."""


class GenerationWatchdog:
    """Runs `on_expire` in a thread when the guarded block is still running after `timeout_s` (None: no
    deadline, nothing is started)."""

    def __init__(self, timeout_s: float | None, on_expire: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self.expired = False  # the watchdog claimed the dispatch
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._claimed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GenerationWatchdog:
        if self.timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, name="generation-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._lock:
            claimed_by_watchdog = self._claimed
            self._claimed = True
        self._done.set()
        if claimed_by_watchdog:
            if self._thread is not None:
                self._thread.join()  # on_expire is over (in production it never returns: the process exits)
            raise GenerationHung(
                f"generation returned after its {self.timeout_s} s deadline; its prompts were published as "
                "rollout failures already"
            ) from exc

    def _watch(self) -> None:
        assert self.timeout_s is not None
        if self._done.wait(self.timeout_s):
            return
        with self._lock:
            if self._claimed:  # returned just now
                return
            self._claimed = self.expired = True
        self.on_expire()


def exit_hung(code: int) -> None:
    """End this process at once with `code`, SIGKILLing its descendants first: a hung engine's own
    processes (vLLM's engine core) must not outlive the producer that leaves for a fresh one."""
    for child in descendants(os.getpid()):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    os._exit(code)
