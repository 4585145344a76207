"""Producer pacing (verl fully-async's budget with carry-over), shared by all producers through atomic
Redis operations.

max_outstanding = train_batch_size * (1 + staleness_threshold). When the trainer publishes version v it
grants budget:v = max_outstanding - outstanding, where outstanding = dispatched - consumed, and deletes
every older budget. A producer takes budget from the newest version before dispatching prompts; one that
finds none waits for the next version. Hence outstanding never exceeds max_outstanding.
A producer that crashed (or lost Redis) mid-dispatch releases what it took and never published when it
starts again, and that room goes back to the current version's budget the same way (RELEASE).
Memory back-pressure: while the run's unread stream data alone exceeds bus.redis_max_bytes (a retention
pass reports it), the trainer caps each grant at one global step's prompts (`cap`): producers then get no
more than the trainer consumes per version, so the backlog shrinks towards one step instead of
max_outstanding; they pause between versions. The cap never starves the trainer: prompts dispatched
under version g are fresh at step g+1 (staleness 1, always kept), so one step's worth completes it.
Dead letters: a dispatched prompt whose rollout the trainer dead-letters (undecodable, invalid, unusable)
never trains, yet the next version comes only after a full global batch has trained; with
staleness_threshold = 0 one dead letter would leave the trainer waiting for a prompt nobody may dispatch.
So the trainer counts dead-lettered rollouts as consumed with TOPUP, which also gives the current version
back the room they freed: budget += n, never past max_outstanding - outstanding nor the grant's cap. Each
is counted exactly once: the trainer's reader increments the trainer hash's `dead_lettered` in the same
script that acks the entry and writes its dead copy (rollstream/bus/reader.py), and TOPUP counts
`dead_lettered - dead_counted` inside Redis and sets `dead_counted`; a retried call, a crash between the
dead letter and its count (the next trainer process runs TOPUP at start) and several ranks all count each
dead letter once. Evictions (filter_groups: a group every trajectory of which scored the same is not
trained) take the same give-back at once (EVICT, `consume_evicted`), else sync mode would wait forever
for their replacements.
Grants and top-ups are logged on the trainer's `dispatch_log` stream, each producer's takes and releases on
its own (`producer:<name>:dispatch_log`), so the bound can be checked from the log (`dispatch_entries`).

Producers run TAKE and RELEASE as scripts, and their ACL user may touch only the keys those scripts need:
read the trainer hash and `consumed`, move `budget:<v>` and `dispatched`, write its own producer keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from rollstream.bus.ids import parse_id, text
from rollstream.bus.streams import iter_stream
from rollstream.names import (
    BUDGET_CAP_FIELD,
    BUDGET_VERSION_FIELD,
    DEAD_COUNTED_FIELD,
    DEAD_LETTERED_FIELD,
    DROPPED_STALE_FIELD,
    EVICTED_EARLY_FIELD,
    Keys,
)
from schemas.text_entries import (
    GRANT,
    RELEASE,
    TAKE,
    TOPUP,
    DispatchRecord,
    decode_dispatch,
    dispatch_lua_fields,
)

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

# Shared by TOPUP and RELEASE, whose KEYS start budget:v, dispatched, consumed, trainer hash, a dispatch_log:
# give version `current`'s budget back up to n prompts of room, never past max_outstanding - outstanding nor
# the grant's cap (both less what is left), logged as a top-up; returns what it added.
_GIVE_BACK = f"""
local function give_back(current, n, outstanding, max_outstanding)
  local left = tonumber(redis.call('GET', KEYS[1]) or '0')
  local add = math.min(n, max_outstanding - outstanding - left)
  local cap = tonumber(redis.call('HGET', KEYS[4], '{BUDGET_CAP_FIELD}') or '-1')
  if cap >= 0 then add = math.min(add, cap - left) end
  if add <= 0 then return 0 end
  redis.call('INCRBY', KEYS[1], add)
  redis.call('XADD', KEYS[5], '*', {
    dispatch_lua_fields(
        TOPUP, version="current", amount="add", outstanding="outstanding", max_outstanding="max_outstanding"
    )
})
  return add
end
local current = tonumber(redis.call('HGET', KEYS[4], '{BUDGET_VERSION_FIELD}') or '-1')
if current ~= tonumber(ARGV[1]) then return {{-1, current}} end
"""

# KEYS: budget:v, dispatched, consumed, trainer hash, dispatch_log
# ARGV: version (the caller's reading of budget_version), max_outstanding
# Returns {counted, added}, or {-1, budget_version} when a grant moved budget_version (nothing done).
_TOPUP = (
    _GIVE_BACK
    + f"""
local lettered = tonumber(redis.call('HGET', KEYS[4], '{DEAD_LETTERED_FIELD}') or '0')
local n = lettered - tonumber(redis.call('HGET', KEYS[4], '{DEAD_COUNTED_FIELD}') or '0')
if n <= 0 then return {{0, 0}} end
redis.call('HSET', KEYS[4], '{DEAD_COUNTED_FIELD}', lettered)
local outstanding = tonumber(redis.call('GET', KEYS[2]) or '0') - redis.call('INCRBY', KEYS[3], n)
if current < 0 then return {{n, 0}} end
return {{n, give_back(current, n, outstanding, tonumber(ARGV[2]))}}
"""
)

# KEYS: budget:v, dispatched, consumed, trainer hash, dispatch_log
# ARGV: version (the caller's reading of budget_version), max_outstanding, n (evicted rollouts)
# Returns {n, added}, or {-1, budget_version} when a grant moved budget_version (nothing done).
_EVICT = (
    _GIVE_BACK
    + f"""
local n = tonumber(ARGV[3])
redis.call('HINCRBY', KEYS[4], '{EVICTED_EARLY_FIELD}', n)
local outstanding = tonumber(redis.call('GET', KEYS[2]) or '0') - redis.call('INCRBY', KEYS[3], n)
if current < 0 then return {{n, 0}} end
return {{n, give_back(current, n, outstanding, tonumber(ARGV[2]))}}
"""
)

# KEYS: trainer hash, consumed. Un-count the early-counted evictions of a crashed trainer process.
_UNCOUNT = f"""
local early = tonumber(redis.call('HGET', KEYS[1], '{EVICTED_EARLY_FIELD}') or '0')
if early ~= 0 then
  redis.call('HSET', KEYS[1], '{EVICTED_EARLY_FIELD}', 0)
  redis.call('DECRBY', KEYS[2], early)
end
return early
"""

# KEYS: budget:v, dispatched, consumed, trainer hash, producer's dispatch_log, producer's inflight counter
# ARGV: version, want, producer
_TAKE = f"""
local current = tonumber(redis.call('HGET', KEYS[4], '{BUDGET_VERSION_FIELD}') or '-1')
if current ~= tonumber(ARGV[1]) then return {{-1, current}} end
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
local take = math.min(left, tonumber(ARGV[2]))
if take <= 0 then return {{0, current}} end
redis.call('DECRBY', KEYS[1], take)
local dispatched = redis.call('INCRBY', KEYS[2], take)
redis.call('INCRBY', KEYS[6], take)
local outstanding = dispatched - tonumber(redis.call('GET', KEYS[3]) or '0')
redis.call('XADD', KEYS[5], '*', {
    dispatch_lua_fields(TAKE, version="ARGV[1]", amount="take", outstanding="outstanding", producer="ARGV[3]")
})
return {{take, current}}
"""

# KEYS: budget:v, dispatched, consumed, trainer hash, producer's dispatch_log, producer's inflight counter
# ARGV: version (the caller's reading of budget_version), max_outstanding, producer
# Returns {released, added}, or {-1, budget_version} when a grant moved budget_version (nothing done).
_RELEASE = (
    _GIVE_BACK
    + f"""
local n = tonumber(redis.call('GET', KEYS[6]) or '0')
redis.call('SET', KEYS[6], 0)
if n <= 0 then return {{0, 0}} end
local dispatched = redis.call('DECRBY', KEYS[2], n)
redis.call('XADD', KEYS[5], '*', {dispatch_lua_fields(RELEASE, amount="n", producer="ARGV[3]")})
if current < 0 then return {{n, 0}} end
local outstanding = dispatched - tonumber(redis.call('GET', KEYS[3]) or '0')
return {{n, give_back(current, n, outstanding, tonumber(ARGV[2]))}}
"""
)


@dataclass(frozen=True)
class Take:
    """Result of a budget take: how many prompts may be dispatched, and the version the budget is for."""

    amount: int
    budget_version: int

    @property
    def stale(self) -> bool:
        """True when the caller asked for an older version than the one budget is granted for."""
        return self.amount < 0


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


def take_budget(r: redis.Redis, keys: Keys, version: int, want: int, producer: str) -> Take:
    """Producer side: atomically take up to `want` dispatches from `version`'s budget."""
    res: Any = r.eval(
        _TAKE,
        6,
        keys.budget(version),
        keys.dispatched,
        keys.consumed,
        keys.trainer,
        keys.producer_dispatch_log(producer),
        keys.producer_inflight(producer),
        version,
        want,
        producer,
    )
    return Take(int(res[0]), int(res[1]))


def mark_published(pipe: Any, keys: Keys, producer: str, count: int = 1) -> None:
    """Queue, on the producer's publish pipeline, that `count` dispatched prompts are now on the log."""
    pipe.decrby(keys.producer_inflight(producer), count)


def release_unpublished(r: redis.Redis, keys: Keys, producer: str, max_outstanding: int) -> int:
    """On producer (re)start or reconnect: prompts it dispatched but never published (it crashed, or Redis
    went away mid-dispatch) stop counting as outstanding, and the current version's budget gets their room
    back (a top-up logged on the producer's dispatch_log, bounded like TOPUP's), else sync mode would wait
    forever for prompts nobody may dispatch again. Returns how many were released."""
    released, _ = _give_back_script(
        r,
        keys,
        _RELEASE,
        [keys.producer_dispatch_log(producer), keys.producer_inflight(producer)],
        max_outstanding,
        producer,
    )
    return released


def record_consumed(r: redis.Redis | Any, keys: Keys, count: int) -> None:
    """Trainer side (may be a pipeline): `count` prompts were consumed (trained or dropped)."""
    if count:
        r.incrby(keys.consumed, count)


def consume_dead(r: redis.Redis, keys: Keys, max_outstanding: int) -> tuple[int, int]:
    """Trainer side: count the rollouts dead-lettered and not yet counted (the trainer hash's `dead_lettered`
    minus `dead_counted`) as consumed and give the current version's budget back the room they freed (TOPUP,
    see the module docstring). Returns (newly counted, budget added); a repeat counts nothing twice."""
    return _give_back_script(r, keys, _TOPUP, [keys.dispatch_log], max_outstanding)


def consume_evicted(r: redis.Redis, keys: Keys, n: int, max_outstanding: int) -> tuple[int, int]:
    """Trainer side: `n` rollouts evicted mid-step (filter_groups) count as consumed now and give the current
    version's budget back their room (the dead letters' TOPUP rule), so producers refill the batch before
    the next version. They stay in the trainer hash's `evicted_early` until their step's consumed count
    settles them (consumers/trainer/ledger.py), and a restarted trainer un-counts what a crash left there
    (`uncount_evicted`): its samples come back and are evicted (or trained) again. Returns (n, added)."""
    if n <= 0:
        return 0, 0
    return _give_back_script(r, keys, _EVICT, [keys.dispatch_log], max_outstanding, str(n))


def uncount_evicted(r: redis.Redis, keys: Keys) -> int:
    """Trainer start: evictions counted early by a process that crashed before its step counted them are
    no longer consumed (their samples are pending again); returns how many."""
    return int(cast(Any, r.eval(_UNCOUNT, 2, keys.trainer, keys.consumed)))


def _give_back_script(
    r: redis.Redis, keys: Keys, script: str, more_keys: list[str], max_outstanding: int, *args: str
) -> tuple[int, int]:
    """Run TOPUP or RELEASE on the current budget version's keys (budget:v, dispatched, consumed, trainer
    hash, then `more_keys`); again on the new version when a grant moved it in between. Returns the script's
    pair."""
    while True:
        version = current_budget(r, keys)[0]
        res: Any = r.eval(
            script,
            4 + len(more_keys),
            keys.budget(max(version, 0)),
            keys.dispatched,
            keys.consumed,
            keys.trainer,
            *more_keys,
            version,
            max_outstanding,
            *args,
        )
        if int(res[0]) >= 0:
            return int(res[0]), int(res[1])


def budget_left(r: redis.Redis, keys: Keys, version: int) -> int:
    """Budget left for `version` (0 when none was granted, it is used up, or a newer grant deleted it)."""
    return int(cast(Any, r.get(keys.budget(version))) or 0)


def inflight(r: redis.Redis, keys: Keys, producer: str) -> int:
    """Prompts `producer` took and has not published (0 when it never took any)."""
    return int(cast(Any, r.get(keys.producer_inflight(producer))) or 0)


def dispatch_entries(r: redis.Redis, keys: Keys) -> list[DispatchRecord]:
    """Every grant, top-up, take and release (the trainer's log and every producer's), in id order."""
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

    dispatched: int  # prompts taken from the budget (crashed producers' unpublished ones released)
    consumed: int  # prompts the trainer finished with: trained, dropped as stale, or dead-lettered
    in_flight: int  # dispatched, not yet published (generating)
    dropped_stale: int  # consumed prompts the trainer dropped as too stale

    @property
    def published(self) -> int:
        """Samples on the rollouts stream so far (dispatched minus in flight)."""
        return self.dispatched - self.in_flight

    @property
    def queued(self) -> int:
        """Samples published and not yet consumed: the trainer group's backlog (undelivered + buffered)."""
        return self.published - self.consumed


def rollout_counts(r: redis.Redis, keys: Keys, producers: Sequence[str]) -> RolloutCounts:
    """One MULTI snapshot of the global counters, in-flight summed over the named producers' own
    counters (GETs only: what the producer ACL allows)."""
    pipe = r.pipeline(transaction=True)
    pipe.get(keys.dispatched)
    pipe.get(keys.consumed)
    pipe.hget(keys.trainer, DROPPED_STALE_FIELD)
    for name in producers:
        pipe.get(keys.producer_inflight(name))
    dispatched, consumed, dropped, *inflight = pipe.execute()
    return RolloutCounts(
        dispatched=int(dispatched or 0),
        consumed=int(consumed or 0),
        in_flight=sum(max(0, int(v or 0)) for v in inflight),
        dropped_stale=int(dropped or 0),
    )
