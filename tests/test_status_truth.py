"""`rollstream status` tells the truth: a trainer whose heart beats while no global step completes is
stalled (`--check` exits 1 and says why), rates come from committed steps over the wall clock, and the
group lag is counted from the stream, right after a Redis restart too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from conftest import P0, PRODUCERS

from rollstream.bus import Publisher, setup_run
from rollstream.cli.main import main
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.ops.embedded_redis import EmbeddedRedis
from rollstream.ops.health import progress_health, trained_rate
from rollstream.ops.status import collect_status
from schemas import StepMetrics


def step_end(g: int, at: float, samples: int = 4) -> StepMetrics:
    """A step_end event of global step g completed at unix time `at`."""
    return StepMetrics(
        type="step_end", global_step=g, local_step=2, sample_count=samples, num_local_updates=2, created_at=at
    )


def test_trained_rate_counts_committed_steps_over_the_wall_clock() -> None:
    ends = [step_end(3, 120.0), step_end(2, 110.0), step_end(1, 100.0)]
    # steps 2 and 3 (8 samples) since step 1, over the 25 s from step 1 to now
    assert trained_rate(ends, now=125.0) == pytest.approx((8 / 25, 60 * 2 / 25))
    # a stall: nothing completed in the last minute, so nothing was trained in it
    assert trained_rate(ends, now=1000.0) == (0.0, 0.0)
    # mid-stall the rate falls with the wall clock instead of holding the last figure
    # (anchor: step 2, the newest before now - 60 s; step 3 came after it)
    assert trained_rate(ends, now=170.0)[0] == pytest.approx(4 / 60)
    assert trained_rate([], now=5.0) == (0.0, 0.0)


def test_progress_states() -> None:
    now = 1000.0
    fresh = {"progress_at": "990", "global_step": "3"}
    assert progress_health(fresh, 60, 10, now=now).state == "ok"
    stalled = progress_health({"progress_at": "800", "global_step": "3"}, 60, 10, now=now)
    assert stalled.state == "stalled" and not stalled.healthy
    assert (
        "no global step completed in 200s (last: 3)" in stalled.why and "heartbeat_stall_s=60" in stalled.why
    )
    assert progress_health({"progress_at": "800", "global_step": "3"}, 60, 10, stopping=True, now=now).healthy
    assert (
        progress_health({"progress_at": "800", "committed_step": "10"}, 60, 10, now=now).state == "finished"
    )
    gone = progress_health({"progress_at": "800", "global_step": "3"}, 60, 10, stopped=True, now=now)
    assert gone.state == "stopped" and not gone.healthy
    # a trainer without progress_at: the newest step_end stands in
    assert progress_health({}, 60, 10, last_step_at=800.0, now=now).state == "stalled"


def test_status_check_fails_on_a_stalled_run_whose_heartbeat_is_fresh(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    setup_run(r, keys, PRODUCERS)
    pub = Publisher(r, nomkstream=False)
    now = time.time()
    for g in (1, 2):
        pub.publish(keys.metrics, step_end(g, now - 400 + 10 * g))
    r.hset(keys.trainer, mapping={"global_step": 2, "heartbeat": now, "progress_at": now - 380})
    argv = [
        "status",
        "--check",
        f"run.name={keys.run}",
        f"run.redis_url={redis_url}",
        "trainer.heartbeat_stall_s=60",
    ]
    code = main(argv)
    out = capsys.readouterr()
    assert code == 1, out.out
    assert "trainer heartbeat" in out.out and "): ok" in out.out  # the heart beats ...
    # ... but nothing moves
    assert "global steps last completed (or start)" in out.out and "STALLED" in out.out
    assert "no global step completed in 38" in out.err and "(last: 2)" in out.err
    assert "trained (committed steps" in out.out and "0.00 samples/s" in out.out
    r.hset(keys.trainer, "progress_at", time.time())  # a step completes: healthy again
    assert main(argv) == 0
    r.hset(keys.trainer, "progress_at", now - 380)
    st = collect_status(r, keys, processes=[{"name": "trainer", "statename": "STOPPING", "description": ""}],
                        stall_after_s=60)
    assert st.healthy  # a trainer being stopped is not stalled


def test_group_lag_is_right_after_a_redis_restart(tmp_path: Path) -> None:
    keys = Keys("lag")
    server = EmbeddedRedis(tmp_path)
    r = server.start()
    try:
        setup_run(r, keys, PRODUCERS)
        for i in range(50):
            r.xadd(keys.rollouts_of(P0), {"i": i})
        got = r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(P0): ">"}, count=50)
        r.xack(keys.rollouts_of(P0), TRAINER_GROUP, *[i for i, _ in got[0][1]])
        # retention-like deletions skew redis' counter
        r.xdel(keys.rollouts_of(P0), *[i for i, _ in got[0][1]][:20])
        r.close()
        server.stop()
        r = server.start()
        groups = {s.name: s for s in collect_status(r, keys).streams}["rollouts:rollout_00"].groups
        assert groups[0]["group"] == "trainer" and groups[0]["lag"] == 0 and groups[0]["pending"] == 0
        for i in range(3):
            r.xadd(keys.rollouts_of(P0), {"i": i})
        groups = {s.name: s for s in collect_status(r, keys).streams}["rollouts:rollout_00"].groups
        assert groups[0]["lag"] == 3
    finally:
        r.close()
        server.stop()
