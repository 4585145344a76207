"""Latency-model producers: the producer with the modelled decode injected (benchmarks/latency.py), its
loop run in slots. What `rollstream run` starts as producers when `bench.latency_model.enable`:

    python -m benchmarks.latency_producer pipeline.yaml [key=value ...] [--name rollout_NN] [--burst]
    [--max-dispatches N]

`latency_model.concurrency` slots (threads) run the producer's loop (producers/worker.py, `slots`:
producers/slots.py) side by side (an inference engine's continuous batching), each dispatching one leased
prompt at a time (the producer asks for a lease of one prompt per slot); they share the producer's prompt
source, lease, counters, stats window and weights under its lock. Idle and generation seconds are
slot-averaged (divided by the slot count), so idle_ratio stays the idle fraction of the slots; idle slots
share one newest-version check per POLL_S. A dispatch taken before a reconnect (by any slot) is discarded
instead of published: the reconnect resynced the producer, whose unpublished prompts are dispatched again
under the same ids. Slots publish out of order, so a crash can skip or repeat a prompt of the source
(benchmark producers only).
"""

from __future__ import annotations

if __name__ == "__main__":  # a worker process: a SIGTERM during the torch import below must not kill it
    from rollstream.runtime.process import install_early_signal_handlers

    install_early_signal_handlers()

import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.latency import LatencyModel, modelled_generate  # noqa: E402
from producers.worker import Producer, producer_index, producer_seed  # noqa: E402
from rollstream.model import BasePolicy, build_policy  # noqa: E402
from rollstream.runtime.process import WorkerContext  # noqa: E402
from rollstream.tasks import Task  # noqa: E402


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
        super().__init__(ctx, policy, task, generate=generate, slots=cfg.bench.latency_model.concurrency)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m benchmarks.latency_producer`: `python -m producers` with a
    LatencyProducer."""
    from producers.__main__ import main

    return main(argv, build=LatencyProducer, role="benchmarks.latency_producer")


if __name__ == "__main__":
    sys.exit(worker_main())
