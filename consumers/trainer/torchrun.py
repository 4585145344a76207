"""`python -m consumers.trainer.torchrun [torchrun options] -m consumers.trainer CONFIG [key=value ...]`:
torchrun (torch.distributed.run, same options), except that a requested stop exits 0.

torchrun forwards SIGTERM/SIGINT to its ranks (each in a session of its own), waits up to
--shutdown-timeout for them, then raises; a stop is how `rollstream stop` ends every run, so here it
exits 0 once the ranks were told to drain: they abandon the step in progress unacked, and every finished
step is committed or covered by a checkpoint. A rank that fails still makes torchrun restart the group
(--max-restarts) and, once the restarts are spent, exit 1 (supervisord then restarts torchrun).
`rollstream run` starts the trainer this way when trainer.nproc_per_node or trainer.nnodes is above 1
(see rollstream/ops/plan.py `trainer_argv`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

log = logging.getLogger(__name__)

#: Signals that mean "stop" (supervisord's stopsignal, Ctrl-C).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with `argv`; 0 when it ends normally or on a stop signal. torchrun's own temp folders
    (`torchelastic_*`, one per restart) and its ranks' temp files go into one private folder (0700, under
    the temp dir) that is removed when torchrun exits, so a stopped run leaves nothing in /tmp."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    with tempfile.TemporaryDirectory(prefix="rollstream-torchrun-") as tmp:
        tempfile.tempdir, os.environ["TMPDIR"] = tmp, tmp  # this process and the ranks it starts
        try:
            torchrun_main(list(argv) if argv is not None else None)
        except SignalException as e:
            if e.sigval not in STOP_SIGNALS:
                raise
            print(f"torchrun: {e.sigval.name}: the ranks were told to stop; exiting 0", file=sys.stderr)
        finally:
            tempfile.tempdir = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
