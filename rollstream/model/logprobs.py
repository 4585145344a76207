"""Per-token log-prob and entropy of the sampling distribution softmax(logits / temperature): the one
place they are computed, from logits (`logprobs_entropy`) or from final hidden states a chunk of tokens at a
time (`chunked_logprobs_entropy`).

The full logits of a batch are [B, R, V] floats (plus a log-softmax and an exp of the same size, and
autograd keeps them for backward): with a 150k vocabulary and a few thousand response tokens that is
gigabytes. Here the output head runs on `chunk_tokens` rows of hidden states at a time; with grad on,
each chunk is checkpointed (its logits are recomputed in backward instead of kept), so peak memory is
O(chunk_tokens x V) however long the batch. The numbers are those of the unchunked computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def logprobs_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """logits [..., V], labels [...] -> (log-prob [...] of each label, entropy [...]) of
    softmax(logits / temperature), in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, labels.long()[..., None]).squeeze(-1)  # [...]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [...]
    return logp, entropy


def head_logprobs_entropy(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """hidden [N,H], head weight [V,H] (+ bias [V]), labels [N] -> (log-prob [N], entropy [N]) of
    softmax(head(hidden) / temperature), in float32."""
    return logprobs_entropy(F.linear(hidden, weight, bias), labels, temperature)  # logits [N,V]


def chunked_logprobs_entropy(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float, chunk_tokens: int
) -> tuple[Tensor, Tensor]:
    """hidden [B,R,H], labels [B,R] -> (log-prob [B,R], entropy [B,R]), computed `chunk_tokens` rows of
    the flattened [B*R] tokens at a time; chunks are checkpointed when grad flows."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    B, R, H = hidden.shape
    flat_h, flat_y = hidden.reshape(B * R, H), labels.reshape(B * R).long()
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for s in range(0, B * R, chunk_tokens):
        h, y = flat_h[s : s + chunk_tokens], flat_y[s : s + chunk_tokens]
        if recompute:
            lp, ent = checkpoint(head_logprobs_entropy, h, weight, bias, y, temperature, use_reentrant=False)
        else:
            lp, ent = head_logprobs_entropy(h, weight, bias, y, temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps).view(B, R), torch.cat(ents).view(B, R)
