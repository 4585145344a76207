"""model.dtype=fast on a CPU: the faster of bfloat16 and float32, measured once per machine and shared by
every process through a cache file."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rollstream.model import fast_dtype
from rollstream.model.base import resolve_dtype


@dataclass
class Timings:
    """Fake product timings by dtype, and the dtypes measured so far."""

    seconds: dict[torch.dtype, float] = field(
        default_factory=lambda: {torch.bfloat16: 0.02, torch.float32: 0.03}
    )
    calls: list[torch.dtype] = field(default_factory=list)

    def measure(self, dtype: torch.dtype) -> float:
        self.calls.append(dtype)
        time.sleep(0.05)  # long enough for a second process to arrive while the first measures
        return self.seconds[dtype]


@pytest.fixture
def timings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Timings]:
    """Fake timings on a CPU with bfloat16 units; the cache file under tmp_path."""
    fake = Timings()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(fast_dtype, "product_seconds", fake.measure)
    monkeypatch.setattr(fast_dtype, "cpu_has_bfloat16_units", lambda: True)
    fast_dtype.fast_cpu_dtype.cache_clear()
    yield fake
    fast_dtype.fast_cpu_dtype.cache_clear()


def test_fast_picks_the_faster_product_and_every_later_process_reads_it(
    timings: Timings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_dtype("fast", torch.device("cpu")) == torch.bfloat16
    stored = json.loads((tmp_path / "rollstream" / "fast-dtype.json").read_text())
    (entry,) = stored.values()
    assert entry["dtype"] == "bfloat16" and entry["bfloat16_s"] == 0.02 and entry["float32_s"] == 0.03
    assert len(timings.calls) == 2
    timings.seconds[torch.bfloat16] = 0.05  # a later process on the same machine does not measure again
    fast_dtype.fast_cpu_dtype.cache_clear()
    assert resolve_dtype("fast", torch.device("cpu")) == torch.bfloat16 and len(timings.calls) == 2
    # another CPU model (or torch build) is measured apart, and here float32 is faster
    monkeypatch.setattr(fast_dtype, "machine_key", lambda: "another cpu | torch x")
    fast_dtype.fast_cpu_dtype.cache_clear()
    assert resolve_dtype("fast", torch.device("cpu")) == torch.float32 and len(timings.calls) == 4
    entries = json.loads((tmp_path / "rollstream" / "fast-dtype.json").read_text()).values()
    assert {e["dtype"] for e in entries} == {"bfloat16", "float32"}


def test_processes_starting_together_measure_once_and_agree(timings: Timings, tmp_path: Path) -> None:
    path, got = fast_dtype.choice_file(), []
    threads = [
        threading.Thread(target=lambda: got.append(fast_dtype._measure_and_store(path, "cpu | torch")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [torch.bfloat16] * 4 and len(timings.calls) == 2


def test_a_damaged_cache_file_is_measured_again_and_no_bfloat16_units_means_float32(
    timings: Timings, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fast_dtype.choice_file()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    timings.seconds[torch.bfloat16] = 0.04
    assert fast_dtype.fast_cpu_dtype() == torch.float32 and len(timings.calls) == 2
    assert json.loads(path.read_text())[fast_dtype.machine_key()]["dtype"] == "float32"
    monkeypatch.setattr(fast_dtype, "cpu_has_bfloat16_units", lambda: False)  # bfloat16 emulated
    fast_dtype.fast_cpu_dtype.cache_clear()
    path.unlink()
    assert resolve_dtype("fast", torch.device("cpu")) == torch.float32
    assert not path.exists() and len(timings.calls) == 2  # nothing measured


def test_the_real_measurement_times_both_dtypes() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        assert 0 < fast_dtype.product_seconds(dtype) < 5


def test_an_unwritable_cache_measures_in_this_process_and_says_so(
    timings: Timings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder cannot be made under a file
    timings.seconds[torch.bfloat16] = 0.04
    assert resolve_dtype("fast", torch.device("cpu")) == torch.float32 and len(timings.calls) == 2
    assert "cannot keep the choice" in caplog.text and "set model.dtype explicitly" in caplog.text
