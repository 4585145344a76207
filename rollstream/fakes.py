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
    ragged: bool = False,
    vocab: int = 30,
) -> RolloutSample:
    """A valid RolloutSample with random tokens and finite log-probs; size grows with n * response_len.
    The group's rows share one prompt (as a producer builds them); ragged=True gives each response a random
    length in [1, response_len], right-padded with id 0 (mask 0, log-prob 0.0); token ids are < vocab."""
    rng = np.random.default_rng(seed)
    prompts = np.repeat(rng.integers(3, vocab, size=(1, prompt_len), dtype=np.int64), n, axis=0)
    responses = rng.integers(3, vocab, size=(n, response_len), dtype=np.int64)
    response_mask = np.ones((n, response_len), dtype=np.int64)
    if ragged and response_len:
        lengths = rng.integers(1, response_len + 1, size=n)
        response_mask = (np.arange(response_len) < lengths[:, None]).astype(np.int64)
        responses *= response_mask
    logp = np.where(response_mask == 1, -rng.random((n, response_len), dtype=np.float32), np.float32(0.0))
    reward = np.asarray(rewards if rewards is not None else rng.random(n), dtype=np.float32)
    input_ids = np.concatenate([prompts, responses], axis=1)
    batch = DataProto.from_dict(
        tensors={
            "prompts": input_ids[:, :prompt_len],  # views of input_ids, as the producer builds them
            "responses": input_ids[:, prompt_len:],
            "input_ids": input_ids,
            "attention_mask": np.concatenate([np.ones((n, prompt_len), dtype=np.int64), response_mask], axis=1),
            "response_mask": response_mask,
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
    the compact layout (schema 2) sends an int32 id and a float32 log-prob."""
    return max(1, target_bytes // (n * 8))
