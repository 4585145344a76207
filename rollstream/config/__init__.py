"""The typed model of pipeline.yaml: one pydantic model for the whole run, one module a concept (verl's
section names: `algorithm`, `actor`, `async_training`, `rollout`, `trainer`), overrides as dotted key=value,
old key names read through deprecated.py for one release."""

from rollstream.config.actor import ActorConfig, OptimConfig
from rollstream.config.algorithm import AlgorithmConfig, FilterGroupsConfig, RolloutCorrectionConfig
from rollstream.config.async_training import AsyncTrainingConfig
from rollstream.config.base import ConfigError
from rollstream.config.bench import BenchConfig, LatencyModelConfig
from rollstream.config.bus import BusConfig
from rollstream.config.data import DataConfig, ReverseTaskConfig
from rollstream.config.loading import apply_overrides, config_to_yaml, load_config
from rollstream.config.model import ModelConfig, Position, gpt_shape_error
from rollstream.config.pipeline import PipelineConfig
from rollstream.config.rollout import MultiTurnConfig, RolloutConfig, VLLMConfig
from rollstream.config.run import AggregatorConfig, RedisConfig, RunConfig
from rollstream.config.trainer import TrainerConfig

__all__ = [
    "ActorConfig", "AggregatorConfig", "AlgorithmConfig", "AsyncTrainingConfig", "BenchConfig", "BusConfig",
    "ConfigError", "DataConfig", "FilterGroupsConfig", "LatencyModelConfig", "ModelConfig",
    "MultiTurnConfig", "OptimConfig", "PipelineConfig", "Position", "ReverseTaskConfig", "RolloutConfig",
    "RedisConfig", "RolloutCorrectionConfig", "RunConfig", "TrainerConfig", "VLLMConfig", "apply_overrides",
    "config_to_yaml", "gpt_shape_error", "load_config",
]
