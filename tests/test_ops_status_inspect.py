"""`rollstream status`, `inspect`, `tail`, `plot` and `replay trainer` against a run namespace filled with
fake events on the real test Redis."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import redis
from conftest import P0, PRODUCERS, delete_run

from producers.rollout import Trajectory, build_rollout_sample
from rollstream.bus import Publisher, setup_run
from rollstream.cli.main import main
from rollstream.keys import GLOBAL_STEP_FIELD, PARAM_VERSION_FIELD, Keys
from rollstream.model import CharTokenizer
from rollstream.ops.inspect import entry_to_json, read_entry
from rollstream.ops.replay_copy import ReplayCopyError, copy_rollouts
from rollstream.ops.run_target import mask_url, split_password
from rollstream.ops.status import collect_status, format_status, worker_health
from rollstream.tasks import RewardResult
from rollstream.weights.store import publish_weights, register_producer_version
from schemas import (
    TRAINED,
    DeadLetter,
    Fate,
    ProducerStats,
    RolloutSample,
    SyncStepRecord,
    encode,
    encode_fate,
)

ROOT = Path(__file__).resolve().parent.parent


def text_sample(sample_id: str, param_version: int, prompt: str, answers: list[str]) -> RolloutSample:
    """A RolloutSample of the reverse task spelled in the CharTokenizer, built as a producer builds it."""
    tok = CharTokenizer()
    trajectories = [Trajectory(prompt_ids=tok.encode(prompt, add_bos=True), finished=True, num_turns=1,
                               version_start=param_version, version_end=param_version) for _ in answers]
    for t, a in zip(trajectories, answers, strict=True):
        ids = tok.encode(a) + [tok.eos_id]
        t.extend(ids, [-0.5] * len(ids), generated=True)
    rewards = [RewardResult(1.0 if a == prompt[::-1] else 0.0, exact=a == prompt[::-1]) for a in answers]
    return build_rollout_sample(
        sample_id=sample_id,
        epoch=0,
        param_version=param_version,
        producer="rollout_00",
        trajectories=trajectories,
        rewards=rewards,
        raw_prompt=prompt,
        tokenizer=tok,
        rollout_status={},
    )


def fill_run(r: redis.Redis, keys: Keys) -> None:
    """3 rollouts (versions 0, 1, 1), a producer stat, 2 records, params v0..v2, fates, a dead letter."""
    setup_run(r, keys, PRODUCERS)
    pub, pub_new = Publisher(r), Publisher(r, nomkstream=False)
    for i, pv in enumerate((0, 1, 1)):
        pub.publish(keys.rollouts_of(P0), text_sample(f"p-{i}", pv, "123", ["321", "312"]))
    pub.publish(keys.stats_of(P0), ProducerStats(producer="rollout_00", param_version=1, samples=3, tokens=24,
                                            gen_tokens_per_s=10.0, idle_ratio=0.25))
    for step in (1, 2):
        rec = SyncStepRecord(
            global_step=step,
            num_local_updates=2,
            metrics={"critic/rewards/mean": 0.1 * step, "fully_async/trainer/idle_ratio": 0.4},
        )
        pub_new.publish(keys.records, rec, entry_id=f"{step}-1")
    for v in range(3):
        publish_weights(r, keys, v, b"w" * 16, global_step=v, inline_max_bytes=1 << 20)
    r.hset(keys.trainer, mapping={GLOBAL_STEP_FIELD: 2, PARAM_VERSION_FIELD: 2})
    register_producer_version(r, keys, "rollout_00", 1)
    for i, (sid, st) in enumerate((("a", 1), ("b", 1), ("c", 2))):
        r.xadd(keys.fates, encode_fate(Fate(sid, f"{i}-0", TRAINED, st, 2 - st, 2)))  # type: ignore[arg-type]
    orig = encode(text_sample("p-bad", 0, "45", ["54"]))
    pub_new.publish(keys.dead, DeadLetter(source=keys.rollouts_of(P0), source_id="1-0", reason="boom",
                                             fields={k: bytes(v) for k, v in orig.items()}))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the rollstream CLI in-process; returns (exit code, stdout, stderr)."""
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_args(keys: Keys, redis_url: str) -> list[str]:
    """Overrides that point the CLI at the test namespace."""
    return [f"run.name={keys.run}", f"run.redis_url={redis_url}"]


def test_status_reports_streams_groups_versions_staleness_rates(r: redis.Redis, keys: Keys) -> None:
    fill_run(r, keys)
    st = collect_status(r, keys)
    streams = {s.name: s for s in st.streams}
    assert streams["rollouts:rollout_00"].length == 3 and streams["rollouts:rollout_00"].bytes > 0
    trainer_group = streams["rollouts:rollout_00"].groups[0]
    assert (trainer_group["group"], trainer_group["lag"], trainer_group["pending"]) == ("trainer", 3, 0)
    assert st.dead == 1 and st.param_version == 2 and st.trainer["global_step"] == "2"
    assert st.producer_versions == {"rollout_00": 1}
    assert st.staleness == {1: 2, 2: 1} and st.staleness_source.startswith("fates")
    assert st.samples_per_s == 0.0 and st.steps_per_min == 0.0  # rates come from committed steps: none here
    assert st.producer_idle == {"rollout_00": 0.25} and st.trainer_idle == pytest.approx(0.4)
    text = format_status(st, "redis://x")
    assert "rollouts" in text and "trainer 0 / 3" in text and "rollout_00=1" in text


def test_status_estimates_staleness_from_rollouts_without_fates(r: redis.Redis, keys: Keys) -> None:
    fill_run(r, keys)
    r.delete(keys.fates)
    st = collect_status(r, keys)
    # next global step is 3: versions 0, 1, 1 -> staleness 3, 2, 2
    assert st.staleness == {2: 2, 3: 1} and st.staleness_source.startswith("rollouts")


def test_status_cli_masks_password(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    fill_run(r, keys)
    code, out, _ = cli(capsys, "status", *run_args(keys, redis_url))
    assert code == 0 and f"run {keys.run}" in out and "param_version 2" in out
    assert mask_url("rediss://user:s3cret@host:6380/0?ssl_cert_reqs=none") == "rediss://user:***@host:6380/0?ssl_cert_reqs=none"
    assert split_password("redis://:pw@h/1") == ("redis://h/1", "pw")


def test_worker_health_states() -> None:
    now = 1000.0
    assert worker_health({}, 60, now=now)[0].state == "missing"
    assert worker_health({"heartbeat": "990.5"}, 60, now=now)[0].state == "ok"
    stalled = worker_health({"heartbeat": "900", "global_step": "3"}, 60, total_steps=10, now=now)[0]
    assert (stalled.state, stalled.age_s, stalled.healthy) == ("stalled", 100.0, False)
    assert (
        worker_health({"heartbeat": "900", "committed_step": "10"}, 60, total_steps=10, now=now)[0].state
        == "finished"
    )
    # a data-parallel trainer: one line per rank, from its own heartbeat
    ranks = worker_health(
        {"world_size": "3", "heartbeat": "999", "heartbeat:r0": "999", "heartbeat:r2": "900"}, 60, now=now
    )
    assert [(w.name, w.state) for w in ranks] == [
        ("trainer-r0", "ok"),
        ("trainer-r1", "missing"),
        ("trainer-r2", "stalled"),
    ]


def test_status_check_exits_nonzero_for_a_stalled_or_missing_trainer(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    fill_run(r, keys)  # the trainer hash has no heartbeat
    code, out, _ = cli(capsys, "status", "--check", *run_args(keys, redis_url))
    assert code == 1 and "trainer heartbeat never" in out and "MISSING" in out
    r.hset(keys.trainer, "heartbeat", time.time())
    code, out, _ = cli(capsys, "status", "--check", *run_args(keys, redis_url))
    assert code == 0 and "(limit 120s): ok" in out
    r.hset(keys.trainer, "heartbeat", time.time() - 90)
    code, out, _ = cli(
        capsys, "status", "--check", *run_args(keys, redis_url), "trainer.heartbeat_stall_s=60"
    )
    assert code == 1 and "STALLED" in out
    code, _, _ = cli(capsys, "status", *run_args(keys, redis_url), "trainer.heartbeat_stall_s=60")
    assert code == 0  # without --check the screen is informational
    code, out, _ = cli(
        capsys,
        "status",
        "--check",
        *run_args(keys, redis_url),
        "trainer.heartbeat_stall_s=60",
        "trainer.total_training_steps=2",
    )
    assert code == 0 and ": finished" in out  # the trainer reached its last step


def test_inspect_rollout_decodes_text_and_summarises_arrays(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    fill_run(r, keys)
    code, out, _ = cli(capsys, "inspect", "rollouts:rollout_00", "-3", *run_args(keys, redis_url))
    assert code == 0
    doc = json.loads(out)
    assert doc["event"]["sample_id"] == "p-0"
    assert doc["text"] == [{"prompt": "123", "response": "321", "reward": 1.0},
                           {"prompt": "123", "response": "312", "reward": 0.0}]
    lp = doc["event"]["full_batch"]["tokens"]["rollout_log_probs"]
    assert lp["dtype"] == "float32" and lp["shape"] == [8] and lp["max"] <= 0 and len(lp["first"]) == 8
    code, out, _ = cli(capsys, "inspect", "rollouts:rollout_00", "--full", *run_args(keys, redis_url))
    full = json.loads(out)
    assert full["event"]["sample_id"] == "p-2"
    assert full["event"]["full_batch"]["response_ids"][:3] == CharTokenizer().encode("321")


def test_inspect_records_by_step_dead_letters_and_plain_streams(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    fill_run(r, keys)
    code, out, _ = cli(capsys, "inspect", "records", "2", *run_args(keys, redis_url))
    assert code == 0 and json.loads(out)["event"]["global_step"] == 2
    code, out, _ = cli(capsys, "inspect", "dead", *run_args(keys, redis_url))
    dead = json.loads(out)
    assert dead["event"]["reason"] == "boom" and dead["original"]["text"][0]["response"] == "54"
    code, out, _ = cli(capsys, "inspect", "fates", "-1", *run_args(keys, redis_url))
    assert json.loads(out)["fields"] == {
        "sample_id": "c",
        "source_id": "2-0",
        "fate": "trained",
        "staleness": "2",
        "param_version": "0",
        "global_step": "2",
    }
    code, _, err = cli(capsys, "inspect", "records", "9", *run_args(keys, redis_url))
    assert code == 1 and "no entry 9" in err
    code, _, err = cli(capsys, "inspect", "nope", *run_args(keys, redis_url))
    assert code == 1 and "unknown stream" in err


def test_read_entry_counts_from_the_end(r: redis.Redis, keys: Keys) -> None:
    fill_run(r, keys)
    entry_id, fields = read_entry(r, keys.rollouts_of(P0), "-2")
    assert entry_to_json("rollouts", entry_id, fields)["header"]["sample_id"] == "p-1"


def test_tail_prints_recent_then_follows_new_entries(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    fill_run(r, keys)
    timer = threading.Timer(0.3, lambda: r.xadd(keys.fates, encode_fate(Fate("d", "3-0", TRAINED, 3, 0, 3))))  # type: ignore[arg-type]
    timer.start()
    code, out, _ = cli(
        capsys, "tail", "fates", "--count", "1", "--exit-after", "2", *run_args(keys, redis_url)
    )
    timer.join()
    lines = [json.loads(x) for x in out.splitlines()]
    assert code == 0 and [x["fields"]["sample_id"] for x in lines] == ["c", "d"]


def test_plot_writes_png_from_records_and_from_jsonl(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    fill_run(r, keys)
    png = tmp_path / "reward.png"
    code, out, _ = cli(capsys, "plot", *run_args(keys, redis_url), "--out", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "2 records" in out
    run_dir = tmp_path / "runs" / "gone"
    run_dir.mkdir(parents=True)
    rows = [
        {"global_step": s, "metrics": {"critic/rewards/mean": s / 10, "val/acc": s / 20}} for s in (1, 2, 3)
    ]
    (run_dir / "records.jsonl").write_text("\n".join(json.dumps(x) for x in rows))
    png2 = tmp_path / "offline.png"
    code, out, _ = cli(capsys, "plot", "run.name=gone", "run.redis_url=redis://127.0.0.1:1/0",
                       f"run.dir={tmp_path / 'runs'}", "--out", str(png2))
    assert code == 0 and png2.stat().st_size > 1000 and "3 records" in out


def test_replay_trainer_copies_a_range_into_a_new_namespace(
    capsys: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    fill_run(r, keys)
    ids = [e[0].decode() for e in r.xrange(keys.rollouts_of(P0))]
    dst = Keys(keys.run + "-replay")
    try:
        code, out, _ = cli(capsys, "replay", "trainer", "--from", keys.run, "--to", dst.run,
                           "--start", ids[1], *run_args(keys, redis_url))
        assert code == 0 and "copied 2 rollouts" in out and f"run.name={dst.run} --burst" in out
        assert [e[0].decode() for e in r.xrange(dst.rollouts_of(P0))] == ids[1:]
        assert r.xinfo_groups(dst.rollouts_of(P0))[0]["lag"] == 2
        with pytest.raises(ReplayCopyError, match="already has entries"):
            copy_rollouts(r, keys, dst)
    finally:
        delete_run(r, dst)


def test_bench_fails_clearly_when_the_module_is_missing(capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capfd, "bench", "no_such_bench")
    assert code == 1 and "no benchmark 'no_such_bench'" in err


def test_replay_records_refolds_into_a_new_run(
    capfd: pytest.CaptureFixture[str], r: redis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    dst = Keys(keys.run + "-rec")
    try:  # run.dir: not ./runs, where a demo run's ACL secrets would be used against the test Redis
        code, out, _ = cli(capfd, "replay", "records", "--from", keys.run, "--to", dst.run,
                           str(ROOT / "pipeline.yaml"), f"run.redis_url={redis_url}", f"run.dir={tmp_path}")
        assert code == 0 and f"from run '{keys.run}'" in out
    finally:
        delete_run(r, dst)
