"""Redis ACL users per role, for runs whose Redis `rollstream run` owns.

Roles: `producer` (append to rollouts and metrics, read params and weights, take dispatch budget — nothing
else), `trainer`, `aggregator`, `admin`. The default user is switched off. Passwords are generated into a
0600 file per role in the run directory and reach workers as ROLLSTREAM_REDIS_PASSWORD_FILE; they never
appear on a command line, in a log, or in `status`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import redis

from rollstream.names import Keys

ROLES = ("producer", "trainer", "aggregator", "admin")

# Connection-level commands every role needs.
_BASE = ["+ping", "+hello", "+auth", "+client|setname", "+client|id", "+select", "+info", "+quit"]


def acl_rules(keys: Keys) -> dict[str, list[str]]:
    """ACL SETUSER rules (without `on`/password) for each role of a run."""
    k = keys

    def key(pattern: str, mode: str = "") -> str:
        return f"%{mode}~{pattern}" if mode else f"~{pattern}"

    budget_glob = k.budget(0).rsplit(":", 1)[0] + ":*"
    weights_glob = k.weights(0).rsplit(":", 1)[0] + ":*"
    producer = [
        *_BASE,
        "+xadd", "+xrevrange", "+xrange", "+get", "+hget", "+hset", "+hgetall", "+hincrby", "+eval", "+evalsha",
        "+multi", "+exec", "+discard", "+mget", "+exists", "+incrby", "+decrby",
        key(k.rollouts, "W"), key(k.metrics, "W"),
        key(k.params, "R"), key(weights_glob, "R"),
        # EVAL checks every declared key as read+write, so the pacing scripts' keys (budget, dispatched,
        # consumed, trainer hash, dispatch_log, producer_inflight) cannot be narrowed to %R/%W here; the
        # scripts run INCRBY/DECRBY/HINCRBY, so a producer can move the pacing counters directly; it
        # still cannot SET/DEL/XDEL/XTRIM, read rollouts, or touch weights, records or another run.
        key(budget_glob), key(k.dispatched), key(k.consumed), key(k.trainer),
        key(k.producer_inflight), key(k.producer_cursor), key(k.producers), key(k.dispatch_log),
        key(k.setup, "R"),
    ]
    trainer = [*_BASE, "+@read", "+@write", "+@stream", "+@hash", "+@string", "+@scripting", "+@transaction",
               "+@keyspace", "-flushall", "-flushdb", "-@dangerous", "+info", f"~{k.prefix}*"]
    aggregator = [*_BASE, "+@read", "+@stream", "+@transaction", "+@hash", "+@string", "-@dangerous",
                  key(k.metrics), key(k.records), key(k.dead, "W"), key(k.sink_cursor), key(k.trainer, "R")]
    admin = ["+@all", "~*", "&*"]
    return {"producer": producer, "trainer": trainer, "aggregator": aggregator, "admin": admin}


def generate_passwords(secrets_dir: Path) -> dict[str, Path]:
    """Create (or reuse) one random password file per role, mode 0600; returns role -> path."""
    secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    out = {}
    for role in ROLES:
        path = secrets_dir / f"{role}.password"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
        out[role] = path
    return out


def apply_acl(r: redis.Redis, keys: Keys, passwords: dict[str, str], *, disable_default: bool = True) -> None:
    """Create/replace the role users (user name = role) and switch the default user off."""
    rules = acl_rules(keys)
    for role, rule in rules.items():
        cmd: list[Any] = ["ACL", "SETUSER", role, "reset", "on", f">{passwords[role]}", *rule]
        r.execute_command(*cmd)
    if disable_default:
        r.execute_command("ACL", "SETUSER", "default", "off")


def mask_url(url: str) -> str:
    """A Redis URL with its password replaced by ***, safe to print."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}" if user else f"{scheme}://***@{host}"
