"""Weights above bus.weights_inline_max_bytes: streamed to a safetensors file tensor by tensor,
announced on `params`, hashed and read back into a producer's model in place, in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from safetensors import safe_open
from torch import nn

from rollstream.keys import Keys
from rollstream.weights.store import (
    WeightsError,
    latest_param_version,
    load_weights_into,
    publish_module_weights,
)
from rollstream.weights.tensors import (
    file_bytes,
    file_sha256,
    load_file_into,
    unique_state,
    write_tensors,
)

ROOT = Path(__file__).resolve().parents[1]


class Tied(nn.Module):
    """An embedding tied to the output head (as Qwen2.5-0.5B), a bf16 block, a buffer and an empty tensor."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight
        self.block = nn.Linear(8, 8).to(torch.bfloat16)
        self.register_buffer("steps", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("empty", torch.zeros(0))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


class Holder:
    """A policy as load_weights_into sees it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def load_state_dict_bytes(self, data: bytes) -> None:
        """Inline path."""
        from rollstream.weights.tensors import load_bytes_into

        load_bytes_into(self.module, data)


def same(a: nn.Module, b: nn.Module) -> bool:
    """Every state-dict tensor equal (dtype included)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa
    )


def test_above_the_inline_limit_weights_go_through_a_streamed_file(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    src, dst = Tied(0), Tied(1)
    assert not same(src, dst)
    pv = publish_module_weights(r, keys, 3, src, global_step=3, inline_max_bytes=100, file_dir=tmp_path)
    path = Path(pv.uri.removeprefix("file://"))
    assert (
        pv.uri.startswith("file://") and path.parent == tmp_path.resolve() and not r.exists(keys.weights(3))
    )
    assert latest_param_version(r, keys) == pv
    assert pv.bytes == path.stat().st_size == file_bytes(unique_state(src)) and pv.sha256 == file_sha256(path)
    with safe_open(str(path), framework="pt") as f:  # a standard safetensors file: tied weight once
        assert sorted(f.keys()) == sorted(unique_state(src)) and "head.weight" not in f.keys()
        assert torch.equal(f.get_tensor("block.weight"), src.block.weight.detach())
    load_weights_into(r, pv, Holder(dst))  # type: ignore[arg-type]
    assert same(src, dst) and dst.head.weight is dst.emb.weight  # still tied after the in-place load


def test_small_weights_stay_inline(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    src, dst = Tied(0), Tied(1)
    pv = publish_module_weights(r, keys, 0, src, global_step=0, inline_max_bytes=1 << 20, file_dir=tmp_path)
    assert pv.uri == keys.weights(0) and not list(tmp_path.iterdir())
    load_weights_into(r, pv, Holder(dst))  # type: ignore[arg-type]
    assert same(src, dst)


def test_a_corrupt_file_is_refused_before_the_model_changes(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    src, dst = Tied(0), Tied(1)
    pv = publish_module_weights(r, keys, 1, src, global_step=1, inline_max_bytes=0, file_dir=tmp_path)
    path = Path(pv.uri.removeprefix("file://"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(WeightsError, match="sha256"):
        load_weights_into(r, pv, Holder(dst))  # type: ignore[arg-type]
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    path.unlink()
    with pytest.raises(WeightsError, match="cannot read"):
        load_weights_into(r, pv, Holder(dst))  # type: ignore[arg-type]


def test_a_write_cut_short_leaves_no_file_and_no_hashing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import rollstream.weights.tensors as tensors_module

    real = tensors_module.tensor_pieces

    def failing_pieces(tensors: dict[str, torch.Tensor]) -> object:
        for i, piece in enumerate(real(tensors)):
            if i == 2:
                raise OSError(28, "No space left on device")
            yield piece

    monkeypatch.setattr(tensors_module, "tensor_pieces", failing_pieces)
    with pytest.raises(OSError, match="No space left"):
        write_tensors(unique_state(Tied(0)), tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name == "weights-sha256"]
    monkeypatch.setattr(tensors_module, "tensor_pieces", real)
    # hashed beside the writes
    digest, size = write_tensors(unique_state(Tied(0)), tmp_path / "w.safetensors")
    assert digest == file_sha256(tmp_path / "w.safetensors") and size == file_bytes(unique_state(Tied(0)))


def test_mismatched_files_are_refused_and_dtypes_are_converted(tmp_path: Path) -> None:
    src = Tied(0)
    write_tensors(unique_state(src), tmp_path / "w.safetensors")
    other = nn.Linear(8, 50)
    with pytest.raises(ValueError, match="unknown tensors"):
        load_file_into(other, tmp_path / "w.safetensors")
    bigger = Tied(1)
    bigger.block = nn.Linear(8, 9).to(torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        load_file_into(bigger, tmp_path / "w.safetensors")
    assert torch.equal(bigger.emb.weight, Tied(1).emb.weight)  # nothing written before the refusal
    fewer = nn.Sequential(nn.Linear(8, 8))
    write_tensors(unique_state(fewer), tmp_path / "few.safetensors")
    with pytest.raises(ValueError, match="lack tensors"):
        load_file_into(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), tmp_path / "few.safetensors")
    half = Tied(2).to(torch.bfloat16)  # a producer in bf16 reading a trainer's float32 weights
    load_file_into(half, tmp_path / "w.safetensors")
    assert half.emb.weight.dtype == torch.bfloat16 and torch.equal(
        half.emb.weight, src.emb.weight.to(torch.bfloat16)
    )


def test_publish_and_load_of_64_mib_stay_in_bounded_memory(redis_url: str) -> None:
    """`rollstream bench weights` (benchmarks/weights.py; the ~1 GB figures in BENCHMARKS.md) at 64 MiB:
    publishing adds at most a
    few MiB to the trainer's peak RSS and loading one 16 MiB hash block, where the whole-blob path adds 2x
    the weights on each side."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the peak RSS")

    def bench(path: str) -> dict[str, float]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.weights",
                "--preset",
                "mlp64",
                "--path",
                path,
                "--redis-url",
                redis_url,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    streamed, whole, chunks = bench("streamed"), bench("bytes"), bench("redis")
    print(f"\n64 MiB: streamed {streamed}\n        whole blob {whole}\n        redis chunks {chunks}")
    assert streamed["loaded_equal"] and streamed["uri_ok"] and streamed["state_dict_mib"] > 60
    assert streamed["publish_peak_extra_mib"] < 8 and streamed["load_peak_extra_mib"] < 20
    # through Redis: one 16 MiB chunk buffer on the trainer, a few chunks in flight on the producer
    assert chunks["loaded_equal"] and chunks["uri_ok"]
    assert chunks["publish_peak_extra_mib"] < 8 + 16 and chunks["load_peak_extra_mib"] < 4 * 16
    assert whole["publish_peak_extra_mib"] > 60 and whole["load_peak_extra_mib"] > 120  # what it replaces
