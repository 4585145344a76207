"""Synthetic RolloutSamples of a chosen size, for bus tests, benchmarks and load tests (no model)."""

from __future__ import annotations

import numpy as np

from schemas import DataProto, RolloutSample


def fake_rollout_sample(
    sample_id: str,
    *,
    param_version: int = 0,
    n: int = 4,
    prompt_len: int = 8,
    response_len: int = 16,
    epoch: int = 0,
    producer: str = "fake",
    seed: int = 0,
    rewards: list[float] | None = None,
) -> RolloutSample:
    """A valid RolloutSample with random tokens and finite log-probs; size grows with n * response_len."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, 30, size=(n, prompt_len), dtype=np.int64)
    responses = rng.integers(3, 30, size=(n, response_len), dtype=np.int64)
    logp = -rng.random((n, response_len), dtype=np.float32)
    reward = np.asarray(rewards if rewards is not None else rng.random(n), dtype=np.float32)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": np.concatenate([prompts, responses], axis=1),
            "attention_mask": np.ones((n, prompt_len + response_len), dtype=np.int64),
            "response_mask": np.ones((n, response_len), dtype=np.int64),
            "rollout_log_probs": logp,
            "rewards": reward,
        },
        non_tensors={"uid": np.array([sample_id] * n, dtype=object)},
    )
    return RolloutSample(
        sample_id=sample_id,
        epoch=epoch,
        param_version=param_version,
        full_batch=batch,
        agent_loop_output_list=[{"num_turns": 1, "response_length": response_len} for _ in range(n)],
        processing_times=[0.01] * n,
        tool_calls=[],
        param_version_start=[param_version] * n,
        param_version_end=[param_version] * n,
        rollout_status={"dispatched": 1},
        producer=producer,
    )


def response_len_for_bytes(target_bytes: int, n: int = 4) -> int:
    """Response length that makes a fake sample about target_bytes on the wire: per response token and row,
    responses, input_ids, attention_mask and response_mask are int64 (8 B each) and the log-prob float32."""
    return max(1, target_bytes // (n * 36))
