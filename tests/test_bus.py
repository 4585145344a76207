"""The Redis Streams bus against a real Redis: publish, group read, dead letters, claims, retention."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis
from conftest import P0, PRODUCERS

from rollstream.bus import (
    Archive,
    GroupReader,
    Janitor,
    Message,
    Publisher,
    RunNotSetUpError,
    iter_stream,
    move_to_archive,
    setup_run,
    stream_floor,
)
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.testing.fakes import fake_rollout_sample
from schemas import DeadLetter, RolloutSample, decode, encode

ROOT = Path(__file__).resolve().parent.parent


def reader(r: redis.Redis, keys: Keys, consumer: str = "c1", **kw: object) -> GroupReader:
    opts: dict = dict(dead_stream=keys.dead, block_ms=50, count=16, claim_idle_s=30.0, max_deliveries=3)
    opts.update(kw)
    return GroupReader(r, keys.rollouts_of(P0), TRAINER_GROUP, consumer, **opts)


def consume(rd: GroupReader, handler: Callable[[list[Message]], None], *, burst: bool = False) -> int:
    """A worker's loop over `rd.batches`: handler(batch) for every non-empty batch, then ack the batch; a
    handler exception hands the batch back (it is re-read and dead-lettered after max_deliveries). Returns
    messages handled."""
    handled = 0
    for msgs in rd.batches(burst=burst):
        if not msgs:
            continue
        try:
            handler(msgs)
        except Exception:
            rd.release(m.id for m in msgs)
            continue
        handled += len(msgs)
        rd.ack([m.id for m in msgs])
    return handled


def publish_samples(r: redis.Redis, keys: Keys, count: int, start: int = 0) -> list[str]:
    setup_run(r, keys, PRODUCERS)
    pub = Publisher(r)
    return pub.publish_many(
        keys.rollouts_of(P0), [fake_rollout_sample(f"s{i}", seed=i) for i in range(start, start + count)]
    )


def dead_entries(r: redis.Redis, keys: Keys) -> list[DeadLetter]:
    out = []
    for _, fields in r.xrange(keys.dead):
        ev = decode(fields)
        assert isinstance(ev, DeadLetter)
        out.append(ev)
    return out


def test_publish_requires_setup(r: redis.Redis, keys: Keys) -> None:
    with pytest.raises(RunNotSetUpError):
        Publisher(r).publish(keys.rollouts_of(P0), fake_rollout_sample("x"))
    assert not r.exists(keys.rollouts_of(P0))


def test_round_trip_through_group(r: redis.Redis, keys: Keys) -> None:
    sent = [fake_rollout_sample(f"s{i}", seed=i, param_version=i % 3) for i in range(10)]
    setup_run(r, keys, PRODUCERS)
    Publisher(r).publish_many(keys.rollouts_of(P0), sent)
    got: list[Message] = []
    handled = consume(reader(r, keys), got.extend, burst=True)
    assert handled == 10
    by_id = {m.event.sample_id: m.event for m in got if isinstance(m.event, RolloutSample)}
    for s in sent:
        d = by_id[s.sample_id]
        assert d.param_version == s.param_version
        for k in ("prompt_ids", "prompt_lens", "response_ids", "response_lens"):
            assert (getattr(d.full_batch, k) == getattr(s.full_batch, k)).all()
        for k, v in s.full_batch.tokens.items():
            assert (d.full_batch.tokens[k] == v).all()
    # acked after the handler: nothing pending
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0


def test_headers_are_plain_text_in_redis_cli(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    setup_run(r, keys, PRODUCERS)
    Publisher(r).publish(
        keys.rollouts_of(P0), fake_rollout_sample("abc-123", param_version=7, epoch=2, producer="rollout_01")
    )
    out = subprocess.run(
        ["redis-cli", "-u", redis_url, "--no-raw", "XRANGE", keys.rollouts_of(P0), "-", "+"],
        capture_output=True, text=True, check=True,
    ).stdout
    lines = [ln.split(")", 1)[-1].strip().strip('"') for ln in out.splitlines()]
    for name, value in (
        ("sample_id", "abc-123"),
        ("param_version", "7"),
        ("producer", "rollout_01"),
    ):
        i = lines.index(name)
        assert lines[i + 1] == value
    assert "epoch" not in lines  # (a header field up to issue 23's third pass; the payload carries it)


def test_malformed_entries_go_to_dead_and_reader_continues(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys, PRODUCERS)
    good = encode(fake_rollout_sample("good-1"))
    payload = msgpack.packb({"type": "rollout", "schema_version": 1})
    bad_entries = {
        "garbage": {"type": b"rollout", "payload": b"\xc1\xff\x00garbage"},
        "truncated": {"type": b"rollout", "payload": bytes(good["payload"])[:-7]},
        "future schema": {
            "type": b"rollout",
            "payload": msgpack.packb({"type": "rollout", "schema_version": 99}),
        },
        "missing field": {"type": b"rollout", "payload": payload},
        "no payload": {"type": b"rollout", "sample_id": b"x"},
    }
    r.xadd(keys.rollouts_of(P0), good)  # type: ignore[arg-type]
    for fields in bad_entries.values():
        r.xadd(keys.rollouts_of(P0), fields)  # type: ignore[arg-type]
    r.xadd(keys.rollouts_of(P0), encode(fake_rollout_sample("good-2")))  # type: ignore[arg-type]
    got: list[Message] = []
    consume(reader(r, keys), got.extend, burst=True)
    assert sorted(m.event.sample_id for m in got if isinstance(m.event, RolloutSample)) == [
        "good-1",
        "good-2",
    ]
    dead = dead_entries(r, keys)
    assert len(dead) == len(bad_entries)
    assert all(d.reason.startswith("decode:") and d.source == keys.rollouts_of(P0) for d in dead)
    reasons = " | ".join(d.reason for d in dead)
    assert "schema" in reasons and "payload" in reasons
    # originals are kept for inspection
    assert any(d.fields.get("payload", b"").startswith(b"\xc1\xff") for d in dead)
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0


def test_oversized_field_is_dead_lettered(r: redis.Redis, keys: Keys) -> None:
    from schemas import Limits

    setup_run(r, keys, PRODUCERS)
    Publisher(r).publish(keys.rollouts_of(P0), fake_rollout_sample("big", n=4, response_len=4096))
    got: list[Message] = []
    consume(reader(r, keys, limits=Limits(max_bin_len=1024, max_field_bytes=1024)), got.extend, burst=True)
    assert got == []
    [d] = dead_entries(r, keys)
    assert d.source_id and "decode" in d.reason


def test_an_oversize_entry_leaves_a_small_dead_copy_with_header_sizes_and_digest(
    r: redis.Redis, keys: Keys
) -> None:
    from rollstream.bus import entry_limits
    from schemas import DEAD_COPY_MAX_BYTES, DEAD_FIELD_KEEP_BYTES
    from schemas.events import entry_digest

    setup_run(r, keys, PRODUCERS)
    sample = fake_rollout_sample("huge", n=8, response_len=64 << 10)  # a few MiB of arrays
    Publisher(r).publish(keys.rollouts_of(P0), sample)
    [(_, original)] = r.xrange(keys.rollouts_of(P0))
    original = {k.decode(): bytes(v) for k, v in original.items()}
    size = sum(len(k) + len(v) for k, v in original.items())
    assert size > 2 * DEAD_COPY_MAX_BYTES
    consume(reader(r, keys, limits=entry_limits(1 << 20)), lambda msgs: None, burst=True)
    [(_, raw)] = r.xrange(keys.dead)
    assert sum(len(k) + len(v) for k, v in raw.items()) < DEAD_COPY_MAX_BYTES + (64 << 10)  # not the payload
    [d] = dead_entries(r, keys)
    assert f"over the max_entry_bytes={1 << 20} limit" in d.reason
    assert d.fields["sample_id"] == b"huge" and d.fields["type"] == b"rollout"  # the readable header stays
    big = {k: len(v) for k, v in original.items() if len(v) > DEAD_FIELD_KEEP_BYTES}
    assert big and d.omitted == big and not set(big) & set(d.fields)
    assert d.sha256 == entry_digest(original)
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0


def test_a_small_bad_entry_is_copied_whole() -> None:
    from schemas import dead_letter_of
    from schemas.events import entry_digest

    fields = {"type": b"rollout", "payload": b"\xc1" * 5000}
    d = dead_letter_of("s", "1-0", "decode: x", fields)
    assert d.fields == fields and d.omitted == {} and d.sha256 == entry_digest(fields)


def test_repeatedly_failing_entry_is_dead_after_max_deliveries(r: redis.Redis, keys: Keys) -> None:
    publish_samples(r, keys, 3)
    calls: dict[str, int] = {}

    def handler(msgs: list[Message]) -> None:
        for m in msgs:
            calls[m.event.sample_id] = calls.get(m.event.sample_id, 0) + 1  # type: ignore[union-attr]
        if any(m.event.sample_id == "s1" for m in msgs):  # type: ignore[union-attr]
            raise RuntimeError("poison")

    rd = reader(r, keys, count=1, max_deliveries=3)
    consume(rd, handler, burst=True)
    assert calls["s0"] == 1 and calls["s2"] == 1
    assert calls["s1"] == 3
    [d] = dead_entries(r, keys)
    assert "delivered 4 times" in d.reason
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0


def test_caller_committed_acks_and_burst_ends_only_when_drained(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys, PRODUCERS)
    for i in range(6):  # whole batches that only dead-letter must not end the burst
        r.xadd(keys.rollouts_of(P0), {"type": b"rollout", "payload": b"garbage %d" % i})
    Publisher(r).publish_many(keys.rollouts_of(P0), [fake_rollout_sample(f"s{i}") for i in range(2)])
    effects = keys.prefix + "effects"
    rd = reader(r, keys, count=3)
    for msgs in rd.batches(burst=True):  # the trainer's and the aggregator's style: ack inside our own MULTI
        if msgs:
            pipe = r.pipeline(transaction=True)
            pipe.rpush(effects, *(m.event.sample_id for m in msgs))  # type: ignore[union-attr]
            pipe.xack(keys.rollouts_of(P0), TRAINER_GROUP, *(m.id for m in msgs))
            pipe.execute()
            rd.forget(m.id for m in msgs)
    assert rd.drained and r.lrange(effects, 0, -1) == [b"s0", b"s1"]
    assert len(dead_entries(r, keys)) == 6 and rd.stats.acked == 2
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0


def test_ready_read_does_not_wait_and_waiting_is_not_transport(r: redis.Redis, keys: Keys) -> None:
    # The first read of a pass is an XREADGROUP without BLOCK. (`BLOCK 1` lasted until Redis's next
    # event-loop tick, up to 100 ms on a quiet server, and a sample published meanwhile counted as transport.)
    setup_run(r, keys, PRODUCERS)
    rd = reader(r, keys, block_ms=2000)
    passes = rd.batches(block_ms=0)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert next(passes) == []
        times.append(time.perf_counter() - t0)
    assert sorted(times)[2] < 0.05, times
    timer = threading.Timer(0.2, lambda: publish_samples(r, keys, 1))
    timer.start()
    t0 = time.perf_counter()
    got = next(rd.batches())  # nothing ready: waits in the blocking read until the sample is published
    waited = time.perf_counter() - t0
    timer.join()
    assert len(got) == 1 and waited >= 0.15
    assert rd.stats.transport_s < waited / 2  # only the decode of the sample that ended the wait


def test_command_packer_writes_what_redis_py_writes_in_fewer_pieces(r: redis.Redis, keys: Keys) -> None:
    """connect()'s RESP packer: the same bytes as redis-py's pure-Python packer, small values (memoryviews
    too) in one buffer per command, values from ZERO_COPY_MIN bytes on passed through uncopied; and the
    values arrive in Redis as sent."""
    from redis.connection import Encoder, PythonRespSerializer

    from rollstream.bus.connection import RespPacker

    ours, theirs = RespPacker(), PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    big = memoryview(bytes(range(256)) * (RespPacker.ZERO_COPY_MIN // 256))
    args = ("XADD", keys.rollouts_of(P0), "*", "s", "é✓", b"b", b"\x00\r\n", "i", 12, "f", 0.1, "m",
            memoryview(b"x" * 7000), "a", bytearray(b"ab"), "big", big)
    pieces = ours.pack(*args)
    assert b"".join(pieces) == b"".join(theirs.pack(*args))
    assert len(pieces) == 3 and pieces[1] is big  # everything before it in one buffer, big as it is
    assert len(ours.pack("XACK", "s", "g", "1-1")) == 1
    assert b"".join(ours.pack("CONFIG GET", "hz")) == b"".join(theirs.pack("CONFIG GET", "hz"))
    for bad in (True, None, [1]):
        with pytest.raises(redis.DataError):
            ours.pack("SET", "k", bad)
    setup_run(r, keys, PRODUCERS)
    fields = {"s": "é✓", "i": 12, "f": 0.1, "m": memoryview(b"x" * 7000), "big": big}
    entry_id = r.xadd(keys.rollouts_of(P0), fields)
    got = r.xrange(keys.rollouts_of(P0), entry_id, entry_id)[0][1]
    assert got == {b"s": "é✓".encode(), b"i": b"12", b"f": b"0.1", b"m": b"x" * 7000, b"big": bytes(big)}


def test_restart_drains_own_pending_first(r: redis.Redis, keys: Keys) -> None:
    publish_samples(r, keys, 6)
    first = reader(r, keys, count=4)
    msgs = first.poll()
    assert len(msgs) == 4  # delivered, never acked: the process "died"
    again = reader(r, keys, count=10)  # same consumer name, new process
    replay = again.poll()
    assert [m.id for m in replay] == [m.id for m in msgs]
    assert all(m.deliveries == 2 for m in replay)
    again.ack(m.id for m in replay)
    rest = again.poll()
    assert len(rest) == 2


def test_reconnect_rereads_own_pending(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    from rollstream.bus import connect

    setup_run(r, keys, PRODUCERS)
    client = connect(redis_url)
    rd = reader(r, keys, consumer="victim")
    rd.r = client
    assert rd.poll() == []
    publish_samples(r, keys, 2)
    # The server delivers to "victim" but the reply is lost with the connection.
    r.xreadgroup(TRAINER_GROUP, "victim", {keys.rollouts_of(P0): ">"}, count=10)
    r.client_kill_filter(_id=client.client_id())
    got: list[Message] = []
    loop = rd.batches()  # the consumer loop workers run
    for _ in range(5):
        got = got or next(loop)
    assert rd.stats.reconnects == 1
    assert len(got) == 2 and all(m.deliveries == 2 for m in got)


def test_a_growing_pool_is_not_a_reconnect(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    """A second connection the pool opens while the first is busy (another thread of the trainer) is not a
    lost socket: the reader does not re-read its pending list for it (the trainer's false warning at start),
    while a connection killed under it still is."""
    from rollstream.bus import connect

    setup_run(r, keys, PRODUCERS)
    client = connect(redis_url)
    rd = reader(r, keys, consumer="grower")
    rd.r = client
    assert rd.poll() == []
    pool = client.connection_pool
    busy = pool.get_connection()  # held, as by a thread blocked in a read
    try:
        assert rd.poll() == []  # the pool opens a second connection for this poll
        assert len(pool._available_connections) + len(pool._in_use_connections) == 2
        assert rd.stats.reconnects == 0
    finally:
        pool.release(busy)
    for conn in list(pool._available_connections):  # the server drops both sockets
        conn.send_command("CLIENT", "ID")
        r.client_kill_filter(_id=conn.read_response())
    got: list[Message] = []
    for _ in range(3):
        got = got or rd.poll()
    assert rd.stats.reconnects == 1


def test_a_switched_off_user_is_refused_at_once(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    """A worker whose ACL user is switched off and its connection killed (the trainer's flood fence) gets
    its refusal at once from the one retry policy, instead of retrying its login forever."""
    from rollstream.bus import connect, retry_on_connection

    user = keys.prefix.strip(":").replace(":", "-") + "-fenced"
    r.acl_setuser(user, enabled=True, passwords=["+pw"], commands=["+ping", "+client|id"], keys=[])
    try:
        client = connect(redis_url, username=user, password="pw")
        assert retry_on_connection(client.ping, "ping")
        r.acl_setuser(user, enabled=False)
        r.client_kill_filter(user=user)
        t0 = time.monotonic()
        with pytest.raises(redis.AuthenticationError):
            retry_on_connection(client.ping, "ping", timeout_s=30)
        assert time.monotonic() - t0 < 5
    finally:
        r.acl_deluser(user)


def test_claimed_after_sigkill_and_acked_once(r: redis.Redis, keys: Keys, redis_url: str) -> None:
    publish_samples(r, keys, 12)
    effects = keys.prefix + "effects"
    script = textwrap.dedent(
        f"""
        import os, sys, time, redis
        from rollstream.bus import GroupReader
        from rollstream.keys import Keys, TRAINER_GROUP
        r = redis.Redis.from_url({redis_url!r})
        keys = Keys({keys.run!r})
        rd = GroupReader(r, keys.rollouts_of("rollout_00"), TRAINER_GROUP, "doomed", dead_stream=keys.dead,
                         count=5,
                         block_ms=50)
        def handler(msgs):
            for m in msgs:
                r.rpush({effects!r}, "doomed:" + m.event.sample_id)
            print("HOLDING", flush=True)
            time.sleep(60)
        for msgs in rd.batches():
            if msgs:
                handler(msgs)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "HOLDING"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 5

    survivor = reader(r, keys, consumer="survivor", claim_idle_s=0.2)
    seen: list[str] = []
    time.sleep(0.3)

    def handler(msgs: list[Message]) -> None:
        for m in msgs:
            seen.append(m.event.sample_id)  # type: ignore[union-attr]

    deadline = time.time() + 10
    while len(seen) < 12 and time.time() < deadline:
        consume(survivor, handler, burst=True)
    assert sorted(seen) == sorted(f"s{i}" for i in range(12))  # each handled once by the survivor
    assert r.xpending(keys.rollouts_of(P0), TRAINER_GROUP)["pending"] == 0
    assert survivor.stats.acked == 12  # acked exactly once each
    assert survivor.stats.claimed == 5


def test_held_entries_are_not_claimed_by_others(r: redis.Redis, keys: Keys) -> None:
    publish_samples(r, keys, 3)
    holder = reader(r, keys, consumer="holder", claim_idle_s=0.3)
    held = holder.poll()
    assert len(held) == 3
    for _ in range(4):
        time.sleep(0.15)
        holder.poll(block_ms=1)  # keeps its in-flight entries fresh
    thief = reader(r, keys, consumer="thief", claim_idle_s=0.3)
    assert thief.poll(block_ms=1) == []


def test_trim_never_removes_unread(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    ids = publish_samples(r, keys, 20)
    # a second, lagging group that has read nothing
    r.xgroup_create(keys.rollouts_of(P0), "lagging", id="0")
    fast = reader(r, keys, count=20)
    consume(fast, lambda msgs: None, burst=True)
    arc = Archive(tmp_path)
    move_to_archive(r, arc, keys.rollouts_of(P0), stream_floor(r, keys.rollouts_of(P0)))
    assert r.xlen(keys.rollouts_of(P0)) == 20  # lagging group has read nothing
    # lagging reads 8, acks 5 (3 pending): only the 5 acked may go
    lag = GroupReader(r, keys.rollouts_of(P0), "lagging", "l1", dead_stream=keys.dead, count=8, block_ms=10)
    msgs = lag.poll()
    lag.ack(m.id for m in msgs[:5])
    moved = move_to_archive(r, arc, keys.rollouts_of(P0), stream_floor(r, keys.rollouts_of(P0)))
    remaining = [i.decode() for i, _ in r.xrange(keys.rollouts_of(P0))]
    assert remaining == ids[5:] and moved.archived == moved.trimmed == 5
    assert [i for i, _ in arc.entries(keys.rollouts_of(P0))] == ids[:5]
    # and the pending + undelivered ones are all still readable
    rest = lag.release([m.id for m in msgs[5:]]) or lag.poll()
    assert [m.id for m in rest] == ids[5:8]


def test_byte_cap_bites_loudly(
    r: redis.Redis, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    setup_run(r, keys, PRODUCERS)
    Publisher(r).publish_many(
        keys.rollouts_of(P0), [fake_rollout_sample(f"b{i}", response_len=2048) for i in range(40)]
    )
    before = r.xlen(keys.rollouts_of(P0))
    jan = Janitor(r, keys, Archive(tmp_path), budget_bytes=1 << 30, every_s=1.0, max_stream_bytes=1 << 20)
    res = jan.run_pass()
    assert res.capped == [keys.rollouts_of(P0)] and r.xlen(keys.rollouts_of(P0)) < before
    assert "RETENTION CAP BIT" in caplog.text
    assert len(list(iter_stream(r, keys.rollouts_of(P0)))) == before  # archived, not lost from the log


def test_janitor_runs_on_interval_and_keeps_unread(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    ids = publish_samples(r, keys, 10)
    rd = reader(r, keys, count=4)
    rd.ack(m.id for m in rd.poll())  # 4 read and acked, 6 undelivered
    jan = Janitor(r, keys, Archive(tmp_path), budget_bytes=1, every_s=60.0)
    res = jan.maybe_run(now=1000.0)
    assert res is not None and res.over_budget and sum(m.trimmed for m in res.moved) == 4
    assert [i.decode() for i, _ in r.xrange(keys.rollouts_of(P0))] == ids[4:]
    assert jan.maybe_run(now=1001.0) is None  # not due yet


def test_a_janitor_pass_cut_by_a_lost_connection_stays_due(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Redis going away mid-pass reaches the caller (its retry_on_connection runs the pass again at once),
    instead of being logged as an archive failure and skipped until the next interval."""
    publish_samples(r, keys, 4)
    jan = Janitor(r, keys, Archive(tmp_path), budget_bytes=1, every_s=60.0)
    real = jan.run_pass
    calls: list[int] = []

    def flaky() -> object:
        calls.append(1)
        if len(calls) == 1:
            raise redis.ConnectionError("connection reset")
        return real()

    jan.run_pass = flaky  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        jan.maybe_run(now=1000.0)
    # not taken for an archive failure
    assert not jan.over_budget or jan.last is None or jan.last.error is None
    res = jan.maybe_run(now=1000.0)  # the retry: still due
    assert res is not None and res.error is None and len(calls) == 2
    assert jan.maybe_run(now=1001.0) is None  # now it is not due


# -- one reader across several streams (the trainer's, over every producer's rollouts:<p>) ---------------


def multi_reader(r: redis.Redis, keys: Keys, consumer: str = "c1", **kw: object) -> GroupReader:
    """A reader of both producers' rollouts streams, as the trainer builds it."""
    return GroupReader(
        r, keys.rollouts_streams(PRODUCERS), TRAINER_GROUP, consumer, dead_stream=keys.dead, block_ms=10, **kw
    )  # type: ignore[arg-type]


def test_one_reader_reads_every_stream_and_acks_each_entry_on_its_own(r: redis.Redis, keys: Keys) -> None:
    """Entry ids of two streams may be equal: each message carries its stream, acks, dead letters and the
    re-read of pending entries after a restart are per stream."""
    setup_run(r, keys, PRODUCERS)
    for p in PRODUCERS:  # the same explicit ids on both streams
        for i in (1, 2):
            fields = encode(fake_rollout_sample(f"{p}-{i}", producer=p))
            r.xadd(keys.rollouts_of(p), fields, id=f"{i}-0")  # type: ignore[arg-type]
    r.xadd(keys.rollouts_of(PRODUCERS[1]), {"x": "garbage"}, id="3-0")
    first = multi_reader(r, keys)
    got = first.poll(0)
    refs = [(keys.rollouts_of(p), f"{i}-0") for p in PRODUCERS for i in (1, 2)]
    assert sorted(m.ref for m in got) == sorted(refs)
    assert all(m.event.sample_id.startswith(keys.stream_producer(m.stream)) for m in got)  # type: ignore[union-attr]
    [(_, dead_fields)] = r.xrange(keys.dead)
    dl = decode(dead_fields)
    assert isinstance(dl, DeadLetter) and (dl.source, dl.source_id) == (keys.rollouts_of(PRODUCERS[1]), "3-0")
    assert first.ack([(keys.rollouts_of(P0), "1-0")]) == 1  # only that stream's 1-0
    with pytest.raises(ValueError, match="name the entry's stream"):
        first.ack(["2-0"])  # a bare id is ambiguous across streams
    restarted = multi_reader(r, keys)  # same consumer: re-reads its own pending entries on every stream
    again = restarted.poll(0)
    assert sorted(m.ref for m in again) == sorted(
        [(keys.rollouts_of(P0), "2-0"), *((keys.rollouts_of(PRODUCERS[1]), f"{i}-0") for i in (1, 2))]
    )
    assert all(m.deliveries == 2 for m in again)
    assert restarted.ack(m.ref for m in again) == 3
    assert all(r.xpending(s, TRAINER_GROUP)["pending"] == 0 for s in keys.rollouts_streams(PRODUCERS))


def test_a_read_of_new_entries_takes_at_most_count_across_the_streams(r: redis.Redis, keys: Keys) -> None:
    """With several streams one XREADGROUP gives each count // streams, and with count below the number of
    streams it reads them in turn: a data-parallel rank never takes more than it asked for."""
    setup_run(r, keys, PRODUCERS)
    for p in PRODUCERS:
        samples = [fake_rollout_sample(f"{p}-{i}", producer=p) for i in range(4)]
        Publisher(r).publish_many(keys.rollouts_of(p), samples)
    rd = multi_reader(r, keys, count=1)
    seen: list[str] = []
    for _ in range(20):  # (the first poll also scans its own pending list, empty)
        msgs = rd.poll(0)
        assert len(msgs) <= 1
        seen += [m.stream for m in msgs]
        if len(seen) == 8:
            break
    assert seen[:4] == keys.rollouts_streams(PRODUCERS) * 2  # in turn
    rd.count = 4
    assert rd.poll(0) == [] and rd.drained
