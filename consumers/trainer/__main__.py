"""`python -m consumers.trainer pipeline.yaml [key=value ...] [--name N]`: the trainer worker (one process,
or one data-parallel rank when started by torchrun: `python -m consumers.trainer.torchrun … -m
consumers.trainer`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from consumers.trainer.roles import consumer_name, rank_info
from rollstream.bus.connection import watch_busy_scripts
from rollstream.runtime.process import (
    EXIT_CONFIG,
    EXIT_OK,
    freeze_startup_heap,
    install_early_signal_handlers,
    start_worker,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the worker (config, logging, signals, Redis), join the data-parallel group when started by
    torchrun, then train until done or stopped."""
    install_early_signal_handlers()  # a SIGTERM during the torch import below must not kill us
    info = rank_info()
    ctx, args = start_worker("consumers.trainer", argv, name_suffix=consumer_name("", info))
    t = ctx.cfg.trainer
    if info.world_size != t.world_size:
        print(f"{ctx.name}: torchrun started {info.world_size} ranks but trainer.nnodes={t.nnodes} * "
              f"trainer.nproc_per_node={t.nproc_per_node} = {t.world_size}", file=sys.stderr)
        return EXIT_CONFIG
    import torch  # after the config is known to be valid

    from consumers.trainer.distributed import DataParallel, DistributedError, watch_parent
    from consumers.trainer.loop import Trainer
    from rollstream.model.base import resolve_device

    if t.torch_threads > 0:
        torch.set_num_threads(t.torch_threads)
    try:
        dp = DataParallel.from_env(resolve_device(ctx.cfg.run.device), t.strategy)
    except DistributedError as e:
        print(f"{ctx.name}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    dp.roles.if_several(watch_parent, ctx.stop)  # torchrun gone (killed): stop instead of lingering
    dp.roles.only_main(watch_busy_scripts, ctx.r, ctx.stop)  # a never-ending script must not stall the run
    try:
        trainer = Trainer(ctx.cfg, ctx.r, ctx.keys, ctx.name, ctx.stop, burst=args.burst, dp=dp)
        freeze_startup_heap()
        trainer.run()
    finally:
        dp.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
