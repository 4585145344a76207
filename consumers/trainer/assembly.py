"""Batch assembly: RolloutSamples -> one padded mini-batch plus the fully-async metrics (verl's
`assemble_batch_from_rollout_samples`). The one place a sample's tokens are padded.

Samples arrive ragged (schemas/ragged.py). Their rows are taken in sample order, so the n trajectories of
one sample stay contiguous (GRPO groups), and the mini-batch is padded once, to its widest prompt and
response: prompts and the prompt half of input_ids / attention_mask on the left, responses and every
per-token array on the right, with 0. The learner's micro-batches are row views of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollstream.rl.metrics import summary_stats
from schemas import DataProto, RolloutSample
from schemas.ragged import RESPONSE_MASK, RaggedBatch

PREFIX = "fully_async"
TOOL_PREFIX = "timing_s/agent_loop/tool_calls"


def _keys(batches: Sequence[RaggedBatch], part: str, ids: Sequence[str]) -> list[str]:
    """The keys of one part (tokens / rows / non_tensors) every batch has (response_mask may be absent:
    all generated); ValueError naming the sample when the batches disagree."""
    first = [k for k in getattr(batches[0], part) if not (part == "tokens" and k == RESPONSE_MASK)]
    for b, sid in zip(batches, ids, strict=True):
        have = {k for k in getattr(b, part) if not (part == "tokens" and k == RESPONSE_MASK)}
        if have != set(first):
            raise ValueError(
                f"sample {sid}: {part} keys {sorted(have)} differ from {sorted(first)} of sample {ids[0]}"
            )
    return first


def _pad_rows(batches: Sequence[RaggedBatch], keys: tuple[list[str], list[str], list[str]]) -> DataProto:
    """Every row of the batches, in order, padded to the widest prompt P and response R: input_ids /
    attention_mask [B, P+R] (int64), prompts [B, P], responses [B, R], response_mask [B, R] (int64), every
    per-token array [B, R] in its dtype, per-row arrays and non_tensors concatenated; keys: the (tokens,
    rows, non_tensors) keys every batch has."""
    tok_keys, row_keys, nt_keys = keys
    plens = [b.row_prompt_lens() for b in batches]
    rlens = [b.response_lens.tolist() for b in batches]
    P = max((max(x) for x in plens if x), default=0)
    R = max((max(x) for x in rlens if x), default=0)
    rows = sum(len(b) for b in batches)
    ids_out = np.zeros((rows, P + R), np.int64)  # (zeroed pages: only the tokens are written)
    mask = np.zeros((rows, P + R), np.int64)
    per_token = {k: np.zeros((rows, R), batches[0].tokens[k].dtype) for k in tok_keys}
    resp_mask = np.zeros((rows, R), np.int64)
    j = 0
    for b, plen, rlen in zip(batches, plens, rlens, strict=True):
        po, ro = b.prompt_offsets(), b.response_offsets()
        rm = b.tokens.get(RESPONSE_MASK)
        tokens = [(arr, b.tokens[k]) for k, arr in per_token.items()]
        for i, (p, r) in enumerate(zip(plen, rlen, strict=True)):  # one copy per row and array
            ids_out[j, P - p : P] = b.prompt_ids[po[i] : po[i] + p]
            resp = slice(ro[i], ro[i] + r)
            ids_out[j, P : P + r] = b.response_ids[resp]
            mask[j, P - p : P + r] = 1
            for arr, flat in tokens:
                arr[j, :r] = flat[resp]
            resp_mask[j, :r] = 1 if rm is None else rm[resp]
            j += 1
    tensors = {"prompts": ids_out[:, :P], "responses": ids_out[:, P:], "input_ids": ids_out,
               "attention_mask": mask, RESPONSE_MASK: resp_mask, **per_token}
    for k in row_keys:
        tensors[k] = np.concatenate([b.rows[k] for b in batches])
    non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in nt_keys}
    return DataProto(tensors, non_tensors)


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


def assemble_batch_from_rollout_samples(samples: list[RolloutSample]) -> tuple[DataProto, dict[str, float]]:
    """The samples' rows as one padded mini-batch [sum n rows] (every row padded to the batch's widest prompt
    and response; the trainer's micro-batches are row views of it) -> (batch, metrics).

    meta_info (verl's names): `sample_ids`, `group_sizes`, `rollout_param_versions` (per sample),
    `trajectory_param_versions` (per row: the version of its last token), `param_version_diversity`
    (distinct end versions over the trajectories), `global_token_num` (per row: prompt + response tokens).
    Metrics: processing-time percentiles, tool-call times, partial-rollout stats and the first sample's
    rollout_status under `fully_async/`. Rows are padded with 0 (the wire convention). An empty list raises
    ValueError.
    """
    if not samples:
        raise ValueError("assemble_batch_from_rollout_samples needs at least one sample")
    batches = [s.full_batch for s in samples]
    ids = [s.sample_id for s in samples]
    keys = (_keys(batches, "tokens", ids), _keys(batches, "rows", ids), _keys(batches, "non_tensors", ids))
    batch = _pad_rows(batches, keys)
    batch.meta_info = _meta_info(samples)
    return batch, _metrics(samples)
