"""Data-parallel trainer ranks on torch.distributed: process group, model wrapping, small collectives.

`torchrun` (here `python -m consumers.trainer.torchrun`, see plan.py) starts `nproc_per_node` ranks per
host and sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `DataParallel.from_env` reads
them and joins the process group: gloo on CPU, NCCL on CUDA (each rank on `cuda:<LOCAL_RANK>`). Without
torchrun (WORLD_SIZE unset or 1) it is a world of one: no process group, every collective is the identity,
so the single-process trainer runs the same code.

Strategies (`trainer.strategy`):
  ddp   DistributedDataParallel: replicated weights, gradients averaged (all-reduce) during backward
  fsdp  torch.distributed.fsdp.fully_shard (FSDP2) on each block of every nn.ModuleList, then the root:
        weights, gradients and optimizer state sharded over the ranks (a model larger than one GPU).
        CUDA only; refused on CPU with a message naming the field.

Collectives of plain data (ledgers, sample ids, RNG states) travel as msgpack bytes in uint8 tensors
(schemas.encode_payload: no pickle, unlike torch's *_object collectives). Each rank reads the rollouts
stream as its own consumer, `consumer_name(base, rank)`, stable across restarts, so a restarted rank
re-reads its own pending entries.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from consumers.trainer.roles import RankInfo, RankRoles, consumer_name, rank_info
from rollstream.weights.tensors import unique_tensors
from schemas import decode_payload, encode_payload

__all__ = [
    "DataParallel",
    "DistributedError",
    "RankInfo",
    "check_strategy",
    "consumer_name",
    "rank_info",
    "watch_parent",
]

log = logging.getLogger(__name__)

#: Seconds a collective may wait for the other ranks before it fails (the trainer keeps its collectives
#: short: ranks wait for data in rounds of one poll each, so this only bounds a hung or vanished rank).
COLLECTIVE_TIMEOUT_S = 1800.0
FSDP_NEEDS_CUDA = (
    "trainer.strategy=fsdp needs CUDA devices (torch.distributed.fsdp.fully_shard shards over NCCL); "
    "use trainer.strategy=ddp on CPU"
)


class DistributedError(RuntimeError):
    """A data-parallel setup that cannot work (message names the setting)."""


def rank_device(device: torch.device, info: RankInfo) -> torch.device:
    """The device of this rank: `cuda:<local_rank>` when the run's device is CUDA without an index."""
    if device.type == "cuda" and device.index is None and info.world_size > 1:
        return torch.device("cuda", info.local_rank)
    return device


def backend_for(device: torch.device) -> str:
    """The process-group backend for a device: nccl on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_strategy(strategy: str, device: torch.device) -> None:
    """Raise DistributedError when `strategy` cannot run on `device` (fsdp off CUDA)."""
    if strategy == "fsdp" and device.type != "cuda":
        raise DistributedError(FSDP_NEEDS_CUDA)
    if strategy not in ("ddp", "fsdp"):
        raise DistributedError(f"trainer.strategy={strategy!r}: expected ddp or fsdp")


def watch_parent(stop: threading.Event, period_s: float = 1.0) -> threading.Thread:
    """Set `stop` when this process's parent (torchrun) goes away: its workers run in sessions of their
    own, so a killed torchrun would otherwise leave them behind. Returns the daemon thread."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(period_s):
            if os.getppid() != parent:
                log.error("torchrun (pid %d) is gone: stopping this rank", parent)
                stop.set()
                return

    thread = threading.Thread(target=watch, name="watch-torchrun", daemon=True)
    thread.start()
    return thread


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun, a client of torchrun's own store with keys prefixed by the restart attempt; None
    without torchrun's store (plain env:// init then). torch 2.13 keeps that store across restarts of the
    group without the per-attempt prefix its env:// init assumes, so a restarted group's gloo read the dead
    group's addresses and never connected (tests/test_trainer_dp_run.py kills ranks to check this)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    world = int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"rollstream/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def _shard(module: nn.Module) -> None:
    """fully_shard every block of every nn.ModuleList, then the root (FSDP2's usual wrapping)."""
    from torch.distributed.fsdp import fully_shard

    for child in list(module.modules()):
        if isinstance(child, nn.ModuleList):
            for block in child:
                fully_shard(block)
    fully_shard(module)


class DataParallel:
    """One trainer rank's view of the data-parallel group: wrapping and the collectives the loop uses."""

    def __init__(
        self, info: RankInfo, device: torch.device, strategy: str = "ddp", fsdp_on_cpu: bool = False
    ) -> None:
        """Describe a rank; `from_env` also joins the process group (collectives need one when world > 1).
        `fsdp_on_cpu` lifts the CUDA-only rule of fsdp (tests run the fsdp code on gloo with it)."""
        if not fsdp_on_cpu:
            check_strategy(strategy, device)
        self.info, self.device, self.strategy = info, device, strategy
        self.roles = RankRoles.of(info, strategy)  # rank 0 alone, or every rank together
        self.collective_s = 0.0  # seconds spent in this object's collectives (not DDP's gradient all-reduce)
        self._ddp: list[nn.Module] = []  # the DDP wrappers made by wrap(), released by close()

    @classmethod
    def from_env(
        cls,
        device: torch.device,
        strategy: str = "ddp",
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        fsdp_on_cpu: bool = False,
    ) -> DataParallel:
        """Read torchrun's environment and, in a world of more than one, join the process group."""
        info = rank_info()
        device = rank_device(device, info)
        dp = cls(info, device, strategy, fsdp_on_cpu)
        if (info.world_size > 1 or strategy == "fsdp") and not dist.is_initialized():
            if "MASTER_ADDR" not in os.environ:
                raise DistributedError(
                    f"trainer.strategy={strategy} with {info.world_size} rank(s) runs under torchrun "
                    "(`rollstream run` starts it so: see rollstream/ops/plan.py trainer_argv)"
                )
            if device.type == "cuda":
                torch.cuda.set_device(device)
            timeout = timedelta(seconds=timeout_s)
            store = attempt_store(timeout)
            if store is None:
                dist.init_process_group(backend_for(device), timeout=timeout)
            else:
                dist.init_process_group(
                    backend_for(device),
                    store=store,
                    rank=info.rank,
                    world_size=info.world_size,
                    timeout=timeout,
                )
            log.info(
                "rank %d of %d joined the %s group on %s",
                info.rank,
                info.world_size,
                backend_for(device),
                device,
            )
        return dp

    # -- who -----------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank (0 in a world of one)."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.info.world_size

    # -- models --------------------------------------------------------------------------------------

    def wrap(self, module: nn.Module) -> nn.Module:
        """The module to run training forwards through: DDP around it (ddp, world > 1), the module itself
        sharded in place (fsdp), or the module unchanged (a world of one under ddp)."""
        if self.strategy == "fsdp":
            _shard(module)
            return module
        if not self.roles.agreed:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=ids)
        self._ddp.append(wrapped)
        return wrapped

    def shard_frozen(self, module: nn.Module) -> None:
        """Shard a frozen copy (proximal / reference policy) like the trained one under fsdp; else nothing."""
        if self.strategy == "fsdp":
            _shard(module)

    @contextmanager
    def forward_through(self, policy: Any, wrapped: nn.Module) -> Iterator[None]:
        """Run `policy`'s forward methods through `wrapped` (DDP's gradient hooks live on the wrapper)."""
        inner = policy.module
        if wrapped is inner:
            yield
            return
        policy.module = wrapped
        try:
            yield
        finally:
            policy.module = inner

    def accumulating(self, wrapped: nn.Module, last: bool) -> AbstractContextManager[Any]:
        """Around the forward and backward of one micro-batch: DDP's no_sync unless it is the last before an
        optimizer step (gradients accumulate locally and are all-reduced once a step); nothing otherwise."""
        from torch.nn.parallel import DistributedDataParallel

        if last or not isinstance(wrapped, DistributedDataParallel):
            return nullcontext()
        return wrapped.no_sync()

    def fused_adamw(self, fused: bool | None) -> bool:
        """AdamW's `fused` (actor.optim.fused): the setting when given, else fused unless sharded (fsdp)."""
        return not self.roles.sharded if fused is None else fused

    def whole_weights(
        self, module: nn.Module, own: Callable[[], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The module's weights, tied tensors once: `own()` (the module's own tensors) unless sharded; under
        fsdp gathered whole on the CPU, a collective (every rank calls it; rank 0 gets them, others {})."""
        if not self.roles.sharded:
            return own()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = get_model_state_dict(module, options=opts)
        return unique_tensors(state) if self.roles.main else {}

    def full_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's whole state_dict, index-keyed as torch.optim.Optimizer.state_dict gives it: a
        collective under fsdp (rank 0 gets it, the others {}), the optimizer's own otherwise."""
        if not self.roles.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd: Any = get_optimizer_state_dict(module, optimizer, options=opts)
        if not osd:
            return {}
        index = {name: i for i, (name, _) in enumerate(module.named_parameters())}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
        return {"state": {index[n]: st for n, st in osd["state"].items()}, "param_groups": groups}

    def load_full_state(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        weights: dict[str, torch.Tensor],
        optim_state: dict[str, Any],
        own: Callable[[], None],
    ) -> None:
        """Load whole weights and an index-keyed optimizer state_dict read from a checkpoint (every rank holds
        both): by `own()` unless sharded; under fsdp scattered into the module's and optimizer's shards (a
        collective)."""
        if not self.roles.sharded:
            return own()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # every rank must walk the tensors in one order (each is a scatter): the module's, not the file's
        names = [name for name, _ in module.named_parameters()]
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(
            module, {k: weights[k] for k in module.state_dict() if k in weights}, options=opts
        )
        osd: Any = {
            "state": {
                names[int(i)]: dict(sorted(st.items())) for i, st in sorted(optim_state["state"].items())
            },
            "param_groups": [
                {**g, "params": [names[int(i)] for i in g["params"]]} for g in optim_state["param_groups"]
            ],
        }
        set_optimizer_state_dict(module, optimizer, osd, options=opts)

    # -- collectives ---------------------------------------------------------------------------------

    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device.type == "cuda" else t

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of `values` over the ranks (float64)."""
        if not self.roles.agreed:
            return [float(v) for v in values]
        t0 = time.perf_counter()
        t = self._comm(torch.tensor([float(v) for v in values], dtype=torch.float64))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out = [float(v) for v in t.cpu().tolist()]
        self.collective_s += time.perf_counter() - t0
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order."""
        if not self.roles.agreed:
            return [data]
        t0 = time.perf_counter()
        size = self._comm(torch.tensor([len(data)], dtype=torch.int64))
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(s.item()) for s in sizes]
        buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = self._comm(buf)
        parts = [torch.zeros_like(buf) for _ in range(self.world_size)]
        dist.all_gather(parts, buf)
        out = [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, lengths, strict=True)]
        self.collective_s += time.perf_counter() - t0
        return out

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank `src`'s bytes on every rank (`data` is read on `src` only)."""
        if not self.roles.agreed:
            return data or b""
        t0 = time.perf_counter()
        mine = (data or b"") if self.rank == src else b""
        size = self._comm(torch.tensor([len(mine)], dtype=torch.int64))
        dist.broadcast(size, src)
        n = int(size.item())
        buf = torch.zeros(max(n, 1), dtype=torch.uint8)
        if self.rank == src and n:
            buf[:n] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        buf = self._comm(buf)
        dist.broadcast(buf, src)
        out = buf[:n].cpu().numpy().tobytes()
        self.collective_s += time.perf_counter() - t0
        return out

    def all_gather_plain(self, value: Any) -> list[Any]:
        """Every rank's msgpack-able value (dicts, lists, str, numbers, bytes), in rank order (a world of one:
        its own value)."""
        if not self.roles.agreed:
            return [value]
        return [decode_payload(b) for b in self.all_gather_bytes(encode_payload(value))]

    def broadcast_plain(self, value: Any, src: int = 0) -> Any:
        """Rank `src`'s msgpack-able value on every rank (a world of one: its own value)."""
        if not self.roles.agreed:
            return value
        return decode_payload(self.broadcast_bytes(encode_payload(value) if self.rank == src else None, src))

    def broadcast_if_sharded(self, value: Any) -> Any:
        """Rank 0's msgpack-able `value` on every rank under fsdp, where every rank runs the same decode in
        step (the weights are sharded); `value` itself otherwise (rank 0 alone runs it)."""
        return self.broadcast_plain(value) if self.roles.sharded else value

    def barrier(self) -> None:
        """Wait until every rank gets here (a no-op in a world of one)."""
        if self.roles.agreed:
            self.all_reduce_sum([0.0])  # a tiny collective: gloo and nccl alike, no device_ids needed

    def close(self) -> None:
        """Leave the process group (when this process joined one), once every rank is done: a rank that
        left while rank 0 still committed made gloo abort the process."""
        if dist.is_initialized():
            if self.roles.agreed:
                self.barrier()
            # A DDP reducer still alive when the group goes (or at interpreter exit) aborted about 1 process
            # in
            # 5 with "terminate called without an active exception" (torch 2.13, gloo): free it first.
            for wrapped in self._ddp:
                if hasattr(wrapped, "reducer"):
                    del wrapped.reducer
            self._ddp.clear()
            gc.collect()
            dist.destroy_process_group()
