"""Bad input at every consumer (hypothesis): garbage, truncated msgpack, wrong types, NaN/inf log-probs,
array lengths that disagree, oversized fields, an unknown schema version, huge declared lengths, token ids
outside the vocabulary. No worker crashes; each bad entry goes to `dead` with a reason; the good entries
around it are processed (trained, folded into a record, loaded as weights).

The trainer and the aggregator run in-process on real Redis, one global step / one record per example;
producers read `params` through WeightSync (they may not write `dead`: a bad params entry is skipped with
one log line).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from conftest import P0, PRODUCERS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.aggregator.sinks import Sinks
from consumers.aggregator.worker import AggregatorWorker
from consumers.trainer.loop import Trainer
from producers.weight_sync import WeightSync
from rollstream.bus import Publisher, setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD, Keys
from rollstream.model import build_policy
from rollstream.pacing.budget import lease_outright
from rollstream.testing import fakes
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.store import latest_param_version, publish_weights
from schemas import (
    EVENT_MODELS,
    DeadLetter,
    RolloutSample,
    decode,
    decode_as,
    decode_payload,
    encode,
    encode_payload,
)

FUZZ = settings(max_examples=12, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MAX_ENTRY_BYTES = 4096  # bus.max_entry_bytes: a field over it is refused as oversized

Fields = dict[bytes, bytes]
Mutation = Callable[[Fields, st.DrawFn], Fields]


def tiny_cfg(keys: Keys, tmp: Path) -> PipelineConfig:
    return load_config("pipeline.yaml", [
        f"run.name={keys.run}", f"run.dir={tmp}", "run.device=cpu", "model.d_model=16", "model.n_layer=1",
        "model.n_head=2", "model.max_seq_len=32", "data.train_batch_size=2", "actor.ppo_mini_batch_size=1",
        "async_training.trigger_parameter_sync_step=2", "trainer.test_freq=0",
        "trainer.total_training_steps=1000",
        "trainer.max_off_policy_threshold=1000", "rollout.n=2", "bus.block_ms=20",
        f"bus.max_entry_bytes={MAX_ENTRY_BYTES}", "aggregator.jsonl=false", "aggregator.tensorboard=false",
    ])


def as_fields(event: Any) -> Fields:
    return {k.encode(): bytes(v) for k, v in encode(event).items()}


# -- ways to break an entry (each takes a good entry's fields) -------------------------------------


def garbage(f: Fields, draw: st.DrawFn) -> Fields:
    return draw(
        st.dictionaries(st.binary(min_size=1, max_size=8), st.binary(max_size=64), min_size=1, max_size=4)
    )


def truncated(f: Fields, draw: st.DrawFn) -> Fields:
    cut = draw(st.floats(0, 1, exclude_max=True))  # a fraction: entry sizes differ between examples
    return {**f, b"payload": f[b"payload"][: int(cut * len(f[b"payload"]))]}


def header_type(f: Fields, draw: st.DrawFn) -> Fields:
    other = draw(st.sampled_from([b"step_end", b"rollout", b"nope", b"", b"\xff\xfe"]))
    return {**f, b"type": other if other != f[b"type"] else b"nope"}


def unknown_schema(f: Fields, draw: st.DrawFn) -> Fields:
    newest = max(m.SCHEMA for m in EVENT_MODELS.values())  # above every event's current schema
    return _payload(f, lambda d: d.__setitem__("schema_version", draw(st.integers(newest + 1, 2**31))))


def huge_declared(f: Fields, draw: st.DrawFn) -> Fields:
    head = draw(st.sampled_from([b"\xdf\xff\xff\xff\xff", b"\xdd\x7f\xff\xff\xff", b"\xc6\x7f\xff\xff\xff",
                                 b"\xdb\xff\xff\xff\xff", b"\xc9\x7f\xff\xff\xff\x01"]))
    return {**f, b"payload": head + draw(st.binary(max_size=16))}


def oversized(f: Fields, draw: st.DrawFn) -> Fields:
    extra = b"x" * draw(st.integers(MAX_ENTRY_BYTES + 1, 4 * MAX_ENTRY_BYTES))
    return _payload(f, lambda d: d.__setitem__(draw(st.sampled_from(list(d))), extra))


def wrong_field_type(f: Fields, draw: st.DrawFn) -> Fields:
    def go(d: dict[str, Any]) -> None:
        name = draw(st.sampled_from(sorted(set(d) - {"type"})))
        d[name] = [1, "x"] if isinstance(d[name], str) else draw(st.sampled_from(["two", b"\x00", [[]]]))

    return _payload(f, go)


def _payload(f: Fields, mutate: Callable[[dict[str, Any]], Any]) -> Fields:
    d = decode_payload(f[b"payload"])
    mutate(d)
    return {**f, b"payload": encode_payload(d)}


def _ragged(f: Fields, mutate: Callable[[dict[str, np.ndarray]], Any]) -> Fields:
    """The entry with its ragged batch's arrays (by name: the four id/length arrays, tokens and rows keys)
    rewritten by mutate (on copies)."""
    names = ("prompt_ids", "prompt_lens", "response_ids", "response_lens")
    batch = decode_as(f, RolloutSample).full_batch  # (schema 5's payload holds it as a list of raw parts)

    def go(d: dict[str, Any]) -> None:
        b = d["full_batch"] = batch
        arrays = {**{k: getattr(b, k).copy() for k in names}, **{k: v.copy() for k, v in b.tokens.items()},
                  **{k: v.copy() for k, v in b.rows.items()}}
        mutate(arrays)
        for k in names:
            setattr(b, k, arrays[k])
        for part in (b.tokens, b.rows):
            for k in part:
                part[k] = arrays[k]

    return _payload(f, go)


def bad_log_probs(f: Fields, draw: st.DrawFn) -> Fields:
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return _ragged(f, lambda t: t["rollout_log_probs"].__setitem__(0, value))


def lengths_disagree(f: Fields, draw: st.DrawFn) -> Fields:
    name = draw(
        st.sampled_from(["response_ids", "rollout_log_probs", "response_lens", "rewards", "prompt_ids"])
    )

    def cut(t: dict[str, np.ndarray]) -> None:
        t[name] = t[name][:-1]

    return _ragged(f, cut)


def bad_tokens(f: Fields, draw: st.DrawFn) -> Fields:
    name = draw(st.sampled_from(["response_ids", "prompt_ids"]))
    value = draw(st.sampled_from([-1, 10_000, 2**40]))
    dtype = draw(st.sampled_from([None, np.float32]))

    def put(t: dict[str, np.ndarray]) -> None:
        if dtype is not None:
            t[name] = t[name].astype(dtype)
        else:
            t[name] = t[name].astype(np.int64)
            t[name][-1] = value

    return _ragged(f, put)


ANY_ENTRY = [garbage, truncated, header_type, unknown_schema, huge_declared, oversized, wrong_field_type]
ROLLOUT_ONLY = [bad_log_probs, lengths_disagree, bad_tokens]


@st.composite
def breakers(draw: st.DrawFn, kinds: list[Mutation]) -> list[Mutation]:
    return draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3))


def dead_sources(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """source entry id -> reason, for every dead letter (the trainer's and the aggregator's)."""
    out = {}
    for _, f in [*r.xrange(keys.dead), *r.xrange(keys.dead_aggregator)]:
        ev = decode(f)
        assert isinstance(ev, DeadLetter)
        out[ev.source_id] = ev.reason
    return out


# -- the trainer ------------------------------------------------------------------------------------


@pytest.fixture
def trainer(r: redis.Redis, keys: Keys, tmp_path: Path) -> Iterator[Trainer]:
    t = Trainer(tiny_cfg(keys, tmp_path), r, keys, "trainer", threading.Event())
    t.resume()
    yield t
    t.effects.stop_leaser()


@FUZZ
@given(data=st.data(), bad=breakers(ANY_ENTRY + ROLLOUT_ONLY))
def test_trainer_dead_letters_bad_rollouts_and_trains_the_good_ones(
    r: redis.Redis, keys: Keys, trainer: Trainer, data: st.DataObject, bad: list[Mutation]
) -> None:
    g = trainer.global_step + 1
    goods, bads = [], []
    entries = []
    for _ in range(2):  # one good sample per local update, bad entries before and between them
        for mutate in bad:
            sid = f"{P0}-bad-{uuid.uuid4().hex[:8]}"
            good = as_fields(fake_rollout_sample(sid, param_version=g - 1, n=2, prompt_len=4, response_len=5,
                                                 producer=P0))
            entries.append(("bad", mutate(good, data.draw)))
        sid = f"{P0}-{lease_outright(r, keys, P0, 1) - 1}"  # leased, as the trainer would lease it
        entries.append(("good", as_fields(fake_rollout_sample(sid, param_version=g - 1, n=2, prompt_len=4,
                                                              response_len=5, seed=g, producer=P0))))
        goods.append(sid)
    for kind, fields in entries:
        eid = r.xadd(keys.rollouts_of(P0), fields).decode()  # type: ignore[arg-type, union-attr]
        if kind == "bad":
            bads.append(eid)
    before = dead_sources(r, keys)
    trainer.stop.clear()
    guard = threading.Timer(30, trainer.stop.set)  # a good sample lost to a bad one would block forever
    guard.start()
    try:
        assert trainer.train_step(g), "the step never got its two good samples"
    finally:
        guard.cancel()
    dead = {k: v for k, v in dead_sources(r, keys).items() if k not in before}
    assert set(dead) == set(bads), f"dead {dead} vs bad {bads}"
    assert all(reason.strip() for reason in dead.values())
    fates = [f[b"sample_id"].decode() for _, f in r.xrange(keys.fates, f"{g}-0", f"{g}-99")]
    assert sorted(fates) == sorted(goods)
    assert r.xpending(keys.rollouts_of(P0), "trainer")["pending"] == 0


# -- the aggregator ---------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), bad=breakers(ANY_ENTRY), rollout_on_metrics=st.booleans())
def test_aggregator_dead_letters_bad_metrics_and_writes_the_record(
    r: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    data: st.DataObject,
    bad: list[Mutation],
    rollout_on_metrics: bool,
) -> None:
    setup_run(r, keys, PRODUCERS)
    # an example hypothesis abandoned mid-way (a draw past its buffer) may have left entries: fold them first
    r.hset(keys.trainer, mapping={COMMITTED_STEP_FIELD: 10**6, TRAINING_STEP_FIELD: 10**6})
    AggregatorWorker(tiny_cfg(keys, tmp_path), r, keys, sinks=Sinks(r, keys, [])).run(burst=True)
    g = len(r.xrange(keys.records)) + 1
    # the trainer vouches for step g
    r.hset(keys.trainer, mapping={COMMITTED_STEP_FIELD: g, TRAINING_STEP_FIELD: g})
    good = [
        fakes.local_update(g, 1, 2, {"actor/loss": 0.5}),
        fakes.local_update(g, 2, 2, {"actor/loss": 1.5}),
        fakes.step_end(g, 2),
    ]
    bads = []
    for i, event in enumerate(good):
        for mutate in bad:
            bads.append(r.xadd(keys.metrics, mutate(as_fields(event), data.draw)).decode())  # type: ignore[arg-type,union-attr]
        if rollout_on_metrics and i == 0:
            bads.append(r.xadd(keys.metrics, as_fields(fake_rollout_sample(f"x{g}"))).decode())  # type: ignore[arg-type,union-attr]
        Publisher(r).publish(keys.metrics, event)
    before = dead_sources(r, keys)
    worker = AggregatorWorker(tiny_cfg(keys, tmp_path), r, keys, sinks=Sinks(r, keys, []))
    worker.run(burst=True)
    dead = {k: v for k, v in dead_sources(r, keys).items() if k not in before}
    assert set(dead) == set(bads), (dead, bads)
    assert all(reason.strip() for reason in dead.values())
    records = r.xrange(keys.records, f"{g}-1", f"{g}-1")
    assert records, f"no record for step {g}"
    assert decode(records[0][1]).metrics["actor/loss"] == pytest.approx(1.0)  # type: ignore[union-attr]


# -- producers reading params ------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), bad=breakers(ANY_ENTRY))
def test_producer_skips_bad_params_entries_and_loads_the_next_good_version(
    r: redis.Redis, keys: Keys, tmp_path: Path, data: st.DataObject, bad: list[Mutation]
) -> None:
    cfg = tiny_cfg(keys, tmp_path)
    policy = build_policy(cfg)
    blob = policy.state_dict_bytes()
    v = (latest_param_version(r, keys) or type("P", (), {"version": -1})()).version + 1
    sync = WeightSync(r, keys, build_policy(cfg), "rollout_00")
    publish_weights(r, keys, v, blob, global_step=v, inline_max_bytes=1 << 30)
    assert sync.wait_initial(threading.Event(), timeout_s=5) and sync.version == v
    good = as_fields(latest_param_version(r, keys))  # type: ignore[arg-type]
    for mutate in bad:  # garbage lands on top of params: the producer keeps its version
        r.xadd(keys.params, mutate(good, data.draw))  # type: ignore[arg-type]
        assert sync.refresh() is False and sync.version == v
    publish_weights(r, keys, v + 1, blob, global_step=v + 1, inline_max_bytes=1 << 30)
    r.xadd(keys.params, garbage(good, data.draw))  # type: ignore[arg-type]
    assert sync.refresh() is True and sync.version == v + 1
