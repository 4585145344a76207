"""Weight sync at scale: publish a model's weights above bus.weights_inline_max_bytes (the file:// path) and
load them into a second model, measuring time and the peak extra RSS of each side.

    rollstream bench weights --preset qwen2.5-0.5b          # ~1 GB: the Qwen2.5-0.5B shape in bf16
    rollstream bench weights --preset mlp64 --json           # 64 MiB float32 (the test's size)
    rollstream bench weights --preset qwen2.5-0.5b --path bytes   # the old whole-blob path, to compare

`streamed` (what the trainer and producers use): the trainer writes the tensors straight into the file and
hashes them on the way; a producer hashes the file in 16 MiB blocks, then reads each tensor into the
memory of its parameter. `bytes`: the whole safetensors blob built in memory, written, read back whole and
deserialised before the copy into the module. Models are randomly initialised (no download). The peak is
/proc's VmHWM (reset before each phase) minus the RSS before it; glibc is told to mmap every allocation
over 64 KiB so memory a phase frees leaves the RSS. Needs Redis (the ParamVersion goes on a real `params`
stream, in a scratch namespace deleted afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import torch
from torch import nn

from rollstream.bus import delete_run
from rollstream.model.base import load_state_dict_from_bytes, state_dict_to_bytes
from rollstream.names import Keys
from rollstream.weights import load_weights, load_weights_into, publish_module_weights, publish_weights
from rollstream.weights_file import unique_state

INLINE_MAX = 64 << 20  # the bus.weights_inline_max_bytes default


def rss(field: str = "VmRSS:") -> int:
    """A /proc/self/status memory figure in bytes."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1]) * 1024


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss()


def build(preset: str, seed: int) -> nn.Module:
    """A randomly initialised model of the preset's shape."""
    torch.manual_seed(seed)
    if preset == "mlp64":  # 16 x 1024x1024 float32 + biases: 64 MiB
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    if preset == "qwen2.5-0.5b":  # Qwen/Qwen2.5-0.5B's config, random init, bfloat16: 494M parameters
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False,
        )
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy on the way
        try:
            return Qwen2ForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(old)
    raise SystemExit(f"unknown preset {preset!r}")


class Holder:
    """What load_weights_into needs from a policy: the module, and the inline loader."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def load_state_dict_bytes(self, data: bytes) -> None:
        """Inline blobs (not used above the inline limit)."""
        load_state_dict_from_bytes(self.module, data)


def measure(preset: str, path: str, redis_url: str, work_dir: Path) -> dict[str, Any]:
    """Publish the trainer model's weights and load them into the producer model; times and peaks."""
    t0 = time.perf_counter()
    trainer, producer = build(preset, 0), build(preset, 1)
    nbytes = sum(t.numel() * t.element_size() for t in unique_state(trainer).values())  # tied tensors once
    r = redis.Redis.from_url(redis_url)
    keys = Keys(f"bench-weights-{uuid.uuid4().hex[:8]}")
    out: dict[str, Any] = {"preset": preset, "path": path, "state_dict_mib": nbytes / 2**20,
                           "build_s": time.perf_counter() - t0, "rss_before_mib": rss() / 2**20}
    try:
        before = reset_peak()
        t0 = time.perf_counter()
        if path == "streamed":
            pv = publish_module_weights(r, keys, 1, trainer, global_step=1, inline_max_bytes=INLINE_MAX,
                                        file_dir=work_dir)
        else:
            pv = publish_weights(r, keys, 1, state_dict_to_bytes(trainer), global_step=1,
                                 inline_max_bytes=INLINE_MAX, file_dir=work_dir)
        out["publish_s"] = time.perf_counter() - t0
        out["publish_peak_extra_mib"] = (rss("VmHWM:") - before) / 2**20
        out["file_mib"] = pv.bytes / 2**20
        out["uri_is_file"] = pv.uri.startswith("file://")

        before = reset_peak()
        t0 = time.perf_counter()
        if path == "streamed":
            load_weights_into(r, pv, Holder(producer))  # type: ignore[arg-type]
        else:
            load_state_dict_from_bytes(producer, load_weights(r, pv))
        out["load_s"] = time.perf_counter() - t0
        out["load_peak_extra_mib"] = (rss("VmHWM:") - before) / 2**20
        sd_t, sd_p = trainer.state_dict(), producer.state_dict()
        out["loaded_equal"] = all(torch.equal(sd_t[k], sd_p[k]) for k in sd_t)
    finally:
        delete_run(r, keys)
        r.close()
    return out


def main(argv: list[str]) -> int:
    """Parse the flags, run one measurement, print it (a table row or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "mlp64"], help="model shape")
    p.add_argument("--path", default="streamed", choices=["streamed", "bytes"], help="weights path measured")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis for the params stream")
    p.add_argument("--dir", default=None, help="folder for the weights file (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table row")
    args = p.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # glibc reads it at start-up: re-exec once with it set
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.weights", *argv])
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        res = measure(args.preset, args.path, args.redis_url, Path(tmp))
    if args.json:
        print(json.dumps(res))
    else:
        print("| preset | path | state dict MiB | publish s | publish peak extra MiB | load s | load peak extra MiB | equal |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {res['preset']} | {res['path']} | {res['state_dict_mib']:.0f} | {res['publish_s']:.2f} | "
              f"{res['publish_peak_extra_mib']:.0f} | {res['load_s']:.2f} | {res['load_peak_extra_mib']:.0f} | "
              f"{res['loaded_equal']} |")
    return 0 if res["loaded_equal"] and res["uri_is_file"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
