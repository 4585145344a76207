"""Trainer checkpoints: one safetensors file per checkpointed global step, written atomically.

`<run_dir>/checkpoints/step-00000007.safetensors` holds
  model/<name>         the policy weights (tied tensors once)
  optim/<i>/<state>    AdamW state of parameter i (step, exp_avg, exp_avg_sq)
  rng/torch, rng/cuda/<d>, rng/numpy, rng/python   RNG states
  meta/payload         uint8: msgpack (schemas.encode_payload) of the metadata: global_step,
                       param_version, optimizer param_groups, RNG scalars, and the caller's ledger
No pickle anywhere: torch.save/torch.load are not used. The newest `keep_last` files are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rollstream.model import BasePolicy
from rollstream.model.base import load_state_dict_checked
from rollstream.weights_file import unique_state
from schemas import decode_payload, encode_payload

_NAME = re.compile(r"^step-(\d{8})\.safetensors$")
_META = "meta/payload"


def checkpoint_path(ckpt_dir: Path, global_step: int) -> Path:
    """File of the checkpoint taken after `global_step`."""
    return ckpt_dir / f"step-{global_step:08d}.safetensors"


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(global_step, path) of every complete checkpoint, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


# -- RNG -------------------------------------------------------------------------------------------


def _rng_tensors() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Torch/CUDA/numpy/python RNG states as tensors plus their scalar parts."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for d, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{d}"] = state
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    py_version, py_state, py_gauss = random.getstate()
    tensors["rng/python"] = torch.tensor(py_state, dtype=torch.int64)
    scalars = {
        "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "python": [py_version, py_gauss],
    }
    return tensors, scalars


def _restore_rng(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Set every RNG back to the saved state (CUDA only when the same devices exist)."""
    torch.set_rng_state(tensors["rng/torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng/cuda/"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    np_name, np_pos, np_has_gauss, np_gauss = scalars["numpy"]
    np_keys = tensors["rng/numpy"].numpy().astype(np.uint32)
    np.random.set_state((np_name, np_keys, int(np_pos), int(np_has_gauss), float(np_gauss)))
    py_version, py_gauss = scalars["python"]
    random.setstate((int(py_version), tuple(int(x) for x in tensors["rng/python"].tolist()), py_gauss))


# -- optimizer -------------------------------------------------------------------------------------


def _optim_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Optimizer per-parameter state as tensors and its param_groups (plain values)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"optim/{idx}/{name}"] = t.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def _optim_state(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Rebuild an optimizer state_dict from saved tensors and param_groups."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("optim/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = t
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


# -- save / load -----------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_dir: Path,
    global_step: int,
    policy: BasePolicy,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint of `global_step` durably (temp file, fsync, os.replace); prune old ones."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model/{k}": v for k, v in unique_state(policy.module).items()}  # no copy of the weights
    opt_tensors, groups = _optim_tensors(optimizer)
    rng_tensors, rng_scalars = _rng_tensors()
    tensors.update(opt_tensors)
    tensors.update(rng_tensors)
    payload = encode_payload({"global_step": global_step, "param_groups": groups, "rng": rng_scalars, **meta})
    tensors[_META] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    path = checkpoint_path(ckpt_dir, global_step)
    fd, tmp = tempfile.mkstemp(dir=ckpt_dir, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(ckpt_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for _, old in list_checkpoints(ckpt_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path, policy: BasePolicy, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG states from `path`; returns its metadata dict."""
    tensors = load_file(str(path))
    meta: dict[str, Any] = decode_payload(tensors.pop(_META).numpy().tobytes())
    model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    load_state_dict_checked(policy.module, model)
    optimizer.load_state_dict(_optim_state(tensors, list(meta.pop("param_groups"))))
    _restore_rng(tensors, meta.pop("rng"))
    return meta


def load_latest_checkpoint(
    ckpt_dir: Path, policy: BasePolicy, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Restore the newest checkpoint in `ckpt_dir` (see load_checkpoint); None when there is none."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        return None
    return load_checkpoint(found[-1][1], policy, optimizer)


def copy_checkpoint(src_dir: Path, dst_dir: Path, global_step: int) -> Path:
    """Copy the checkpoint of `global_step` into another run's checkpoint folder (for a trainer replay);
    FileNotFoundError names the steps `src_dir` still has."""
    src = checkpoint_path(src_dir, global_step)
    if not src.is_file():
        have = [g for g, _ in list_checkpoints(src_dir)]
        raise FileNotFoundError(f"no checkpoint of step {global_step} in {src_dir} (have {have}; "
                                "raise trainer.keep_checkpoints to keep older ones)")
    dst_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    dst = checkpoint_path(dst_dir, global_step)
    shutil.copy2(src, dst)  # keeps the file mode
    return dst
