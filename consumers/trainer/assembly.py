"""Batch assembly: RolloutSamples -> one mini-batch plus the fully-async metrics (verl's
`assemble_batch_from_rollout_samples`).

The samples' rows are taken as they arrived, ragged (schemas/ragged.py), in sample order, so the n
trajectories of one sample stay contiguous (GRPO groups); the learner pads the rows it trains once
(consumers/trainer/batch.py `MiniBatch.padded`), and its micro-batches are row views of that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from consumers.trainer.batch import MiniBatch
from rollstream.rl.metrics import summary_stats
from schemas import RolloutSample
from schemas.ragged import RESPONSE_MASK, RaggedBatch

PREFIX = "fully_async"
TOOL_PREFIX = "timing_s/agent_loop/tool_calls"


def _check_keys(batches: Sequence[RaggedBatch], part: str, ids: Sequence[str]) -> None:
    """ValueError naming the sample when the batches' keys of one part (tokens / rows) differ
    (response_mask may be absent: all generated)."""
    first = [k for k in getattr(batches[0], part) if not (part == "tokens" and k == RESPONSE_MASK)]
    for b, sid in zip(batches, ids, strict=True):
        have = {k for k in getattr(b, part) if not (part == "tokens" and k == RESPONSE_MASK)}
        if have != set(first):
            raise ValueError(
                f"sample {sid}: {part} keys {sorted(have)} differ from {sorted(first)} of sample {ids[0]}"
            )


def percentile_stats(values: Sequence[float], prefix: str) -> dict[str, float]:
    """`{prefix}/avg,max,min,tp50,tp95,tp99` of values; {} when there are none."""
    if len(values) == 0:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}/avg": float(a.mean()),
        f"{prefix}/max": float(a.max()),
        f"{prefix}/min": float(a.min()),
        f"{prefix}/tp50": float(np.percentile(a, 50)),
        f"{prefix}/tp95": float(np.percentile(a, 95)),
        f"{prefix}/tp99": float(np.percentile(a, 99)),
    }


def partial_stats(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """Partial-rollout stats: trajectories whose tokens span versions (start < end), their share, max span."""
    spans = [
        end - start
        for s in samples
        for start, end in zip(s.param_version_start, s.param_version_end, strict=True)
    ]
    partial = sum(1 for d in spans if d > 0)
    return {
        f"{PREFIX}/partial/total_partial_num": float(partial),
        f"{PREFIX}/partial/partial_ratio": partial / len(spans) if spans else 0.0,
        f"{PREFIX}/partial/max_partial_span": float(max(spans, default=0)),
    }


def row_tool_seconds(samples: Sequence[RolloutSample]) -> list[float]:
    """One value per row: the trajectory's total tool-call seconds (0.0 for a sample that carries none)."""
    return [t for s in samples for t in (s.tool_calls if s.tool_calls else [0.0] * s.n)]


def tool_call_stats(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """verl's `timing_s/agent_loop/tool_calls/{max,min,mean}` over rows; {} when no sample used tools."""
    if not any(s.tool_calls for s in samples):
        return {}
    return summary_stats(row_tool_seconds(samples), TOOL_PREFIX)


def _meta_info(samples: Sequence[RolloutSample]) -> dict[str, object]:
    """The batch's meta_info under verl's names (see assemble_batch_from_rollout_samples)."""
    trajectory_versions = [int(v) for s in samples for v in s.param_version_end]
    return {
        "sample_ids": [s.sample_id for s in samples],
        "group_sizes": [s.n for s in samples],
        "rollout_param_versions": [s.param_version for s in samples],
        "trajectory_param_versions": trajectory_versions,
        "param_version_diversity": len(set(trajectory_versions)),
        "global_token_num": [
            p + r
            for s in samples
            for p, r in zip(s.full_batch.row_prompt_lens(), s.full_batch.response_lens.tolist(), strict=True)
        ],
    }


def _metrics(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """Processing-time percentiles, tool-call times, partial-rollout stats and the first sample's
    rollout_status under `fully_async/`."""
    metrics: dict[str, float] = {}
    metrics.update(
        percentile_stats([t for s in samples for t in s.processing_times], f"{PREFIX}/processing_time")
    )
    metrics.update(tool_call_stats(samples))
    metrics.update(partial_stats(samples))
    for key, value in samples[0].rollout_status.items():
        metrics[f"{PREFIX}/{key}"] = float(value)
    return metrics


def assemble_batch_from_rollout_samples(samples: list[RolloutSample]) -> tuple[MiniBatch, dict[str, float]]:
    """The samples' rows as one mini-batch [sum n rows] (ragged, in sample order; the learner pads the rows
    it trains once, and its micro-batches are row views of that) -> (batch, metrics).

    meta_info (verl's names): `sample_ids`, `group_sizes`, `rollout_param_versions` (per sample),
    `trajectory_param_versions` (per row: the version of its last token), `param_version_diversity`
    (distinct end versions over the trajectories), `global_token_num` (per row: prompt + response tokens).
    Metrics: processing-time percentiles, tool-call times, partial-rollout stats and the first sample's
    rollout_status under `fully_async/`. Samples whose per-token or per-row keys differ, or an empty list,
    raise ValueError.
    """
    if not samples:
        raise ValueError("assemble_batch_from_rollout_samples needs at least one sample")
    batches = [s.full_batch for s in samples]
    ids = [s.sample_id for s in samples]
    _check_keys(batches, "tokens", ids)
    _check_keys(batches, "rows", ids)
    return MiniBatch.of(batches, _meta_info(samples)), _metrics(samples)
