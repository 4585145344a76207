"""model.dtype=fast on a CPU: the weights' dtype whose matrix products this CPU computes faster, measured once
per machine and kept in a cache file, so every process of a run on the machine agrees.

A CPU flag is not enough. Without AVX512-BF16 or AMX torch emulates bfloat16 products (~9x slower than
float32), so float32 is chosen without measuring. With them it depends on the CPU: bfloat16 ran a SmolLM2
forward + backward 2-4x faster than float32 on a Xeon with AMX and 1.5x faster on an AMD Zen 4, but 1.5x
slower on a Xeon exposing AVX512-BF16 without AMX, whose float32 products are fast (BENCHMARKS.md, Real model,
on a Xeon without AMX). So there `fast` times one thread's product of a SmolLM2-sized layer in both dtypes
(~0.3 s) and picks bfloat16 only when it is faster. The first process to need the answer measures it under a
file lock; the others wait for it and read the file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import platform
import time
from functools import lru_cache
from pathlib import Path

import torch

from rollstream.pretrained import cache_root
from rollstream.runtime.files import atomic_write

log = logging.getLogger(__name__)

#: The cache file's name, under $XDG_CACHE_HOME/rollstream (~/.cache/rollstream).
CHOICE_FILE = "fast-dtype.json"
#: The product timed: [ROWS, IN] x [IN, OUT], a SmolLM2 MLP layer over a micro-batch's tokens.
ROWS, IN, OUT = 512, 576, 1536
#: Timed repeats per dtype (the fastest counts), after one warm-up.
REPEATS = 5


def choice_file() -> Path:
    """$XDG_CACHE_HOME/rollstream/fast-dtype.json (~/.cache/rollstream/fast-dtype.json)."""
    return cache_root() / CHOICE_FILE


def cpu_has_bfloat16_units() -> bool:
    """Whether the CPU has bfloat16 instructions (AVX512-BF16 or AMX); without them torch emulates them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def machine_key() -> str:
    """What the choice depends on: the CPU's model name and the torch build."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} | torch {torch.__version__}"


def product_seconds(dtype: torch.dtype) -> float:
    """The fastest of REPEATS one-thread products [ROWS, IN] x [IN, OUT] in `dtype`, in seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(ROWS, IN, generator=gen).to(dtype)
        w = torch.randn(OUT, IN, generator=gen).to(dtype)
        torch.nn.functional.linear(x, w)
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(threads)


def measure() -> tuple[str, float, float]:
    """(the faster dtype's name, bfloat16's seconds, float32's seconds) of the product, timed here."""
    bf16, f32 = product_seconds(torch.bfloat16), product_seconds(torch.float32)
    return ("bfloat16" if bf16 < f32 else "float32"), bf16, f32


def _read(path: Path) -> dict[str, dict[str, object]]:
    """The cache file's entries by machine key; {} when missing or unreadable (it is then measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _measure_and_store(path: Path, key: str) -> torch.dtype:
    """Under an exclusive lock beside `path`: the stored choice for `key`, else measured, stored, returned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        data = _read(path)
        entry = data.get(key)
        if isinstance(entry, dict) and entry.get("dtype") in ("bfloat16", "float32"):
            return getattr(torch, str(entry["dtype"]))
        choice, bf16, f32 = measure()
        data[key] = {"dtype": choice, "bfloat16_s": bf16, "float32_s": f32, "measured": time.time()}
        atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
        log.info("model.dtype=fast on this CPU: %s (a %dx%dx%d product: bfloat16 %.1f ms, float32 %.1f ms; "
                 "kept in %s)", choice, ROWS, IN, OUT, bf16 * 1e3, f32 * 1e3, path)
        return getattr(torch, choice)


@lru_cache(maxsize=1)
def fast_cpu_dtype() -> torch.dtype:
    """float32 without bfloat16 instructions; else the dtype this machine's cache file names, measured and
    stored there by the first process that asks (measured in this process alone, with a warning, when the
    file cannot be written: processes of one run may then disagree)."""
    if not cpu_has_bfloat16_units():
        return torch.float32
    path = choice_file()
    try:
        return _measure_and_store(path, machine_key())
    except OSError as e:
        choice = getattr(torch, measure()[0])
        log.warning("model.dtype=fast: cannot keep the choice in %s (%s); measured %s for this process alone "
                    "(set model.dtype explicitly so every process agrees)", path, e, choice)
        return choice
