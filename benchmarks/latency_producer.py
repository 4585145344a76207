"""Latency-model producers: the producer with the modelled decode injected (benchmarks/latency.py), its
loop run in slots. What `rollstream run` starts as producers when `bench.latency_model.enable`:

    python -m benchmarks.latency_producer pipeline.yaml [key=value ...] [--name rollout_NN] [--burst]
    [--max-dispatches N]

`latency_model.concurrency` slots (threads) run the producer's loop (producers/worker.py) side by side (an
inference engine's continuous batching), each dispatching one leased prompt at a time (the producer asks
for a lease of one prompt per slot); they share the producer's prompt source, lease, counters, stats window
and weights under one lock. Idle and generation seconds are slot-averaged (divided by the slot count), so
idle_ratio stays the idle fraction of the slots. A dispatch taken before a reconnect (by any slot) is
discarded instead of published: the reconnect resynced the producer, whose unpublished prompts are
dispatched again under the same ids. Slots publish out of order, so a crash can skip or repeat a prompt of
the source (benchmark producers only).
"""

from __future__ import annotations

if __name__ == "__main__":  # a worker process: a SIGTERM during the torch import below must not kill it
    from rollstream.runtime.process import install_early_signal_handlers

    install_early_signal_handlers()

import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.latency import LatencyModel, modelled_generate  # noqa: E402
from producers.rollout import Trajectory  # noqa: E402
from producers.worker import POLL_S, Producer, producer_index, producer_seed  # noqa: E402
from rollstream.model import (
    BasePolicy,  # noqa: E402
    build_policy,  # noqa: E402
)
from rollstream.runtime.process import WorkerContext  # noqa: E402
from rollstream.tasks import Prompt, Task  # noqa: E402
from schemas import RolloutSample  # noqa: E402

log = logging.getLogger(__name__)


class LatencyProducer(Producer):
    """A Producer with the modelled decode injected, its loop run in `latency_model.concurrency` slots."""

    def __init__(
        self, ctx: WorkerContext, policy: BasePolicy | None = None, task: Task | None = None
    ) -> None:
        cfg = ctx.cfg
        policy = policy or build_policy(cfg)
        rng = np.random.default_rng(
            producer_seed(cfg.run.seed, producer_index(ctx.name, cfg.rollout.num_producers))
        )
        version_now = (lambda: self.weights.version) if cfg.async_training.partial_rollout else None
        generate = modelled_generate(LatencyModel.from_config(cfg), policy.tokenizer, rng, version_now)
        self.slots = cfg.bench.latency_model.concurrency
        self.lock = threading.RLock()  # slots share the source, counters, stats window and weights
        self.generation = 0  # bumped by each reconnect; a dispatch taken under an older one is not published
        self._slot = threading.local()  # the generation a slot's current dispatch was taken under
        self._newest = (-1, 0.0)  # (version, monotonic time of the check), shared by idle slots
        super().__init__(ctx, policy, task, generate=generate)

    def _serve(self, limit: int | None, burst: bool) -> None:
        """`slots` loops side by side, one prompt a dispatch (one slot: the producer's own loop)."""
        if self.slots == 1:
            super()._serve(limit, burst)
            return
        slots = [
            threading.Thread(
                target=self._loop, args=(1, limit, burst), name=f"{self.name}-slot{i}", daemon=True
            )
            for i in range(self.slots)
        ]
        for t in slots:
            t.start()
        for t in slots:
            t.join()

    # ---- the producer's steps, one slot at a time ---------------------------------------------------
    def _reserve(self, limit: int | None) -> bool:
        with self.lock:  # other slots see the reservation
            return super()._reserve(limit)

    def _unreserve(self) -> None:
        with self.lock:
            super()._unreserve()

    def _refresh(self) -> tuple[bool, int]:
        with self.lock:
            self._slot.generation = self.generation
            return super()._refresh()

    def _reconnect(self, error: BaseException) -> None:
        with self.lock:  # once for all slots: every dispatch in flight belongs to the old generation
            super()._reconnect(error)
            self.generation += 1

    def _newest_version(self) -> int:
        """The newest published version; idle slots share one check per POLL_S."""
        version, at = self._newest
        if self.slots > 1 and time.monotonic() - at < POLL_S:
            return version
        self._newest = (super()._newest_version(), time.monotonic())
        return self._newest[0]

    def _add_idle(self, seconds: float) -> None:
        with self.lock:
            super()._add_idle(seconds / self.slots)  # slot-averaged

    def _take_prompts(self, amount: int) -> tuple[list[tuple[int, int, Prompt]], int, list[str]]:
        with self.lock:
            return super()._take_prompts(amount)

    def _lease_want(self, want: int) -> int:
        """A lease of one prompt per slot."""
        return want * self.slots

    def _finish(
        self,
        ids: list[str],
        items: list[tuple[int, int, Prompt]],
        param_version: int,
        trajs: list[Trajectory],
        gen_s: float,
        status: dict[str, float | int],
        before: tuple[int, int],
        after: tuple[int, int] | None = None,
    ) -> list[RolloutSample]:
        with self.lock:
            if getattr(self._slot, "generation", self.generation) != self.generation:
                log.warning("discarding %d samples: taken before a reconnect resynced the producer",
                            len(items))
                return []
            gen_s /= self.slots  # slot-averaged
            return super()._finish(ids, items, param_version, trajs, gen_s, status, before, after)

    def _maybe_stats(self) -> None:
        with self.lock:
            super()._maybe_stats()

    def _emit_stats(self, param_version: int) -> None:
        with self.lock:
            super()._emit_stats(param_version)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m benchmarks.latency_producer`: `python -m producers` with a
    LatencyProducer."""
    from producers.__main__ import main

    return main(argv, build=LatencyProducer, role="benchmarks.latency_producer")


if __name__ == "__main__":
    sys.exit(worker_main())
