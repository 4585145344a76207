"""`trainer:`: the trainer consumer (how long, checkpoints, validation, ranks)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollstream.config.base import Section


class TrainerConfig(Section):
    """The trainer consumer."""

    max_off_policy_threshold: int = Field(
        2, description="Drop samples with staleness (global_step - param_version) above this"
    )
    max_off_policy_strategy: Literal["drop", "train"] = Field(
        "drop",
        description="Samples over the threshold: drop (recorded) or train them, weighted by "
        "algorithm.rollout_correction",
    )
    num_warmup_batches: int = Field(
        1, ge=0, description="Mini-batches of samples the trainer waits for before its first update (as verl)"
    )
    total_training_steps: int = Field(
        50,
        ge=1,
        description="Stop after this many global steps (of async_training.trigger_parameter_sync_step local "
        "updates each)",
    )
    save_freq: int = Field(
        1, ge=1, description="Checkpoint every this many global steps (rollouts acked only after)"
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="Newest checkpoints kept on disk; `rollstream replay trainer --steps A-B` needs step "
        "A-1's",
    )
    test_freq: int = Field(5, ge=0, description="Validate every this many versions (0 = never)")
    heartbeat_stall_s: float = Field(
        120.0,
        gt=0,
        description="`rollstream status` marks the trainer stalled when its heartbeat is older (`--check` "
        "exits 1)",
    )
    sync_mode: bool = Field(
        False,
        description="Collect the full global batch before training, as synchronous RL does (benchmarks)",
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="torch intra-op threads of each trainer process (0 = torch default); 1 avoids "
        "oversubscribed cores",
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Data-parallel trainer ranks per host; > 1 (or nnodes > 1) launches the trainer under "
        "torchrun",
    )
    nnodes: int = Field(
        1, ge=1, description="Hosts running trainer ranks (one torchrun per host, same rendezvous)"
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="torchrun rendezvous host:port (c10d) shared by every trainer host; null = standalone on "
        "one host",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="torchrun restarts of the whole rank group after a rank fails, before torchrun itself "
        "exits",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Data parallel: ddp = replicated weights, averaged gradients; fsdp = fully_shard (CUDA "
        "only)",
    )

    @model_validator(mode="after")
    def _threshold(self) -> TrainerConfig:
        if self.max_off_policy_threshold < 1:
            raise ValueError(
                f"max_off_policy_threshold={self.max_off_policy_threshold} must be >= 1 (1 = on-policy only)"
            )
        return self

    @property
    def world_size(self) -> int:
        """Trainer ranks in all: nnodes * nproc_per_node."""
        return self.nnodes * self.nproc_per_node

    @property
    def distributed(self) -> bool:
        """True when the trainer runs as torchrun ranks (more than one rank, or fsdp, which needs a process
        group)."""
        return self.world_size > 1 or self.strategy == "fsdp"

