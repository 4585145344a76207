"""Sampling one token per row: temperature, top-k and top-p truncation, the inverse-CDF draw, and the
log-prob the trainer recomputes; and the checks every engine makes of a generate call's arguments."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p; renormalise. [B,V]."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the top token always survives
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def top_k_filter(probs: Tensor, top_k: int) -> Tensor:
    """Zero all but the k most likely tokens (ties at the k-th kept); renormalise; top_k <= 0 keeps all.
    [B,V]."""
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return probs
    kth = probs.topk(top_k, dim=-1).values[:, -1:]
    out = probs.masked_fill(probs < kth, 0.0)
    return out / out.sum(-1, keepdim=True)


def sample_tokens(
    logits: Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    greedy: bool,
    top_k: int = -1,
) -> tuple[Tensor, Tensor]:
    """logits [B,V] -> (tokens [B] long, log-prob [B] of each token under softmax(logits / temperature)).

    The log-prob is that of the distribution the token was sampled from (as verl's rollout computes it,
    and as the trainer recomputes it with the same temperature); top-k >= 1 and top-p < 1 truncate sampling
    further (top-k first, as vLLM and transformers do) without renormalising the stored log-prob. Greedy
    (or temperature 0) picks the argmax and reports its temperature-1 log-prob."""
    logits = logits.float()
    scaled = logits if greedy or temperature == 0.0 else logits / temperature
    logp = F.log_softmax(scaled, dim=-1)
    if greedy or temperature == 0.0:
        tok = logits.argmax(-1)
    else:
        tok = sample_rows(top_p_filter(top_k_filter(logp.exp(), top_k), top_p), generator)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def sample_rows(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [B,V] (rows need not sum to 1), by inverse CDF: one uniform per row,
    searched in the row's cumulative sum. A zero-probability token is never picked. On CPU this is ~30x
    cheaper than torch.multinomial, which draws an exponential per vocabulary entry (at 128 rows x 49k
    tokens that was a third of a producer's generation). The cumulative sum is float32, accumulated in
    float64 on CPU: a token's mass is off by at most ~1e-7. u <= 1 - 2^-24 keeps u x total below total in
    float32 (round to nearest), so the search never passes the last token with mass."""
    dev = generator.device if generator is not None else probs.device
    u = torch.rand((probs.shape[0], 1), generator=generator, device=dev).to(probs.device)
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)


def check_generate_args(
    prompts: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    limit: int | None,
    top_k: int = -1,
) -> None:
    """ValueError naming the argument unless a generate call's arguments are valid for a model of `limit`
    positions (None: unbounded): n >= 1, max_new_tokens and temperature >= 0, 0 < top_p <= 1, top_k -1 or
    >= 1, non-empty prompts, and the longest prompt + max_new_tokens within the limit (shared by every
    engine)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_new_tokens < 0 or temperature < 0 or not 0.0 < top_p <= 1.0 or top_k == 0 or top_k < -1:
        raise ValueError(f"bad sampling args: {max_new_tokens=} {temperature=} {top_p=} {top_k=}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max((len(p) for p in prompts), default=0)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} > max_seq_len {limit}")
