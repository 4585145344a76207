"""Workers keep freed sample buffers for reuse (rollstream.runtime.process.tune_allocator): a trainer that
holds one batch of decoded samples while it decodes the next must not pay a page fault per 4 KB of every new
array."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import numpy as np
from rollstream.runtime.process import tune_allocator
tuned = tune_allocator() if sys.argv[1] == "tuned" else {}
held = []
def batch():
    return [np.ones(1 << 19) for _ in range(8)]  # eight 4 MB arrays, written (as a decode writes input_ids)
held = batch()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    held = batch()  # the previous batch is freed only once the next one exists
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start, sorted(tuned))
"""

glibc_linux = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's"
)


def probe(mode: str, **env: str) -> tuple[int, str]:
    """(minor page faults of 20 batches, thresholds set) from a fresh interpreter."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.split(maxsplit=1)  # fmt: skip
    return int(out[0]), out[1].strip()


@glibc_linux
def test_a_tuned_worker_reuses_freed_buffers_instead_of_faulting_them_in_again() -> None:
    """Untuned, every 4 MB array is a fresh mapping faulted in again (here ~45,000 faults for 160 arrays, with
    transparent huge pages taking some); tuned, the freed batch's memory is reused (~4,100: 11x fewer)."""
    plain, none = probe("plain")
    tuned, names = probe("tuned")
    assert none == "[]" and names == "['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_']"
    assert plain > 20_000, plain  # the cost being removed is really there
    assert tuned < plain / 5, (tuned, plain)


@glibc_linux
def test_glibcs_own_environment_variables_win() -> None:
    """A user who set MALLOC_MMAP_THRESHOLD_ keeps it: tune_allocator leaves that threshold alone."""
    _, names = probe("tuned", MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    assert names == "['MALLOC_TRIM_THRESHOLD_']"


@glibc_linux
def test_a_glibc_tunable_wins_too() -> None:
    """GLIBC_TUNABLES' malloc thresholds are the user's too: the trim threshold set there is left alone."""
    _, names = probe("tuned", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")
    assert names == "['MALLOC_MMAP_THRESHOLD_']"
