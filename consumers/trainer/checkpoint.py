"""Trainer checkpoints: one safetensors file per checkpointed global step, written atomically.

`<run_dir>/checkpoints/step-00000007.safetensors` holds
  model/<name>         the policy weights (tied tensors once)
  optim/<i>/<state>    AdamW state of parameter i (step, exp_avg, exp_avg_sq)
  rng/torch, rng/cuda/<d>, rng/numpy, rng/python   RNG states
  meta/payload         uint8: msgpack (schemas.encode_payload) of the metadata: meta_version,
                       global_step, optimizer param_groups, RNG scalars, and the trainer loop's
                       param_version, steps (StepLedger.to_plain of the steps it covers), committed
                       (the ledgers of recent earlier commits, reconcile.CommitHistory) and counters
No pickle anywhere: torch.save/torch.load are not used. The newest `keep_last` files are kept.

Data parallel: rank 0 writes the one file (weights and optimizer once: replicated under DDP, gathered
whole under FSDP); the metadata's `ranks` lists every rank's RNG state (`rng_plain`), and its `steps` hold
every rank's fates. On resume rank 0 reads the file and broadcasts its bytes (`read_checkpoint` takes
bytes), so other hosts need no shared folder; each rank restores its own RNG when the world size is the
same (the file's rng/* tensors are rank 0's).

The metadata layout is versioned like the wire schema (schemas/legacy.py): a file written by an older
version is upgraded one version at a time on load, so a trainer resumes from any older checkpoint.
  1  (no meta_version key) a fate is {sample_id, entry_id, fate, staleness, param_version}
  2  a fate is a schemas.text_entries.Fate, as on the `fates` stream (entry_id renamed source_id,
     global_step added)
  3  a step's ack_ids are [stream, entry id] pairs (one rollouts stream per producer); the bare ids of
     version 2 were entries of the shared `rollouts` stream, which this version no longer reads: dropped
  4  `committed`: rank 0's recent commits before this checkpoint's own (reconcile.CommitHistory.to_plain: each
     {at, steps}), committed again on resume if Redis lacks them (a failover lost them); older: none kept.
     A step's `updates`: its local_update events ([metrics entry id, event]); older: none (read as [])
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file

from consumers.trainer.distributed import DataParallel
from consumers.trainer.learner import Learner
from consumers.trainer.roles import RankRoles
from rollstream.model import BasePolicy
from rollstream.runtime.files import atomic_write, private_dir
from rollstream.weights.checkpoints import checkpoint_path, list_checkpoints
from rollstream.weights.tensors import load_tensors_into, unique_state
from schemas import decode_payload, encode_payload

_META = "meta/payload"
#: Layout version of the metadata this code writes (see the module docstring).
META_VERSION = 4
_VERSION_KEY = "meta_version"


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


def rng_plain() -> dict[str, Any]:
    """This process's torch/CUDA/numpy/python RNG states as plain msgpack-able values (a rank's entry in
    the checkpoint metadata's `ranks`)."""
    tensors, scalars = _rng_tensors()
    return {
        "torch": tensors["rng/torch"].numpy().tobytes(),
        "cuda": [
            tensors[k].numpy().tobytes() for k in sorted(k for k in tensors if k.startswith("rng/cuda/"))
        ],
        "numpy": tensors["rng/numpy"].numpy().tobytes(),
        "python": tensors["rng/python"].numpy().tobytes(),
        "scalars": scalars,
    }


def restore_rng_plain(state: dict[str, Any]) -> None:
    """Set every RNG back to a `rng_plain` state."""
    tensors = {
        "rng/torch": torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8),
        "rng/numpy": torch.frombuffer(bytearray(state["numpy"]), dtype=torch.int64),
        "rng/python": torch.frombuffer(bytearray(state["python"]), dtype=torch.int64),
    }
    for d, raw in enumerate(state.get("cuda", [])):
        tensors[f"rng/cuda/{d}"] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    _restore_rng(tensors, dict(state["scalars"]))


# -- optimizer -------------------------------------------------------------------------------------


def _optim_tensors(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An optimizer state_dict's per-parameter state as tensors and its param_groups (plain values)."""
    tensors: dict[str, torch.Tensor] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"optim/{idx}/{name}"] = t.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def _optim_order(item: tuple[str, Any]) -> tuple[int, str]:
    """Sort key of an `optim/<i>/<name>` tensor: by parameter index, then name (others first)."""
    parts = item[0].split("/", 2)
    return (int(parts[1]), parts[2]) if parts[0] == "optim" and len(parts) == 3 else (-1, item[0])


def _optim_state(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Rebuild an optimizer state_dict from saved tensors and param_groups."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in sorted(tensors.items(), key=_optim_order):  # safetensors' key order is arbitrary
        if key.startswith("optim/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = t
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


# -- metadata versions -----------------------------------------------------------------------------


def _meta_1_to_2(meta: dict[str, Any]) -> dict[str, Any]:
    """Fates become schemas.text_entries.Fate: entry_id -> source_id, plus their step's global_step."""
    for step in meta.get("steps", []):
        for fate in step.get("fates", []):
            fate["source_id"] = fate.pop("entry_id")
            fate["global_step"] = step["global_step"]
    return meta


def _meta_2_to_3(meta: dict[str, Any]) -> dict[str, Any]:
    """Ack ids become [stream, id] pairs: the bare ids of the shared `rollouts` stream are dropped (no
    per-producer stream holds them)."""
    for step in meta.get("steps", []):
        step["ack_ids"] = [ref for ref in step.get("ack_ids", []) if not isinstance(ref, str)]
    return meta


def _meta_3_to_4(meta: dict[str, Any]) -> dict[str, Any]:
    """No earlier commits were kept: `committed` is empty (only the checkpoint's own steps can be redone)."""
    meta.setdefault("committed", [])
    return meta


#: version -> function turning metadata of that version into the next one.
_META_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _meta_1_to_2,
    2: _meta_2_to_3,
    3: _meta_3_to_4,
}


def upgrade_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint metadata of any older layout upgraded to META_VERSION (the version key removed);
    ValueError for a layout newer than this code knows."""
    version = meta.pop(_VERSION_KEY, 1)
    if type(version) is not int or version > META_VERSION:
        raise ValueError(
            f"checkpoint metadata version {version!r} is newer than {META_VERSION}: update rollstream"
        )
    while version < META_VERSION:
        meta = _META_UPGRADES[version](meta)
        version += 1
    return meta


# -- save / load -----------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_dir: Path,
    global_step: int,
    policy: BasePolicy,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint of `global_step` durably (rollstream.runtime.files.atomic_write); prune old
    ones."""
    return checkpoint_writer(
        ckpt_dir, global_step, unique_state(policy.module), optimizer.state_dict(), meta, keep_last
    )()


def checkpoint_writer(
    ckpt_dir: Path,
    global_step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int = 2,
) -> Callable[[], Path]:
    """The checkpoint of `global_step` from the weights (a state dict, tied tensors once) and an optimizer
    state_dict (index-keyed, as torch.optim.Optimizer.state_dict gives it), what a data-parallel rank 0 writes
    for every rank, in two halves: this call captures the meta (encoded now), the RNG states and the tensor
    references; the function it returns writes the file durably (atomic_write), prunes old ones and returns
    its path. It may run on another thread while the caller goes on, provided nothing changes the tensors
    until it returns."""
    private_dir(ckpt_dir)
    tensors = {f"model/{k}": v for k, v in weights.items()}  # no copy of the weights
    opt_tensors, groups = _optim_tensors(optimizer_state)
    rng_tensors, rng_scalars = _rng_tensors()
    tensors.update(opt_tensors)
    tensors.update(rng_tensors)
    payload = encode_payload({_VERSION_KEY: META_VERSION, "global_step": global_step, "param_groups": groups,
                              "rng": rng_scalars, **meta})
    tensors[_META] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    path = checkpoint_path(ckpt_dir, global_step)

    def write() -> Path:
        atomic_write(
            path, lambda tmp: save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        )
        for _, old in list_checkpoints(ckpt_dir)[:-keep_last]:
            old.unlink(missing_ok=True)
        return path

    return write


def load_checkpoint(path: Path, policy: BasePolicy, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG states from `path`; returns its metadata dict, upgraded
    to META_VERSION."""
    weights, optimizer_state, meta = read_checkpoint(load_file(str(path)))
    load_tensors_into(policy.module, weights)
    optimizer.load_state_dict(optimizer_state)
    return meta


def read_checkpoint(
    source: bytes | dict[str, torch.Tensor], rank: int = 0, world_size: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights as a state dict, optimizer state_dict, metadata upgraded to META_VERSION) of a
    checkpoint given as its file's bytes (or loaded tensors), after restoring this rank's RNG states:
    its own from the metadata's `ranks` when the world size matches, else the file's (rank 0's)."""
    tensors = st_load(source) if isinstance(source, bytes | bytearray) else dict(source)
    meta: dict[str, Any] = upgrade_meta(decode_payload(tensors.pop(_META).numpy().tobytes()))
    model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    optimizer_state = _optim_state(tensors, list(meta.pop("param_groups")))
    rng = meta.pop("rng")
    own = RankRoles(rank, world_size).own_entry(meta.get("ranks") or [])
    if own is not None:
        restore_rng_plain(own["rng"])
    else:
        _restore_rng(tensors, rng)
    return model, optimizer_state, meta


def restore_newest(
    ckpt_dir: Path, dp: DataParallel, learner: Learner, counters: dict[str, int]
) -> dict[str, Any] | None:
    """Restore the newest checkpoint into `learner` (and this rank's RNG) and this rank's `counters`; its
    metadata, None when there is none. Rank 0 reads the file and broadcasts its bytes (other hosts need no
    shared folder)."""
    found = dp.roles.only_main(list_checkpoints, ckpt_dir) or []
    data = dp.broadcast_bytes(found[-1][1].read_bytes() if found else None)
    if not data:
        return None
    weights, optimizer_state, meta = read_checkpoint(data, dp.rank, dp.world_size)
    learner.load_checkpoint_state(weights, optimizer_state)
    counters.update({k: int(v) for k, v in rank_counters(meta, dp).items() if k in counters})
    return meta


def rank_counters(meta: dict[str, Any], dp: DataParallel) -> dict[str, Any]:
    """This rank's counters in a checkpoint's metadata: its own when the checkpoint has one entry per rank
    of this world; otherwise (another world size, or a world of one) the totals go to rank 0."""
    own = dp.roles.own_entry(meta.get("ranks") or [])
    if own is not None:
        return dict(own.get("counters", {}))
    return dp.roles.only_main(lambda: dict(meta.get("counters", {}))) or {}
