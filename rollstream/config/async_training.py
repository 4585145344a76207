"""`async_training:` (verl's fully_async_policy names): how far producers run ahead of the trainer, how
often the trainer publishes weights, and whether producers swap weights mid-trajectory."""

from __future__ import annotations

from pydantic import Field

from rollstream.config.base import Section


class AsyncTrainingConfig(Section):
    """The asynchronous pipeline's knobs (verl's `async_training:`)."""

    staleness_threshold: float = Field(
        0.0,
        ge=0,
        description="Pacing: at most data.train_batch_size*(1+staleness_threshold) prompts outstanding",
    )
    trigger_parameter_sync_step: int = Field(
        2, ge=1, description="Local updates per global step (one weight publish each)"
    )
    partial_rollout: bool = Field(
        True, description="Swap weights mid-trajectory (start<end) instead of finishing under old weights"
    )
