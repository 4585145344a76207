"""Batch assembly: RolloutSamples -> one training DataProto plus the fully-async metrics (verl's
`assemble_batch_from_rollout_samples`).

Samples may come from different producers with different prompt / response widths; every sample is
padded to the widest first (prompts and the prompt half of input_ids/attention_mask on the left, responses
and every per-response-token array on the right), then the rows are concatenated in sample order, so the
n trajectories of one sample stay contiguous (GRPO groups).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from schemas import DataProto, RolloutSample

PREFIX = "fully_async"
TOOL_PREFIX = "timing_s/agent_loop/tool_calls"


def _pad(arr: np.ndarray, left: int, right: int, value: float = 0) -> np.ndarray:
    """Pad a 2-d array [n, w] with `left`/`right` columns of `value`."""
    if left == 0 and right == 0:
        return arr
    return np.pad(arr, ((0, 0), (left, right)), constant_values=value)


def _widths(sample: RolloutSample) -> tuple[int, int]:
    """(prompt width P, response width R) of one sample's full_batch."""
    t = sample.full_batch.tensors
    if "responses" not in t:
        raise ValueError(f"sample {sample.sample_id}: full_batch has no 'responses'")
    resp_w = int(t["responses"].shape[1])
    if "prompts" in t:
        return int(t["prompts"].shape[1]), resp_w
    return int(t["input_ids"].shape[1]) - resp_w, resp_w


def _pad_sample(sample: RolloutSample, P: int, R: int) -> DataProto:
    """The sample's full_batch padded to prompt width P and response width R (response_mask added)."""
    batch = sample.full_batch
    p, rw = _widths(sample)
    out: dict[str, np.ndarray] = {}
    for key, arr in batch.tensors.items():
        if arr.ndim != 2:
            out[key] = arr
        elif key == "prompts":
            out[key] = _pad(arr, P - p, 0)
        elif arr.shape[1] == p + rw:  # input_ids, attention_mask, position_ids: [prompt | response]
            out[key] = np.concatenate([_pad(arr[:, :p], P - p, 0), _pad(arr[:, p:], 0, R - rw)], axis=1)
        elif arr.shape[1] == rw:
            out[key] = _pad(arr, 0, R - rw)
        else:
            raise ValueError(f"sample {sample.sample_id}: tensor {key!r} width {arr.shape[1]} fits neither P nor R")
    if "response_mask" not in out:
        if "attention_mask" not in out:
            raise ValueError(f"sample {sample.sample_id}: needs response_mask or attention_mask")
        out["response_mask"] = out["attention_mask"][:, -R:].copy() if R else np.zeros((len(batch), 0), np.int64)
    return DataProto(out, batch.non_tensors, batch.meta_info)


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
    spans = [end - start for s in samples for start, end in zip(s.param_version_start, s.param_version_end, strict=True)]
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
    a = np.asarray(row_tool_seconds(samples), dtype=np.float64)
    return {
        f"{TOOL_PREFIX}/max": float(a.max()),
        f"{TOOL_PREFIX}/min": float(a.min()),
        f"{TOOL_PREFIX}/mean": float(a.mean()),
    }


#: Reorders an assembled batch's rows (e.g. balancing tokens across data-parallel ranks); see balance.py.
BalanceFn = Callable[[DataProto], DataProto]


def assemble_batch_from_rollout_samples(
    samples: list[RolloutSample], pad_id: int = 0, balance_batch: BalanceFn | None = None
) -> tuple[DataProto, dict[str, float]]:
    """Concat the samples' full_batches (padded to a common width) -> (batch [sum n rows], metrics).

    meta_info (verl's names): `sample_ids`, `group_sizes`, `rollout_param_versions` (per sample),
    `trajectory_param_versions` (per row: the version of its last token), `param_version_diversity`
    (distinct end versions over the trajectories), `global_token_num` (per row: attention-mask sum).
    Metrics: processing-time percentiles, tool-call times, partial-rollout stats and the first sample's
    rollout_status under `fully_async/`. `balance_batch`, when given, reorders the rows after concat
    (before `global_token_num` is taken, as verl does). `pad_id` must be 0 (the wire convention); an
    empty list raises ValueError.
    """
    if not samples:
        raise ValueError("assemble_batch_from_rollout_samples needs at least one sample")
    if pad_id != 0:
        raise ValueError(f"the wire convention pads with 0, got pad_id={pad_id}")
    widths = [_widths(s) for s in samples]
    P = max(w[0] for w in widths)
    R = max(w[1] for w in widths)
    batch = DataProto.concat([_pad_sample(s, P, R) for s in samples])
    trajectory_versions = [int(v) for s in samples for v in s.param_version_end]
    batch.meta_info = {
        "sample_ids": [s.sample_id for s in samples],
        "group_sizes": [s.n for s in samples],
        "rollout_param_versions": [s.param_version for s in samples],
        "trajectory_param_versions": trajectory_versions,
        "param_version_diversity": len(set(trajectory_versions)),
    }
    if balance_batch is not None:
        batch = balance_batch(batch)
    if "attention_mask" in batch.tensors:
        batch.meta_info["global_token_num"] = batch.tensors["attention_mask"].sum(axis=-1).astype(int).tolist()

    metrics: dict[str, float] = {}
    metrics.update(percentile_stats([t for s in samples for t in s.processing_times], f"{PREFIX}/processing_time"))
    metrics.update(tool_call_stats(samples))
    metrics.update(partial_stats(samples))
    for key, value in samples[0].rollout_status.items():
        metrics[f"{PREFIX}/{key}"] = float(value)
    return batch, metrics
