"""Trainer-side checks of a decoded RolloutSample that the wire schema cannot make: token ids inside this
model's vocabulary, integer token/mask arrays, 0/1 masks, widths that agree (P + R), and rows no longer
than the model accepts.

A sample failing them would crash the learner (an embedding lookup out of range, a float index) or train
on garbage; the trainer dead-letters it instead, with the reason returned here.
"""

from __future__ import annotations

import numpy as np

from schemas import RolloutSample

TOKEN_ARRAYS = ("prompts", "responses", "input_ids")
MASK_ARRAYS = ("attention_mask", "response_mask")


def unusable_reason(sample: RolloutSample, vocab_size: int, max_seq_len: int | None) -> str | None:
    """Why this trainer cannot learn from `sample` (None when it can)."""
    tensors = sample.full_batch.tensors
    for name in (*TOKEN_ARRAYS, *MASK_ARRAYS):
        arr = tensors.get(name)
        if arr is None:
            continue
        if arr.dtype.kind not in "iub":
            return f"{name} has dtype {arr.dtype}, not integer"
        if arr.size == 0:
            continue
        lo, hi = int(np.min(arr)), int(np.max(arr))
        if name in TOKEN_ARRAYS and (lo < 0 or hi >= vocab_size):
            return f"{name} holds token ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size})"
        if name in MASK_ARRAYS and (lo < 0 or hi > 1):
            return f"{name} holds values in [{lo}, {hi}], not 0/1"
    widths = _widths(tensors)
    if isinstance(widths, str):
        return widths
    ids = tensors.get("input_ids")
    if max_seq_len is not None and ids is not None and ids.ndim == 2 and ids.shape[1] > max_seq_len:
        return f"rows are {ids.shape[1]} tokens, over the model's max_seq_len {max_seq_len}"
    return None


def _widths(tensors: dict[str, np.ndarray]) -> str | None:
    """input_ids/attention_mask must be [n, P+R] and response_mask/rollout_log_probs [n, R]."""
    prompts, responses = tensors.get("prompts"), tensors.get("responses")
    if prompts is None or responses is None or prompts.ndim != 2 or responses.ndim != 2:
        return "prompts and responses must be 2-D arrays"
    P, R = prompts.shape[1], responses.shape[1]
    for name, want in (("input_ids", P + R), ("attention_mask", P + R), ("response_mask", R), ("rollout_log_probs", R)):
        arr = tensors.get(name)
        if arr is not None and (arr.ndim != 2 or arr.shape[1] != want):
            return f"{name} has shape {arr.shape}, expected width {want} (prompts {P} + responses {R})"
    return None
