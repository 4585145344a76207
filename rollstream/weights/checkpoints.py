"""Where a run's trainer checkpoints live: one `step-<global step, 8 digits>.safetensors` file per
checkpointed step in `<run_dir>/checkpoints/`. The trainer writes and restores them
(consumers/trainer/checkpoint.py, which owns the file's contents); this module only names, lists and copies
the files (a trainer replay copies one into the new run), so the runtime needs no trainer code for that."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from rollstream.runtime.files import private_dir

_NAME = re.compile(r"^step-(\d{8})\.safetensors$")


def checkpoint_path(ckpt_dir: Path, global_step: int) -> Path:
    """File of the checkpoint taken after `global_step`."""
    return ckpt_dir / f"step-{global_step:08d}.safetensors"


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(global_step, path) of every complete checkpoint, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def copy_checkpoint(src_dir: Path, dst_dir: Path, global_step: int) -> Path:
    """Copy the checkpoint of `global_step` into another run's checkpoint folder (for a trainer replay);
    FileNotFoundError names the steps `src_dir` still has."""
    src = checkpoint_path(src_dir, global_step)
    if not src.is_file():
        have = [g for g, _ in list_checkpoints(src_dir)]
        raise FileNotFoundError(f"no checkpoint of step {global_step} in {src_dir} (have {have}; "
                                "raise trainer.keep_checkpoints to keep older ones)")
    private_dir(dst_dir)
    dst = checkpoint_path(dst_dir, global_step)
    shutil.copy2(src, dst)  # keeps the file mode
    return dst
