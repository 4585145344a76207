"""`rollstream replay trainer` end to end: record a live trainer run (fake paced producer, real Redis, CPU),
replay steps 3-6 from the step-2 checkpoint into a new namespace by running the printed command as
printed, and the replayed weights equal the live run's at step 6, bit for bit."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis
from conftest import P0, delete_run
from safetensors.torch import load_file
from test_trainer import FakeProducer, trainer_args

from rollstream.bus import setup_run
from rollstream.cli.main import main
from rollstream.keys import COMMITTED_STEP_FIELD, Keys
from schemas import TRAINED, Fate, decode_fate, encode_fate

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


def model_tensors(path: Path) -> dict[str, object]:
    """The policy weights stored in a trainer checkpoint."""
    return {k: v for k, v in load_file(str(path)).items() if k.startswith("model/")}


def fates(r: redis.Redis, keys: Keys, first: int, last: int) -> list[tuple[str, str]]:
    """(sample_id, fate) of steps first..last in commit order."""
    rows = r.xrange(keys.fates, min=f"{first}-0", max=f"{last}-{2**64 - 1}")
    return [(fate.sample_id, fate.fate) for fate in (decode_fate(f) for _, f in rows)]


def test_replay_steps_3_to_6_from_the_step_2_checkpoint_equals_the_live_weights(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "runs"
    live = [*trainer_args(keys, redis_url, run_dir, STEPS), "trainer.keep_checkpoints=10"]
    producer = FakeProducer(r, keys)
    producer.start()
    try:
        proc = subprocess.run(live, cwd=ROOT, capture_output=True, text=True, timeout=240)
    finally:
        producer.stop.set()
        producer.join(timeout=5)
    assert proc.returncode == 0, proc.stderr[-3000:]

    dst = Keys(keys.run + "-replay")
    try:
        overrides = [a for a in live[3:] if "=" in a and not a.startswith("run.name=")]
        code = main(["replay", "trainer", "--from", keys.run, "--to", dst.run, "--steps", "3-6",
                     "pipeline.yaml", *overrides])
        out = capsys.readouterr().out
        assert code == 0, out
        command = out.strip().splitlines()[-1].strip()
        assert "--burst" in command and "trainer.total_training_steps=6" in command

        t0 = time.monotonic()
        replay = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=240)  # noqa: S602
        assert replay.returncode == 0, replay.stderr[-3000:]
        assert time.monotonic() - t0 < 240

        # the replay trained exactly the copied samples, with the same fates, and stopped at step 6
        assert fates(r, dst, 3, 6) == fates(r, keys, 3, 6)
        assert r.hget(dst.trainer, COMMITTED_STEP_FIELD) == b"6"
        ckpt = "checkpoints/step-00000006.safetensors"
        want, got = model_tensors(run_dir / keys.run / ckpt), model_tensors(run_dir / dst.run / ckpt)
        assert want.keys() == got.keys() and want
        for name in want:
            assert bool((want[name] == got[name]).all()), name  # type: ignore[attr-defined]
        start = model_tensors(run_dir / dst.run / "checkpoints/step-00000002.safetensors")
        assert any(not bool((start[k] == want[k]).all()) for k in want)  # type: ignore[attr-defined]
    finally:
        delete_run(r, dst)


def test_replay_steps_needs_the_checkpoint_before_the_first_step(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    setup_run(r, keys, [P0])
    r.xadd(keys.rollouts_of(P0), {"x": "1"}, id="5-1")
    r.xadd(keys.fates, encode_fate(Fate(f"{P0}-s", "5-1", TRAINED, 1, 1, 2)), id="2-1")  # type: ignore[arg-type]
    dst = Keys(keys.run + "-replay")
    try:
        code = main(["replay", "trainer", "--from", keys.run, "--to", dst.run, "--steps", "2-2",
                     "pipeline.yaml", f"run.redis_url={redis_url}", f"run.dir={tmp_path}"])
        err = capsys.readouterr().err
        assert code == 1 and "no checkpoint of step 1" in err and "keep_checkpoints" in err
        code = main(["replay", "trainer", "--from", keys.run, "--to", dst.run + "x", "--steps", "2-3",
                     "pipeline.yaml", f"run.redis_url={redis_url}", f"run.dir={tmp_path}"])
        assert code == 1 and "no entries for steps [3]" in capsys.readouterr().err
    finally:
        delete_run(r, dst)
        delete_run(r, Keys(dst.run + "x"))
