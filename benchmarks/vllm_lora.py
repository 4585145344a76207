"""How a LoRA version reaches a vLLM engine, both ways measured: merged weights reloaded in place (what
`rollout.name=vllm` with `model.lora_rank > 0` does) against vLLM's own adapters (`enable_lora`, one
`LoRARequest` per version, loaded from a PEFT folder of the factors).

Per path, on a random Qwen2 built here (CPU; each path in its own process, one engine each):
the seconds to swap in a version (median of 3), tokens/s sampling with it, and the swap check's figure (mean
|log-prob diff| per probe token against the trainer's merged weights). The adapter path also samples without
an adapter on its LoRA-enabled engine.

    python -m benchmarks vllm_lora [--hidden 512 --layers 4 --heads 4 --kv-heads 2 --mlp 1024] [--rank 16]
        [--dtype float32|bfloat16] [--factor-std 0.05] [--rows 32] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="vllm_lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the random Qwen2 (tied head)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head size: hidden / heads)")
    p.add_argument("--kv-heads", type=int, default=2, help="key-value heads")
    p.add_argument("--mlp", type=int, default=None, help="MLP size (default 2 x hidden)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute")
    p.add_argument("--factor-std", type=float, default=0.05, help="spread of the random factors A and B")
    p.add_argument("--rows", type=int, default=32, help="rows sampled at once")
    p.add_argument("--tokens", type=int, default=32, help="tokens per row (eos ignored)")
    p.add_argument("--path", choices=["merged", "adapter"], help=argparse.SUPPRESS)  # one path, in-process
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _trainer(model: str, rank: int, seed: int, dtype: str, std: float) -> Any:
    """The trainer's LoRA policy (every linear layer but the head) with every factor redrawn from `seed`."""
    from rollstream.config import load_config
    from rollstream.model import build_policy
    from rollstream.model.lora import is_factor

    cfg = load_config(None, ["model.backend=hf", f"model.hf_path={model}", "run.device=cpu",
                             f"model.dtype={dtype}", f"model.lora_rank={rank}",
                             f"model.lora_alpha={2 * rank}"])
    policy = build_policy(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if is_factor(name):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return policy


def _peft_folder(factors: dict[str, torch.Tensor], rank: int, model: str, folder: Path) -> str:
    """The factors as a PEFT adapter folder (what vLLM's LoRARequest loads)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    tensors, targets = {}, set()
    for name, t in factors.items():
        layer, which = name[: -len(".lora.A")], name[-1]
        targets.add(layer.rsplit(".", 1)[-1])
        tensors[f"base_model.model.{layer}.lora_{which}.weight"] = t.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, target_modules=sorted(targets),
        base_model_name_or_path=model, bias="none", fan_in_fan_out=False, use_rslora=False,
        modules_to_save=None, lora_dropout=0.0)))
    return str(folder)


def _one_path(a: argparse.Namespace) -> dict[str, Any]:
    """Measure one path in this process (its own engine)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from producers.engines.lora_merge import LoRAMerger
    from producers.engines.vllm import VISION_AUDIO, _reload_in_worker
    from rollstream.weights.fingerprint import policy_probe, probe_diff
    from rollstream.weights.tensors import published_state

    adapter = a.path == "adapter"
    for name in VISION_AUDIO:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(model=a.model, tokenizer=a.model, dtype=a.dtype, seed=0,
                                  logprobs_mode="processed_logprobs", generation_config="vllm",
                                  enforce_eager=True, max_model_len=128, enable_prefix_caching=False)
    if adapter:
        kwargs.update(enable_lora=True, max_lora_rank=a.rank, max_loras=1)
    llm = LLM(**kwargs)
    merger = LoRAMerger.from_checkpoint(a.model, getattr(torch, a.dtype), a.rank, 2.0 * a.rank)
    prompts = [TokensPrompt(prompt_token_ids=[1, 5 + i % 50, 6, 7]) for i in range(a.rows)]
    sample = SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    probe = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)

    def tokens_per_s(request: Any) -> float:
        llm.generate(prompts[:2], sample, lora_request=request, use_tqdm=False)  # warm
        t0 = time.perf_counter()
        out = llm.generate(prompts, sample, lora_request=request, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t0)

    swaps, checks, request = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for version in (1, 2, 3):
            trainer = _trainer(a.model, a.rank, version, a.dtype, a.factor_std)
            ids, want = policy_probe(trainer)
            factors = {n: t.detach().clone() for n, t in published_state(trainer.module).items()}
            t0 = time.perf_counter()
            if adapter:  # a new adapter id per version, the previous one removed
                path = _peft_folder(factors, a.rank, a.model, Path(tmp) / f"v{version}")
                if request is not None:
                    llm.llm_engine.remove_lora(request.lora_int_id)
                request = LoRARequest(f"v{version}", version, path)
                llm.llm_engine.add_lora(request)
            else:
                llm.collective_rpc(_reload_in_worker, args=(merger.merged(factors.items()),))
                llm.reset_prefix_cache()
            swaps.append(time.perf_counter() - t0)
            one = [TokensPrompt(prompt_token_ids=ids)]
            out = llm.generate(one, probe, lora_request=request, use_tqdm=False)
            lps: Any = out[0].prompt_logprobs
            got = [float(lp[t].logprob) for lp, t in zip(lps[1:], ids[1:], strict=True)]
            checks.append(probe_diff(want, got)[0])
    result = dict(path=a.path, swap_s=statistics.median(swaps), swap_check=max(checks),
                  tokens_per_s=tokens_per_s(request))
    if adapter:
        result["tokens_per_s_no_adapter"] = tokens_per_s(None)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Build the model, measure each path in its own process, print one JSON line per path."""
    a = _args(argv)
    if a.path:
        print(json.dumps(_one_path(a)))
        return 0
    from producers.engines.vllm import intel_openmp
    from rollstream.testing.hf_tiny import make_tiny_hf_model

    lib = intel_openmp()  # as a producer runs its engine (producers/engines/vllm.py: reexec_with_openmp)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="WARNING", **({"LD_PRELOAD": str(lib)} if lib else {}))
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_hf_model(Path(tmp) / "qwen2", seed=0, arch="qwen2", tokenizer="bpe",
                                   hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                                   num_kv_heads=a.kv_heads, intermediate_size=a.mlp)
        for path in ("merged", "adapter"):
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks", "vllm_lora", *(argv or []), "--path", path,
                 "--model", str(model)], capture_output=True, text=True, timeout=900, env=env,
            )
            lines = done.stdout.strip().splitlines()
            print(lines[-1] if done.returncode == 0 and lines else f"{path}: failed\n{done.stderr[-2000:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
