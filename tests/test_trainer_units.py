"""Trainer pieces: staleness edges, checkpoint round trip, idempotent commit, one learner update."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from conftest import P0, PRODUCERS
from safetensors.torch import load_file, save_file

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.checkpoint import (
    META_VERSION,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from consumers.trainer.learner import Learner
from consumers.trainer.ledger import StepLedger, commit_steps, committed_sample_ids
from consumers.trainer.staleness import dropped_metrics, staleness
from rollstream.bus import setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import COMMITTED_STEP_FIELD, TRAINER_GROUP, Keys
from rollstream.testing.fakes import fake_rollout_sample, leased_fakes
from schemas import (
    DROPPED,
    TRAINED,
    Fate,
    StepMetrics,
    decode,
    decode_fate,
    decode_payload,
    encode,
    encode_payload,
)

TINY = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32", "run.device=cpu"]


def test_staleness_threshold_keeps_k_and_drops_k_plus_one(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    import threading

    from consumers.trainer.loop import Trainer

    k = 2
    assert staleness(global_step=5, param_version=4) == 1  # on-policy
    cfg = load_config(
        None,
        TINY
        + [
            f"run.name={keys.run}",
            f"run.dir={tmp_path}",
            "actor.ppo_mini_batch_size=2",
            "data.train_batch_size=4",
            f"trainer.max_off_policy_threshold={k}",
        ],
    )
    setup_run(r, keys, PRODUCERS)
    too_old, edge, fresh = "rollout_00-0", "rollout_00-1", "rollout_00-2"
    for sample, version in zip(leased_fakes(r, keys, 3, n=2, prompt_len=5, response_len=6, seed=0),
                               (5 - k - 1, 5 - k, 4), strict=True):
        sample.param_version = version
        r.xadd(keys.rollouts_of(P0), encode(sample))  # type: ignore[arg-type]
    trainer = Trainer(cfg, r, keys, "trainer", threading.Event(), burst=True)  # burst: returns once drained
    trainer.collector.newest_published = 4
    ledger = StepLedger(5)
    # global step 5 through the consumer loop: staleness k kept, k+1 dropped
    got = trainer.collector.collect(5, ledger)
    assert got is not None
    kept, dropped = got.kept, got.dropped
    assert got.dropped_lengths == [6.0] and got.evicted == []
    assert [(m.event.sample_id, st) for m, st in kept] == [(edge, k), (fresh, 1)]  # type: ignore[union-attr]
    assert dropped == [k + 1] and [(f.sample_id, f.fate) for f in ledger.fates] == [(too_old, DROPPED)]
    assert int(r.get(keys.consumed)) == 1  # type: ignore[arg-type]  # the drop is counted at once
    assert dropped_metrics([]) == {"training/off_policy/dropped_samples": 0.0}
    m = dropped_metrics([3, 5])
    assert m["training/off_policy/dropped_samples"] == 2
    assert m["training/off_policy/dropped_samples_staleness/mean"] == 4
    assert m["training/off_policy/dropped_samples_staleness/max"] == 5
    assert m["training/off_policy/dropped_samples_staleness/min"] == 3


def _batch(n_samples: int = 2) -> object:
    samples = [
        fake_rollout_sample(f"s{i}", n=4, prompt_len=5, response_len=6, seed=i) for i in range(n_samples)
    ]
    return assemble_batch_from_rollout_samples(samples)[0]


def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    cfg = load_config(None, TINY + ["actor.ppo_mini_batch_size=2", "data.train_batch_size=4"])
    a = Learner(cfg)
    a.update(_batch())  # non-trivial optimizer state
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    meta = {"param_version": 1, "steps": [{"anything": [1, 2]}]}
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, a.policy, a.optimizer, meta)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]  # keeps the last 2
    expected_draws = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])

    b = Learner(cfg)  # fresh weights and an empty optimizer
    torch.manual_seed(0)
    got = load_checkpoint(list_checkpoints(tmp_path)[-1][1], b.policy, b.optimizer)
    assert got["global_step"] == 3 and got["steps"] == [{"anything": [1, 2]}]
    for (na, pa), (nb, pb) in zip(
        a.policy.module.named_parameters(), b.policy.module.named_parameters(), strict=True
    ):
        assert na == nb and torch.equal(pa, pb)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == [dict(g, betas=tuple(g["betas"])) for g in sb["param_groups"]]
    for idx, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][idx][name]), (idx, name)
    draws = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(draws[0], expected_draws[0])
    np.testing.assert_array_equal(draws[1], expected_draws[1])
    assert draws[2] == expected_draws[2]
    # the same next update from both
    ma, mb = a.update(_batch()), b.update(_batch())
    assert ma["actor/pg_loss"] == mb["actor/pg_loss"] and ma["actor/grad_norm"] == mb["actor/grad_norm"]


def test_learner_update_reports_metrics_and_changes_weights() -> None:
    cfg = load_config(
        None, TINY + ["actor.ppo_mini_batch_size=2", "data.train_batch_size=4", "actor.kl_loss_coef=0.1"]
    )
    learner = Learner(cfg)
    before = learner.policy.state_dict_bytes()
    learner.begin_step()
    m = learner.update(_batch())
    assert learner.policy.state_dict_bytes() != before
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/kl_loss",
                "critic/rewards/mean", "response_length/mean", "perf/total_num_tokens",
                "global_seqlen/min", "global_seqlen/max", "timing_s/update_actor", "timing_s/old_log_prob"):
        assert np.isfinite(m[key]), key
    assert m["perf/total_num_tokens"] == 8 * 11  # 8 rows of 5 prompt + 6 response tokens
    # first update of a step: prox == current weights, so the IS weight is pi_prox/pi_behave only
    assert m["rollout_corr/rollout_is_mean"] > 0
    assert m["training/rollout_probs_diff_valid"] == 1.0 and m["training/rollout_probs_diff_max"] >= 0


def test_commit_is_atomic_and_a_replay_is_harmless(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys, PRODUCERS)
    samples = leased_fakes(r, keys, 3, n=1)
    ids = [r.xadd(keys.rollouts_of(P0), encode(s)).decode() for s in samples]  # type: ignore[union-attr,arg-type]
    sids = [s.sample_id for s in samples]
    r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(P0): ">"})
    ledger = StepLedger(
        1,
        fates=[
            Fate(sids[0], ids[0], TRAINED, 1, 0, 1),
            Fate(sids[1], ids[1], TRAINED, 1, 0, 1),
            Fate(sids[2], ids[2], DROPPED, 3, -2, 1),
        ],
        ack_ids=[(keys.rollouts_of(P0), i) for i in ids],
        step_end=StepMetrics(
            type="step_end", global_step=1, local_step=2, sample_count=2, num_local_updates=2
        ),
    )
    commit_steps(r, keys, [ledger], param_version=1)
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0
    assert [e[0] for e in r.xrange(keys.fates)] == [b"1-1", b"1-2", b"1-3"]
    assert [decode_fate(f) for _, f in r.xrange(keys.fates)] == ledger.fates
    assert committed_sample_ids(r, keys) == set(sids)
    assert int(r.get(keys.consumed)) == 3
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) == b"1"
    ends = [decode(f) for _, f in r.xrange(keys.metrics) if f[b"type"] == b"step_end"]
    assert len(ends) == 1 and ends[0].global_step == 1
    # replaying the same commit: fates refused by Redis, nothing raised, nothing double-written
    commit_steps(r, keys, [StepLedger.from_plain(ledger.to_plain())], param_version=1)
    assert r.xlen(keys.fates) == 3
    assert int(r.get(keys.consumed)) == 3  # each prompt is counted once
    assert sum(1 for _, f in r.xrange(keys.metrics) if f[b"type"] == b"step_end") == 1


def test_resume_redoes_a_commit_cut_short_and_publishes_the_missing_version(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    import threading

    from consumers.trainer.loop import Trainer
    from rollstream.pacing.budget import current_budget
    from schemas import ParamVersion

    cfg = load_config(None, TINY + [f"run.name={keys.run}", f"run.dir={tmp_path}", "trainer.test_freq=0",
                                    "actor.ppo_mini_batch_size=1", "data.train_batch_size=2"])
    setup_run(r, keys, PRODUCERS)
    samples = leased_fakes(r, keys, 2, n=2)
    ids = [r.xadd(keys.rollouts_of(P0), encode(s)).decode() for s in samples]  # type: ignore[union-attr,arg-type]
    s0, s1 = (s.sample_id for s in samples)
    r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(P0): ">"})
    # a crash right after the step-1 checkpoint: nothing published, nothing committed
    first = Trainer(cfg, r, keys, "trainer", threading.Event())
    ledger = StepLedger(
        1,
        [Fate(s0, ids[0], TRAINED, 1, 0, 1), Fate(s1, ids[1], TRAINED, 1, 0, 1)],
        [(keys.rollouts_of(P0), i) for i in ids],
        StepMetrics(type="step_end", global_step=1, local_step=2, sample_count=2, num_local_updates=2),
    )
    save_checkpoint(first.ckpt_dir, 1, first.learner.policy, first.learner.optimizer,
                    {"param_version": 1, "steps": [ledger.to_plain()]})
    for _ in range(2):  # the second resume finds everything done and changes nothing
        t = Trainer(cfg, r, keys, "trainer", threading.Event())
        t.resume()
        t.effects.stop_leaser()
        assert t.global_step == 1 and t.collector.seen == {s0, s1}
        assert [ev.version for ev in (decode(f) for _, f in r.xrange(keys.params))
                if isinstance(ev, ParamVersion)] == [1]
        assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0
        assert r.xlen(keys.fates) == 2 and int(r.get(keys.consumed)) == 2
        assert sum(1 for _, f in r.xrange(keys.metrics) if f[b"type"] == b"step_end") == 1
        assert current_budget(r, keys)[0] == 1


def _one_leased_step(r: redis.Redis, keys: Keys, run_dir: Path) -> tuple[PipelineConfig, StepLedger]:
    """A run validating and checkpointing every step, and step 1's ledger over two leased fake samples the
    trainer group has read (nothing committed yet)."""
    cfg = load_config(None, TINY + [f"run.name={keys.run}", f"run.dir={run_dir}", "trainer.test_freq=1",
                                    "trainer.save_freq=1", "data.val_size=4"])
    setup_run(r, keys, PRODUCERS)
    samples = leased_fakes(r, keys, 2, n=2)
    ids = [r.xadd(keys.rollouts_of(P0), encode(s)).decode() for s in samples]  # type: ignore[union-attr,arg-type]
    r.xreadgroup(TRAINER_GROUP, "trainer", {keys.rollouts_of(P0): ">"})
    return cfg, StepLedger(
        1,
        [Fate(s.sample_id, i, TRAINED, 1, 0, 1) for s, i in zip(samples, ids, strict=True)],
        [(keys.rollouts_of(P0), i) for i in ids],
    )


def test_the_checkpoint_is_written_while_the_version_validates_and_commits_only_once_durable(
    r: redis.Redis, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    import consumers.trainer.loop as loop_module
    from consumers.trainer.loop import Trainer

    cfg, ledger = _one_leased_step(r, keys, tmp_path)
    seen_while_validating: list[bool] = []
    began_during_validation: list[bool] = []
    validating = threading.Event()
    real_validate, real_writer = loop_module.validate, loop_module.checkpoint_writer

    def writer_after_validation_starts(*args: object, **kwargs: object) -> object:
        """The real writer, made to start writing only once validation has begun (up to 20 s)."""
        write = real_writer(*args, **kwargs)  # type: ignore[arg-type]

        def gated() -> Path:
            began_during_validation.append(validating.wait(20))
            return write()
        return gated

    def slow_validate(*args: object) -> dict[str, float]:
        """Validation that waits (up to 20 s) for step 1's checkpoint and then draws from every RNG."""
        validating.set()
        deadline = time.monotonic() + 20
        while not checkpoint_path(t.ckpt_dir, 1).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen_while_validating.append(checkpoint_path(t.ckpt_dir, 1).exists())
        torch.rand(3), np.random.rand(), random.random()
        return real_validate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop_module, "validate", slow_validate)
    monkeypatch.setattr(loop_module, "checkpoint_writer", writer_after_validation_starts)
    t = Trainer(cfg, r, keys, "trainer", threading.Event())
    t.resume()  # version 0 validates too (no checkpoint is due)
    seen_while_validating.clear()
    validating.clear()
    torch_rng, py_rng = torch.get_rng_state(), random.getstate()
    t._finish_step(1, ledger, time.perf_counter())
    t.effects.stop_leaser()
    # the write ran beside validation, the commit waited for it, and validation drew no RNG state away
    assert began_during_validation == [True] and seen_while_validating == [True]
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) == b"1"
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == py_rng
    saved = load_file(str(checkpoint_path(t.ckpt_dir, 1)))
    assert torch.equal(saved["rng/torch"], torch_rng)
    step_end = [decode(f) for _, f in r.xrange(keys.metrics) if f[b"type"] == b"step_end"]
    assert [ev.global_step for ev in step_end] == [1]  # type: ignore[union-attr]
    m = step_end[0].metrics  # type: ignore[union-attr]
    assert m["timing_s/checkpoint"] > 0 and m["timing_s/checkpoint_wait"] >= 0


def test_a_checkpoint_that_fails_to_write_commits_nothing(
    r: redis.Redis, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    import consumers.trainer.loop as loop_module
    from consumers.trainer.loop import Trainer

    cfg, ledger = _one_leased_step(r, keys, tmp_path)

    def failing_writer(*args: object, **kwargs: object) -> object:
        def write() -> Path:
            raise OSError(28, "No space left on device")
        return write

    monkeypatch.setattr(loop_module, "checkpoint_writer", failing_writer)
    t = Trainer(cfg, r, keys, "trainer", threading.Event())
    t.resume()
    with pytest.raises(OSError, match="No space left"):
        t._finish_step(1, ledger, time.perf_counter())
    t.effects.stop_leaser()
    assert r.hget(keys.trainer, COMMITTED_STEP_FIELD) in (None, b"0")  # nothing acked, nothing in fates
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 2 and r.xlen(keys.fates) == 0


def test_a_checkpoint_with_old_format_metadata_loads_upgraded(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Metadata written before it had a version (fates with `entry_id`, no `global_step`) is upgraded on
    load, and committing its steps writes the same fates entries as current metadata would; its bare ack ids
    (of the shared `rollouts` stream this version no longer reads) are dropped; it kept no earlier commits."""
    cfg = load_config(None, TINY + ["actor.ppo_mini_batch_size=2", "data.train_batch_size=4"])
    learner = Learner(cfg)
    path = save_checkpoint(tmp_path, 4, learner.policy, learner.optimizer, {"param_version": 4, "steps": []})
    tensors = load_file(str(path))
    meta = decode_payload(tensors["meta/payload"].numpy().tobytes())
    assert meta.pop("meta_version") == META_VERSION == 4
    meta["steps"] = [
        {  # what the trainer wrote before metadata versions (layout 1)
            "global_step": 4,
            "fates": [
                {"sample_id": "s0", "entry_id": "5-0", "fate": "trained", "staleness": 1, "param_version": 3},
                {"sample_id": "s1", "entry_id": "6-0", "fate": "dropped", "staleness": 3, "param_version": 1},
            ],
            "ack_ids": ["5-0", "6-0"],
            "step_end": None,
        }
    ]
    tensors["meta/payload"] = torch.frombuffer(bytearray(encode_payload(meta)), dtype=torch.uint8)
    save_file(tensors, str(checkpoint_path(tmp_path, 4)))

    got = load_checkpoint(checkpoint_path(tmp_path, 4), Learner(cfg).policy, Learner(cfg).optimizer)
    assert "meta_version" not in got and got["param_version"] == 4
    assert got["committed"] == []  # layout 4: no earlier commits were kept
    (ledger,) = [StepLedger.from_plain(d) for d in got["steps"]]
    assert ledger.fates == [Fate("s0", "5-0", TRAINED, 1, 3, 4), Fate("s1", "6-0", DROPPED, 3, 1, 4)]
    assert ledger.dropped == 1 and ledger.ack_ids == []
    setup_run(r, keys, PRODUCERS)
    commit_steps(r, keys, [ledger], param_version=4)
    assert [(i, f) for i, f in r.xrange(keys.fates)] == [
        (b"4-1", {b"sample_id": b"s0", b"source_id": b"5-0", b"fate": b"trained", b"staleness": b"1",
                  b"param_version": b"3", b"global_step": b"4"}),
        (b"4-2", {b"sample_id": b"s1", b"source_id": b"6-0", b"fate": b"dropped", b"staleness": b"3",
                  b"param_version": b"1", b"global_step": b"4"}),
    ]


def test_a_checkpoint_from_a_newer_rollstream_is_refused(tmp_path: Path) -> None:
    cfg = load_config(None, TINY + ["actor.ppo_mini_batch_size=2", "data.train_batch_size=4"])
    learner = Learner(cfg)
    path = save_checkpoint(tmp_path, 1, learner.policy, learner.optimizer, {"param_version": 1, "steps": []})
    tensors = load_file(str(path))
    meta = decode_payload(tensors["meta/payload"].numpy().tobytes())
    meta["meta_version"] = META_VERSION + 1
    tensors["meta/payload"] = torch.frombuffer(bytearray(encode_payload(meta)), dtype=torch.uint8)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="newer than"):
        load_checkpoint(path, learner.policy, learner.optimizer)


def test_an_effect_is_retried_whole_under_its_name(caplog: pytest.LogCaptureFixture) -> None:
    """The one retry policy: a connection loss inside an effect repeats the whole effect, and the retry
    warning names it with its arguments."""
    import logging

    from consumers.trainer.effects import TrainerEffects
    from rollstream.bus.connection import retried as effect

    class Flaky(TrainerEffects):
        def __init__(self) -> None:  # no Redis: the effect's body is what is tested
            self.calls: list[int] = []

        @effect("granting version {version}")
        def grant(self, version: int) -> None:
            self.calls.append(version)
            if len(self.calls) == 1:
                raise redis.ConnectionError("gone")

    flaky = Flaky()
    with caplog.at_level(logging.WARNING, logger="rollstream.bus.connection"):
        flaky.grant(3)
    assert flaky.calls == [3, 3]
    assert "granting version 3 failed, redis unavailable" in caplog.text


def test_a_best_effort_effect_gives_up_at_its_deadline_and_a_refused_login_is_never_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`effect(until=...)`: retried until the deadline, then given up with a warning (None back); a plain
    effect raises a refused login at once (the process exits with EXIT_REFUSED)."""
    import logging
    import time

    from consumers.trainer.effects import TrainerEffects
    from rollstream.bus.connection import retried as effect

    class Gone(TrainerEffects):
        def __init__(self) -> None:  # no Redis: the policy is what is tested
            self.calls = 0

        @effect("settling", until="deadline")
        def settle(self, deadline: float) -> None:
            self.calls += 1
            raise redis.ConnectionError("gone")

        @effect("granting")
        def refused(self) -> None:
            self.calls += 1
            raise redis.AuthenticationError("user is off")

    gone = Gone()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="consumers.trainer.loop"):
        assert gone.settle(time.monotonic() + 0.3) is None
    assert time.monotonic() - t0 < 2.0 and gone.calls >= 1
    assert "settling: given up, redis unreachable until its deadline" in caplog.text
    gone.calls = 0
    with pytest.raises(redis.AuthenticationError):
        gone.refused()
    assert gone.calls == 1


@pytest.mark.parametrize(("size", "batch"), [(3, "64"), (0, "null"), (3, "2")])
def test_validation_re_decodes_only_the_newest_val_recent_size_trained_prompts(
    size: int, batch: str, r: redis.Redis, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import consumers.trainer.evaluate as evaluate_module
    from consumers.trainer.loop import Trainer
    from rollstream.tasks import Prompt

    decoded: list[list[str]] = []
    batches: list[int] = []
    real = evaluate_module.evaluate

    def spy(policy: object, task: object, prompts: list[Prompt], limit: int, batch: int, turns: int) -> dict:
        decoded.append([p.uid for p in prompts])
        batches.append(batch)
        return real(policy, task, prompts, limit, batch, turns)  # type: ignore[arg-type]

    monkeypatch.setattr(evaluate_module, "evaluate", spy)
    cfg = load_config(None, TINY + [f"run.name={keys.run}", f"run.dir={tmp_path}", "data.val_size=4",
                                    f"data.val_recent_size={size}", f"data.val_batch_size={batch}"])
    setup_run(r, keys, PRODUCERS)
    trainer = Trainer(cfg, r, keys, "trainer", threading.Event())
    trainer.recent.extend(Prompt(uid=f"p{i}", text=f"{i}12>", answer=f"21{i}") for i in range(10))
    metrics = evaluate_module.validate(cfg, trainer.learner.policy, trainer.dp, list(trainer.recent))
    assert len(decoded[0]) == 4  # the held-out prompts
    assert decoded[1] == [f"p{i}" for i in range(10 - size, 10)]  # the newest `size` trained prompts
    assert ("val/recent_train_acc" in metrics) == (size > 0) and "val/acc" in metrics
    # data.val_batch_size: prompts per greedy batch, null = each set in one batch
    assert batches == ([4, max(size, 1)] if batch == "null" else [int(batch)] * 2)


def test_a_local_updates_metrics_are_put_together_in_one_place() -> None:
    """metrics.local_update_metrics + step_report.local_update_event: the learner's metrics, then the batch's
    (a later part wins a shared name), the collection's, the run's stale counters (advanced) and the timings;
    non-finite values are left out and counted."""
    from consumers.trainer.collect import Collected
    from consumers.trainer.metrics import UpdateTimings, local_update_metrics
    from consumers.trainer.staleness import DROPPED_SAMPLES, STALE_SAMPLES, STALE_TRAJECTORIES
    from consumers.trainer.step_report import local_update_event

    counters = {STALE_SAMPLES: 2, STALE_TRAJECTORIES: 5}
    learned = {"actor/loss": 0.5, "shared": 1.0, "actor/grad_norm": float("nan")}
    got = Collected(dropped=[4, 6])
    metrics, fg = local_update_metrics(3, got, learned, {"shared": 2.0}, [0, 2, 1], counters,
                                       UpdateTimings(gen=1.5, assemble=0.25, transport=0.125), False)
    ev = local_update_event(3, 2, 1, len(got.kept), metrics, fg)
    m = ev.metrics
    assert (ev.type, ev.global_step, ev.local_step, ev.rank, ev.sample_count) == ("local_update", 3, 2, 1, 0)
    assert m["actor/loss"] == 0.5 and m["shared"] == 2.0 and "actor/grad_norm" not in m
    assert m["actor/nonfinite_metrics"] == 1.0
    assert m[DROPPED_SAMPLES] == 2.0 and m["training/global_step"] == 3.0
    assert counters == {STALE_SAMPLES: 2, STALE_TRAJECTORIES: 7}  # two trajectories older than version 2
    assert m[f"fully_async/count/{STALE_TRAJECTORIES}"] == 7.0
    assert (m["timing_s/gen"], m["timing_s/assemble"], m["timing_s/transport"]) == (1.5, 0.25, 0.125)
    assert m["fully_async/total_wait_time"] == 1.5


@pytest.mark.parametrize(
    ("rank", "world", "strategy", "main", "agreed", "whole_model"),
    [(0, 1, "ddp", True, False, True), (1, 2, "ddp", False, True, False), (0, 2, "ddp", True, True, True),
     (1, 2, "fsdp", False, True, True), (0, 1, "fsdp", True, False, True)],
)
def test_a_ranks_roles_are_read_off_its_place_and_the_strategy(
    rank: int, world: int, strategy: str, main: bool, agreed: bool, whole_model: bool
) -> None:
    """RankRoles: rank 0 alone is `main`; several ranks agree; under fsdp every rank takes part in what needs
    the whole model (validation, the optimizer state), under ddp rank 0 alone."""
    from consumers.trainer.roles import RankInfo, RankRoles

    roles = RankRoles.of(RankInfo(rank, world), strategy)
    assert (roles.main, roles.agreed, roles.whole_model) == (main, agreed, whole_model)
    assert roles.sharded == (strategy == "fsdp")
