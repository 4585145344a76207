"""`run:` (where the run lives) and `aggregator:` (the metrics consumer)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from rollstream.config.base import Section

#: A Sentinel address: host:port (an IPv6 host in brackets).
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


class RedisConfig(Section):
    """Replication and failover of the run's Redis (`run.redis`): replicas, Sentinel, WAIT."""

    replicas: int = Field(
        0,
        ge=0,
        le=5,
        description="Embedded redis only: replicas started beside the primary, with 3 Sentinels (0 = one "
        "server, no Sentinel)",
    )
    sentinels: list[str] = Field(
        default_factory=list,
        description="host:port of an external deployment's Sentinels; clients find the primary through them",
    )
    master_name: str = Field(
        "", description="Sentinel's name of the primary (empty: rollstream-<run name>)",
        pattern=r"^[A-Za-z0-9_.-]{0,64}$",
    )
    quorum: int = Field(2, ge=1, description="Embedded Sentinels that must agree the primary is down (of 3)")
    down_after_ms: int = Field(
        5000, ge=100, description="Embedded Sentinels: a primary silent this long is considered down"
    )
    failover_timeout_ms: int = Field(
        60000, ge=1000, description="Embedded Sentinels: failover-timeout (retry and reconfigure pacing)"
    )
    wait_replicas: int | None = Field(
        None,
        ge=0,
        description="Replicas that must acknowledge a publish or a trainer commit (WAIT) before it counts; "
        "null = 1 with replicas or sentinels, else 0",
    )
    wait_timeout_ms: int = Field(
        1000, ge=1, description="How long a publish or commit waits for its WAIT before it is retried"
    )
    replica_lag_bound_s: float = Field(
        10.0, gt=0, description="`status --check` fails when no replica acknowledged within this long"
    )

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        for item in value:
            m = _HOST_PORT.match(item)
            if m is None or not 0 < int(m.group(2)) < 65536:
                raise ValueError(f"run.redis.sentinels entry {item!r} must be host:port (port 1-65535)")
        return value

    @model_validator(mode="after")
    def _embedded_or_external(self) -> RedisConfig:
        if self.replicas and self.sentinels:
            raise ValueError(
                f"run.redis.replicas={self.replicas} starts embedded Sentinels; run.redis.sentinels="
                f"{self.sentinels!r} names external ones: set one of them"
            )
        if self.quorum > 3:
            raise ValueError(f"run.redis.quorum={self.quorum} must be at most 3 (the embedded Sentinels)")
        if self.wait_replicas is not None and self.replicas and self.wait_replicas > self.replicas:
            raise ValueError(
                f"run.redis.wait_replicas={self.wait_replicas} exceeds run.redis.replicas={self.replicas}: "
                "no write could ever be acknowledged"
            )
        return self

    @property
    def replicated(self) -> bool:
        """True when the run's Redis has replicas behind Sentinel (embedded replicas or external ones)."""
        return bool(self.replicas or self.sentinels)

    def acks_needed(self) -> int:
        """Replicas a write must reach (WAIT) before it counts: wait_replicas, else 1 when replicated."""
        if self.wait_replicas is not None:
            return self.wait_replicas
        return 1 if self.replicated else 0

    def master_of(self, run_name: str) -> str:
        """The Sentinel master name of the run's primary."""
        return self.master_name or f"rollstream-{run_name}"


class RunConfig(Section):
    """Where the run lives."""

    name: str = Field(
        "demo", description="Run name; every Redis key is rs:{<name>}:…", pattern=r"^[A-Za-z0-9_.-]{1,64}$"
    )
    redis_url: str | None = Field(
        None,
        description="Redis URL (redis://, rediss://, unix://, or redis+cluster://host:port,host:port for a "
        "Redis Cluster: the run lives on the node serving its slot); null = start an embedded redis-server",
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
    redis: RedisConfig = Field(
        default_factory=RedisConfig, description="Replicas, Sentinel failover and WAIT acknowledgements"
    )

    @field_validator("redis_url")
    @classmethod
    def _cluster_url(cls, value: str | None) -> str | None:
        from rollstream.topology.cluster import is_cluster_url, parse_cluster_url

        if value is not None and is_cluster_url(value):
            try:
                parse_cluster_url(value)
            except ValueError as e:
                raise ValueError(f"run.redis_url: {e}") from None
        return value

    @model_validator(mode="after")
    def _sentinels_need_no_url(self) -> RunConfig:
        if self.redis.sentinels and self.redis_url is not None and self.redis_url.startswith("redis+cluster"):
            raise ValueError(
                f"run.redis.sentinels={self.redis.sentinels!r} and run.redis_url={self.redis_url!r}: a Redis "
                "Cluster fails over by itself (no Sentinel); set one of them"
            )
        if self.redis.sentinels and self.redis_url is not None and not self.redis_url.startswith("redis+"):
            raise ValueError(
                f"run.redis.sentinels={self.redis.sentinels!r} and run.redis_url={self.redis_url!r}: with "
                "sentinels the primary is found through them; leave run.redis_url null"
            )
        if self.redis.replicas and self.redis_url is not None:
            raise ValueError(
                f"run.redis.replicas={self.redis.replicas} is for the embedded redis: run.redis_url "
                f"must be null (it is {self.redis_url!r}); for an external one set run.redis.sentinels"
            )
        return self



class AggregatorConfig(Section):
    """The metrics aggregator consumer."""

    incomplete_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Report a global step still incomplete this long after its step_end was due: the trainer "
        "committed it, or began a step past the checkpoint (trainer.save_freq) whose commit carries it",
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

