"""`python -m consumers.trainer pipeline.yaml [key=value ...] [--name N]`: the trainer worker."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollstream.worker import EXIT_OK, start_worker


def main(argv: Sequence[str] | None = None) -> int:
    """Start the worker (config, logging, signals, Redis), then train until done or stopped."""
    ctx, _args = start_worker("consumers.trainer", argv)
    from consumers.trainer.loop import Trainer  # torch import after the config is known to be valid

    Trainer(ctx.cfg, ctx.r, ctx.keys, ctx.name, ctx.stop).run()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
