"""`eager_gqa`: transformers' eager attention without copying grouped-query key/value heads.

transformers' eager kernel repeats each key/value head to the query heads that share it (`repeat_kv`)
before its two matmuls: a copy of the whole KV cache per layer per decode step (SmolLM2: 9 query heads on 3
key/value heads, so 3x the cache), and of every row's keys and values in training. Here the query heads of
a group are folded into the query-length axis instead, [B, KV, G*T, D], so each matmul reads the one
key/value head in place; the mask is broadcast over the group in a view. The numbers are eager's (the same
products and the same float32 softmax); the returned weights are shaped as eager's, [B, H, T, L].

Registered with transformers under `EAGER_GQA` (kernel and eager's additive mask) by `register()`, which
`HFPolicy.from_pretrained` calls when `model.attn_implementation` names it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

EAGER_GQA = "eager_gqa"


def eager_gqa_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """query [B,H,T,D], key/value [B,KV,L,D] (H a multiple of KV; query head h reads key/value head
    h // (H/KV), as after transformers' repeat_kv), additive mask [B,1,T,L] -> (output [B,T,H,D], weights
    [B,H,T,L])."""
    B, H, T, D = query.shape
    KV, L = key.shape[1], key.shape[2]
    G = H // KV
    q = query.reshape(B, KV, G * T, D)  # heads kv*G + g -> rows g*T + t of group kv
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling  # [B, KV, G*T, L]
    if attention_mask is not None:
        scores = (scores.view(B, KV, G, T, L) + attention_mask[:, :, None]).view(B, KV, G * T, L)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value)  # [B, KV, G*T, D]
    out = out.view(B, H, T, D).transpose(1, 2).contiguous()
    return out, weights.view(B, H, T, L)


def register() -> None:
    """Make `attn_implementation="eager_gqa"` loadable by transformers (idempotent): the kernel above with
    eager's additive float mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(EAGER_GQA, eager_gqa_attention_forward)
    AttentionMaskInterface.register(EAGER_GQA, eager_mask)
