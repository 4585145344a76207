"""`run:` (where the run lives) and `aggregator:` (the metrics consumer)."""

from __future__ import annotations

from pydantic import Field

from rollstream.config.base import Section


class RunConfig(Section):
    """Where the run lives."""

    name: str = Field(
        "demo", description="Run name; every Redis key is rs:{<name>}:…", pattern=r"^[A-Za-z0-9_.-]{1,64}$"
    )
    redis_url: str | None = Field(
        None, description="Redis URL (redis://, rediss://, unix://); null = start an embedded redis-server"
    )
    password_file: str | None = Field(
        None, description="File holding the Redis password (instead of the URL)"
    )
    dir: str = Field(
        "runs", description="Parent folder of run directories (logs, checkpoints, supervisord config)"
    )
    seed: int = Field(0, description="Seed for prompts, model init and sampling")
    device: str = Field("auto", description="torch device: auto (cuda when present), cpu or cuda[:N]")
    acl: bool = Field(
        True,
        description="Embedded redis only: one ACL user per role (producer, trainer, aggregator, admin), "
                    "default user off",
    )



class AggregatorConfig(Section):
    """The metrics aggregator consumer."""

    incomplete_timeout_s: float = Field(
        120.0, gt=0, description="Report a global step still incomplete after this"
    )
    total_gpus: int = Field(1, ge=1, description="GPUs behind perf/throughput")
    jsonl: bool = Field(True, description="Write records to <run dir>/records.jsonl")
    tensorboard: bool = Field(
        True, description="Also write TensorBoard scalars when tensorboard is installed"
    )
    wandb_project: str | None = Field(
        None, description="Also log to this wandb project when wandb is installed"
    )
    max_deliveries: int = Field(
        1000,
        ge=1,
        description="Deliveries before a metrics entry goes to dead (high: a restart re-delivers "
        "kept-pending entries)",
    )

