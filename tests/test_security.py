"""Security: ACL roles on a private redis-server, TLS (rediss://) with a self-signed certificate, and no
pickle/eval/exec on any read path."""

from __future__ import annotations

import ast
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from conftest import P0

from rollstream.bus import GroupReader, Publisher, connect, setup_run
from rollstream.bus.outbox import OutboxDrain
from rollstream.keys import AGGREGATOR_GROUP, Keys
from rollstream.ops.acl import ROLES, apply_acl, generate_passwords, mask_url
from rollstream.ops.embedded_redis import no_retry
from rollstream.pacing.budget import ask_lease, grant_budget, lease_pass, mark_published
from rollstream.pacing.counters import lease_of, rollout_counts
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.weights.store import latest_param_version, publish_weights, register_producer_version
from schemas import ProducerStats

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        ["redis-server", "--save", "", "--appendonly", "no", "--dir", str(tmp), "--bind", "127.0.0.1", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return p


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    p = start_redis(tmp_path, "--port", str(port))
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url, retry=no_retry()).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url, port
    p.terminate()
    p.wait(5)


PRODUCERS = ["rollout_00", "rollout_01"]


def test_acl_roles_confine_producer(private_redis: tuple[str, int], tmp_path: Path) -> None:
    url, port = private_redis
    keys = Keys("acl")
    admin0 = redis.Redis.from_url(url)
    setup_run(admin0, keys, PRODUCERS)
    files = generate_passwords(tmp_path / "secrets", [*ROLES, *PRODUCERS])
    assert all(oct(p.stat().st_mode)[-3:] == "600" for p in files.values())
    pw = {role: p.read_text() for role, p in files.items()}
    apply_acl(admin0, keys, pw, producers=PRODUCERS)

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url, retry=no_retry()).ping()  # default user is off

    trainer = connect(url, username="trainer", password=pw["trainer"])
    grant_budget(trainer, keys, 0, 8)
    publish_weights(trainer, keys, 0, b"w" * 16, global_step=0, inline_max_bytes=1 << 20)
    prod = connect(f"redis://127.0.0.1:{port}/0", username="rollout_00", password=pw["rollout_00"])
    # everything a producer does works: publish, stats, ask for and read its lease, publish-with-cursor,
    # version, the run's counts
    Publisher(prod).publish(keys.rollouts_of(P0), fake_rollout_sample("rollout_00-0", producer="rollout_00"))
    Publisher(prod).publish(
        keys.stats_of(P0),
        ProducerStats(
            producer="rollout_00", param_version=0, samples=1, tokens=1, gen_tokens_per_s=1.0, idle_ratio=0.0
        ),
    )
    ask_lease(prod, keys, "rollout_00", 2)
    assert lease_pass(trainer, keys, [*PRODUCERS]) == 2 and lease_of(prod, keys, "rollout_00") == 2
    pipe = prod.pipeline(transaction=True)
    mark_published(pipe, keys, "rollout_00", 1)
    pipe.set(keys.producer_cursor("rollout_00"), "0:1")
    pipe.execute()
    register_producer_version(prod, keys, "rollout_00", 0)
    assert rollout_counts(prod, keys, PRODUCERS).in_flight == 1  # leased 2, published 1
    assert latest_param_version(prod, keys) is not None and prod.get(keys.weights(0)) == b"w" * 16

    # and nothing else (a compromised producer must not reach another role's keys): each command a compromised
    # producer could try
    forbidden = {
        "read rollouts": lambda: prod.xrange(keys.rollouts_of(P0)),
        "write weights": lambda: prod.set(keys.weights(1), b"evil"),
        "write records": lambda: prod.xadd(keys.records, {"x": "1"}),
        "write metrics": lambda: prod.xadd(keys.metrics, {"x": "1"}),
        "write dispatch_log": lambda: prod.xadd(keys.dispatch_log, {"x": "1"}),
        "write fates": lambda: prod.xadd(keys.fates, {"x": "1"}),
        "write params": lambda: prod.xadd(keys.params, {"x": "1"}),
        "HSET trainer global_step": lambda: prod.hset(keys.trainer, "global_step", 10**6),
        "HSET trainer committed_step": lambda: prod.hset(keys.trainer, "committed_step", 10**6),
        "HSET trainer via a script": lambda: prod.eval(
            "return redis.call('HSET', KEYS[1], 'committed_step', 9)", 1, keys.trainer
        ),
        "another producer's cursor": lambda: prod.set(keys.producer_cursor("rollout_01"), "9:9"),
        "another producer's published count": lambda: prod.incrby(keys.producer_published("rollout_01"), 5),
        "another producer's want": lambda: prod.set(keys.producer_want("rollout_01"), 10**6),
        "EVAL": lambda: prod.eval("return 1", 0),
        "EVALSHA": lambda: prod.evalsha("e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
        "FCALL": lambda: prod.execute_command("FCALL", "f", 0),
        "INCRBY dispatched": lambda: prod.incrby(keys.dispatched, 10**6),
        "DECRBY dispatched": lambda: prod.decrby(keys.dispatched, 10**6),
        "INCRBY consumed": lambda: prod.incrby(keys.consumed, 10**6),
        "INCRBY budget": lambda: prod.incrby(keys.budget(0), 10**6),
        "DECRBY budget": lambda: prod.decrby(keys.budget(0), 10**6),
        "HINCRBY lease": lambda: prod.hincrby(keys.lease, "rollout_00", 10**6),
        "HSET lease": lambda: prod.hset(keys.lease, "rollout_01", 0),
        "SETBIT consumed": lambda: prod.setbit(keys.consumed_bits("rollout_01"), 0, 1),
        "another producer's version": lambda: prod.set(keys.producer_version("rollout_01"), 0),
        "SET budget": lambda: prod.set(keys.budget(0), 10**6),
        "DEL budget": lambda: prod.delete(keys.budget(0)),
        "XTRIM rollouts": lambda: prod.xtrim(keys.rollouts_of(P0), maxlen=0),
        "XDEL rollouts": lambda: prod.execute_command("XDEL", keys.rollouts_of(P0), "0-1"),
        "FLUSHALL": lambda: prod.flushall(),
        "another run": lambda: prod.get("rs:{other}:weights:0"),
    }
    aggregator = connect(url, username="aggregator", password=pw["aggregator"])
    forbidden |= {
        "aggregator XTRIM records": lambda: aggregator.xtrim(keys.records, maxlen=0),
        "aggregator XDEL records": lambda: aggregator.execute_command("XDEL", keys.records, "1-1"),
        "aggregator DEL records": lambda: aggregator.delete(keys.records),
        "aggregator XADD records": lambda: aggregator.xadd(keys.records, {"x": "1"}, maxlen=0),
        "aggregator XADD its dead": lambda: aggregator.xadd(keys.dead_aggregator, {"x": "1"}, maxlen=0),
        "aggregator LTRIM its outbox": lambda: aggregator.ltrim(keys.records_outbox, 1, 0),
        "aggregator LPOP its dead outbox": lambda: aggregator.lpop(keys.dead_aggregator_outbox),
        "aggregator DEL its outbox": lambda: aggregator.delete(keys.records_outbox),
        "aggregator write metrics": lambda: aggregator.xadd(keys.metrics, {"x": "1"}),
        "aggregator write trainer hash": lambda: aggregator.hset(keys.trainer, "committed_step", 1),
        "aggregator read rollouts": lambda: aggregator.xrange(keys.rollouts_of(P0)),
        "aggregator read dead": lambda: aggregator.xrange(keys.dead),
        "trainer FLUSHALL": lambda: trainer.flushall(),
        "trainer another run": lambda: trainer.get("rs:{other}:weights:0"),
    }
    # the aggregator dead-letters what it cannot fold (WATCH + MULTI: RPUSH its dead outbox, XACK; the trainer
    # moves it into dead:aggregator), and may run no script at all
    metric_id = trainer.xadd(keys.metrics, {"type": "nonsense"})
    agg_reader = GroupReader(aggregator, keys.metrics, AGGREGATOR_GROUP, "aggregator",
                             dead_stream=keys.dead_aggregator_outbox, dead_outbox=True, block_ms=10)
    assert [m.id for m in agg_reader.poll(0)] == []  # undecodable: dead-lettered inside the read
    assert OutboxDrain(keys).drain(trainer) == 1 and trainer.xlen(keys.dead_aggregator) == 1
    assert trainer.xpending(keys.metrics, AGGREGATOR_GROUP)["pending"] == 0
    assert metric_id is not None
    forbidden["aggregator write metrics via a script"] = lambda: aggregator.eval(
        "return redis.call('XADD', KEYS[1], '*', 'x', '1')", 1, keys.metrics
    )
    allowed = [name for name, call in forbidden.items() if _permitted(call)]
    assert allowed == [], f"permitted: {allowed}"
    assert trainer.xlen(keys.rollouts_of(P0)) == 1
    admin = connect(url, username="admin", password=pw["admin"])
    assert admin.ping()


def _permitted(call: Callable[[], object]) -> bool:
    """True unless Redis refuses the call with NOPERM."""
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return False
    except redis.ResponseError as e:
        # (the last: in a script)
        refusals = ("NOPERM", "can't run this command", "can't access at least one of the keys")
        return not any(r in str(e) for r in refusals)
    return True


def test_mask_url_hides_password() -> None:
    assert mask_url("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert "s3cret" not in mask_url("rediss://:s3cret@h/0")
    assert mask_url("redis://h:1/0") == "redis://h:1/0"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_rediss(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    p = start_redis(
        tmp_path,
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(cert),
        "--tls-auth-clients",
        "no",
    )
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        r = connect(url)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        keys = Keys("tls")
        setup_run(r, keys, PRODUCERS)
        Publisher(r).publish(keys.rollouts_of(P0), fake_rollout_sample("over-tls"))
        assert r.xlen(keys.rollouts_of(P0)) == 1
        with pytest.raises(redis.ConnectionError):  # plain TCP to the TLS port fails
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=no_retry()).ping()
    finally:
        p.terminate()
        p.wait(5)


FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}


def test_no_pickle_eval_exec_in_package() -> None:
    offenders = []
    # not benchmarks/: pickle is their baseline
    for pkg in ("rollstream", "schemas", "producers", "consumers"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    offenders += [
                        f"{path}:{node.lineno} import {a.name}"
                        for a in node.names
                        if a.name.split(".")[0] in FORBIDDEN_MODULES
                    ]
                elif (
                    isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] in FORBIDDEN_MODULES
                ):
                    offenders.append(f"{path}:{node.lineno} from {node.module}")
                elif isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    builtin = (
                        isinstance(f, ast.Name) or getattr(getattr(f, "value", None), "id", "") == "builtins"
                    )
                    # r.eval(...) is Lua on the server, m.eval() torch
                    if name in FORBIDDEN_CALLS and builtin:
                        offenders.append(f"{path}:{node.lineno} {name}()")
                    if (
                        name == "load"
                        and isinstance(f, ast.Attribute)
                        and getattr(f.value, "id", "") == "torch"
                    ):
                        offenders.append(f"{path}:{node.lineno} torch.load (pickle)")
                    if (
                        name == "import_module"
                        and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and str(node.args[0].value) in FORBIDDEN_MODULES
                    ):
                        offenders.append(f"{path}:{node.lineno} import_module({node.args[0].value!r})")
    assert offenders == []
