"""LoRA on the vLLM engine in bfloat16 (what the SmolLM2 config runs, `model.dtype=fast` on a CPU with
bfloat16): an engine started by `VLLMPolicy.from_config` for a LoRA config merges each version's factors with
the trainer's rounding, and the swap check reads within bfloat16's bound at every version, every factor
changed. Its own engine, in its own process (this file run as a script): a second engine in a pytest process
would tear down the first one's parallel state when it goes. The float32 case, exact to ~5e-7, is in
tests/test_vllm_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

pytest.importorskip("vllm")

from conftest import REDIS_URL  # noqa: E402
from test_vllm_engine import LORA, PROMPTS, engine_config, lora_trainer, probe_of, recompute  # noqa: E402

from producers.engines.vllm import VLLMPolicy  # noqa: E402
from producers.weight_sync import WeightSync  # noqa: E402
from rollstream.keys import Keys  # noqa: E402
from rollstream.testing.hf_tiny import make_tiny_hf_model  # noqa: E402
from rollstream.weights.fingerprint import default_max_diff  # noqa: E402
from rollstream.weights.store import publish_module_weights  # noqa: E402

BF16 = "model.dtype=bfloat16"


def swap_lora_versions(model_dir: Path, r: redis.Redis, keys: Keys, folder: Path) -> dict[str, list[float]]:
    """Start a LoRA engine in bfloat16, load two versions with every factor changed through a checked
    WeightSync; the swap checks' mean figures and the mean |behaviour - trainer recompute| per version."""
    engine = VLLMPolicy.from_config(engine_config(model_dir, *LORA, BF16), seed=0)
    assert engine.merger is not None and engine.dtype_name == "bfloat16"
    sync = WeightSync(r, keys, None, "rollout_00", loader=engine.load_param_version,
                      prober=engine.probe_logprobs, max_diff=default_max_diff("bfloat16"))
    out: dict[str, list[float]] = {"versions": [], "checks": [], "behaviour": []}
    for version in (1, 2):
        trainer = lora_trainer(model_dir, version, BF16)
        publish_module_weights(r, keys, version, trainer.module, global_step=version, inline_max_bytes=0,
                               file_dir=folder, probe=probe_of(trainer))
        assert sync.refresh() and sync.last_check is not None
        out["versions"].append(sync.version)
        out["checks"].append(sync.last_check[1])
        rows = engine.generate(PROMPTS, n=2, max_new_tokens=10, temperature=1.0)
        diffs = torch.cat([(recompute(trainer, row.prompt_ids, row.response_ids, 1.0).float()
                            - torch.tensor(row.log_probs)).abs() for row in rows])
        out["behaviour"].append(float(diffs.mean()))
    return out


def test_lora_versions_in_bfloat16_pass_the_swap_check(tmp_path: Path, keys: Keys) -> None:
    model_dir = make_tiny_hf_model(tmp_path / "qwen2", seed=0, arch="qwen2", tokenizer="bpe",
                                   chat_template=True, hidden_size=128)
    done = subprocess.run(
        [sys.executable, __file__, str(model_dir), REDIS_URL, keys.run, str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nLoRA on vLLM, bfloat16: {out}")
    assert out["versions"] == [1, 2], out
    assert max(out["checks"]) <= default_max_diff("bfloat16"), out  # at every version
    assert max(out["behaviour"]) < default_max_diff("bfloat16"), out  # the sampled tokens' log-probs too


if __name__ == "__main__":  # the engine's own process: model dir, redis URL, run name, a folder
    _dir, _url, _run, _folder = sys.argv[1:5]
    print(json.dumps(swap_lora_versions(Path(_dir), redis.Redis.from_url(_url), Keys(_run), Path(_folder))))
