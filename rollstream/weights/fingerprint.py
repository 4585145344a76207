"""The swap check's fingerprint of a param version: the log-probs of a fixed probe sequence under it.

With every version the trainer publishes the probe's token ids and its own log-probs of them (temperature 1,
float32, eval mode) in the ParamVersion (`probe_ids`, `probe_logprobs`). After loading a version, a producer
computes the same with its own engine (the built-in sampler's module, or vLLM through `prompt_logprobs`) and
compares: the mean absolute difference per token is the check's figure (`producer/swap_check/logprob_diff`
in the records). A figure over the bound (`rollout.swap_check_max_diff`, by default `default_max_diff` of the
engine's dtype) is a failed swap: the engine does not hold the weights it would stamp.

The probe is pseudo-random tokens over the ids the model can embed (from a fixed seed, the same on every
host): such tokens are unlikely under any model, so their log-probs depend on every layer, the embedding
and the output head alike, and a stale tensor anywhere moves them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of processes that only read params
    from rollstream.model.base import BasePolicy

#: Tokens in the probe sequence (its log-probs: one fewer), or the model's context when shorter.
PROBE_LEN = 32
#: Fewest probe log-probs a check compares (a context shorter than this cannot be checked meaningfully).
MIN_COMPARED = 4
#: Seed of the probe's token ids (fixed: every host draws the same sequence for a vocabulary size).
PROBE_SEED = 20261204
#: Default bound on the mean absolute log-prob difference per probe token, by the engine's dtype: float32
#: engines agree with transformers to ~1e-6 (measured 4.8e-7); bf16 and fp16 round every activation, so two
#: kernels of one bfloat16 model differ: on SmolLM2-135M (30 layers) transformers' eager against its sdpa
#: attention read 0.046, either against float32 0.054-0.072, and vLLM's CPU engine against the trainer 0.061
#: (BENCHMARKS.md, Real model); 0.15 leaves twice that. In bfloat16 the check catches gross errors (a stale
#: tied head read 0.27 on a tiny float32 model), not a version one step stale: float32 checks that.
DEFAULT_MAX_DIFF = {"float32": 1e-3, "bfloat16": 0.15, "float16": 2e-2}


#: The swap check's metrics in a producer's stats and in the records (consumers/aggregator/fold.py): the
#: version checked, and the mean and max |log-prob difference| per probe token.
SWAP_CHECK_VERSION = "producer/swap_check/version"
SWAP_CHECK_DIFF = "producer/swap_check/logprob_diff"
SWAP_CHECK_DIFF_MAX = "producer/swap_check/logprob_diff_max"


class SwapCheckError(RuntimeError):
    """A loaded version's probe log-probs differ from the trainer's by more than the bound."""


def probe_ids(vocab_size: int, length: int = PROBE_LEN) -> list[int]:
    """The probe's token ids: `length` pseudo-random ids in [0, vocab_size), the same on every host."""
    if vocab_size < 1 or length < 2:
        raise ValueError(f"probe needs vocab_size >= 1 and length >= 2, got {vocab_size}, {length}")
    rng = random.Random(PROBE_SEED)
    return [rng.randrange(vocab_size) for _ in range(length)]


def policy_probe_logprobs(policy: BasePolicy, ids: Sequence[int]) -> list[float]:
    """log p(ids[t+1] | ids[:t+1]) under the policy's module at temperature 1, in float32, eval mode, no
    grad (the module's train/eval mode is restored); ids beyond the model's context are left out."""
    import torch

    ids = list(ids)[: policy.max_seq_len or None]
    module = policy.module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            x = torch.tensor([list(ids)], dtype=torch.long)
            lp = policy.log_probs(x, torch.ones_like(x), len(ids) - 1, 1.0)
    finally:
        module.train(was_training)
    return [float(v) for v in lp[0].float().cpu()]


def embeddable_vocab(policy: BasePolicy) -> int:
    """How many ids the probe may draw from: the tokenizer's length, or the model's input embedding rows
    when fewer (a Qwen2 tokenizer may count an added token the checkpoint has no row for)."""
    module = policy.module
    get = getattr(module, "get_input_embeddings", None)
    emb = get() if callable(get) else getattr(module, "tok_emb", None)
    rows = getattr(emb, "num_embeddings", None)
    n = policy.tokenizer.vocab_size
    return min(n, int(rows)) if isinstance(rows, int) and rows > 0 else n


def policy_probe(policy: BasePolicy) -> tuple[list[int], list[float]]:
    """The probe a publisher sends with a version of `policy`: the fixed ids (PROBE_LEN, or the model's
    context when shorter) over the ids the model can embed, and the policy's log-probs of them."""
    ids = probe_ids(embeddable_vocab(policy), min(PROBE_LEN, policy.max_seq_len or PROBE_LEN))
    return ids, policy_probe_logprobs(policy, ids)


def probe_diff(expected: Sequence[float], got: Sequence[float]) -> tuple[float, float]:
    """(mean, max) absolute difference of two probe log-prob lists, over `got`'s length (an engine with a
    shorter context scores a prefix: log-probs are causal); fewer than MIN_COMPARED values, `got` longer than
    `expected`, or a non-finite value is an infinite difference (never a pass)."""
    if len(got) > len(expected) or len(got) < MIN_COMPARED:
        return float("inf"), float("inf")
    expected = expected[: len(got)]
    diffs = [abs(a - b) for a, b in zip(expected, got, strict=True)]
    if any(d != d for d in diffs):  # NaN
        return float("inf"), float("inf")
    return sum(diffs) / len(diffs), max(diffs)


def default_max_diff(dtype: str) -> float:
    """The default bound for an engine computing in `dtype` (float32, bfloat16, float16; else float32's)."""
    return DEFAULT_MAX_DIFF.get(dtype, DEFAULT_MAX_DIFF["float32"])
