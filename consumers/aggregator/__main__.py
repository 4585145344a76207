"""`python -m consumers.aggregator pipeline.yaml [key=value ...] [--name N] [--burst]`: run the aggregator."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollstream.runtime.process import (
    EXIT_OK,
    freeze_startup_heap,
    install_early_signal_handlers,
    start_worker,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the worker, fold until SIGTERM (or until drained with --burst), exit 0."""
    install_early_signal_handlers()  # before the heavier imports
    from consumers.aggregator.worker import AggregatorWorker

    ctx, args = start_worker("consumers.aggregator", argv)
    worker = AggregatorWorker(ctx.cfg, ctx.r, ctx.keys, name=ctx.name, stop=ctx.stop)
    freeze_startup_heap()
    worker.run(burst=args.burst)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
