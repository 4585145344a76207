"""Weight sync at scale: publish a model's weights above bus.weights_inline_max_bytes and load them into a
second model, measuring time to the first token on the new version and the peak extra RSS of each side.

    rollstream bench weights --preset qwen2.5-0.5b          # ~1 GB, the Qwen2.5-0.5B shape in bf16: file vs
    redis
    rollstream bench weights --preset mlp64 --json           # 64 MiB float32 (the test's size)
    rollstream bench weights --preset qwen2.5-0.5b --path bytes   # the old whole-blob path, to compare

`redis` (bus.weights_transport=redis, hosts without a shared disk): the same stream of bytes goes into
Redis chunks; the producer reads them a chunk at a time into a temp file on its own disk, then loads it
as below. The chunks go to a private redis-server the benchmark starts (unless --redis-url), on loopback:
network time between real hosts comes on top.

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
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import torch
from torch import nn

from rollstream.bus import connect, delete_run
from rollstream.keys import Keys
from rollstream.ops.embedded_redis import free_port, redis_server_binary, wait_for_redis
from rollstream.weights.store import (
    CHUNK_BYTES,
    load_weights,
    load_weights_into,
    publish_module_weights,
    publish_weights,
)
from rollstream.weights.tensors import load_bytes_into, module_bytes, unique_state

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
        load_bytes_into(self.module, data)


def first_token(model: nn.Module, preset: str) -> float:
    """Seconds to the first token the loaded model produces (one greedy forward of a 1-token prompt)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        if preset == "qwen2.5-0.5b":
            int(model(input_ids=torch.tensor([[1]])).logits[0, -1].argmax())
        else:
            int(model(torch.ones(1, 1024)).argmax())
    return time.perf_counter() - t0


def measure_path(
    r: redis.Redis,
    trainer: nn.Module,
    producer: nn.Module,
    preset: str,
    path: str,
    version: int,
    work_dir: Path,
    chunk_bytes: int,
) -> dict[str, Any]:
    """Publish the trainer model's weights by `path`, load them into the (zeroed) producer model, take the
    first token; times and peaks."""
    keys = Keys(f"bench-weights-{uuid.uuid4().hex[:8]}")
    with torch.no_grad():
        for t in producer.state_dict().values():
            t.zero_()
    out: dict[str, Any] = {"preset": preset, "path": path}
    try:
        before = reset_peak()
        t0 = time.perf_counter()
        if path in ("streamed", "redis"):
            pv = publish_module_weights(
                r,
                keys,
                version,
                trainer,
                global_step=version,
                inline_max_bytes=INLINE_MAX,
                file_dir=work_dir,
                transport="redis" if path == "redis" else "file",
                chunk_bytes=chunk_bytes,
            )
        else:
            pv = publish_weights(r, keys, version, module_bytes(trainer), global_step=version,
                                 inline_max_bytes=INLINE_MAX, file_dir=work_dir)
        out["publish_s"] = time.perf_counter() - t0
        out["publish_peak_extra_mib"] = (rss("VmHWM:") - before) / 2**20
        out["file_mib"] = pv.bytes / 2**20
        out["uri_ok"] = pv.uri.startswith("redis-chunks://" if path == "redis" else "file://")

        before = reset_peak()
        t0 = time.perf_counter()
        if path == "bytes":
            load_bytes_into(producer, load_weights(r, pv))
        else:
            load_weights_into(r, pv, Holder(producer))  # type: ignore[arg-type]
        out["load_s"] = time.perf_counter() - t0
        out["load_peak_extra_mib"] = (rss("VmHWM:") - before) / 2**20
        out["first_token_s"] = first_token(producer, preset)
        out["publish_to_first_token_s"] = out["publish_s"] + out["load_s"] + out["first_token_s"]
        sd_t, sd_p = trainer.state_dict(), producer.state_dict()
        out["loaded_equal"] = all(torch.equal(sd_t[k], sd_p[k]) for k in sd_t)
    finally:
        delete_run(r, keys)
    return out


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of our own (no persistence, loopback port), so a 1 GB model's chunks never land in a
    shared Redis; its URL."""
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for_redis(url).close()
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def measure(
    preset: str, paths: list[str], redis_url: str, work_dir: Path, chunk_bytes: int
) -> list[dict[str, Any]]:
    """Build the trainer and producer models once, then measure each path in turn on them."""
    t0 = time.perf_counter()
    trainer, producer = build(preset, 0), build(preset, 1)
    nbytes = sum(t.numel() * t.element_size() for t in unique_state(trainer).values())  # tied tensors once
    build_s = time.perf_counter() - t0
    r = connect(redis_url)  # the workers' client: large values go to the socket uncopied
    try:
        rows = [measure_path(r, trainer, producer, preset, path, i + 1, work_dir, chunk_bytes)
                for i, path in enumerate(paths)]
    finally:
        r.close()
    for row in rows:
        row.update(state_dict_mib=nbytes / 2**20, build_s=build_s)
    return rows


def main(argv: list[str]) -> int:
    """Parse the flags, measure each path, print them (table rows or JSON lines)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "mlp64"], help="model shape")
    p.add_argument(
        "--path",
        nargs="+",
        default=["streamed", "redis"],
        choices=["streamed", "redis", "bytes"],
        help="weights paths measured in turn: streamed (file://, shared disk), redis (chunks), bytes (old)",
    )
    p.add_argument(
        "--redis-url", default=None, help="Redis for params and chunks (default: a private redis-server)"
    )
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="chunk size of the redis path")
    p.add_argument("--dir", default=None, help="folder for the weights file (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object per path instead of table rows")
    args = p.parse_args(argv)
    # glibc reads it at start-up: re-exec once with it set
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.weights", *argv])
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(private_redis())
        tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir))
        rows = measure(args.preset, args.path, url, Path(tmp), args.chunk_bytes)
    if args.json:
        for res in rows:
            print(json.dumps(res))
    else:
        print(
            "| preset | path | state dict MiB | publish s | publish peak extra MiB | load s | load peak "
            "extra MiB "
            "| first token s | publish -> first token s | equal |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for res in rows:
            print(
                f"| {res['preset']} | {res['path']} | {res['state_dict_mib']:.0f} | {res['publish_s']:.2f} | "
                f"{res['publish_peak_extra_mib']:.0f} | {res['load_s']:.2f} | "
                f"{res['load_peak_extra_mib']:.0f} | "
                f"{res['first_token_s']:.2f} | {res['publish_to_first_token_s']:.2f} | {res['loaded_equal']} "
                "|"
            )
    return 0 if all(res["loaded_equal"] and res["uri_ok"] for res in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
