"""The rollout producer against a real Redis: what it publishes, weight swaps, pacing with several
producers, tool calls, the HF weight round trip, and crash / SIGTERM behaviour of the worker process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from conftest import P0, padded_arrays

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from producers.watchdog import GenerationHung
from producers.weight_sync import WeightSync
from producers.worker import Producer, producer_seed
from rollstream.bus import parse_id, run_producers, setup_run
from rollstream.config import PipelineConfig, load_config
from rollstream.keys import DROPPED_STALE_FIELD, Keys, producer_names
from rollstream.model import CharTokenizer, Completion, build_batch, build_policy
from rollstream.pacing.budget import consume, grant_budget, queue_count_consumed
from rollstream.pacing.counters import dispatch_entries, rollout_counts
from rollstream.runtime.process import EXIT_HUNG, EXIT_OK, WorkerContext
from rollstream.tasks import build_prompt_source, calculate
from rollstream.weights.store import producer_versions, publish_weights
from schemas import DispatchRecord, ProducerStats, RolloutSample, decode
from schemas.text_entries import GRANT, LEASE, TOPUP

pytestmark = pytest.mark.usefixtures("leasing")  # the trainer's lease loop runs in every test

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline.yaml"

# Small and fast on 2 CPU cores.
SMALL = [
    "run.device=cpu",
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "model.max_seq_len=32",
    "data.epoch_size=64",
    "data.val_size=4",
    "data.max_response_length=6",
    "data.train_batch_size=4",
    "async_training.trigger_parameter_sync_step=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.prompts_per_dispatch=2",
    "rollout.stats_every_s=60",
]


def small_cfg(keys: Keys, *overrides: str) -> PipelineConfig:
    """pipeline.yaml shrunk for tests, on the test's run namespace."""
    return load_config(PIPELINE, [*SMALL, f"run.name={keys.run}", *overrides])


def context(cfg: PipelineConfig, keys: Keys, name: str, redis_url: str) -> WorkerContext:
    """A WorkerContext with its own Redis client (what start_worker builds, minus argv and signals)."""
    return WorkerContext(cfg=cfg, name=name, keys=keys, r=redis.Redis.from_url(redis_url, socket_timeout=10))


def publish(r: redis.Redis, keys: Keys, version: int, blob: bytes, grant: int | None = None) -> None:
    """Play the trainer: publish `blob` as `version`, then grant it `grant` dispatches of budget."""
    publish_weights(r, keys, version, blob, global_step=version, inline_max_bytes=1 << 30)
    if grant is not None:
        grant_budget(r, keys, version, grant)


def start_run(r: redis.Redis, keys: Keys, blob: bytes, grant: int, producers: int = 2) -> None:
    """Set up the run's streams (of `producers` producers) and publish version 0 with a budget."""
    setup_run(r, keys, producer_names(producers))
    publish(r, keys, 0, blob, grant)


def samples(r: redis.Redis, keys: Keys) -> list[RolloutSample]:
    """Every RolloutSample on the producers' rollouts streams, decoded, in id order."""
    rows: Any = [row for s in keys.rollouts_streams(run_producers(r, keys)) for row in r.xrange(s)]
    out = [decode(fields) for _, fields in sorted(rows, key=lambda row: parse_id(row[0]))]
    assert all(isinstance(s, RolloutSample) for s in out)
    return out  # type: ignore[return-value]


def producer_stats(r: redis.Redis, keys: Keys) -> list[ProducerStats]:
    """Every ProducerStats event on the producers' stats streams, in id order."""
    rows: Any = sorted(
        (row for s in keys.stats_streams(run_producers(r, keys)) for row in r.xrange(s)),
        key=lambda row: parse_id(row[0]),
    )
    return [ev for ev in (decode(f) for _, f in rows) if isinstance(ev, ProducerStats)]


def dispatch_log(r: redis.Redis, keys: Keys) -> list[DispatchRecord]:
    """Every grant, top-up and lease on the trainer's log, in id order."""
    return dispatch_entries(r, keys)


def outstanding(r: redis.Redis, keys: Keys) -> int:
    """Prompts leased and not yet consumed, from the counters the producers' stats report."""
    counts = rollout_counts(r, keys, [])
    return counts.dispatched - counts.consumed


def in_flight(r: redis.Redis, keys: Keys, producer: str) -> int:
    """Prompts leased to `producer` and not published."""
    return rollout_counts(r, keys, [producer]).in_flight


def count_consumed(r: redis.Redis, keys: Keys, sample_ids: list[str]) -> None:
    """Play the trainer's commit: these samples' prompts are consumed."""
    pipe = r.pipeline(transaction=True)
    queue_count_consumed(pipe, keys, sample_ids)
    pipe.execute()


def build_blob(cfg: PipelineConfig, seed: int) -> bytes:
    """Weights of a freshly initialised policy of `cfg`'s shape with another seed."""
    return build_policy(
        cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": seed})})
    ).state_dict_bytes()


def padded(s: RolloutSample) -> dict[str, np.ndarray]:
    """The sample's tensors as the trainer pads them (the producer publishes them ragged)."""
    return padded_arrays(assemble_batch_from_rollout_samples([s])[0])


def masked_logprob_error(policy: Any, s: RolloutSample) -> torch.Tensor:
    """|stored behaviour log-prob - fresh forward| per response token [n,R] (0 where response_mask is 0)."""
    t = padded(s)
    R = t["responses"].shape[1]
    with torch.no_grad():
        fresh = policy.log_probs(torch.tensor(t["input_ids"]), torch.tensor(t["attention_mask"]), R)
    return (fresh - torch.tensor(t["rollout_log_probs"])).abs() * torch.tensor(t["response_mask"])


# ---- what a producer publishes -------------------------------------------------------------------


def test_published_samples_are_what_was_generated(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    cfg = small_cfg(keys)
    policy = build_policy(cfg)
    start_run(r, keys, policy.state_dict_bytes(), grant=cfg.max_outstanding)
    producer = Producer(context(cfg, keys, "rollout_01", redis_url))

    assert producer.run(max_dispatches=1) == 1

    got = samples(r, keys)
    assert len(got) == cfg.rollout.prompts_per_dispatch
    # Replaying the same prompts with the producer's seed gives exactly the published tokens.
    tok = policy.tokenizer
    texts = [s.full_batch.non_tensors["raw_prompt"][0] for s in got]
    gen = torch.Generator().manual_seed(producer_seed(cfg.run.seed, 1))
    replay = policy.generate(
        [tok.encode(t, add_bos=True) for t in texts], n=cfg.rollout.n,
        max_new_tokens=cfg.data.max_response_length, generator=gen,
    )
    n = cfg.rollout.n
    for k, s in enumerate(got):
        t = padded(s)
        assert s.n == n and s.producer == "rollout_01" and s.param_version == 0
        assert set(s.full_batch.non_tensors["uid"]) == {s.sample_id}
        P = t["prompts"].shape[1]
        assert (t["input_ids"] == np.concatenate([t["prompts"], t["responses"]], 1)).all()
        for i in range(n):
            want = replay[k * n + i]
            length = int(t["response_mask"][i].sum())
            assert t["responses"][i, :length].tolist() == want.response_ids
            assert (t["responses"][i, length:] == 0).all()
            assert s.full_batch.non_tensors["response_text"][i] == tok.decode(want.response_ids)
            assert t["prompts"][i][t["attention_mask"][i, :P] == 1].tolist() == want.prompt_ids
            assert s.agent_loop_output_list[i]["finished"] == want.finished
        assert float(masked_logprob_error(policy, s).max()) < 1e-4
        assert s.param_version_start == s.param_version_end == [0] * n
        # the global status when the dispatch finished: nothing published yet, this dispatch in flight
        assert s.rollout_status["count/total_generated_samples"] == 0
        assert s.rollout_status["monitor/active_tasks_size"] == cfg.rollout.prompts_per_dispatch
    # Lease bookkeeping: published prompts stay outstanding until consumed; none in flight.
    assert outstanding(r, keys) == cfg.rollout.prompts_per_dispatch
    assert in_flight(r, keys, "rollout_01") == 0
    assert [s.sample_id for s in got] == [f"rollout_01-{i}" for i in range(len(got))]  # seqs of its lease
    assert r.get(keys.producer_cursor("rollout_01")) is not None
    assert producer_versions(r, keys) == {"rollout_01": 0}
    stats = producer_stats(r, keys)
    assert stats and stats[-1].samples == len(got) and stats[-1].tokens == sum(s.num_tokens for s in got)


def test_slots_dispatch_side_by_side_and_publish_each_prompt_once(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """`slots=2`: two copies of the loop generate at once, one prompt a dispatch each, and every leased
    prompt is published exactly once under its own id."""
    cfg = small_cfg(keys)
    start_run(r, keys, build_blob(cfg, 0), grant=cfg.max_outstanding)
    both = threading.Barrier(2, timeout=30)  # passed only while two generations are in flight at once
    serial = threading.Lock()  # the agent loop itself shares one policy and generator
    threads: list[str] = []

    def generate(request: Any, param_version: int) -> Any:
        with serial:
            threads.append(threading.current_thread().name)
            first_two = len(threads) <= 2
        if first_two:
            both.wait()
        with serial:
            return producer.agent_loop(request, param_version)

    producer = Producer(context(cfg, keys, "rollout_00", redis_url), generate=generate, slots=2)
    assert producer.run(max_dispatches=6) == 6
    got = samples(r, keys)
    assert sorted(s.sample_id for s in got) == [f"rollout_00-{i}" for i in range(6)]  # each once
    assert all(s.n == cfg.rollout.n and "rollout_failure" not in s.rollout_status for s in got)
    assert len(set(threads)) == 2 and threading.current_thread().name not in threads
    assert producer.counters.dispatched == producer.counters.published == 6
    with pytest.raises(ValueError, match="slots need a generate function"):  # the agent loop is not shared
        Producer(context(cfg, keys, "rollout_01", redis_url), slots=2)


def test_a_switch_reports_no_window_that_only_waited_for_the_new_version(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """A window holding only the wait for the version just loaded (published nothing, generated nothing) is
    not reported as a window of the version left: the wait goes into the next window (a step's record merges
    every window of its span, consumers/aggregator/fold.py)."""
    cfg = small_cfg(keys)
    start_run(r, keys, build_blob(cfg, 0), grant=cfg.max_outstanding)
    producer = Producer(context(cfg, keys, "rollout_00", redis_url))
    assert producer.run(max_dispatches=1) == 1
    emitted = len(producer_stats(r, keys))
    producer._on_switch(0, 1)  # nothing published or generating since the last window: the wait carries on
    assert len(producer_stats(r, keys)) == emitted
    producer.generating = 1  # mid-generation: the window of the version left is reported
    producer._on_switch(1, 2)
    assert [ev.param_version for ev in producer_stats(r, keys)[emitted:]] == [1]
    producer.generating = 0
    producer.window.samples = 2  # published since the last window: reported
    producer._on_switch(2, 3)
    assert [(ev.param_version, ev.samples) for ev in producer_stats(r, keys)[emitted + 1:]] == [(2, 2)]


@pytest.mark.parametrize("partial", [True, False])
def test_new_version_mid_generation(r: redis.Redis, keys: Keys, redis_url: str, partial: bool) -> None:
    cfg = small_cfg(keys, f"async_training.partial_rollout={partial}", "rollout.sync_every_tokens=2",
                    "data.max_response_length=8")
    start_run(r, keys, build_blob(cfg, 0), grant=cfg.rollout.prompts_per_dispatch)
    producer = Producer(context(cfg, keys, "rollout_00", redis_url))
    v1 = build_blob(cfg, 1)

    # The fake trainer publishes (and grants) version 1 while the first dispatch is generating:
    # from the first weight check inside generate, or as generate starts when there is none.
    generate = producer.policy.generate
    published: list[bool] = []

    def publish_once() -> None:
        if not published:
            publish(r, keys, 1, v1, grant=cfg.max_outstanding)
            published.append(True)

    def generate_with_trainer(*args: Any, **kwargs: Any) -> Any:
        on_chunk = kwargs.get("on_chunk")
        if on_chunk is None:
            publish_once()
        else:
            kwargs["on_chunk"] = lambda: (publish_once(), on_chunk())[1]
        return generate(*args, **kwargs)

    producer.policy.generate = generate_with_trainer  # type: ignore[method-assign]
    assert producer.run(max_dispatches=2) == 2

    got = samples(r, keys)
    first, second = got[:2], got[2:]
    assert [s.param_version for s in got] == [0, 0, 1, 1]  # stamped at dispatch
    starts = [v for s in first for v in s.param_version_start]
    ends = [v for s in first for v in s.param_version_end]
    assert set(starts) == {0}
    if partial:
        assert 1 in ends  # weights changed mid-trajectory: start < end
        swapped = sum(
            int(a < b) for s in first for a, b in zip(s.param_version_start, s.param_version_end, strict=True)
        )
        assert producer.counters.partial_swaps == swapped > 0
        assert second[0].rollout_status["count/total_generated_samples"] == len(first)
        v0_policy, v1_policy = build_policy(cfg), build_policy(cfg)
        v1_policy.load_state_dict_bytes(v1)
        for s in first:
            err0, err1 = masked_logprob_error(v0_policy, s), masked_logprob_error(v1_policy, s)
            mask = torch.tensor(padded(s)["response_mask"]).bool()
            # every behaviour log-prob is the one of the weights that sampled it
            assert bool(((err0 < 1e-4) | (err1 < 1e-4))[mask].all())
            for i, end in enumerate(s.param_version_end):
                last = int(mask[i].sum()) - 1
                assert float((err1 if end == 1 else err0)[i, last]) < 1e-4
                assert float(err0[i, 0]) < 1e-4
    else:
        assert set(ends) == {0}  # unfinished work finished under the old weights
    for s in second:
        assert s.param_version_start == s.param_version_end == [1] * s.n
    # The switch reported the window of the version left.
    stats = producer_stats(r, keys)
    assert stats[0].param_version == 0 and 0 in stats[0].versions_in_use
    assert stats[-1].param_version == 1


# ---- pacing with several producers ---------------------------------------------------------------


def test_three_producers_respect_the_budget(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    cfg = small_cfg(keys, "rollout.num_producers=3", "rollout.n=2", "data.max_response_length=4",
                    "async_training.staleness_threshold=0.5")
    tbs, bound = cfg.data.train_batch_size, cfg.max_outstanding
    assert bound == 6
    blob = build_blob(cfg, 0)
    start_run(r, keys, blob, grant=bound, producers=3)
    producers = [Producer(context(cfg, keys, f"rollout_{i:02d}", redis_url)) for i in range(3)]
    errors: list[BaseException] = []

    def work(p: Producer) -> None:
        try:
            p.run()
        except BaseException as e:  # surfaced by the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,), daemon=True) for p in producers]
    for t in threads:
        t.start()
    # Fake trainer: consume samples in global steps of train_batch_size; publish + grant after each.
    version, pending = 0, []
    last_ids: dict[str, Any] = dict.fromkeys(keys.rollouts_streams(producer_names(3)), "0-0")
    deadline = time.monotonic() + 60
    try:
        while version < 5 and not errors:
            assert time.monotonic() < deadline, "producers stalled"
            reply: Any = r.xread(dict(last_ids), block=100)
            for stream, entries in reply or []:
                last_ids[stream.decode()] = entries[-1][0]
                pending += [decode(f).sample_id for _, f in entries]  # type: ignore[union-attr]
            while len(pending) >= tbs:
                count_consumed(r, keys, pending[:tbs])
                pending = pending[tbs:]
                version += 1
                publish(r, keys, version, blob, grant=bound)
    finally:
        for p in producers:
            p.ctx.stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors

    log = dispatch_log(r, keys)
    granted = {e.version: e.amount for e in log if e.op == GRANT}
    taken: dict[int | None, int] = {}
    for e in log:
        if e.op == LEASE:
            taken[e.version] = taken.get(e.version, 0) + e.amount
            assert e.outstanding is not None and e.outstanding <= bound
    assert set(granted) == set(range(version + 1))
    assert all(taken.get(v, 0) <= granted[v] for v in granted), (granted, taken)
    assert {e.producer for e in log if e.op == LEASE} == {"rollout_00", "rollout_01", "rollout_02"}
    # Everything dispatched was published (SIGTERM-like stop finishes the dispatch), once each.
    got = samples(r, keys)
    assert len({s.sample_id for s in got}) == len(got) <= sum(taken.values())  # a lease may be unused
    assert outstanding(r, keys) <= bound
    by_producer: dict[str, set[str]] = {}
    for s in got:
        by_producer.setdefault(s.producer, set()).add(s.full_batch.non_tensors["raw_prompt"][0])
    a, b, c = by_producer.values()
    assert not (a & b or a & c or b & c)  # disjoint prompt shards
    assert any(p.counters.idle_s > 0 for p in producers)  # leases, not the producers, set the pace


def test_an_idle_producer_is_leased_the_budget_a_dead_letter_gives_back(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """Sync mode: the version's whole window dispatched, the producer idles; the trainer dead-letters one
    rollout and tops the budget up (no new version: that comes only after a full batch trains). The
    producer must be leased it and publish a replacement stamped with the same version, within the
    bound."""
    cfg = small_cfg(keys, "rollout.n=2", "data.max_response_length=4", "async_training.staleness_threshold=0")
    bound = cfg.max_outstanding
    start_run(r, keys, build_blob(cfg, 0), grant=bound)
    producer = Producer(context(cfg, keys, "rollout_00", redis_url))
    thread = threading.Thread(target=producer.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while r.xlen(keys.rollouts_of(P0)) < bound:
            assert time.monotonic() < deadline and thread.is_alive(), "producer did not dispatch the window"
            time.sleep(0.02)
        time.sleep(0.5)
        assert r.xlen(keys.rollouts_of(P0)) == bound  # the window is out: it idles
        first = samples(r, keys)[0].sample_id  # the trainer dead-letters one rollout, and pacing counts it
        assert consume(r, keys, [first], bound) == (1, 1)
        assert consume(r, keys, [first], bound) == (0, 0)  # once
        while r.xlen(keys.rollouts_of(P0)) < bound + 1:
            assert time.monotonic() < deadline, "the producer never took the budget given back"
            time.sleep(0.02)
    finally:
        producer.ctx.stop.set()
        thread.join(30)
    got = samples(r, keys)
    assert len(got) == bound + 1 and {s.param_version for s in got} == {0}
    log = dispatch_log(r, keys)
    assert [(e.op, e.amount) for e in log if e.op in (GRANT, TOPUP)] == [(GRANT, bound), (TOPUP, 1)]
    assert all(e.outstanding is not None and e.outstanding <= bound for e in log if e.op == LEASE)


# ---- the tool agent ------------------------------------------------------------------------------


class ScriptedToolPolicy:
    """A fake model: turn 1 writes `[calc:EXPR]` (then junk to be cut), turn 2 copies the tool result."""

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        self.max_seq_len = 64
        self.calls: list[list[str]] = []
        self.loaded: list[bytes] = []

    def generate(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, **kwargs: Any
    ) -> list[Completion]:
        out, texts = [], []
        for p in prompts:
            text = self.tokenizer.decode(p)
            texts.append(text)
            if "[=" in text:
                ids = self.tokenizer.encode(text.rsplit("[=", 1)[1].split("]")[0]) + [self.tokenizer.eos_id]
            else:
                ids = self.tokenizer.encode(f"[calc:{text.split('=')[0]}]xx")
            ids = ids[:max_new_tokens]
            for _ in range(n):
                out.append(
                    Completion(list(p), list(ids), [-0.5] * len(ids), ids[-1] == self.tokenizer.eos_id)
                )
        self.calls.append(texts)
        return out

    def load_state_dict_bytes(self, blob: bytes) -> None:
        self.loaded.append(blob)


def test_tool_agent_records_tool_calls(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    cfg = small_cfg(
        keys,
        "data.task=arith",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.max_turns=3",
        "data.max_response_length=20",
        "rollout.n=2",
    )
    start_run(r, keys, b"scripted weights", grant=cfg.max_outstanding)
    fake = ScriptedToolPolicy()
    producer = Producer(context(cfg, keys, "rollout_00", redis_url), policy=fake)  # type: ignore[arg-type]
    assert producer.run(max_dispatches=1) == 1
    assert fake.loaded == [b"scripted weights"] and len(fake.calls) == 2  # two turns, then done

    got = samples(r, keys)
    assert len(got) == cfg.rollout.prompts_per_dispatch
    tok = fake.tokenizer
    for s in got:
        expr = s.full_batch.non_tensors["raw_prompt"][0].split("=")[0]
        value = calculate(expr)
        call, result, answer = f"[calc:{expr}]", f"[={value}]", str(value)
        assert list(s.full_batch.non_tensors["response_text"]) == [call + result + answer] * s.n
        assert len(s.tool_calls) == s.n and all(0 <= x < 1 for x in s.tool_calls)
        t = padded(s)
        assert s.full_batch.tokens["response_mask"].dtype == np.uint8  # sent only because tools wrote tokens
        mask = [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
        for i in range(s.n):
            assert t["response_mask"][i, : len(mask)].tolist() == mask
            assert tok.decode(t["responses"][i][t["response_mask"][i] == 0]) == result
            assert (t["rollout_log_probs"][i][np.array(mask) == 0] == 0).all()
            assert np.allclose(t["rollout_log_probs"][i][np.array(mask) == 1], -0.5)
            assert s.agent_loop_output_list[i]["num_turns"] == 2 and s.agent_loop_output_list[i]["finished"]
        assert t["rewards"].tolist() == [1.0] * s.n
        assert s.num_tokens == s.n * (len(call) + len(answer) + 1)


# ---- the HF backend's weights through the bus ----------------------------------------------------


def test_hf_weights_round_trip(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rollstream.model.hf import HFPolicy
    from rollstream.testing.hf_tiny import make_tiny_hf_model

    trained = HFPolicy.from_pretrained(make_tiny_hf_model(tmp_path / "a", seed=0), device="cpu")
    other = HFPolicy.from_pretrained(make_tiny_hf_model(tmp_path / "b", seed=1), device="cpu")
    ids, mask, R = build_batch([[1, 5, 6, 7], [1, 8]], [[9, 10, 2], [11]], 0)
    with torch.no_grad():
        want, before = trained.log_probs(ids, mask, R), other.log_probs(ids, mask, R)
    assert not torch.equal(want, before)

    publish_weights(r, keys, 0, trained.state_dict_bytes(), global_step=0, inline_max_bytes=1 << 30)
    sync = WeightSync(r, keys, other, "rollout_00")
    assert sync.refresh() and sync.version == 0
    with torch.no_grad():
        assert torch.equal(other.log_probs(ids, mask, R), want)
    assert not sync.refresh()  # nothing newer


# ---- the worker process --------------------------------------------------------------------------

# Big enough that a dispatch takes seconds, so the process can be signalled between take and publish.
SLOW = [
    "model.d_model=64",
    "model.n_layer=2",
    "model.n_head=4",
    "rollout.n=64",
    "rollout.prompts_per_dispatch=8",
    "data.max_response_length=24",
    "async_training.partial_rollout=false",
]
# The same model, restarted in-process with a small amount of work.
RESTART = [*SLOW, "rollout.n=2", "rollout.prompts_per_dispatch=2", "data.max_response_length=4"]


def spawn_producer(keys: Keys, redis_url: str, *overrides: str) -> subprocess.Popen[bytes]:
    """`python -m producers` as rollout_00 on the test run."""
    args = [sys.executable, "-m", "producers", str(PIPELINE), *SMALL, *SLOW, f"run.name={keys.run}",
            f"run.redis_url={redis_url}", *overrides, "--name", "rollout_00"]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_take(r: redis.Redis, keys: Keys, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> int:
    """Block until the process was leased prompts and began generating them; returns the amount leased."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        takes = [e for e in dispatch_log(r, keys) if e.op == LEASE]
        if takes:
            time.sleep(0.05)  # it reads its lease within POLL_S (0.005 s); a dispatch of SLOW takes longer
            return takes[0].amount
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        time.sleep(0.01)
    raise AssertionError("producer was never leased prompts")


def test_sigterm_finishes_and_publishes_the_dispatch(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    cfg = small_cfg(keys, *SLOW)
    start_run(r, keys, build_blob(cfg, 0), grant=1000)
    proc = spawn_producer(keys, redis_url)
    try:
        taken = wait_for_take(r, keys, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_OK, err.decode()[-2000:]
    got = samples(r, keys)
    assert len(got) == taken == cfg.rollout.prompts_per_dispatch  # finished, published, asked no more
    assert in_flight(r, keys, "rollout_00") == 0
    # A restart resumes after the published prompts (the cursor moved with the publish).
    restarted = Producer(context(small_cfg(keys, *RESTART), keys, "rollout_00", redis_url))
    assert restarted.run(max_dispatches=1) == 1 and restarted.counters.released_on_start == 0
    before = {s.full_batch.non_tensors["raw_prompt"][0] for s in got}
    after = {s.full_batch.non_tensors["raw_prompt"][0] for s in samples(r, keys)[len(got):]}
    assert after and not before & after


def test_sigkill_before_publish_is_dispatched_again_on_restart(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    cfg = small_cfg(keys, *SLOW)
    start_run(r, keys, build_blob(cfg, 0), grant=1000)
    proc = spawn_producer(keys, redis_url)
    try:
        taken = wait_for_take(r, keys, proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert r.xlen(keys.rollouts_of(P0)) == 0, "killed too late: the dispatch was already published"
    assert outstanding(r, keys) == taken > 0
    assert r.get(keys.producer_cursor("rollout_00")) is None

    restarted = Producer(context(small_cfg(keys, *RESTART), keys, "rollout_00", redis_url))
    assert restarted.start()
    assert restarted.counters.released_on_start == taken  # its lease is still its own
    assert outstanding(r, keys) == taken
    # Nothing was skipped: the restarted producer draws its shard from the start again, under the same ids.
    assert restarted.run(max_dispatches=1) == 1
    shard = build_prompt_source(cfg).shard(0, cfg.rollout.num_producers)
    per = restarted.ctx.cfg.rollout.prompts_per_dispatch
    first = [p.text for _, _, p in shard.take(per)]
    got = samples(r, keys)
    assert [s.full_batch.non_tensors["raw_prompt"][0] for s in got] == first
    assert [s.sample_id for s in got] == [f"rollout_00-{i}" for i in range(per)]
    assert [e.op for e in dispatch_log(r, keys)].count(LEASE) == 1  # no new lease: it used the old one


def test_rollout_status_is_the_global_status_of_all_producers(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    cfg = small_cfg(keys, "rollout.num_producers=2")
    policy = build_policy(cfg)
    start_run(r, keys, policy.state_dict_bytes(), grant=cfg.max_outstanding)
    r.hset(keys.trainer, DROPPED_STALE_FIELD, 3)  # the trainer's run-long count (written in its commits)
    r.incrby(keys.consumed, 1)
    a = Producer(context(cfg, keys, "rollout_00", redis_url), policy=policy)
    b = Producer(context(cfg, keys, "rollout_01", redis_url), policy=build_policy(cfg))
    assert a.run(max_dispatches=1) == 1
    assert b.run(max_dispatches=1) == 1
    per = cfg.rollout.prompts_per_dispatch
    status = samples(r, keys)[-1].rollout_status  # one of b's
    assert status == {
        "count/total_generated_samples": per,  # a's samples: another producer's work counts
        "count/dropped_stale_samples": 3,
        "count/current_param_version": 0,
        "monitor/active_tasks_size": per,  # b's own dispatch, not yet published
        "monitor/queue/mq_queue_size": per - 1,  # published and not consumed
        "static/max_required_samples": cfg.max_outstanding,
        "static/required_samples": cfg.actor.ppo_mini_batch_size,
        "static/staleness_threshold": cfg.async_training.staleness_threshold,
        "static/max_queue_size": cfg.max_outstanding,
        "static/max_concurrent_samples": 2 * per,
    }


def test_lower_priority_raises_the_nice_value_of_the_process() -> None:
    import os
    import subprocess
    import sys

    if os.nice(0) > 16:  # the kernel caps nice at 19: from here the test could not see a raise of 3
        pytest.skip(f"the tests run at nice {os.nice(0)}: a raise of 3 would pass 19")
    code = (
        "import os; from producers.worker import lower_priority; a = os.nice(0); lower_priority(3); "
        "print(os.nice(0) - a)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "3"


def test_a_generation_failure_publishes_its_prompts_as_rollout_failures(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """An engine error (or an engine's timeout) neither hangs the producer nor loses the prompts: each is
    published with empty responses and rollout_status `rollout_failure` = 1 (the trainer evicts it and gives
    its room back), and the producer goes on generating."""
    cfg = small_cfg(keys)
    policy = build_policy(cfg)
    start_run(r, keys, policy.state_dict_bytes(), grant=cfg.max_outstanding)
    calls = []

    def flaky(request: Any, param_version: int) -> Any:
        calls.append(param_version)
        if len(calls) == 1:
            raise TimeoutError("engine did not answer within 30 s")
        return producer.agent_loop(request, param_version)

    producer = Producer(context(cfg, keys, "rollout_00", redis_url), generate=flaky)
    assert producer.run(max_dispatches=2) == 2
    got = samples(r, keys)
    per = cfg.rollout.prompts_per_dispatch
    assert len(got) == 2 * per and len(calls) == 2
    failed, fine = got[:per], got[per:]
    for s in failed:
        assert s.rollout_status["rollout_failure"] == 1 and s.n == cfg.rollout.n and s.num_tokens == 0
    assert all("rollout_failure" not in s.rollout_status and s.num_tokens > 0 for s in fine)
    assert outstanding(r, keys) == 2 * per and in_flight(r, keys, "rollout_00") == 0


def test_a_generation_that_never_returns_is_published_as_failures_once(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    """A hung engine: past rollout.generate_timeout_s the watchdog publishes the dispatch's prompts as rollout
    failures and ends the process (here: a hook); the generation returning later publishes nothing twice."""
    cfg = small_cfg(keys, "rollout.generate_timeout_s=0.3")
    start_run(r, keys, build_blob(cfg, 0), grant=cfg.max_outstanding)
    release, ended = threading.Event(), threading.Event()

    def hang(request: Any, param_version: int) -> Any:
        release.wait(30)
        return producer.agent_loop(request, param_version)

    producer = Producer(context(cfg, keys, "rollout_00", redis_url), generate=hang)
    producer.on_hung = ended.set  # instead of os._exit(EXIT_HUNG)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            producer.run(max_dispatches=1)
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    assert ended.wait(30), "the watchdog never ended the hung generation"
    got = samples(r, keys)
    per = cfg.rollout.prompts_per_dispatch
    assert [s.sample_id for s in got] == [f"rollout_00-{i}" for i in range(per)]
    assert all(s.rollout_status["rollout_failure"] == 1 and s.num_tokens == 0 for s in got)
    assert in_flight(r, keys, "rollout_00") == 0  # published: the trainer evicts them and gives the room back
    release.set()  # the engine answers at last: too late, the dispatch is not published again
    worker.join(30)
    assert len(errors) == 1 and isinstance(errors[0], GenerationHung), errors
    assert len(samples(r, keys)) == per


def test_a_hung_producer_exits_for_its_supervisor_and_a_restart_goes_on(
    r: redis.Redis, keys: Keys, redis_url: str
) -> None:
    cfg = small_cfg(keys, *SLOW)
    start_run(r, keys, build_blob(cfg, 0), grant=1000)
    proc = spawn_producer(keys, redis_url, "rollout.generate_timeout_s=0.001")  # no generation is that fast
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_HUNG, err.decode()[-2000:]
    assert "generate_timeout_s" in err.decode()
    failed = samples(r, keys)
    assert failed and all(s.rollout_status["rollout_failure"] == 1 for s in failed)
    assert in_flight(r, keys, "rollout_00") == 0
    restarted = Producer(context(small_cfg(keys, *RESTART), keys, "rollout_00", redis_url))
    assert restarted.run(max_dispatches=1) == 1 and restarted.counters.released_on_start == 0
    fresh = samples(r, keys)[len(failed) :]
    assert fresh and all("rollout_failure" not in s.rollout_status for s in fresh)
    assert {s.sample_id for s in fresh}.isdisjoint(s.sample_id for s in failed)
