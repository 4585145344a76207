"""Issue 24's findings, each under the role's real ACL user (the users `rollstream run` creates, on a private
redis-server): what a credential may no longer do, and what the audit now sees (docs/GUARANTEES.md).

Issue 41's table, row by row (all under the real users): non-canonical seq forms and `²`, `version=abc`,
`version=0`, `published=x`, the last possible id and the impersonated id are in tests/test_producer_input.py
(which imports this module's fixture); `want=10^9` while publishing nothing, the floods (a free-form key, an
oversized key, a flooded stream) are below; the aggregator's trim of `records` and `dead:aggregator` (item 5:
refused by design, its outboxes) at the end, where what docs/GUARANTEES.md still lists as possible (memory
up to the bound) is a strict xfail, and a lease held without progress is taken back after 3 dispatch times."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis
import torch
from conftest import P0
from test_producer import context, small_cfg, start_run
from test_security import PRODUCERS, _permitted, private_redis  # noqa: F401  (a fixture)

from consumers.aggregator.worker import AggregatorWorker
from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.guard import value_reason
from consumers.trainer.leaser import Leaser
from consumers.trainer.ledger import StepLedger
from consumers.trainer.metrics import UPDATE_SKIPPED
from consumers.trainer.roles import RankRoles
from producers.publish import PublishError
from producers.worker import Producer
from rollstream.bus import GroupReader, Publisher, connect, retry_on_connection, setup_run
from rollstream.bus.connection import watch_busy_scripts
from rollstream.bus.outbox import OutboxDrain, pack_item
from rollstream.config import load_config
from rollstream.keys import AGGREGATOR_GROUP, DEAD_LETTERED_FIELD, TRAINER_GROUP, Keys
from rollstream.model import build_policy
from rollstream.ops.acl import ROLES, apply_acl, generate_passwords
from rollstream.ops.audit import audit_run
from rollstream.ops.health import WorkerHealth
from rollstream.ops.status import collect_status, format_status
from rollstream.pacing.budget import ask_lease, grant_budget, lease_outright, mark_published
from rollstream.pacing.counters import lease_of, rollout_counts
from rollstream.tasks import REWARD_RANGE
from rollstream.testing.fakes import fake_metrics_log, fake_rollout_sample, leased_fakes, publish_log
from schemas import SKIPPED, DeadLetter, ProducerStats, SyncStepRecord, decode, decode_as, encode
from schemas.ragged import TOKEN_SCORES

MAX_ID = "18446744073709551615-18446744073709551615"


@dataclass
class Roles:
    """One connection per user of a run, as `rollstream run` sets them up."""

    url: str
    keys: Keys
    admin: redis.Redis
    trainer: redis.Redis
    aggregator: redis.Redis
    producers: dict[str, redis.Redis]
    warden: redis.Redis | None = None  # the run's user manager (rollstream/ops/warden.py)


@pytest.fixture
def roles(private_redis: tuple[str, int], tmp_path: Path) -> Iterator[Roles]:  # noqa: F811
    url, _ = private_redis
    keys = Keys("conf")
    setup_run(redis.Redis.from_url(url), keys, PRODUCERS)
    files = generate_passwords(tmp_path / "secrets", [*ROLES, *PRODUCERS])
    pw = {role: p.read_text() for role, p in files.items()}
    apply_acl(redis.Redis.from_url(url), keys, pw, producers=PRODUCERS)
    yield Roles(
        url,
        keys,
        *(connect(url, username=u, password=pw[u]) for u in ("admin", "trainer", "aggregator")),
        {p: connect(url, username=p, password=pw[p]) for p in PRODUCERS},
        connect(url, username="warden", password=pw["warden"]),
    )


def run_aggregator(cfg: Any, roles: Roles) -> None:
    """The aggregator under its user, in burst mode; then what the live run does next: the trainer moves its
    outboxes into records and dead:aggregator, and the aggregator's next pass feeds the sinks."""
    AggregatorWorker(cfg, roles.aggregator, roles.keys).run(burst=True)
    OutboxDrain(roles.keys).drain(roles.trainer)
    AggregatorWorker(cfg, roles.aggregator, roles.keys).run(burst=True)


def test_a_writer_trimming_its_own_output_shows_in_the_audit(roles: Roles) -> None:
    """Finding 1: XADD's own MAXLEN deletes what ACLs let a writer append to; `entries-added` still counts it.
    Samples the trainer holds pending when they are deleted are dead-lettered (and counted for pacing)."""
    keys, prod = roles.keys, roles.producers["rollout_00"]
    for i in range(3):
        Publisher(prod).publish(keys.rollouts_of(P0), fake_rollout_sample(f"{P0}-{i}", producer=P0))

    def trainer_reader() -> GroupReader:
        return GroupReader(
            roles.trainer,
            keys.rollouts_of(P0),
            TRAINER_GROUP,
            "trainer",
            dead_stream=keys.dead,
            dead_count=(keys.trainer, DEAD_LETTERED_FIELD),
            block_ms=10,
        )

    assert len(trainer_reader().poll(0)) == 3  # delivered, pending until trained
    assert audit_run(roles.admin, keys).problems() == []
    prod.xadd(keys.rollouts_of(P0), {"x": "y"}, maxlen=0, approximate=False)  # what no ACL can refuse
    assert (
        trainer_reader().poll(0) == []
    )  # a restarted trainer re-reads its pending entries: all three are gone
    assert roles.admin.hget(keys.trainer, DEAD_LETTERED_FIELD) == b"3" and roles.admin.xlen(keys.dead) == 3
    # the aggregator may no longer XADD to records or its dead letters (below); their one writer, the
    # trainer, trimming them would show the same way
    roles.trainer.xadd(keys.records, {"x": "y"}, id="1-1")
    roles.trainer.xadd(keys.records, {"x": "y"}, maxlen=0, approximate=False)
    roles.trainer.xadd(keys.dead_aggregator, {"x": "y"}, maxlen=0, approximate=False)
    rep = audit_run(roles.admin, keys)
    assert rep.destroyed == {keys.rollouts_of(P0): 4, keys.records: 2, keys.dead_aggregator: 1}
    assert any(f"4 entries of {keys.rollouts_of(P0)} destroyed" in p for p in rep.problems())
    assert len(rep.dead) == 3 and not rep.pending


def test_the_aggregator_runs_no_script_creates_no_group_and_keeps_off_the_trainers_dead(
    roles: Roles, tmp_path: Path
) -> None:
    """Findings 1, 2, 7: no EVAL (a `while true` script froze Redis), no XGROUP CREATE (a group of its own
    held retention back), and no write to `dead` (it erased the trainer's dead letters); its own dead letters
    work."""
    keys, agg = roles.keys, roles.aggregator
    forbidden = {
        "EVAL": lambda: agg.eval("return 1", 0),
        "XGROUP CREATE metrics": lambda: agg.xgroup_create(keys.metrics, "mine", id="$"),
        "XADD dead": lambda: agg.xadd(keys.dead, {"x": "y"}),
        "XADD dead MAXLEN 0": lambda: agg.xadd(keys.dead, {"x": "y"}, maxlen=0),
    }
    assert [name for name, call in forbidden.items() if _permitted(call)] == []
    roles.trainer.xadd(keys.metrics, {"type": "nonsense"})
    worker = AggregatorWorker(load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"]), agg, keys)
    worker.run(burst=True)
    assert roles.admin.xlen(keys.dead_aggregator) == 0  # in its outbox: the trainer moves it
    assert OutboxDrain(keys).drain(roles.trainer) == 1
    [(_, fields)] = roles.admin.xrange(keys.dead_aggregator)
    assert isinstance(dl := decode(fields), DeadLetter) and dl.source == keys.metrics
    assert roles.admin.xpending(keys.metrics, AGGREGATOR_GROUP)["pending"] == 0


def test_stats_out_of_their_domain_never_reach_records(roles: Roles, tmp_path: Path) -> None:
    """Finding 5: stats of a made-up producer, an idle_ratio of -3, NaN rates and metrics are dead-lettered
    with the reason; records and records.jsonl (strict JSON) hold only the run's producers and finite
    values."""
    keys, prod = roles.keys, roles.producers["rollout_00"]
    bad = [
        ProducerStats(
            producer="rollout_77", param_version=0, samples=5, tokens=5, gen_tokens_per_s=1.0, idle_ratio=0.0
        ),
        ProducerStats(
            producer="rollout_00", param_version=0, samples=1, tokens=1, gen_tokens_per_s=1.0, idle_ratio=-3.0
        ),
        ProducerStats(
            producer="rollout_00",
            param_version=0,
            samples=1,
            tokens=1,
            gen_tokens_per_s=math.nan,
            idle_ratio=0.5,
        ),
        ProducerStats(
            producer="rollout_00",
            param_version=0,
            samples=1,
            tokens=1,
            gen_tokens_per_s=1.0,
            idle_ratio=0.5,
            metrics={"m": math.inf},
        ),
    ]
    for ev in bad:
        Publisher(prod).publish(keys.stats_of(P0), ev)
    publish_log(roles.admin, keys, fake_metrics_log(2, local_updates=1, producers=2, test_freq=0))
    cfg = load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"])
    run_aggregator(cfg, roles)
    records = [decode(f) for _, f in roles.admin.xrange(keys.records)]
    assert [rec.global_step for rec in records if isinstance(rec, SyncStepRecord)] == [1, 2]
    for rec in records:
        assert not any("rollout_77" in name for name in rec.metrics), rec.metrics
        assert all(math.isfinite(v) for v in rec.metrics.values())
        assert 0.0 <= rec.metrics["producer/idle_ratio"] <= 1.0
    reasons = [decode(f).reason for _, f in roles.admin.xrange(keys.dead_aggregator)]  # type: ignore[union-attr]
    assert reasons == [
        "impersonation: field producer='rollout_77' on the stream of producer 'rollout_00'",
        "implausible: idle_ratio=-3.0 is not in [0, 1]",
        "implausible: gen_tokens_per_s=nan is not a finite rate >= 0",
        "implausible: metric m=inf is not finite",
    ]
    lines = (tmp_path / keys.run / "records.jsonl").read_text().splitlines()

    def refuse(literal: str) -> None:
        raise ValueError(f"records.jsonl holds {literal}")

    assert [json.loads(line, parse_constant=refuse)["step"] for line in lines] == [1, 2]


def test_a_refused_publish_keeps_the_cursor_and_the_in_flight_count(
    roles: Roles, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Finding 4: after `XADD rollouts <max id>` every XADD to rollouts fails; the publish transaction used to
    move the cursor and in-flight count anyway (64 prompts lost). Now the cursor and the published count
    stay, so those prompts are dispatched again under their ids."""
    keys = roles.keys
    cfg = small_cfg(keys, f"run.redis_url={roles.url}", f"run.dir={tmp_path}")
    start_run(roles.trainer, keys, build_policy(cfg).state_dict_bytes(), grant=cfg.max_outstanding)
    ctx = context(cfg, keys, "rollout_00", roles.url)
    ctx.r = roles.producers["rollout_00"]
    producer = Producer(ctx)
    leaser = Leaser(roles.trainer, keys, PRODUCERS, threading.Event()).start()
    request.addfinalizer(leaser.stop.set)
    assert producer.run(max_dispatches=1) == 1  # one publish lands: the cursor is in Redis
    cursor = roles.admin.get(keys.producer_cursor("rollout_00"))
    roles.producers["rollout_00"].xadd(keys.rollouts_of(P0), {"x": "y"}, id=MAX_ID)  # it exhausts its own ids
    before = producer.source.cursor
    with pytest.raises(PublishError, match="exhausted"):
        producer.run(max_dispatches=1)
    assert roles.admin.get(keys.producer_cursor("rollout_00")) == cursor and producer.source.cursor == before
    assert rollout_counts(roles.admin, keys, ["rollout_00"]).in_flight == cfg.rollout.prompts_per_dispatch


def test_rewards_are_checked_against_the_tasks_range() -> None:
    """Finding 6's domain: rewards and each row's token-score sum within the reward range, all finite; one
    token's own score may be negative (token-level credit)."""
    sample = fake_rollout_sample("rollout_00-1", n=2, prompt_len=3, response_len=4)
    batch = sample.full_batch
    assert value_reason(sample, REWARD_RANGE) is None
    lens = batch.response_lens
    batch.tokens[TOKEN_SCORES] = np.zeros(int(lens.sum()), dtype=np.float32)
    batch.tokens[TOKEN_SCORES][0], batch.tokens[TOKEN_SCORES][1] = -0.2, 0.7  # row 0 sums to 0.5
    assert value_reason(sample, REWARD_RANGE) is None
    batch.tokens[TOKEN_SCORES][int(lens[0])] = 3e38  # row 1 sums far out of range
    assert "token_level_scores row sums" in (value_reason(sample, REWARD_RANGE) or "")
    batch.tokens[TOKEN_SCORES][int(lens[0])] = np.nan
    assert "token_level_scores row sums" in (value_reason(sample, REWARD_RANGE) or "")
    batch.tokens[TOKEN_SCORES][int(lens[0])] = 0.0
    batch.rows["rewards"] = np.array([1.0, np.inf], dtype=np.float32)
    assert "rewards hold values in [1.0, inf]" in (value_reason(sample, REWARD_RANGE) or "")


def test_a_skipped_update_marks_its_samples_skipped(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    """Finding 6: a non-finite loss or gradient skips the optimizer step; its samples were still marked
    `trained`. Now their fate is `skipped`, the update says `actor/update_skipped` = 1, and no non-finite
    value is emitted."""
    from consumers.trainer.loop import Trainer

    cfg = load_config(
        None,
        [
            "model.d_model=16",
            "model.n_layer=1",
            "model.n_head=2",
            "model.max_seq_len=32",
            "run.device=cpu",
            f"run.name={keys.run}",
            f"run.dir={tmp_path}",
            "actor.ppo_mini_batch_size=2",
            "data.train_batch_size=4",
        ],
    )
    setup_run(r, keys, PRODUCERS)
    for sample in leased_fakes(r, keys, 2, param_version=0, n=2, prompt_len=5, response_len=6):
        r.xadd(keys.rollouts_of(P0), encode(sample))  # type: ignore[arg-type]
    trainer = Trainer(cfg, r, keys, "trainer", threading.Event(), burst=True)
    with torch.no_grad():
        next(trainer.learner.policy.parameters()).fill_(
            math.nan
        )  # every log-prob, the loss, the gradient: NaN
    ledger = StepLedger(1)
    got = trainer.collector.collect(1, ledger)
    assert got is not None and len(got.kept) == 2
    batch, batch_metrics = assemble_batch_from_rollout_samples([m.event for m, _ in got.kept])  # type: ignore[misc]
    learned = trainer.learner.update(batch)
    trainer._record_update(1, 1, ledger, got, batch, batch_metrics, learned, (0.0, 0.0))
    assert [f.fate for f in ledger.fates] == [SKIPPED, SKIPPED]
    [(_, fields)] = r.xrange(keys.metrics)
    update: Any = decode(fields)
    assert update.metrics[UPDATE_SKIPPED] == 1.0 and all(math.isfinite(v) for v in update.metrics.values())


def test_a_script_that_never_ends_is_killed_by_the_trainer(roles: Roles) -> None:
    """Finding 2: a producer's `EVAL "while true do end" 0` blocked Redis until an operator ran SCRIPT KILL;
    every worker crash-looped on BUSY. No producer may run a script now (above); should a script that may
    (an admin's, or a bug in the trainer's) never end, the trainer's watch kills it, and workers wait BUSY
    out."""
    roles.admin.config_set("busy-reply-threshold", 100)
    stop = threading.Event()
    watch_busy_scripts(roles.trainer, stop, period_s=0.1)
    errors: list[str] = []

    def freeze() -> None:
        try:
            roles.admin.eval("while true do end", 0)
        except redis.ResponseError as e:
            errors.append(str(e))

    attacker = threading.Thread(target=freeze)
    attacker.start()
    try:
        time.sleep(0.3)  # past the threshold: Redis answers BUSY until the script ends
        assert retry_on_connection(roles.aggregator.ping, "ping while a script blocks", timeout_s=10)
        attacker.join(10)
        assert errors and "killed" in errors[0].lower(), errors
    finally:
        stop.set()


def test_status_check_sees_pacing_counters_moved_outside_the_scripts(roles: Roles) -> None:
    """Finding 3: `INCRBY dispatched 1000000` stopped training for good and `status --check` said ok. No
    producer may move the counters now (below); should anything else (an admin's hand, a bug), the
    `pacing` line says broken."""
    keys, prod = roles.keys, roles.admin
    grant_budget(roles.trainer, keys, 0, 8)

    def pacing() -> WorkerHealth:
        [line] = [
            w for w in collect_status(roles.admin, keys, max_outstanding=8).workers if w.name == "pacing"
        ]
        return line

    assert pacing().state == "ok"
    prod.incrby(keys.dispatched, 10**6)
    assert pacing().state == "broken" and "outstanding=1000000" in pacing().why
    prod.decrby(keys.dispatched, 2 * 10**6)
    assert pacing().state == "broken" and "outstanding=-1000000" in pacing().why
    prod.incrby(keys.dispatched, 10**6)
    prod.incrby(keys.budget(0), 10**6)
    assert pacing().state == "broken" and "budget 1000008" in pacing().why


def test_a_producer_may_run_no_script(roles: Roles) -> None:
    """Finding 2: `EVAL "while true do end" 0` froze Redis. Producers pace by leases now and run no script."""
    prod = roles.producers["rollout_00"]
    for call in (
        lambda: prod.eval("while true do end", 0),
        lambda: prod.evalsha("e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
        lambda: prod.execute_command("FCALL", "f", 0),
        lambda: prod.execute_command("SCRIPT", "LOAD", "return 1"),
        lambda: prod.execute_command("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', print)"),
    ):
        assert not _permitted(call)
def test_a_producer_cannot_publish_in_another_producers_name(roles: Roles, tmp_path: Path) -> None:
    """Finding 5: a sample claiming `producer=rollout_01` was trained and counted as rollout_01's. A producer
    may write only its own streams; on them, a sample or stats in another's name (the `producer` field, or a
    sample_id not `<producer>-…`) is dead-lettered with the reason, never trained or folded."""
    from consumers.trainer.collect import Collector, rollouts_reader
    from consumers.trainer.effects import TrainerEffects

    keys, p0, p1 = roles.keys, roles.producers[P0], roles.producers["rollout_01"]
    forged = encode(
        fake_rollout_sample("rollout_01-x", producer="rollout_01", n=2, prompt_len=4, response_len=4)
    )
    stats = ProducerStats(
        producer="rollout_01", param_version=0, samples=1, tokens=1, gen_tokens_per_s=1.0, idle_ratio=0.0
    )
    assert not _permitted(lambda: p0.xadd(keys.rollouts_of("rollout_01"), forged))  # type: ignore[arg-type]
    assert not _permitted(lambda: p0.xadd(keys.stats_of("rollout_01"), encode(stats)))  # type: ignore[arg-type]
    assert not _permitted(lambda: p1.xadd(keys.rollouts_of(P0), {"x": "y"}))
    p0.xadd(keys.rollouts_of(P0), forged)  # type: ignore[arg-type]
    lease_outright(roles.trainer, keys, P0, 1)
    for sid in ("rollout_01-y", f"{P0}-0"):  # another's sample id, then an honest (leased) sample
        p0.xadd(
            keys.rollouts_of(P0),
            encode(fake_rollout_sample(sid, producer=P0, n=2, prompt_len=4, response_len=4)),  # type: ignore[arg-type]
        )
    cfg = load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"])
    stop = threading.Event()
    dp: Any = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    reader = rollouts_reader(cfg, roles.trainer, keys, "trainer", stop)
    effects = TrainerEffects(cfg, roles.trainer, keys, tmp_path / "weights", dp)
    collector = Collector(cfg, effects, reader, dp, stop, True, 1000, 64)
    while collector.fill() and not reader.drained:
        pass
    assert [m.event.sample_id for m in collector.buffer] == [f"{P0}-0"]  # type: ignore[union-attr]
    dead, source = [decode(f) for _, f in roles.admin.xrange(keys.dead)], keys.rollouts_of(P0)
    assert [(d.source, d.reason) for d in dead] == [  # type: ignore[union-attr]
        (source, f"impersonation: field producer='rollout_01' on the stream of producer '{P0}'"),
        (source, f"impersonation: field sample_id='rollout_01-y' on the stream of producer '{P0}'"),
    ]
    Publisher(p0).publish(keys.stats_of(P0), stats)
    run_aggregator(cfg, roles)
    [(_, fields)] = roles.admin.xrange(keys.dead_aggregator)
    assert decode_as(fields, DeadLetter).reason == (
        "impersonation: field producer='rollout_01' on the stream of producer 'rollout_00'"
    )


def test_an_explicit_id_cannot_block_another_producer(roles: Roles) -> None:
    """Finding 4: one producer's `XADD rollouts <max id>` made every other producer's XADD fail. Now it can
    exhaust only the ids of its own streams."""
    keys, p0, p1 = roles.keys, roles.producers[P0], roles.producers["rollout_01"]
    p0.xadd(keys.rollouts_of(P0), {"x": "y"}, id=MAX_ID)
    p0.xadd(keys.stats_of(P0), {"x": "y"}, id=MAX_ID)
    assert p1.xadd(keys.rollouts_of("rollout_01"), {"x": "y"})  # its own streams have every id left
    assert p1.xadd(keys.stats_of("rollout_01"), {"x": "y"})
    for stream in (keys.rollouts_of("rollout_01"), keys.stats_of("rollout_01")):
        assert not _permitted(lambda s=stream: p0.xadd(s, {"x": "y"}, id=MAX_ID))  # type: ignore[misc]


def test_a_producers_trim_destroys_only_its_own_entries_and_the_audit_names_them(roles: Roles) -> None:
    """Finding 1 per producer: `XADD MAXLEN 0` on its own stream deletes only that producer's entries (it may
    not touch another's stream), and the audit reports the destroyed entries of exactly that stream."""
    keys = roles.keys
    for p in PRODUCERS:
        for i in range(3):
            sample = fake_rollout_sample(f"{p}-{i}", producer=p)
            Publisher(roles.producers[p]).publish(keys.rollouts_of(p), sample)
    p0 = roles.producers[P0]
    assert not _permitted(
        lambda: p0.xadd(keys.rollouts_of("rollout_01"), {"x": "y"}, maxlen=0, approximate=False)
    )
    p0.xadd(keys.rollouts_of(P0), {"x": "y"}, maxlen=0, approximate=False)
    assert roles.admin.xlen(keys.rollouts_of(P0)) == 0
    assert roles.admin.xlen(keys.rollouts_of("rollout_01")) == 3
    rep = audit_run(roles.admin, keys)
    assert rep.destroyed == {keys.rollouts_of(P0): 4}
    assert any(f"4 entries of {keys.rollouts_of(P0)} destroyed" in p for p in rep.problems())
    assert rep.published == rep.pending == {f"rollout_01-{i}" for i in range(3)}  # undelivered, intact


# -- pacing: leases only the trainer writes -----------------------------------------------------------------


def test_a_producer_cannot_move_the_pacing_nor_take_more_than_its_lease(roles: Roles) -> None:
    """Finding 3: `INCRBY dispatched 1000000` stopped training for good; DECRBY made each version grant
    ~1,000,000; 40 entries published without taking budget loosened the pacing for good. Only the trainer
    writes budgets, leases and counters; a producer's want of any size gets it at most the budget; entries
    outside its lease are refused and count nothing."""
    keys, prod, trainer = roles.keys, roles.producers["rollout_00"], roles.trainer
    grant_budget(trainer, keys, 0, 8)
    moves = {
        "INCRBY dispatched": lambda: prod.incrby(keys.dispatched, 10**6),
        "DECRBY dispatched": lambda: prod.decrby(keys.dispatched, 10**6),
        "SET consumed": lambda: prod.set(keys.consumed, 10**6),
        "DECRBY budget": lambda: prod.decrby(keys.budget(0), 10**6),
        "HINCRBY lease": lambda: prod.hincrby(keys.lease, "rollout_00", 10**6),
        "HSET trainer budget_version": lambda: prod.hset(keys.trainer, "budget_version", 10**6),
        "SETBIT consumed": lambda: prod.setbit(keys.consumed_bits("rollout_00"), 0, 1),
        "another's want": lambda: prod.set(keys.producer_want("rollout_01"), 10**6),
    }
    assert [name for name, move in moves.items() if _permitted(move)] == []
    ask_lease(prod, keys, "rollout_00", 10**12)  # its own key: any value it likes
    leaser = Leaser(trainer, keys, PRODUCERS, threading.Event())
    assert leaser.run_once() == 8 and leaser.run_once() == 0  # the budget, and no more
    assert lease_of(prod, keys, "rollout_00") == 8 and int(roles.admin.get(keys.dispatched)) == 8  # type: ignore[arg-type]
    # 40 entries outside its lease, then its 8: the 40 are dead-lettered and count nothing
    cfg = load_config(None, [f"run.name={keys.run}", "bus.block_ms=10", "data.train_batch_size=8",
                             "actor.ppo_mini_batch_size=8", "async_training.trigger_parameter_sync_step=1"])
    pub = Publisher(prod)
    for seq in [*range(8, 48), *range(8)]:
        pub.publish(
            keys.rollouts_of(P0),
            fake_rollout_sample(
                f"rollout_00-{seq}", n=2, prompt_len=3, response_len=4, producer="rollout_00"
            ),
        )
    from types import SimpleNamespace

    from consumers.trainer.collect import Collector, rollouts_reader
    from consumers.trainer.effects import TrainerEffects

    dp = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    reader = rollouts_reader(cfg, trainer, keys, "trainer", threading.Event())
    effects = TrainerEffects(cfg, trainer, keys, cfg.run_dir() / "weights", dp)  # type: ignore[arg-type]
    collector = Collector(cfg, effects, reader, dp, threading.Event(), False, 1000, 64)  # type: ignore[arg-type]
    while len(collector.buffer) < 8:
        assert collector.fill()
    assert roles.admin.xlen(keys.dead) == 40
    assert int(roles.admin.get(keys.consumed) or 0) == 0  # type: ignore[arg-type]
    assert grant_budget(trainer, keys, 1, 8) == (0, 8)  # nothing consumed yet: no room for more


def test_the_audit_names_the_samples_a_trim_destroyed_before_any_read(roles: Roles) -> None:
    """Finding 1: a trim of rollouts before the trainer read it left no id to report. A producer's ids are
    its lease's seqs and its published count moves with each publish, so the audit names them."""
    keys, prod = roles.keys, roles.producers["rollout_00"]
    lease_outright(roles.trainer, keys, "rollout_00", 3)
    pipe = prod.pipeline(transaction=True)
    for seq in range(3):
        pipe.xadd(
            keys.rollouts_of(P0), encode(fake_rollout_sample(f"rollout_00-{seq}", producer="rollout_00"))
        )  # type: ignore[arg-type]
    mark_published(pipe, keys, "rollout_00", 3)
    pipe.execute()
    assert audit_run(roles.admin, keys).problems() == []
    prod.xadd(keys.rollouts_of(P0), {"x": "y"}, maxlen=0, approximate=False)
    rep = audit_run(roles.admin, keys)
    assert rep.destroyed_ids == {"rollout_00-0", "rollout_00-1", "rollout_00-2"}
    assert any("3 published samples are not on the log" in p for p in rep.problems())


# -- issue 41: what a producer may still write -------------------------------------------------------------


def test_a_producer_writes_only_the_four_keys_the_design_names(roles: Roles) -> None:
    """Issue 41, item 4: `XADD producer:rollout_00:flood` and `SET` of any other name under its prefix were
    allowed (a free-form namespace: +1.7 GB not reclaimed); now its user names cursor, published, want and
    version one by one, and XADD reaches only its two streams."""
    keys, prod = roles.keys, roles.producers[P0]
    own = keys.producer_prefix(P0)
    refused = {
        "XADD producer:<name>:flood": lambda: prod.xadd(own + "flood", {"x": "y"}),
        "SET producer:<name>:blob": lambda: prod.set(own + "blob", "x"),
        "SET producer:<name>:dispatch_log": lambda: prod.set(own + "dispatch_log", "x"),
        "APPEND producer:<name>:want": lambda: prod.append(keys.producer_want(P0), "x"),
        "XADD producer:<name>:want": lambda: prod.xadd(keys.producer_want(P0), {"x": "y"}),
    }
    assert [name for name, call in refused.items() if _permitted(call)] == []
    for key in (keys.producer_cursor(P0), keys.producer_want(P0), keys.producer_version(P0)):
        assert prod.set(key, "1")
    published = keys.producer_published(P0)
    assert prod.incrby(published, 2) == 2 and prod.decrby(published, 1) == 1


def test_a_hoarders_lease_expires_the_others_fill_the_batch_and_its_late_publish_never_trains(
    roles: Roles,
) -> None:
    """Issue 41, item 3: rollout_00 writes want=10^9 and publishes nothing, holding the whole budget
    (training stopped: 0 steps in 90 s). Now it is leased its fair share (issue 62: half of 8 before anyone
    delivered), its lease expires (here at lease_timeout_s: no dispatch time observed yet), the prompts go to
    rollout_01, and rollout_00's late publish of a taken-back seq is dead-lettered ("lease expired") and
    counts nothing."""
    from consumers.trainer.collect import Collector, rollouts_reader
    from consumers.trainer.effects import TrainerEffects
    from rollstream.pacing.expiry import LeaseExpiry

    keys, trainer = roles.keys, roles.trainer
    hoarder, other = roles.producers[P0], roles.producers["rollout_01"]
    grant_budget(trainer, keys, 0, 8)
    ask_lease(hoarder, keys, P0, 10**9)
    clock = [0.0]
    expiry = LeaseExpiry(600.0, 8, probation=1, every_s=0, clock=lambda: clock[0])
    leaser = Leaser(trainer, keys, PRODUCERS, threading.Event(), expiry=expiry)
    assert leaser.run_once() == 4 and lease_of(trainer, keys, P0) == 4  # its share, not everything
    ask_lease(other, keys, "rollout_01", 8)
    assert leaser.run_once() == 4

    def publish(client: redis.Redis, name: str, seq: int) -> None:
        sample = fake_rollout_sample(f"{name}-{seq}", n=2, prompt_len=3, response_len=4, producer=name)
        Publisher(client).publish(keys.rollouts_of(name), sample)

    for seq in range(4):  # rollout_01 delivers (its entries wait with the trainer: progress)
        publish(other, "rollout_01", seq)
    clock[0] = 601.0
    leaser.run_once()  # expired: 4 taken back, 1 to it on probation
    assert expiry.expired == {P0: 4}
    assert lease_of(trainer, keys, P0) == 5 and lease_of(trainer, keys, "rollout_01") == 4
    cfg = load_config(None, [f"run.name={keys.run}", "bus.block_ms=10", "data.train_batch_size=8",
                             "actor.ppo_mini_batch_size=8", "async_training.trigger_parameter_sync_step=1"])
    publish(hoarder, P0, 3)  # late: taken back
    publish(hoarder, P0, 4)  # its probation lease: fine
    dp = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    reader = rollouts_reader(cfg, trainer, keys, "trainer", threading.Event())
    effects = TrainerEffects(cfg, trainer, keys, cfg.run_dir() / "weights", dp)  # type: ignore[arg-type]
    collector = Collector(cfg, effects, reader, dp, threading.Event(), False, 1000, 64)  # type: ignore[arg-type]
    while len(collector.buffer) < 5:
        assert collector.fill()
    collector.fill()
    [(_, fields)] = roles.admin.xrange(keys.dead)
    assert isinstance(dl := decode(fields), DeadLetter) and dl.reason.startswith("lease expired: ")
    assert "rollout_00-3" in dl.reason
    assert sorted(m.event.sample_id for m in collector.buffer) == sorted(
        [*(f"rollout_01-{s}" for s in range(4)), "rollout_00-4"]
    )
    assert int(roles.admin.get(keys.consumed) or 0) == 4  # type: ignore[arg-type]  # the 4 taken back, once
    st = collect_status(roles.admin, keys)
    assert st.expired == {P0: 4}
    shown = format_status(st, "x")
    assert "leases expired (prompts taken back, rollout.lease_timeout_s): rollout_00 4" in shown
    rep = audit_run(roles.admin, keys)
    assert rep.problems() == [], rep.problems()


def _calls(r: redis.Redis, command: str) -> int:
    """How many times the server ran `command` (INFO commandstats; 0 if never)."""
    stats: Any = r.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_no_revoked_bit_is_read_until_a_lease_expires_and_a_late_publish_is_still_refused(
    roles: Roles,
) -> None:
    """Review of item 3: the trainer read one revoked bit (GETBIT) per consumed sample although no lease had
    expired. Now 16 samples cost no GETBIT (one EXISTS per producer at the start); once a lease expires in
    the trainer's process, the same collector reads bits again and still refuses a late publish."""
    from consumers.trainer.collect import Collector, rollouts_reader
    from consumers.trainer.effects import TrainerEffects
    from rollstream.pacing.expiry import expire_lease

    keys, trainer, admin = roles.keys, roles.trainer, roles.admin
    grant_budget(trainer, keys, 0, 32)
    for name in PRODUCERS:
        ask_lease(roles.producers[name], keys, name, 8)
    assert Leaser(trainer, keys, PRODUCERS, threading.Event()).run_once() == 16
    cfg = load_config(None, [f"run.name={keys.run}", "bus.block_ms=10", "data.train_batch_size=16",
                             "actor.ppo_mini_batch_size=16", "trainer.parameter_sync_step=1"])

    def publish(name: str, seqs: range) -> None:
        for seq in seqs:
            sample = fake_rollout_sample(f"{name}-{seq}", n=2, prompt_len=3, response_len=4, producer=name)
            Publisher(roles.producers[name]).publish(keys.rollouts_of(name), sample)

    publish("rollout_01", range(8))
    publish(P0, range(4))
    dp = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    reader = rollouts_reader(cfg, trainer, keys, "trainer", threading.Event())
    effects = TrainerEffects(cfg, trainer, keys, cfg.run_dir() / "weights", dp)  # type: ignore[arg-type]
    collector = Collector(cfg, effects, reader, dp, threading.Event(), False, 1000, 64)  # type: ignore[arg-type]
    admin.config_resetstat()
    while len(collector.buffer) < 12:
        assert collector.fill()
    assert _calls(admin, "getbit") == 0 and _calls(admin, "exists") == len(PRODUCERS)
    assert expire_lease(trainer, keys, P0, 32)[0] == 8  # its unconsumed seqs taken back, in this process
    publish(P0, range(4, 6))  # late
    while admin.xlen(keys.dead) < 2:
        collector.fill()
    reasons = [decode_as(f, DeadLetter).reason for _, f in admin.xrange(keys.dead)]
    assert all(r.startswith("lease expired: ") for r in reasons), reasons
    assert len(collector.buffer) == 12 and _calls(admin, "getbit") == 2  # only the expired producer's


def test_a_producer_flooding_redis_is_fenced_and_the_run_goes_on(roles: Roles) -> None:
    """Issue 41, item 4: 64 MiB SETs on its own keys and 1 MiB stats entries grew Redis by 1.5 GB, unbounded
    and unreported. The trainer's FloodFence measures each producer (its four keys, its two streams) and past
    the bound takes its lease back, says why in `fenced` (status) and leases only to the others; the warden,
    reading `fenced`, switches its ACL user off and kills its connections (issue 62: the trainer may not)."""
    from rollstream.ops.warden import Warden
    from rollstream.pacing.fence import FloodFence

    keys, trainer = roles.keys, roles.trainer
    flooder, other = roles.producers[P0], roles.producers["rollout_01"]
    grant_budget(trainer, keys, 0, 8)
    ask_lease(flooder, keys, P0, 4)
    ask_lease(other, keys, "rollout_01", 2)
    fence = FloodFence(1 << 20, 8, every_s=0)
    leaser = Leaser(trainer, keys, PRODUCERS, threading.Event(), fence=fence)
    assert leaser.run_once() == 6 and fence.fenced == {}
    for i in range(4):  # 1.2 MiB of "stats" on its own stream: over a 1 MiB bound
        flooder.xadd(keys.stats_of(P0), {"type": "producer", "blob": "x" * (300 << 10), "i": i})
    ask_lease(other, keys, "rollout_01", 8)
    leaser.run_once()
    assert set(fence.fenced) == {P0} and "over bus.producer_max_bytes=1048576" in fence.fenced[P0]
    assert roles.warden is not None
    warden = Warden(keys, PRODUCERS)
    assert warden.run_once(roles.warden) == [P0]
    with pytest.raises((redis.ConnectionError, redis.AuthenticationError)):
        flooder.ping()  # its connection was killed, and its user is off: no reconnect
    assert lease_of(trainer, keys, "rollout_01") == 8 and lease_of(trainer, keys, P0) == 4
    assert int(roles.admin.get(keys.consumed) or 0) == 4  # type: ignore[arg-type]  # its lease taken back
    ask_lease(roles.admin, keys, P0, 100)  # (as if it still asked)
    grant_budget(trainer, keys, 1, 16)
    leaser.run_once()
    assert lease_of(trainer, keys, P0) == 4  # nothing more leased to it
    st = collect_status(roles.admin, keys)
    assert st.fenced == fence.fenced
    assert f"FENCED producer {P0}: " in format_status(st, roles.url)
    # a restarted trainer keeps it fenced; the warden switches its user off again (an ACL file reload would
    # have switched it back on), at every pass
    roles.admin.execute_command("ACL", "SETUSER", P0, "on")
    again = FloodFence(1 << 20, 16, every_s=0)
    again.maybe_check(trainer, keys, PRODUCERS)
    assert set(again.fenced) == {P0}
    assert warden.run_once(roles.warden) == []  # not new to this warden, fenced again all the same
    [user] = [u for u in roles.admin.execute_command("ACL", "LIST") if u.split()[1] == P0.encode()]
    assert b" off " in user
    # the trainer's credential can ask for producers only: a request naming another user is ignored
    trainer.hset(keys.fenced, "aggregator", "forged")
    assert warden.run_once(roles.warden) == [] and roles.aggregator.ping()


def test_no_data_role_manages_users_or_kills_clients(roles: Roles) -> None:
    """Issue 62, item 4: with trainer_fences the trainer user could ACL SETUSER (grant itself every command on
    every key) and CLIENT KILL. Now no data role can; the warden can, and reads no data."""
    keys = roles.keys
    data_roles = {"trainer": roles.trainer, "aggregator": roles.aggregator, **roles.producers}
    for name, conn in data_roles.items():
        for cmd in (
            ("ACL", "SETUSER", name, "on", "+@all", "~*"),
            ("ACL", "SETUSER", "intruder", "on", ">pw", "+@all", "~*"),
            ("CLIENT", "KILL", "USER", "aggregator"),
            ("CLIENT", "KILL", "ID", "1"),
        ):
            assert not _permitted(lambda c=conn, a=cmd: c.execute_command(*a)), (name, cmd)
    assert roles.warden is not None
    assert _permitted(lambda: roles.warden.execute_command("CLIENT", "KILL", "USER", "nobody-connected"))
    for read in (
        lambda w: w.xrange(keys.rollouts_of(P0)),
        lambda w: w.xrange(keys.params),
        lambda w: w.get(keys.weights(0)),
        lambda w: w.hgetall(keys.trainer),
        lambda w: w.hset(keys.fenced, P0, "x"),
        lambda w: w.eval("return 1", 0),
    ):
        assert not _permitted(lambda f=read: f(roles.warden))


def test_the_trainers_scripts_run_under_its_own_acl(roles: Roles) -> None:
    """Redis 7 checks every command a Lua script runs against the caller's ACL, so the trainer's scripts
    (the pacing's, its dead letters) grant it nothing its user lacks: no key outside the run's prefix, no
    FLUSHALL, no ACL or CLIENT KILL from inside a script either."""
    t, keys = roles.trainer, roles.keys
    assert t.eval("return redis.call('SET', KEYS[1], 'x')", 1, keys.prefix + "mine") == b"OK"
    for body, key in (
        ("return redis.call('SET', KEYS[1], 'x')", "other-run:key"),
        ("return redis.call('GET', KEYS[1])", "other-run:key"),
        ("return redis.call('FLUSHALL')", keys.prefix + "mine"),
        ("return redis.call('KEYS', '*')", keys.prefix + "mine"),
    ):
        assert not _permitted(lambda b=body, k=key: t.eval(b, 1, k)), body
    for body in (  # and these no script may run at all, whoever calls it
        "return redis.call('ACL', 'SETUSER', 'trainer', '+@all', '~*')",
        "return redis.call('CLIENT', 'KILL', 'USER', 'aggregator')",
        "return redis.call('CONFIG', 'SET', 'maxmemory', '0')",
    ):
        with pytest.raises(redis.ResponseError, match="not allowed from script"):
            t.eval(body, 1, keys.prefix + "mine")
    assert roles.admin.exists("other-run:key") == 0 and roles.admin.exists(keys.prefix + "mine") == 1


def test_a_flood_of_1mib_stats_entries_stays_under_the_producers_bound(roles: Roles) -> None:
    """Issue 62, item 2: 1,891 XADDs of 1 MiB to a producer's own stats stream took Redis from 127 MiB to
    4,330 MiB unfenced: MEMORY USAGE at its default sampling read 14 MiB where the stream held 4,240 MiB, the
    small honest entries at its head hiding the flood. Scaled down (a 4 MiB bound, 12 entries of 1 MiB behind
    2,000 small ones): the fence measures the whole stream, fences the producer, drops its unread excess to
    bounded copies on `dead` (so it is back under its bound), keeps what a reader was delivered, says so in
    `fenced`, and the audit finds nothing destroyed; the other producer keeps its lease and its data."""
    from rollstream.pacing.fence import FloodFence

    keys, trainer, admin = roles.keys, roles.trainer, roles.admin
    flooder, other = roles.producers[P0], roles.producers["rollout_01"]
    bound = 4 << 20
    grant_budget(trainer, keys, 0, 8)
    ask_lease(flooder, keys, P0, 2)
    ask_lease(other, keys, "rollout_01", 2)
    fence = FloodFence(bound, 8, every_s=0)
    leaser = Leaser(trainer, keys, PRODUCERS, threading.Event(), fence=fence)
    assert leaser.run_once() == 4 and fence.fenced == {}
    for name, conn in ((P0, flooder), ("rollout_01", other)):
        pipe = conn.pipeline(transaction=False)
        for i in range(2000):
            pipe.xadd(keys.stats_of(name), {"type": "producer", "i": i})
        pipe.execute()
    # the aggregator was delivered (and acked) the first 100 of the flooder's entries: they are kept
    read: Any = roles.aggregator.xreadgroup(AGGREGATOR_GROUP, "agg", {keys.stats_of(P0): ">"}, count=100)
    roles.aggregator.xack(keys.stats_of(P0), AGGREGATOR_GROUP, *(i for i, _ in read[0][1]))
    for _ in range(12):
        flooder.xadd(keys.stats_of(P0), {"type": "producer", "blob": b"x" * (1 << 20)})
    stats = keys.stats_of(P0)
    sampled, full = admin.memory_usage(stats), admin.memory_usage(stats, samples=0)
    assert sampled < bound < full, (sampled, full)  # the sampled measure missed it
    ask_lease(other, keys, "rollout_01", 6)
    leaser.run_once()
    assert set(fence.fenced) == {P0}
    assert f"over bus.producer_max_bytes={bound}" in fence.fenced[P0]
    assert "1912 unread entries" in fence.fenced[P0] and fenced_hash(admin, keys) == fence.fenced
    assert admin.memory_usage(stats, samples=0) + admin.memory_usage(keys.rollouts_of(P0), samples=0) < bound
    assert admin.xlen(stats) == 100 and [i for i, _ in admin.xrange(stats, count=100)] == [
        i for i, _ in read[0][1]
    ]
    assert admin.xlen(keys.dead) == 1912 and admin.memory_usage(keys.dead, samples=0) < 2 << 20
    copy = decode_as(admin.xrange(keys.dead, count=1)[0][1], DeadLetter)  # newest first: a 1 MiB one
    assert copy.reason.startswith(f"fenced: {P0} was fenced") and copy.omitted == {"blob": 1 << 20}
    assert admin.xlen(keys.stats_of("rollout_01")) == 2000  # the honest producer's data, untouched
    assert lease_of(trainer, keys, "rollout_01") == 6 and lease_of(trainer, keys, P0) == 2
    assert audit_run(admin, keys).destroyed == {}  # every dropped entry has its copy on `dead`


def fenced_hash(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """The `fenced` hash as status reads it."""
    from rollstream.pacing.fence import fenced

    return fenced(r, keys)


def test_a_producers_oversized_key_is_fenced(roles: Roles) -> None:
    """A 64 MiB SET on its own `want` (the keys hold counts: tens of bytes) is fenced at once."""
    from rollstream.pacing.fence import PRODUCER_KEYS_MAX_BYTES, FloodFence

    keys, flooder = roles.keys, roles.producers[P0]
    flooder.set(keys.producer_want(P0), "9" * (PRODUCER_KEYS_MAX_BYTES + 1))
    fence = FloodFence(1 << 30, 8, every_s=0)
    assert [p for p, _ in fence.maybe_check(roles.trainer, keys, PRODUCERS)] == [P0]
    assert "its keys hold 4097 bytes" in fence.fenced[P0]


# -- issue 41's table: the aggregator's trims (closed), then what docs/GUARANTEES.md still lists as possible,
# as a strict xfail ------------------------------------------------------------------------------------------


def _destroy_attempts(agg: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Every way the aggregator's user could remove an entry of records, its dead letters or its outboxes."""
    out: dict[str, Any] = {}
    for stream in (keys.records, keys.dead_aggregator):
        out |= {
            f"XADD {stream} MAXLEN 0": lambda s=stream: agg.xadd(s, {"x": "y"}, maxlen=0, approximate=False),
            f"XADD {stream} MINID": lambda s=stream: agg.xadd(s, {"x": "y"}, minid="99999999999999"),
            f"XADD {stream} far id": lambda s=stream: agg.xadd(s, {"x": "y"}, id=MAX_ID),
            f"XTRIM {stream}": lambda s=stream: agg.xtrim(s, maxlen=0),
            f"XDEL {stream}": lambda s=stream: agg.execute_command("XDEL", s, "1-1"),
            f"XSETID {stream}": lambda s=stream: agg.execute_command("XSETID", s, MAX_ID),
            f"DEL {stream}": lambda s=stream: agg.delete(s),
        }
    for box in (keys.records_outbox, keys.dead_aggregator_outbox):
        out |= {
            f"LTRIM {box}": lambda b=box: agg.ltrim(b, 1, 0),
            f"LPOP {box}": lambda b=box: agg.lpop(b),
            f"RPOP {box}": lambda b=box: agg.rpop(b),
            f"LREM {box}": lambda b=box: agg.lrem(b, 0, b"x"),
            f"LSET {box}": lambda b=box: agg.lset(b, 0, b"x"),
            f"DEL {box}": lambda b=box: agg.delete(b),
            f"UNLINK {box}": lambda b=box: agg.unlink(b),
        }
    return out


def test_the_aggregator_cannot_trim_records(roles: Roles, tmp_path: Path) -> None:
    """Issue 41's last row: `XADD records MAXLEN 0` took records 269 -> 0 and nothing rebuilt them. Item 5,
    by design: the aggregator's user appends its records to an outbox list (RPUSH only) and the trainer moves
    them into `records`; every command that could remove a record or an outbox item is refused, and the
    records and the audit stay whole."""
    keys, agg = roles.keys, roles.aggregator
    publish_log(roles.admin, keys, fake_metrics_log(3, local_updates=1, producers=2, test_freq=0))
    cfg = load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"])
    run_aggregator(cfg, roles)
    assert roles.admin.xlen(keys.records) == 3
    agg.rpush(keys.records_outbox, b"not a record")  # what it may do: append (the trainer refuses junk)
    agg.rpush(keys.dead_aggregator_outbox, pack_item({}))
    allowed = [name for name, call in _destroy_attempts(agg, keys).items() if _permitted(call)]
    assert allowed == []
    assert OutboxDrain(keys).drain(roles.trainer) == 2
    assert [i for i, _ in roles.admin.xrange(keys.records)] == [b"1-1", b"2-1", b"3-1"]
    notes = [decode_as(f, DeadLetter).reason for _, f in roles.admin.xrange(keys.dead_aggregator)]
    junk = "refused from the aggregator's outbox: an outbox item that is not a list of field pairs"
    assert notes == [junk, junk]
    assert audit_run(roles.admin, keys).destroyed == {}


def test_records_waiting_in_the_outbox_are_folded_once_across_an_aggregator_restart(
    roles: Roles, tmp_path: Path
) -> None:
    """Under its user the aggregator's records wait in its outbox until the trainer moves them: a restarted
    aggregator counts them as done (no second copy), and once moved, records are 1..3 and the sinks catch
    up on the next pass."""
    keys, agg = roles.keys, roles.aggregator
    publish_log(roles.admin, keys, fake_metrics_log(3, local_updates=1, producers=2, test_freq=0))
    cfg = load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"])
    AggregatorWorker(cfg, agg, keys).run(burst=True)
    assert roles.admin.llen(keys.records_outbox) == 3 and roles.admin.xlen(keys.records) == 0
    roles.trainer.xgroup_setid(keys.metrics, AGGREGATOR_GROUP, "0")  # its log read again, as after a loss
    AggregatorWorker(cfg, agg, keys).run(burst=True)
    assert roles.admin.llen(keys.records_outbox) == 3
    run_aggregator(cfg, roles)
    assert [i for i, _ in roles.admin.xrange(keys.records)] == [b"1-1", b"2-1", b"3-1"]
    assert roles.admin.llen(keys.records_outbox) == 0
    lines = (tmp_path / keys.run / "records.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_a_stopping_trainer_moves_the_record_of_its_last_step_and_does_not_wait_without_an_aggregator(
    roles: Roles, tmp_path: Path
) -> None:
    """Under ACLs only the trainer moves the outbox, and it stops before the aggregator: on its way out it
    waits (up to 5 s) for the record of its last committed step while an aggregator reads `metrics`, so the
    run's last record is not left in the outbox; with no aggregator reading it does not wait."""
    from consumers.trainer.effects import TrainerEffects
    from rollstream.keys import COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD

    keys, agg = roles.keys, roles.aggregator
    cfg = load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"])
    dp: Any = SimpleNamespace(rank=0, world_size=1, roles=RankRoles())
    effects = TrainerEffects(cfg, roles.trainer, keys, tmp_path / "weights", dp)
    roles.trainer.hset(keys.trainer, mapping={COMMITTED_STEP_FIELD: 2, TRAINING_STEP_FIELD: 2})
    t0 = time.monotonic()
    effects.settle_outbox()
    assert time.monotonic() - t0 < 1.0  # no aggregator consumer: nothing to wait for
    roles.trainer.xadd(keys.metrics, {"type": "x"})  # the trainer's last event, just read by the aggregator
    assert agg.xreadgroup(AGGREGATOR_GROUP, "aggregator", {keys.metrics: ">"}, count=1)

    def fold_late() -> None:
        time.sleep(0.5)
        agg.rpush(keys.records_outbox, pack_item(encode(SyncStepRecord(global_step=2, num_local_updates=1))))

    thread = threading.Thread(target=fold_late)
    thread.start()
    t0 = time.monotonic()
    effects.settle_outbox()
    thread.join()
    assert 0.4 < time.monotonic() - t0 < 4.0
    assert [i for i, _ in roles.admin.xrange(keys.records)] == [b"2-1"]


def test_the_aggregator_cannot_trim_its_dead_letters(roles: Roles, tmp_path: Path) -> None:
    """Issue 41's last row: `XADD dead:aggregator MAXLEN 0` took 1,128 dead letters to 0. Its dead letters go
    through its outbox too; none can be removed, and a forged or far-ahead record is refused as a note."""
    keys, agg = roles.keys, roles.aggregator
    roles.trainer.xadd(keys.metrics, {"type": "nonsense"})
    AggregatorWorker(load_config(None, [f"run.name={keys.run}", f"run.dir={tmp_path}"]), agg, keys).run(
        burst=True
    )
    record = SyncStepRecord(global_step=10**9, num_local_updates=1)
    agg.rpush(keys.records_outbox, pack_item(encode(record)))  # a record ahead of the trainer: a note
    assert OutboxDrain(keys).drain(roles.trainer) == 2
    assert roles.admin.xlen(keys.dead_aggregator) == 2 and roles.admin.xlen(keys.records) == 0
    allowed = [name for name, call in _destroy_attempts(agg, keys).items() if _permitted(call)]
    assert allowed == []
    reasons = [decode_as(f, DeadLetter).reason for _, f in roles.admin.xrange(keys.dead_aggregator)]
    assert reasons[0].startswith("decode: ")
    assert "a record of step 1000000000, ahead of the trainer's step 0" in reasons[1]
    assert audit_run(roles.admin, keys).destroyed == {}


def test_a_producer_holds_a_lease_without_publishing_for_three_dispatch_times_at_most(roles: Roles) -> None:
    """Issue 62 (this was a strict xfail: a lease held up to lease_timeout_s): once a producer of the run has
    shown its dispatch time (here rollout_01: 10 s), a lease held without progress is taken back after 3 of
    them, not after lease_timeout_s (600 s); its share was half the budget meanwhile."""
    from rollstream.pacing.expiry import LeaseExpiry

    keys, trainer = roles.keys, roles.trainer
    grant_budget(trainer, keys, 0, 8)
    ask_lease(roles.producers[P0], keys, P0, 10**9)
    clock = [0.0]
    expiry = LeaseExpiry(600.0, 8, probation=1, every_s=0, clock=lambda: clock[0])
    leaser = Leaser(trainer, keys, PRODUCERS, threading.Event(), expiry=expiry)
    leaser.run_once()
    assert lease_of(trainer, keys, P0) == 4
    other = roles.producers["rollout_01"]
    for t in (10.0, 20.0):  # rollout_01 delivers one sample every 10 s
        clock[0] = t
        seq = int(t // 10) - 1
        Publisher(other).publish(keys.rollouts_of("rollout_01"),
                                 fake_rollout_sample(f"rollout_01-{seq}", producer="rollout_01"))
        leaser.run_once()
    assert expiry.deadline_s(P0) == 30.0
    clock[0] = 29.0
    leaser.run_once()
    assert expiry.expired == {}
    clock[0] = 30.0
    leaser.run_once()
    assert expiry.expired == {P0: 4}


@pytest.mark.xfail(strict=True, reason="docs/GUARANTEES.md: a producer writes up to its bound")
def test_a_producer_cannot_use_memory_below_its_bound(roles: Roles) -> None:
    """Between checks and below bus.producer_max_bytes a producer's own stream grows: bounded, not zero."""
    from rollstream.pacing.fence import FloodFence

    keys, prod = roles.keys, roles.producers[P0]
    prod.xadd(keys.stats_of(P0), {"blob": "x" * (100 << 10)})
    fence = FloodFence(1 << 20, 8, every_s=0)
    assert fence.maybe_check(roles.trainer, keys, PRODUCERS) != []
