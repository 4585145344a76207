"""The swap check (rollstream/weights/fingerprint.py, producers/weight_sync.py) with the built-in engine: the
probe travels with each version, a producer's load is checked against it, and a mismatch is loaded again and
then refused (the version is never registered). Through a whole run: tests/test_hf_pipeline.py."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import redis
import torch

from producers.weight_sync import SwapFailed, WeightSync
from rollstream.config import load_config
from rollstream.keys import Keys
from rollstream.model import BasePolicy, build_policy
from rollstream.weights.fingerprint import (
    default_max_diff,
    embeddable_vocab,
    policy_probe,
    policy_probe_logprobs,
    probe_diff,
    probe_ids,
)
from rollstream.weights.store import gc_weights, latest_param_version, load_weights_into, publish_weights
from schemas import ParamVersion


def policy(seed: int) -> BasePolicy:
    """The demo's tiny GPT with weights from `seed`."""
    return build_policy(load_config("pipeline.yaml", [f"run.seed={seed}"]))


def probe(p: BasePolicy) -> tuple[list[int], list[float]]:
    """The trainer's probe of `p`."""
    return policy_probe(p)


def test_the_probe_is_fixed_and_its_diff_never_passes_garbage() -> None:
    assert probe_ids(100) == probe_ids(100) and len(probe_ids(100)) == 32
    assert all(0 <= i < 7 for i in probe_ids(7))
    assert probe_diff([-1.0, -2.0, -3.0, -4.0], [-1.0, -2.5, -3.0, -4.5]) == (0.25, 0.5)
    a = [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert probe_diff(a, a[:4]) == (0.0, 0.0)  # an engine with a shorter context checks a prefix
    assert probe_diff(a[:4], a) == (math.inf, math.inf)  # more than was published
    assert probe_diff(a, a[:3]) == (math.inf, math.inf)  # too short to mean anything
    assert probe_diff(a, [-1.0, -2.0, -3.0, math.nan]) == (math.inf, math.inf)
    assert probe_diff([], []) == (math.inf, math.inf)
    assert default_max_diff("float32") == 1e-3 and default_max_diff("bfloat16") == 0.15
    with pytest.raises(ValueError, match="vocab_size"):
        probe_ids(0)


def test_the_probe_depends_on_every_tensor() -> None:
    p = policy(0)
    ids, before = probe(p)
    for name, param in p.module.named_parameters():  # any one tensor moved moves the probe
        with torch.no_grad():
            saved = param.detach().clone()
            param.add_(0.05 * torch.randn_like(param))
            mean, _ = probe_diff(before, policy_probe_logprobs(p, ids))
            param.copy_(saved)
        assert mean > 1e-4, name


def test_a_builtin_swap_is_checked_and_a_mismatch_refused(r: redis.Redis, keys: Keys) -> None:
    engine, v1, v2 = policy(0), policy(1), policy(2)
    assert engine.module.training  # the check leaves the module's mode as it found it
    sync = WeightSync(r, keys, engine, "rollout_00", max_diff=default_max_diff("float32"))
    inline = 1 << 30
    publish_weights(r, keys, 1, v1.state_dict_bytes(), global_step=1, inline_max_bytes=inline,
                    probe=probe(v1))
    assert sync.refresh() and sync.version == 1
    assert sync.last_check == (1, 0.0, 0.0) and engine.module.training  # the same code on both sides
    pv = latest_param_version(r, keys)
    assert pv is not None and pv.probe_ids == policy_probe(engine)[0]
    # version 2's weights announced with version 1's fingerprint: loaded, checked, loaded again, refused
    publish_weights(r, keys, 2, v2.state_dict_bytes(), global_step=2, inline_max_bytes=inline,
                    probe=probe(v1))
    loads: list[int] = []
    inner = sync.loader
    sync.loader = lambda rr, pv: (loads.append(pv.version), inner(rr, pv))[-1]  # type: ignore[func-returns-value]
    with pytest.raises(SwapFailed, match="param_version 2: .* rollout.swap_check_max_diff=0.001"):
        sync.refresh()
    assert loads == [2, 2] and sync.version == 1
    assert r.get(keys.producer_version("rollout_00")) == b"1"  # version 2 never registered
    # a version without a probe (published before the check existed) loads unchecked
    publish_weights(r, keys, 3, v2.state_dict_bytes(), global_step=3, inline_max_bytes=1 << 30)
    assert sync.refresh() and sync.version == 3 and sync.last_check is not None and sync.last_check[0] == 2


def test_the_probe_draws_only_ids_the_model_can_embed(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rollstream.model.hf import HFPolicy
    from rollstream.testing.hf_tiny import make_tiny_hf_model

    # the fixture's Qwen2 tokenizer counts <|endoftext|> too: 58 entries for 57 embedding rows
    p = HFPolicy.from_pretrained(make_tiny_hf_model(tmp_path / "qwen2", arch="qwen2"), device="cpu")
    assert p.tokenizer.vocab_size == 58 and p.module.get_input_embeddings().num_embeddings == 57
    assert embeddable_vocab(p) == 57 and 57 in probe_ids(58)  # the old draw held an id with no row
    ids, lps = policy_probe(p)
    assert max(ids) < 57 and len(lps) == len(ids) - 1 and all(math.isfinite(v) for v in lps)


def test_a_late_producer_loads_the_newest_version_when_its_first_was_collected(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The trainer published 0, the producer read its pointer, then the trainer published 1-3 and collected
    0's file before the producer read it: the first load takes version 3 instead of exiting."""
    trained, engine = policy(1), policy(0)
    blob = trained.state_dict_bytes()
    files = tmp_path / "weights"
    files.mkdir()
    publish_weights(r, keys, 0, blob, global_step=0, inline_max_bytes=0, file_dir=files, probe=probe(trained))
    loads: list[int] = []

    def slow_loader(rr: redis.Redis, pv: ParamVersion) -> None:
        if not loads:  # the trainer moves on while this producer loads its model
            for v in (1, 2, 3):
                publish_weights(r, keys, v, blob, global_step=v, inline_max_bytes=0, file_dir=files,
                                probe=probe(trained))
            assert 0 in gc_weights(r, keys, 3, keep_last=2, file_dir=files)
        loads.append(pv.version)
        load_weights_into(rr, pv, engine)

    sync = WeightSync(r, keys, engine, "rollout_00", loader=slow_loader, max_diff=default_max_diff("float32"))
    sync.prober = lambda ids: policy_probe_logprobs(engine, ids)
    assert sync.wait_initial(threading.Event(), timeout_s=5)
    assert loads == [0, 3] and sync.version == 3 and sync.last_check == (3, 0.0, 0.0)
    assert r.get(keys.producer_version("rollout_00")) == b"3"
