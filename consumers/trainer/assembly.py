"""Batch assembly: RolloutSamples -> padded training batches plus the fully-async metrics (verl's
`assemble_batch_from_rollout_samples`). The one place a sample's tokens are padded.

Samples arrive ragged (schemas/ragged.py). Their rows are taken in sample order, so the n trajectories of
one sample stay contiguous (GRPO groups), and each micro-batch of rows is padded once, to its own widest
prompt and response: prompts and the prompt half of input_ids / attention_mask on the left, responses and
every per-token array on the right, with 0. The learner trains on these as they are.
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


def _pad_rows(batches: Sequence[RaggedBatch], spans: Sequence[tuple[int, int, int]],
              keys: tuple[list[str], list[str], list[str]]) -> DataProto:
    """Rows [lo, hi) of batches[k] for each (k, lo, hi) in spans, padded to their own widest prompt P and
    response R: input_ids / attention_mask [b, P+R] (int64), prompts [b, P], responses [b, R], response_mask
    [b, R] (int64), every per-token array [b, R] in its dtype, per-row arrays and non_tensors concatenated;
    keys: the (tokens, rows, non_tensors) keys every batch has."""
    used = [batches[k] for k, _, _ in spans]
    tok_keys, row_keys, nt_keys = keys
    plens = [b.row_prompt_lens()[lo:hi] for b, (_, lo, hi) in zip(used, spans, strict=True)]
    rlens = [b.response_lens[lo:hi].tolist() for b, (_, lo, hi) in zip(used, spans, strict=True)]
    P = max((max(x) for x in plens if x), default=0)
    R = max((max(x) for x in rlens if x), default=0)
    rows = sum(hi - lo for _, lo, hi in spans)
    ids_out = np.zeros((rows, P + R), np.int64)  # (zeroed pages: only the tokens are written)
    mask = np.zeros((rows, P + R), np.int64)
    per_token = {k: np.zeros((rows, R), batches[0].tokens[k].dtype) for k in tok_keys}
    resp_mask = np.zeros((rows, R), np.int64)
    j = 0
    for b, (_, lo, _), plen, rlen in zip(used, spans, plens, rlens, strict=True):
        po, ro = b.prompt_offsets(), b.response_offsets()
        rm = b.tokens.get(RESPONSE_MASK)
        tokens = [(arr, b.tokens[k]) for k, arr in per_token.items()]
        for i, (p, r) in enumerate(zip(plen, rlen, strict=True), start=lo):  # one copy per row and array
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
        tensors[k] = np.concatenate([b.rows[k][lo:hi] for b, (_, lo, hi) in zip(used, spans, strict=True)])
    non_tensors = {
        k: np.concatenate([b.non_tensors[k][lo:hi] for b, (_, lo, hi) in zip(used, spans, strict=True)])
        for k in nt_keys
    }
    return DataProto(tensors, non_tensors)


def micro_spans(sizes: Sequence[int], micro_batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Per micro-batch of `micro_batch_size` rows (0: one micro-batch of every row), the (sample, first
    row, end row) runs it takes from samples of `sizes` rows, in order."""
    total = sum(sizes)
    size = micro_batch_size if micro_batch_size > 0 else max(total, 1)
    out: list[list[tuple[int, int, int]]] = []
    for start in range(0, total, size):
        end, spans, base = min(start + size, total), [], 0
        for k, n in enumerate(sizes):
            lo, hi = max(start - base, 0), min(end - base, n)
            if lo < hi:
                spans.append((k, lo, hi))
            base += n
        out.append(spans)
    return out


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


def assemble_micro_batches(
    samples: list[RolloutSample], micro_batch_size: int = 0
) -> tuple[list[DataProto], dict[str, float]]:
    """The samples' rows as padded micro-batches of `micro_batch_size` rows (0: one batch of every row),
    each padded once to its own widths -> (micro-batches, metrics). Every micro-batch carries the whole
    batch's meta_info (one dict; see assemble_batch_from_rollout_samples). An empty list raises ValueError."""
    if not samples:
        raise ValueError("assemble_batch_from_rollout_samples needs at least one sample")
    batches = [s.full_batch for s in samples]
    ids = [s.sample_id for s in samples]
    meta = _meta_info(samples)
    tok_keys, row_keys, nt_keys = (_keys(batches, part, ids) for part in ("tokens", "rows", "non_tensors"))
    out = []
    for spans in micro_spans([len(b) for b in batches], micro_batch_size):
        part = _pad_rows(batches, spans, (tok_keys, row_keys, nt_keys))
        part.meta_info = meta
        out.append(part)
    return out, _metrics(samples)


def assemble_batch_from_rollout_samples(samples: list[RolloutSample]) -> tuple[DataProto, dict[str, float]]:
    """The samples' rows as one padded batch [sum n rows] (every row padded to the batch's widest prompt and
    response) -> (batch, metrics).

    meta_info (verl's names): `sample_ids`, `group_sizes`, `rollout_param_versions` (per sample),
    `trajectory_param_versions` (per row: the version of its last token), `param_version_diversity`
    (distinct end versions over the trajectories), `global_token_num` (per row: prompt + response tokens).
    Metrics: processing-time percentiles, tool-call times, partial-rollout stats and the first sample's
    rollout_status under `fully_async/`. Rows are padded with 0 (the wire convention). An empty list raises
    ValueError.
    """
    parts, metrics = assemble_micro_batches(samples, 0)
    return parts[0], metrics
