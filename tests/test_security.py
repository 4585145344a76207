"""Security: ACL roles on a private redis-server, TLS (rediss://) with a self-signed certificate, and no
pickle/eval/exec on any read path."""

from __future__ import annotations

import ast
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollstream.bus import Publisher, connect, setup_run
from rollstream.fake import fake_rollout_sample
from rollstream.names import Keys
from rollstream.security import apply_acl, generate_passwords, mask_url

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
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url, port
    p.terminate()
    p.wait(5)


def test_acl_roles_confine_producer(private_redis: tuple[str, int], tmp_path: Path) -> None:
    url, port = private_redis
    keys = Keys("acl")
    admin0 = redis.Redis.from_url(url)
    setup_run(admin0, keys)
    files = generate_passwords(tmp_path / "secrets")
    assert all(oct(p.stat().st_mode)[-3:] == "600" for p in files.values())
    pw = {role: p.read_text() for role, p in files.items()}
    apply_acl(admin0, keys, pw)

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url).ping()  # default user is off

    prod = connect(f"redis://127.0.0.1:{port}/0", username="producer", password=pw["producer"])
    Publisher(prod).publish(keys.rollouts, fake_rollout_sample("p1"))  # allowed: XADD rollouts
    with pytest.raises(redis.exceptions.NoPermissionError):
        prod.xrange(keys.rollouts)  # producers cannot read rollouts
    with pytest.raises(redis.exceptions.NoPermissionError):
        prod.set(keys.weights(1), b"evil")  # nor write weights
    with pytest.raises(redis.exceptions.NoPermissionError):
        prod.xadd(keys.records, {"x": "1"})  # nor records
    with pytest.raises(redis.exceptions.NoPermissionError):
        prod.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        prod.get("rs:{other}:weights:0")  # nor another run's keys

    trainer = connect(url, username="trainer", password=pw["trainer"])
    assert trainer.xlen(keys.rollouts) == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        trainer.flushall()
    admin = connect(url, username="admin", password=pw["admin"])
    assert admin.ping()


def test_mask_url_hides_password() -> None:
    assert mask_url("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert "s3cret" not in mask_url("rediss://:s3cret@h/0")
    assert mask_url("redis://h:1/0") == "redis://h:1/0"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_rediss(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    p = start_redis(tmp_path, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                    "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")
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
        setup_run(r, keys)
        Publisher(r).publish(keys.rollouts, fake_rollout_sample("over-tls"))
        assert r.xlen(keys.rollouts) == 1
        with pytest.raises(redis.ConnectionError):  # plain TCP to the TLS port fails
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping()
    finally:
        p.terminate()
        p.wait(5)


FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}


def test_no_pickle_eval_exec_in_package() -> None:
    offenders = []
    for pkg in ("rollstream", "schemas", "producers", "consumers"):
        for path in (ROOT / pkg).rglob("*.py"):
            if "bench" in path.parts:  # benchmarks compare against pickle as a baseline, never a read path
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    offenders += [f"{path}:{node.lineno} import {a.name}" for a in node.names
                                  if a.name.split(".")[0] in FORBIDDEN_MODULES]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                    offenders.append(f"{path}:{node.lineno} from {node.module}")
                elif isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    builtin = isinstance(f, ast.Name) or getattr(getattr(f, "value", None), "id", "") == "builtins"
                    if name in FORBIDDEN_CALLS and builtin:  # r.eval(...) is Lua on the server, m.eval() torch
                        offenders.append(f"{path}:{node.lineno} {name}()")
                    if name == "load" and isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "torch":
                        offenders.append(f"{path}:{node.lineno} torch.load (pickle)")
                    if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                            and str(node.args[0].value) in FORBIDDEN_MODULES:
                        offenders.append(f"{path}:{node.lineno} import_module({node.args[0].value!r})")
    assert offenders == []

