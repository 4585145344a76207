"""`python -m consumers.trainer pipeline.yaml [key=value ...] [--name N]`: the trainer worker."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollstream.worker import EXIT_OK, freeze_startup_heap, install_early_signal_handlers, start_worker


def main(argv: Sequence[str] | None = None) -> int:
    """Start the worker (config, logging, signals, Redis), then train until done or stopped."""
    install_early_signal_handlers()  # a SIGTERM during the torch import below must not kill us
    ctx, args = start_worker("consumers.trainer", argv)
    import torch  # after the config is known to be valid

    from consumers.trainer.loop import Trainer

    if ctx.cfg.trainer.torch_threads > 0:
        torch.set_num_threads(ctx.cfg.trainer.torch_threads)
    trainer = Trainer(ctx.cfg, ctx.r, ctx.keys, ctx.name, ctx.stop, burst=args.burst)
    freeze_startup_heap()
    trainer.run()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
