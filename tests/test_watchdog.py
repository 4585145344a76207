"""The generation watchdog: exactly one of the generation and its deadline claims a dispatch."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from producers.watchdog import GenerationHung, GenerationWatchdog
from rollstream.runtime.procfs import is_running

ROOT = Path(__file__).resolve().parents[1]


def test_a_block_within_its_deadline_is_never_expired() -> None:
    calls: list[int] = []
    with GenerationWatchdog(5.0, lambda: calls.append(1)) as dog:
        pass
    time.sleep(0.05)
    assert not dog.expired and calls == []


def test_no_deadline_starts_no_thread() -> None:
    with GenerationWatchdog(None, lambda: None) as dog:
        assert dog._thread is None


def test_a_block_past_its_deadline_is_expired_once_and_its_late_result_refused() -> None:
    calls: list[float] = []
    dog = GenerationWatchdog(0.05, lambda: calls.append(1))
    with pytest.raises(GenerationHung, match="deadline"), dog:
        time.sleep(0.3)
    assert dog.expired and calls == [1]


def test_an_error_after_the_deadline_is_chained_to_the_refusal() -> None:
    with pytest.raises(GenerationHung) as info, GenerationWatchdog(0.01, lambda: None):
        time.sleep(0.1)
        raise TimeoutError("engine")
    assert isinstance(info.value.__cause__, TimeoutError)


@pytest.mark.parametrize("timeout_s", [0.001, 0.002, 0.005])
def test_a_race_at_the_deadline_has_exactly_one_winner(timeout_s: float) -> None:
    for _ in range(30):
        expired = threading.Event()
        try:
            with GenerationWatchdog(timeout_s, expired.set):
                time.sleep(timeout_s)
            won_by_block = True
        except GenerationHung:
            won_by_block = False  # raised only once on_expire has run
        assert expired.is_set() != won_by_block


def test_exit_hung_takes_the_engines_processes_with_it() -> None:
    """A producer leaving a hung engine kills its descendants (a child and a grandchild here) and exits."""
    code = (
        "import subprocess, sys, time\n"
        "from producers.watchdog import exit_hung\n"
        "from rollstream.runtime.procfs import descendants\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import subprocess, time; subprocess.Popen([\"sleep\", \"60\"]); time.sleep(60)'])\n"
        "import os\n"
        "for _ in range(100):\n"
        "    if len(descendants(os.getpid())) == 2: break\n"
        "    time.sleep(0.05)\n"
        "print(' '.join(map(str, descendants(os.getpid()))), flush=True)\n"
        "exit_hung(5)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 5, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.05)
    assert not any(is_running(p) for p in pids)

