"""Trainer-side checks of a decoded RolloutSample that depend on this model or need a pass over the values:
token ids inside the vocabulary, 0/1 masks, rows no longer than the model accepts. (Dtypes and widths are
checked by the RolloutSample schema itself, at decode.)

A sample failing them would crash the learner (an embedding lookup out of range) or train on garbage; the
trainer dead-letters it instead, with the reason returned here.
"""

from __future__ import annotations

import numpy as np

from schemas import RolloutSample
from schemas.events import MASK_ARRAYS, TOKEN_ARRAYS


def unusable_reason(sample: RolloutSample, vocab_size: int, max_seq_len: int | None) -> str | None:
    """Why this trainer cannot learn from `sample` (None when it can)."""
    tensors = sample.full_batch.tensors
    for name in (*TOKEN_ARRAYS, *MASK_ARRAYS):
        arr = tensors.get(name)
        if arr is None or arr.size == 0:
            continue
        lo, hi = int(np.min(arr)), int(np.max(arr))
        if name in TOKEN_ARRAYS and (lo < 0 or hi >= vocab_size):
            return f"{name} holds token ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size})"
        if name in MASK_ARRAYS and (lo < 0 or hi > 1):
            return f"{name} holds values in [{lo}, {hi}], not 0/1"
    ids = tensors.get("input_ids")
    if max_seq_len is not None and ids is not None and ids.shape[1] > max_seq_len:
        return f"rows are {ids.shape[1]} tokens, over the model's max_seq_len {max_seq_len}"
    return None
