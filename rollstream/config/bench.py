"""`bench:`: settings only benchmarks use (`rollstream bench`), kept apart from the run's own sections and
printed by `rollstream config` only when set."""

from __future__ import annotations

from pydantic import Field

from rollstream.config.base import Section


class LatencyModelConfig(Section):
    """A producer that models generation time instead of decoding (benchmarks/latency.py)."""

    enable: bool = Field(
        False,
        description="Replace decoding by sleeping each dispatch's modelled decode time (rest of the producer "
                    "unchanged)",
    )
    tokens_per_s: float = Field(
        200.0, gt=0, description="Modelled decode speed of one trajectory in tokens per second"
    )
    length_median: float = Field(
        8.0, gt=0, description="Median modelled response length in tokens (lognormal)"
    )
    length_sigma: float = Field(
        1.0, ge=0, description="Log-space std of the modelled response length (the long tail)"
    )
    concurrency: int = Field(
        8,
        ge=1,
        description="Slots per producer, each dispatching one prompt at a time (an engine's continuous "
                    "batching)",
    )


class BenchConfig(Section):
    """Benchmarks only: not a setting of a real run."""

    latency_model: LatencyModelConfig = Field(
        default_factory=LatencyModelConfig,
        description="Modelled generation time instead of decoding (benchmarks/latency_producer.py)",
    )
