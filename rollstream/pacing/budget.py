"""Producer pacing (verl fully-async's budget with carry-over) as leases that only the trainer writes.

max_outstanding = train_batch_size * (1 + staleness_threshold). When the trainer publishes version v it
grants budget:v = max_outstanding - outstanding, where outstanding = dispatched - consumed (`dispatched`:
every prompt ever leased to a producer), and deletes every older budget. Producers never touch those
counters, and run no script: a producer asks by writing its own `producer:<name>:want` (the lease total it
wants to reach: what it has used plus one dispatch), and the trainer's `Leaser` (a thread of rank 0) moves
budget into the `lease` hash (producer -> prompts leased to it so far) up to each want, a few producers a
pass in turn. A producer dispatches only what its lease allows: prompt number `seq` of a producer (counted
from 0 over the whole run, as published) gets sample id `<name>-<seq>`, and the trainer refuses a sample
whose seq is outside its producer's lease. Hence outstanding never exceeds max_outstanding, whatever a
producer writes: a producer can use only its own lease, and a junk or duplicate entry consumes nothing.

Consumption is counted per prompt, once: `consumed:<name>` is a bitmap of that producer's seqs the trainer
has finished with (trained, dropped as stale, evicted, dead-lettered, skipped); a script sets the bits and
adds to `consumed` only the bits it flipped, and only for seqs inside the lease. So a retried call, a
commit replayed after a crash, a sample evicted again after a restart, and several ranks all count a prompt
once, and nothing a producer publishes beyond its lease or twice moves the pacing.

A producer that crashed (or lost Redis) mid-dispatch keeps its lease: its published count
(`producer:<name>:published`, moved with the publish) says where its next seq starts, so the restarted
producer dispatches the same prompts again under the same ids.

Leases expire (`rollout.lease_timeout_s`): a producer with leased prompts the trainer has not finished, none
of whose prompts it finished for that long while none of its entries waited with the trainer (unread or read
and not yet acked: then a slow trainer, not the producer, is late), e.g. a hoarder writing any `want` and
publishing nothing, or a dead producer, loses every unfinished seq of its lease: the trainer's `_EXPIRE`
script sets their bits in `consumed:<name>` (counted as consumed, once, like a dead letter) and in
`revoked:<name>`, logs an `expire` entry and tops the current version's budget up by their room, so the others
are leased it. The producer's lease total is never lowered (the bitmaps stay exact); a sample of a revoked
seq published late is dead-lettered by the trainer ("lease expired") and counts nothing, so every seq still
ends once. Until one of its prompts is finished again the producer is leased at most `prompts_per_dispatch`
unfinished prompts (`probation`), so a hoarder holds at most one dispatch per timeout.

Early consumption gives room back at once: samples evicted (filter_groups, rollout failures), dropped as
stale or dead-lettered count as consumed when the trainer meets them, and the current version's budget gets
their room back (a top-up: budget += n, never past max_outstanding - outstanding nor the grant's cap), else
sync mode (window = one global batch) would wait forever for their replacements. Trained samples are
counted in the step's commit; their room comes back with the next version's grant.
Memory back-pressure: while the run's unread stream data alone exceeds bus.redis_max_bytes (a retention
pass reports it), the trainer caps each grant at one global step's prompts (`cap`): producers then get no
more than the trainer consumes per version, so the backlog shrinks towards one step; they pause between
versions. Prompts leased under version g are fresh at step g+1, so one step's worth completes it.
Grants, top-ups and leases are logged on the trainer's `dispatch_log` stream, so the bound can be checked
from the log (`dispatch_entries`).

Liveness: a producer reads its lease before it loads the newest weights, so a prompt leased under version v
is never generated with weights older than v's predecessor, and the trainer publishes a version's weights
before it grants its budget.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from rollstream.bus.connection import CONNECTION_ERRORS
from rollstream.bus.ids import count_or_none, parse_id, shown, split_sample_id, text
from rollstream.bus.streams import iter_stream
from rollstream.keys import (
    BUDGET_CAP_FIELD,
    BUDGET_VERSION_FIELD,
    DROPPED_STALE_FIELD,
    TRAINER_GROUP,
    Keys,
)
from rollstream.pacing.expiry import bump_epoch
from schemas.text_entries import (
    EXPIRE,
    GRANT,
    LEASE,
    TOPUP,
    DispatchRecord,
    decode_dispatch,
    dispatch_lua_fields,
)

log = logging.getLogger(__name__)

#: Seconds between two passes of the trainer's Leaser (a producer waits at most about this for a lease).
LEASE_PERIOD_S = 0.005

# KEYS: budget:v, dispatched, consumed, trainer hash, dispatch_log, budget:v-1 … (older ones to delete)
# ARGV: version, max_outstanding, cap (-1: none)
_GRANT = f"""
local outstanding = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(redis.call('GET', KEYS[3]) or '0')
local budget = tonumber(ARGV[2]) - outstanding
local cap = tonumber(ARGV[3])
if cap >= 0 and budget > cap then budget = cap end
if budget < 0 then budget = 0 end
redis.call('SET', KEYS[1], budget)
redis.call('HSET', KEYS[4], '{BUDGET_VERSION_FIELD}', ARGV[1], '{BUDGET_CAP_FIELD}', ARGV[3])
for i = 6, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('XADD', KEYS[5], '*', {dispatch_lua_fields(GRANT, version="ARGV[1]", amount="budget",
                                                      outstanding="outstanding", max_outstanding="ARGV[2]")})
return {{budget, outstanding}}
"""

# Scripts whose KEYS start budget:v, dispatched, consumed, trainer hash, dispatch_log, lease hash and whose
# ARGV[1] is the caller's reading of budget_version: nothing is done when a grant moved it ({-1, current}).
_CURRENT = f"""
local current = tonumber(redis.call('HGET', KEYS[4], '{BUDGET_VERSION_FIELD}') or '-1')
if current ~= tonumber(ARGV[1]) then return {{-1, current}} end
"""

# KEYS: the six above, then each asking producer's want key; ARGV: version, the number of producers P, their
# names (in the order of their want keys), then P caps (the most lease total each may reach; -1: none).
# Leases each producer up to its want (a canonical decimal it wrote, as rollstream/bus/ids.py parses counts;
# anything else counts as 0; never past its cap) from what is left of the budget, in the given order.
# Returns {leased, version}.
_LEASE = (
    _CURRENT
    + f"""
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
local total = 0
local np = tonumber(ARGV[2])
for j = 1, np do
  if left <= 0 then break end
  local i = j + 2
  local raw = redis.call('GET', KEYS[6 + j]) or '0'
  local want = 0  -- a producer's own key: only a canonical decimal of at most 18 digits counts
  if #raw <= 18 and (raw == '0' or string.match(raw, '^[1-9][0-9]*$')) then want = tonumber(raw) end
  local cap = tonumber(ARGV[2 + np + j])
  if cap >= 0 and want > cap then want = cap end
  local have = tonumber(redis.call('HGET', KEYS[6], ARGV[i]) or '0')
  local add = math.floor(math.min(want - have, left))
  if add > 0 then
    left = left - add
    total = total + add
    redis.call('HINCRBY', KEYS[6], ARGV[i], add)
    local outstanding = redis.call('INCRBY', KEYS[2], add) - tonumber(redis.call('GET', KEYS[3]) or '0')
    redis.call('XADD', KEYS[5], '*', {
        dispatch_lua_fields(
            LEASE, version="ARGV[1]", amount="add", outstanding="outstanding", producer="ARGV[i]"
        )
    })
  end
end
if total > 0 then redis.call('DECRBY', KEYS[1], total) end
return {{total, current}}
"""
)

# Count prompts as consumed, once each: KEYS from 7 are `consumed:<producer>` bitmaps; ARGV from `first`:
# the number of producers P, their names (in bitmap order), then (producer index, seq) pairs. A seq counts
# when it is inside that producer's lease and its bit was not set. Returns how many counted.
_COUNT_FN = """
local function count_ids(first)
  local np = tonumber(ARGV[first])
  local limit = {}
  for k = 1, np do limit[k] = tonumber(redis.call('HGET', KEYS[6], ARGV[first + k]) or '0') end
  local n = 0
  for i = first + np + 1, #ARGV, 2 do
    local k = tonumber(ARGV[i])
    local seq = tonumber(ARGV[i + 1])
    if seq < limit[k] and redis.call('SETBIT', KEYS[6 + k], seq, 1) == 0 then n = n + 1 end
  end
  if n > 0 then redis.call('INCRBY', KEYS[3], n) end
  return n
end
"""

# In the step's commit (a MULTI: no retry on a moved version, no top-up). ARGV[1] is unused.
_COUNT = _COUNT_FN + "return count_ids(2)\n"

# The end of a script that freed `n` seqs of room (locals n, max_outstanding, outstanding set): the current
# version's budget gets the room back (up to max_outstanding and the budget cap), logged as a top-up; returns
# {n, budget added}.
_TOPUP_TAIL = f"""
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
local add = math.min(n, max_outstanding - outstanding - left)
local cap = tonumber(redis.call('HGET', KEYS[4], '{BUDGET_CAP_FIELD}') or '-1')
if cap >= 0 then add = math.min(add, cap - left) end
if add <= 0 then return {{n, 0}} end
redis.call('INCRBY', KEYS[1], add)
redis.call('XADD', KEYS[5], '*', {
    dispatch_lua_fields(
        TOPUP, version="current", amount="add", outstanding="outstanding", max_outstanding="max_outstanding"
    )
})
return {{n, add}}
"""

# Early consumption. ARGV: version, max_outstanding, then the ids as for count_ids. Counts, then gives the
# current version's budget back up to n prompts of room, never past max_outstanding - outstanding nor the
# grant's cap (both less what is left), logged as a top-up. Returns {counted, added}.
_CONSUME = (
    _COUNT_FN
    + _CURRENT
    + """
local n = count_ids(3)
if n == 0 or current < 0 then return {n, 0} end
local max_outstanding = tonumber(ARGV[2])
local outstanding = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(redis.call('GET', KEYS[3]) or '0')
"""
    + _TOPUP_TAIL
)


# Take a producer's unfinished lease back. KEYS: the six base keys, `consumed:<p>`, `revoked:<p>`; ARGV:
# version, max_outstanding, producer. Every seq below its lease whose consumed bit is clear (from the first
# clear one) gets its consumed and revoked bits set and counts as consumed; the current version's budget gets
# their room back as a top-up would. Returns {taken back, budget added} ({-1, current} when a grant moved the
# version).
_EXPIRE = (
    _CURRENT
    + f"""
local lease = tonumber(redis.call('HGET', KEYS[6], ARGV[3]) or '0')
local first = redis.call('BITPOS', KEYS[7], 0)
local n = 0
for seq = first, lease - 1 do
  if redis.call('SETBIT', KEYS[7], seq, 1) == 0 then
    redis.call('SETBIT', KEYS[8], seq, 1)
    n = n + 1
  end
end
if n == 0 then return {{0, 0}} end
redis.call('INCRBY', KEYS[3], n)
local max_outstanding = tonumber(ARGV[2])
local outstanding = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(redis.call('GET', KEYS[3]) or '0')
redis.call('XADD', KEYS[5], '*', {
    dispatch_lua_fields(EXPIRE, version="current", amount="n", outstanding="outstanding", producer="ARGV[3]")
})
"""
    + _TOPUP_TAIL
)


def leased_sample_id(producer: str, seq: int) -> str:
    """The sample id of `producer`'s prompt number `seq` (counted from 0 over the run)."""
    return f"{producer}-{seq}"


def _base_keys(keys: Keys, version: int) -> list[str]:
    return [keys.budget(max(version, 0)), keys.dispatched, keys.consumed, keys.trainer, keys.dispatch_log,
            keys.lease]


def _id_args(keys: Keys, sample_ids: Iterable[str]) -> tuple[list[str], list[str | int]]:
    """(bitmap keys, ARGV tail) of count_ids for the leased ids among `sample_ids`."""
    seqs: dict[str, list[int]] = defaultdict(list)
    for sid in sample_ids:
        if (parsed := split_sample_id(sid)) is not None:
            seqs[parsed[0]].append(parsed[1])
    names = sorted(seqs)
    args: list[str | int] = [len(names), *names]
    for k, name in enumerate(names, start=1):
        for seq in seqs[name]:
            args += [k, seq]
    return [keys.consumed_bits(name) for name in names], args


def grant_budget(
    r: redis.Redis, keys: Keys, version: int, max_outstanding: int, cap: int | None = None
) -> tuple[int, int]:
    """Trainer side, on publishing `version`: set its budget with carry-over, at most `cap` prompts (memory
    back-pressure, see the module docstring); returns (budget, outstanding)."""
    older = [keys.budget(v) for v in range(max(0, version - 8), version)]
    res: Any = r.eval(
        _GRANT,
        5 + len(older),
        keys.budget(version),
        keys.dispatched,
        keys.consumed,
        keys.trainer,
        keys.dispatch_log,
        *older,
        version,
        max_outstanding,
        -1 if cap is None else cap,
    )
    return int(res[0]), int(res[1])


def lease_pass(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> int:
    """Trainer side: lease each producer (in the given order) up to its want from the current version's
    budget; returns the prompts leased (0 before the first grant)."""
    return lease_once(r, keys, producers)[0]


def lease_once(
    r: redis.Redis,
    keys: Keys,
    producers: Sequence[str],
    version: int | None = None,
    caps: dict[str, int] | None = None,
) -> tuple[int, int]:
    """`lease_pass`, also returning the budget's current version (-1 before the first grant), which the
    Leaser keeps for its next pass: one EVALSHA per pass while no grant moves it. `version`: the caller's
    last reading (read here when None or -1; a stale one costs one more call). `caps`: producer -> the most
    lease total it may reach (its want is clamped to it; the Leaser's probation after an expiry)."""
    if version is None or version < 0:
        version = current_budget(r, keys)[0]
    limits = [(caps or {}).get(p, -1) for p in producers]
    while True:
        if version < 0 or not producers:
            return 0, version
        res: Any = _script(r, _LEASE)(
            keys=[*_base_keys(keys, version), *(keys.producer_want(p) for p in producers)],
            args=[version, len(producers), *producers, *limits],
            client=r,
        )
        if int(res[0]) >= 0:
            return int(res[0]), version
        version = int(res[1])  # a grant moved it: the script said which


#: Scripts as redis-py Script objects (EVALSHA; sent again after a NOSCRIPT), by body.
_SCRIPTS: dict[str, Any] = {}


def _script(r: redis.Redis, body: str) -> Any:
    """`body` as a redis-py Script (its SHA computed once per process); call it with client=r."""
    if (script := _SCRIPTS.get(body)) is None:
        script = _SCRIPTS[body] = r.register_script(body)
    return script


def lease_outright(r: redis.Redis, keys: Keys, producer: str, n: int) -> int:
    """Trainer (or admin) side with no Leaser running: lease `n` more prompts to `producer` at once, outside
    any budget (benchmarks and tests that run producers without a trainer); returns its lease total."""
    pipe = r.pipeline(transaction=True)
    pipe.hincrby(keys.lease, producer, n)
    pipe.incrby(keys.dispatched, n)
    total, _ = pipe.execute()
    return int(total)


def queue_count_consumed(pipe: Any, keys: Keys, sample_ids: Iterable[str]) -> None:
    """Queue, on the trainer's commit MULTI, that the prompts of `sample_ids` are consumed (each once; ids
    outside their producer's lease count nothing). Their room comes back with the next grant."""
    bitmaps, args = _id_args(keys, sample_ids)
    if bitmaps:
        pipe.eval(_COUNT, 6 + len(bitmaps), *_base_keys(keys, 0), *bitmaps, 0, *args)


def consume(r: redis.Redis, keys: Keys, sample_ids: Iterable[str], max_outstanding: int) -> tuple[int, int]:
    """Trainer side, early consumption (evicted, dropped as stale, dead-lettered): count each leased prompt
    of `sample_ids` once and give the current version's budget back the room they freed (a top-up, see
    the module docstring). Returns (newly counted, budget added); a repeat counts nothing twice."""
    bitmaps, args = _id_args(keys, sample_ids)
    if not bitmaps:
        return 0, 0
    while True:
        version = current_budget(r, keys)[0]
        res: Any = r.eval(
            _CONSUME, 6 + len(bitmaps), *_base_keys(keys, version), *bitmaps, version, max_outstanding, *args
        )
        if int(res[0]) >= 0:
            return int(res[0]), int(res[1])


def expire_lease(r: redis.Redis, keys: Keys, producer: str, max_outstanding: int) -> tuple[int, int]:
    """Trainer side: take back every unfinished seq of `producer`'s lease (counted as consumed once, marked
    revoked, logged as `expire`) and give the current version's budget their room; returns (taken back,
    budget added). Bumps this process's expiry epoch before and after (rollstream/pacing/expiry.py)."""
    bump_epoch()
    try:
        return _expire(r, keys, producer, max_outstanding)
    finally:
        bump_epoch()


def _expire(r: redis.Redis, keys: Keys, producer: str, max_outstanding: int) -> tuple[int, int]:
    while True:
        version = current_budget(r, keys)[0]
        res: Any = _script(r, _EXPIRE)(
            keys=[*_base_keys(keys, version), keys.consumed_bits(producer), keys.revoked_bits(producer)],
            args=[version, max_outstanding, producer],
            client=r,
        )
        if int(res[0]) >= 0:
            return int(res[0]), int(res[1])


def is_revoked(r: redis.Redis, keys: Keys, producer: str, seq: int) -> bool:
    """True when the trainer took `producer`'s prompt `seq` back (its lease expired)."""
    return bool(r.getbit(keys.revoked_bits(producer), seq))


def finished_counts(
    r: redis.Redis, keys: Keys, producers: Sequence[str]
) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """One MULTI snapshot: (producer -> prompts leased to it, producer -> of those, prompts the trainer
    finished with (its `consumed:<name>` bit count), the producers whose `rollouts:<name>` hold entries the
    trainer group has not read or not acked yet: their work is with the trainer). Unread entries are told
    by the group's `lag` (XINFO GROUPS); only where Redis cannot tell it (a null lag) is XINFO STREAM asked
    for the last id, in a second round trip: its reply carries the stream's first and last entries, whole
    rollouts, every second (BENCHMARKS.md, the trainer's watches)."""
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(keys.lease)
    for p in producers:
        pipe.bitcount(keys.consumed_bits(p))
        pipe.xinfo_groups(keys.rollouts_of(p))
    raw, *per = pipe.execute(raise_on_error=False)
    lease = {text(k): int(v) for k, v in raw.items()}
    done, busy, unknown = {}, set(), {}
    for i, p in enumerate(producers):
        count, groups = per[2 * i : 2 * i + 2]
        done[p] = int(count)
        if isinstance(groups, Exception):
            continue  # no stream yet: nothing published
        for g in groups:
            if text(g.get("name", b"")) != TRAINER_GROUP:
                continue
            if int(g.get("pending", 0)) > 0 or (g.get("lag") or 0) > 0:
                busy.add(p)
            elif g.get("lag") is None:
                unknown[p] = text(g.get("last-delivered-id", b"0-0"))
    if unknown:
        pipe = r.pipeline(transaction=False)
        for p in unknown:
            pipe.xinfo_stream(keys.rollouts_of(p))
        for (p, delivered), info in zip(unknown.items(), pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(info, Exception) and text(info.get("last-generated-id", b"0-0")) != delivered:
                busy.add(p)
    return {p: lease.get(p, 0) for p in producers}, done, busy


def is_consumed(r: redis.Redis, keys: Keys, sample_id: str) -> bool:
    """True when the prompt of a leased sample id was counted as consumed."""
    parsed = split_sample_id(sample_id)
    return parsed is not None and bool(r.getbit(keys.consumed_bits(parsed[0]), parsed[1]))


def leases(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """Producer -> prompts leased to it so far."""
    raw: Any = r.hgetall(keys.lease)
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def lease_of(r: redis.Redis, keys: Keys, producer: str) -> int:
    """Prompts leased to `producer` so far (0 before its first lease)."""
    return int(cast(Any, r.hget(keys.lease, producer)) or 0)


def published_count(r: redis.Redis, keys: Keys, producer: str) -> int:
    """Prompts `producer` has published so far (its next seq), as it says: 0 when its key holds anything
    but a canonical count (`published_report` says which)."""
    return published_report(r, keys, producer)[0]


def published_report(r: redis.Redis, keys: Keys, producer: str) -> tuple[int, str | None]:
    """(`published_count`, None), or (0, why) when the producer's own `published` key holds something that
    is not a canonical count (the value is its input: reported, never trusted)."""
    return read_count(cast(Any, r.get(keys.producer_published(producer))), keys.producer_published(producer))


def read_count(raw: Any, field: str) -> tuple[int, str | None]:
    """(value, None) of a count read from Redis (None: 0), or (0, why) when it is not a canonical count."""
    if raw is None:
        return 0, None
    n = count_or_none(raw)
    if n is None:
        return 0, f"{field}={shown(raw)} is not a canonical count: ignored"
    return n, None


def ask_lease(r: redis.Redis | Any, keys: Keys, producer: str, total: int) -> None:
    """Producer side: ask for leases up to `total` prompts in all (its own key; the Leaser grants)."""
    r.set(keys.producer_want(producer), total)


def mark_published(pipe: Any, keys: Keys, producer: str, count: int = 1) -> None:
    """Queue, on the producer's publish pipeline, that `count` more of its leased prompts are on the log."""
    pipe.incrby(keys.producer_published(producer), count)


class LeaseExpiry:
    """The Leaser's expiry clock (module docstring): per producer, when the trainer last finished one of its
    prompts or last held unread or unacked entries of its stream; past `timeout_s` with leased prompts still
    unfinished and none of its entries with the trainer, its unfinished lease is taken back (`expire_lease`)
    and it goes on probation: leased at most `probation` unfinished prompts until one of its prompts is
    finished again."""

    def __init__(
        self, timeout_s: float, max_outstanding: int, probation: int, *, every_s: float = 1.0,
        clock: Any = None,
    ) -> None:
        """Expire after `timeout_s` seconds (> 0), checked every `every_s`; `probation` >= 1 prompts."""
        if not timeout_s > 0:
            raise ValueError(f"rollout.lease_timeout_s={timeout_s!r} must be > 0")
        if probation < 1:
            raise ValueError(f"probation={probation!r} must be >= 1 prompt")
        self.timeout_s, self.max_outstanding, self.probation = timeout_s, max_outstanding, probation
        self.every_s = min(every_s, timeout_s / 4)
        self.clock = clock or time.monotonic
        self.caps: dict[str, int] = {}  # producer -> the most lease total it may reach (probation)
        self.expired: dict[str, int] = {}  # producer -> prompts taken back from it over this process
        self._seen: dict[str, tuple[int, float]] = {}  # producer -> (prompts finished, since when)
        self._next = 0.0

    def maybe_check(self, r: redis.Redis, keys: Keys, producers: Sequence[str]) -> list[tuple[str, int]]:
        """Check when due; returns (producer, prompts taken back) for each lease expired now."""
        now = self.clock()
        if now < self._next:
            return []
        self._next = now + self.every_s
        lease, done, busy = finished_counts(r, keys, producers)
        out = []
        for p in producers:
            seen = self._seen.get(p)
            if seen is None or seen[0] != done[p] or p in busy:
                self._seen[p] = (done[p], now)
                if seen is not None and seen[0] != done[p]:
                    self.caps.pop(p, None)  # one of its prompts finished: off probation
                continue
            since = seen[1]
            if lease[p] <= done[p] or now - since < self.timeout_s:
                continue  # nothing unfinished, or not long enough
            taken, added = expire_lease(r, keys, p, self.max_outstanding)
            self.caps[p] = lease[p] + self.probation
            self._seen[p] = (done[p] + taken, now)
            if taken:
                self.expired[p] = self.expired.get(p, 0) + taken
                out.append((p, taken))
                log.warning(
                    "lease of %s expired: no prompt of it finished nor any entry of it unread for %.0f s; %d "
                    "unfinished prompts taken back (budget topped up by %d); at most %d more leased to it "
                    "until one of its prompts is finished", p, now - since, taken, added, self.probation,
                )
        return out


class Leaser:
    """The trainer's lease loop: a daemon thread running `lease_pass` every LEASE_PERIOD_S, the producers
    taken in turn (a different one first each pass), until `stop`. Connection errors are waited out."""

    def __init__(
        self, r: redis.Redis, keys: Keys, producers: Sequence[str], stop: threading.Event,
        period_s: float = LEASE_PERIOD_S, *, expiry: LeaseExpiry | None = None, fence: Any = None,
        outbox: Any = None,
    ) -> None:
        """Lease to `producers` (the run's producer names) on `r` until `stop` is set; with `expiry`, take
        back the leases of producers that finish nothing (see LeaseExpiry); with `fence` (a
        rollstream.security.FloodFence), fence producers that flood Redis and lease them nothing more; with
        `outbox` (a rollstream.bus.outbox.OutboxDrain), move the aggregator's outboxes into its streams."""
        self.r, self.keys, self.producers, self.stop, self.period_s = r, keys, list(producers), stop, period_s
        self.expiry, self.fence, self.outbox = expiry, fence, outbox
        self.leased = 0  # prompts leased by this loop
        self.thread: threading.Thread | None = None
        self._turn = 0
        self._version = -1  # the budget's version at the last pass (-1: read it on the next)

    def run_once(self) -> int:
        """One pass (with an expiry check, a fence check and an outbox drain when due); returns the prompts
        leased."""
        if self.outbox is not None:
            self.outbox.maybe_drain(self.r)
        if not self.producers:
            return 0
        if self.fence is not None:
            self.fence.maybe_check(self.r, self.keys, self.producers)
        if self.expiry is not None:
            self.expiry.maybe_check(self.r, self.keys, self.producers)
        k = self._turn % len(self.producers)
        self._turn += 1
        order = self.producers[k:] + self.producers[:k]
        if self.fence is not None and self.fence.fenced:
            order = [p for p in order if p not in self.fence.fenced]
        caps = self.expiry.caps if self.expiry is not None else None
        n, self._version = lease_once(self.r, self.keys, order, self._version, caps)
        self.leased += n
        return n

    def start(self) -> Leaser:
        """Run the loop in a daemon thread; returns self."""
        self.thread = threading.Thread(target=self._loop, name="leaser", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.wait(self.period_s):
            try:
                self.run_once()
            except CONNECTION_ERRORS as e:
                log.warning("leaser: %s; retrying", e)
                self.stop.wait(0.5)
            except redis.ResponseError as e:  # e.g. BUSY while another script runs: waited out
                log.warning("leaser: %s; retrying", e)
                self.stop.wait(0.5)


def budget_left(r: redis.Redis, keys: Keys, version: int) -> int:
    """Budget left for `version` (0 when none was granted, it is used up, or a newer grant deleted it)."""
    return int(cast(Any, r.get(keys.budget(version))) or 0)


def dispatch_entries(r: redis.Redis, keys: Keys) -> list[DispatchRecord]:
    """Every grant, top-up and lease (and an older run's producer takes and releases), in id order."""
    rc: Any = r
    streams = [
        keys.dispatch_log,
        *(text(k) for k in rc.scan_iter(match=keys.producer_pattern("dispatch_log"))),
    ]
    rows = sorted(((i, f) for s in streams for i, f in iter_stream(r, s)), key=lambda row: parse_id(row[0]))
    return [decode_dispatch(f) for _, f in rows]


def current_budget(r: redis.Redis, keys: Keys) -> tuple[int, int]:
    """(version budget is granted for, budget left) — (-1, 0) before the first grant."""
    v: Any = r.hget(keys.trainer, BUDGET_VERSION_FIELD)
    if v is None:
        return -1, 0
    left: Any = r.get(keys.budget(int(v)))
    return int(v), int(left or 0)


@dataclass(frozen=True)
class RolloutCounts:
    """Run-wide pacing counters of all producers together, read in one snapshot."""

    dispatched: int  # prompts leased to producers
    consumed: int  # prompts the trainer finished with: trained, dropped as stale, evicted or dead-lettered
    in_flight: int  # leased, not yet published (generating, or a lease not used yet)
    dropped_stale: int  # consumed prompts the trainer dropped as too stale

    @property
    def published(self) -> int:
        """Leased prompts on the rollouts stream so far (leased minus in flight)."""
        return self.dispatched - self.in_flight

    @property
    def queued(self) -> int:
        """Samples published and not yet consumed: the trainer group's backlog (undelivered + buffered)."""
        return self.published - self.consumed


def rollout_counts(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> RolloutCounts:
    """One MULTI snapshot of the global counters, in flight summed over the named producers (their lease
    less what they published; GETs only: what the producer ACL allows)."""
    pipe = r.pipeline(transaction=True)
    pipe.get(keys.dispatched)
    pipe.get(keys.consumed)
    pipe.hget(keys.trainer, DROPPED_STALE_FIELD)
    for name in producers:
        pipe.hget(keys.lease, name)
        pipe.get(keys.producer_published(name))
    dispatched, consumed, dropped, *per = pipe.execute()
    return RolloutCounts(
        dispatched=int(dispatched or 0),
        consumed=int(consumed or 0),
        # a producer's own `published` is input: anything but a canonical count reads as 0, and more than
        # its lease as its lease (in flight is never negative)
        in_flight=sum(
            max(0, int(per[i] or 0) - (count_or_none(per[i + 1] or b"0") or 0)) for i in range(0, len(per), 2)
        ),
        dropped_stale=int(dropped or 0),
    )
