"""The whole run (pipeline.yaml): its sections and the rules that span them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from rollstream.config.actor import ActorConfig
from rollstream.config.algorithm import AlgorithmConfig
from rollstream.config.async_training import AsyncTrainingConfig
from rollstream.config.base import Section
from rollstream.config.bench import BenchConfig
from rollstream.config.bus import BusConfig
from rollstream.config.data import DataConfig
from rollstream.config.deprecated import translate
from rollstream.config.model import ModelConfig
from rollstream.config.rollout import RolloutConfig
from rollstream.config.run import AggregatorConfig, RunConfig
from rollstream.config.trainer import TrainerConfig

#: model.dtype values whose weights can be low precision (what actor.optim.master_weights is for)
LOW_PRECISION = ("bfloat16", "float16", "fast")


class PipelineConfig(Section):
    """The whole run (pipeline.yaml)."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and Redis")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts and batch sizes")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy network")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Producers")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Advantages, rollout correction, dynamic sampling"
    )
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy update and its optimizer")
    async_training: AsyncTrainingConfig = Field(
        default_factory=AsyncTrainingConfig, description="Run-ahead, weight publishes, mid-trajectory swaps"
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Trainer consumer")
    bus: BusConfig = Field(default_factory=BusConfig, description="Redis Streams transport")
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig, description="Metrics aggregator")
    bench: BenchConfig = Field(
        default_factory=BenchConfig, description="Benchmarks only (`rollstream bench`), not a run setting"
    )

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        return translate(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _batch_sizes(self) -> PipelineConfig:
        tbs, pss, mbs = (
            self.data.train_batch_size,
            self.async_training.trigger_parameter_sync_step,
            self.actor.ppo_mini_batch_size,
        )
        if tbs != pss * mbs:
            raise ValueError(
                f"data.train_batch_size={tbs} must equal "
                f"async_training.trigger_parameter_sync_step={pss} "
                f"* actor.ppo_mini_batch_size={mbs} (= {pss * mbs})"
            )
        world, nodes, procs = self.trainer.world_size, self.trainer.nnodes, self.trainer.nproc_per_node
        if mbs % world:
            raise ValueError(
                f"actor.ppo_mini_batch_size={mbs} must be divisible by the trainer world size "
                f"trainer.nnodes={nodes} * trainer.nproc_per_node={procs} (= {world}): each rank trains "
                "ppo_mini_batch_size / world_size samples per local update"
            )
        if nodes > 1 and not self.trainer.rdzv_endpoint:
            raise ValueError(
                f"trainer.nnodes={nodes} needs trainer.rdzv_endpoint (host:port every trainer host reaches)"
            )
        if self.rollout.name == "vllm" and self.model.backend != "hf":
            raise ValueError(
                f"rollout.name=vllm needs model.backend=hf (model.backend={self.model.backend!r}: vLLM "
                "loads a HF checkpoint)"
            )
        if self.rollout.top_k == 0:
            raise ValueError("rollout.top_k=0: -1 samples from every token, k >= 1 from the k most likely")
        if self.rollout.name == "vllm" and self.rollout.top_k != -1:
            raise ValueError(
                f"rollout.top_k={self.rollout.top_k} with rollout.name=vllm: vLLM's log-probs are then those "
                "of the top-k-renormalised distribution, not log_softmax(logits / temperature) the trainer "
                "recomputes; use top_k=-1"
            )
        if self.rollout.name == "vllm" and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} with rollout.name=vllm: vLLM's log-probs are then "
                "those of the "
                "top-p-renormalised distribution, not log_softmax(logits / temperature) the trainer "
                "recomputes; use top_p=1"
            )
        if self.data.task.startswith("rg:") and self.model.backend != "hf":
            raise ValueError(
                f"data.task={self.data.task} needs model.backend=hf (the tiny GPT's character vocabulary "
                "cannot spell reasoning-gym questions)"
            )
        if self.actor.optim.master_weights and (self.model.dtype not in LOW_PRECISION or world > 1):
            raise ValueError(
                f"actor.optim.master_weights=true needs model.dtype bfloat16, float16 or fast (got "
                f"{self.model.dtype!r}) and one trainer process (world size {world})"
            )
        if self.actor.zero_advantage_rows != "train" and (why := self._rows_need_training(world)):
            raise ValueError(f"actor.zero_advantage_rows={self.actor.zero_advantage_rows} needs {why}")
        if self.actor.gradient_checkpointing and self.model.backend != "hf":
            raise ValueError(
                "actor.gradient_checkpointing=true needs model.backend=hf "
                f"(model.backend={self.model.backend!r} has none)"
            )
        wait_ms = self.run.redis.wait_timeout_ms
        if self.run.redis.acks_needed() and wait_ms >= self.bus.socket_timeout_s * 1000:
            raise ValueError(
                f"run.redis.wait_timeout_ms={wait_ms} must be below bus.socket_timeout_s="
                f"{self.bus.socket_timeout_s} (a WAIT past the socket timeout reads as a lost connection)"
            )
        return self

    @model_validator(mode="after")
    def _tool(self) -> PipelineConfig:
        if self.data.tool != "none" and not self.rollout.multi_turn.enable:
            raise ValueError(
                f"data.tool={self.data.tool} needs rollout.multi_turn.enable=true (the multi-turn agent runs "
                "the tool between the model's turns)"
            )
        return self

    @model_validator(mode="after")
    def _continuous(self) -> PipelineConfig:
        if not self.rollout.continuous:
            return self
        if self.rollout.name == "vllm":
            raise ValueError(
                "rollout.continuous=true is the built-in engine's continuous generation; with "
                "rollout.name=vllm set rollout.vllm.continuous (default true) instead"
            )
        if self.bench.latency_model.enable:
            raise ValueError(
                "rollout.continuous=true with bench.latency_model.enable: the latency model replaces the "
                "engine's generation per dispatch, so there is no running batch to admit rows into"
            )
        return self

    @model_validator(mode="after")
    def _lora(self) -> PipelineConfig:
        rank = self.model.lora_rank
        if not rank:
            return self
        if self.trainer.strategy == "fsdp":
            raise ValueError(
                f"model.lora_rank={rank} with trainer.strategy=fsdp: LoRA is built for one process or ddp "
                "(fsdp would shard frozen and trainable weights together); use strategy ddp"
            )
        if self.model.init_from:
            raise ValueError(
                f"model.lora_rank={rank} with model.init_from={self.model.init_from!r}: producers build the "
                "base weights themselves from the model; fold the warm start into model.hf_path instead"
            )
        return self

    def _rows_need_training(self, world: int) -> str | None:
        """Why a zero-advantage row can have a gradient in this config (so actor.zero_advantage_rows must be
        train), or None: what in the loss or the correction sees every row."""
        rc = self.algorithm.rollout_correction
        if self.algorithm.adv_estimator != "grpo":
            return f"algorithm.adv_estimator=grpo (got {self.algorithm.adv_estimator!r}: per-token credit)"
        if self.actor.entropy_coeff > 0 or self.actor.kl_loss_coef > 0:
            return (f"actor.entropy_coeff=0 and actor.kl_loss_coef=0 (got {self.actor.entropy_coeff} and "
                    f"{self.actor.kl_loss_coef}: every row has an entropy or KL gradient)")
        if not rc.bypass_mode or rc.rollout_rs is not None:
            return (f"algorithm.rollout_correction.bypass_mode=true without rollout_rs (got bypass_mode="
                    f"{rc.bypass_mode}, rollout_rs={rc.rollout_rs!r}: the correction sees every row)")
        if world > 1:
            return f"one trainer process (world size {world}: every rank must run the same backwards)"
        return None

    @property
    def max_outstanding(self) -> int:
        """Pacing bound: train_batch_size * (1 + staleness_threshold) prompts dispatched but not consumed."""
        return int(self.data.train_batch_size * (1 + self.async_training.staleness_threshold))

    def run_dir(self) -> Path:
        """The run's own folder: <run.dir>/<run.name>."""
        return Path(self.run.dir) / self.run.name

