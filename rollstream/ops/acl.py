"""Redis ACL users per role, for runs whose Redis `rollstream run` owns (and, with apply_acl_on_cluster, for
runs on a shared Redis Cluster: ACL users are per node there, so they are set on every node).

Users: one per producer, named after it (`rollout_00` …), `trainer`, `aggregator`, `warden`, `admin`. The
default user is switched off. Passwords are generated into a 0600 file per user in the run directory and reach
workers as ROLLSTREAM_REDIS_PASSWORD_FILE; they never appear on a command line, in a log, or in `status`.

Redis 7 selectors bind each command to the keys it may touch, so no user can write what another role writes. A
producer may: XADD to its own `rollouts:<name>` and `stats:<name>` (no other producer's: the stream names its
writer, and a trim or an explicit id there hurts only its own entries); read `params`, `weights:*`, `setup`;
read the trainer hash, the `archive` hash, the `lease` hash, `consumed`, `dispatched` and every producer's
published count; and write its own four keys `producer:<name>:cursor`, `…:published`, `…:want` (the lease it
asks for) and `…:version`, no other name under `producer:<name>:`. It
runs no script and cannot move the pacing: only the trainer writes budgets, leases and the counters
(rollstream/pacing/). It cannot read rollouts, write another producer's streams, write the trainer hash,
`metrics`, `dispatch_log`, `records`, `fates`, `dead`, weights or params, another producer's keys, or another
run's. The trainer reads every `rollouts:*` stream as its group. The aggregator
reads `metrics` and every `stats:*` stream as its group (created by setup_run: it may not create groups),
RPUSHes its records and dead letters to two outbox lists that the trainer moves into `records` and
`dead:aggregator` (rollstream/bus/outbox.py; dead-lettering is WATCH + MULTI: it may run no script), reads
`records`, keeps `sink_cursor`, reads the trainer hash and the `archive` hash; it cannot delete or trim
anything (no XADD on `records` or `dead:aggregator`, no LTRIM/LPOP/DEL on its outboxes). The trainer owns the
run's keys; only it (and admin) can write `archive`, the folder every reader of the log is pointed to. No
data role may ACL SETUSER or CLIENT KILL (no ACL binds those to one user, so whoever may run them can give
itself every right): the `warden` (rollstream/ops/warden.py) may, and it may read `fenced` and nothing else;
the trainer asks it to fence a producer that floods Redis by writing that hash (rollstream/pacing/fence.py).
The trainer's Lua scripts grant it nothing: Redis 7 checks every command a script runs against the caller's
ACL (its keys and commands), as tests/test_confinement.py shows.
Left open (no ACL can close it: ACLs do not see arguments): a writer of a stream may trim it with XADD's own
MAXLEN/MINID (the audit counts what is destroyed, rollstream/ops/audit.py) and XADD with an explicit id far
ahead; since every producer writes only its own streams, that destroys or blocks only its own output, and the
aggregator XADDs to no stream. The
trainer's `watch_busy_scripts` kills a script that blocks Redis (only the trainer and admin may run scripts).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from rollstream.keys import STATS, Keys
from rollstream.runtime.files import private_dir

log = logging.getLogger(__name__)

#: Users other than the producers (one user per producer, named after it).
ROLES = ("trainer", "aggregator", "warden", "admin")

# Connection-level commands every user needs (WAIT: a write counts once replicas acknowledged it; it only
# blocks the caller; CLUSTER SLOTS: on a Redis Cluster a client asks which node serves its run's slot,
# rollstream/topology/cluster.py; elsewhere Redis answers it with an error).
_BASE = [
    "+ping", "+hello", "+auth", "+client|setname", "+client|id", "+select", "+info", "+quit", "+wait",
    "+cluster|slots",
]


def producer_rules(keys: Keys, producer: str) -> list[str]:
    """ACL SETUSER rules of one producer's user: each command bound to the only keys it may touch."""
    k = keys
    weights = k.weights(0).rsplit(":", 1)[0] + ":*"
    # its own keys, named one by one (no free-form `producer:<name>:*` namespace): cursor, published count,
    # want (the lease it asks for), version
    own = " ".join(f"~{key}" for key in k.producer_keys(producer))
    return [
        *_BASE,
        "+multi",
        "+exec",
        "+discard",
        f"(+xadd %W~{k.rollouts_of(producer)} %W~{k.stats_of(producer)})",
        f"(+xrevrange +xrange %R~{k.params})",
        f"(+get %R~{weights} %R~{k.consumed} %R~{k.dispatched} %R~{k.producer_pattern('published')})",
        f"(+exists %R~{k.setup})",
        f"(+hget %R~{k.trainer} %R~{k.archive} %R~{k.lease})",
        # no script at all, and no XADD outside its two streams
        f"(+get +set +incrby +decrby {own})",
    ]


def warden_rules(keys: Keys) -> list[str]:
    """ACL SETUSER rules of the warden (rollstream/ops/warden.py): switch users off and kill their
    connections, read the trainer's fence requests; no data."""
    return [*_BASE, "+acl|setuser", "+client|kill", f"(+hgetall +hget %R~{keys.fenced})"]


def acl_rules(keys: Keys, producers: Sequence[str] = ()) -> dict[str, list[str]]:
    """ACL SETUSER rules (without `on`/password) for each user of a run: trainer, aggregator, warden, admin
    and one per producer name. Only the warden (and admin) may ACL SETUSER or CLIENT KILL."""
    k = keys
    group = [
        "+xreadgroup",
        "+xack",
        "+xautoclaim",
        "+xclaim",
        "+xpending",
        "+xinfo|groups",
        "+xrange",
        "+watch",
    ]
    trainer = [
        *_BASE,
        "+@read",
        "+@write",
        "+@stream",
        "+@hash",
        "+@string",
        "+@scripting",
        "+@bitmap",
        "+@transaction",
        "+@keyspace",
        "-flushall",
        "-flushdb",
        "-@dangerous",
        "+info",
        f"~{k.prefix}*",
    ]
    aggregator = [
        *_BASE,
        "+multi",
        "+exec",
        "+discard",
        "+time",
        f"({' '.join(group)} ~{k.metrics} ~{k.stream_pattern(STATS)})",
        # no XADD on records or dead:aggregator (its MAXLEN/MINID would trim them, issue 41 item 5): the
        # append-only outboxes the trainer moves into them (rollstream/bus/outbox.py)
        f"(+xrange +xrevrange +xlen %R~{k.records})",
        f"(+rpush %W~{k.records_outbox} %W~{k.dead_aggregator_outbox})",
        f"(+lrange %R~{k.records_outbox})",
        # dead-lettering is WATCH + MULTI (XADD dead, XACK): no scripts, so no EVAL to freeze Redis
        "+unwatch",
        f"(+hget +hset +hgetall ~{k.sink_cursor})",
        f"(+hget +hmget %R~{k.trainer})",
        f"(+hget %R~{k.archive})",
    ]
    admin = ["+@all", "~*", "&*"]
    rules = {"trainer": trainer, "aggregator": aggregator, "warden": warden_rules(k), "admin": admin}
    for name in producers:
        if name in rules:
            raise ValueError(f"producer name {name!r} clashes with the {name!r} user")
        rules[name] = producer_rules(keys, name)
    return rules


def generate_passwords(secrets_dir: Path, users: Sequence[str] = ROLES) -> dict[str, Path]:
    """Create (or reuse) one random password file per user, mode 0600; returns user -> path."""
    private_dir(secrets_dir)
    out = {}
    for role in users:
        path = secrets_dir / f"{role}.password"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
        out[role] = path
    return out


def apply_acl(
    r: redis.Redis,
    keys: Keys,
    passwords: dict[str, str],
    *,
    producers: Sequence[str] = (),
    disable_default: bool = True,
) -> None:
    """Create/replace the users (trainer, aggregator, warden, admin, one per producer) and switch the default
    user off."""
    rules = acl_rules(keys, producers)
    for role, rule in rules.items():
        cmd: list[Any] = ["ACL", "SETUSER", role, "reset", "on", f">{passwords[role]}", *rule]
        r.execute_command(*cmd)
    if disable_default:
        r.execute_command("ACL", "SETUSER", "default", "off")


def apply_acl_on_cluster(
    url: str,
    keys: Keys,
    passwords: dict[str, str],
    *,
    producers: Sequence[str] = (),
    username: str | None = None,
    password: str | None = None,
) -> list[str]:
    """apply_acl on every node of the Redis Cluster named by a `redis+cluster://` URL, primaries and
    replicas: ACL users are per node in a Cluster (ACL SETUSER is not propagated, and a failover promotes a
    replica with its own users). The default user is left as it is (the Cluster is shared; its operator
    decides); no warden runs there, so a flood is reported, not fenced. Logs in with
    `username`/`password` (an operator's user allowed ACL SETUSER); returns the nodes' addresses. Run it again
    after adding a node."""
    from rollstream.topology.cluster import for_each_node

    return for_each_node(
        url,
        lambda r: apply_acl(r, keys, passwords, producers=producers, disable_default=False),
        username=username,
        password=password,
    )


def mask_url(url: str) -> str:
    """A Redis URL with its password replaced by ***, safe to print."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}" if user else f"{scheme}://***@{host}"
