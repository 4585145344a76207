"""The pacing's writes (rollstream/pacing/__init__.py tells the scheme): the trainer's Lua scripts that grant
a version's budget, lease it to the producers that ask, count prompts as consumed once (the `consumed:<name>`
bitmaps) with a top-up, and take an unfinished lease back; the producer's own two writes (its `want`, its
published count); the budget's current version."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis

from rollstream.bus.ids import split_sample_id
from rollstream.keys import BUDGET_CAP_FIELD, BUDGET_VERSION_FIELD, Keys
from schemas.text_entries import EXPIRE, GRANT, LEASE, TOPUP, dispatch_lua_fields

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


# KEYS: the six above, then each asking producer's want key, then each one's `consumed:<name>` bitmap; ARGV:
# version, the number of producers P, their names (in the order of their want keys), then P caps (the most
# lease total each may reach; -1: none), then P shares (the most unfinished prompts each may hold, counted
# live against its consumed bits; -1: none). Leases each producer up to its want (a canonical decimal it
# wrote, as rollstream/bus/ids.py parses counts; anything else counts as 0; never past its cap nor its
# consumed bits plus its share) from what is left of the budget, in the given order.
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
  local share = tonumber(ARGV[2 + 2 * np + j])
  if share >= 0 then
    local reach = redis.call('BITCOUNT', KEYS[6 + np + j]) + share
    if want > reach then want = reach end
  end
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


def current_budget(r: redis.Redis, keys: Keys) -> tuple[int, int]:
    """(version budget is granted for, budget left) — (-1, 0) before the first grant."""
    v: Any = r.hget(keys.trainer, BUDGET_VERSION_FIELD)
    if v is None:
        return -1, 0
    left: Any = r.get(keys.budget(int(v)))
    return int(v), int(left or 0)


def budget_left(r: redis.Redis, keys: Keys, version: int) -> int:
    """Budget left for `version` (0 when none was granted, it is used up, or a newer grant deleted it)."""
    return int(cast(Any, r.get(keys.budget(version))) or 0)


def grant_budget(
    r: redis.Redis, keys: Keys, version: int, max_outstanding: int, cap: int | None = None
) -> tuple[int, int]:
    """Trainer side, on publishing `version`: set its budget with carry-over, at most `cap` prompts (memory
    back-pressure, see rollstream/pacing/__init__.py); returns (budget, outstanding)."""
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
    shares: dict[str, int] | None = None,
) -> tuple[int, int]:
    """`lease_pass`, also returning the budget's current version (-1 before the first grant), which the
    Leaser keeps for its next pass: one EVALSHA per pass while no grant moves it. `version`: the caller's
    last reading (read here when None or -1; a stale one costs one more call). `caps`: producer -> the most
    lease total it may reach (its want is clamped to it; the Leaser's probation after an expiry). `shares`:
    producer -> the most unfinished prompts it may hold (its fair share), counted in the script against its
    `consumed:<name>` bits as they are now, so a share follows the trainer's consumption without lag."""
    if version is None or version < 0:
        version = current_budget(r, keys)[0]
    limits = [(caps or {}).get(p, -1) for p in producers]
    limits += [(shares or {}).get(p, -1) for p in producers]
    while True:
        if version < 0 or not producers:
            return 0, version
        res: Any = _script(r, _LEASE)(
            keys=[*_base_keys(keys, version), *(keys.producer_want(p) for p in producers),
                  *(keys.consumed_bits(p) for p in producers)],
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
    rollstream/pacing/__init__.py). Returns (newly counted, budget added); a repeat counts nothing twice."""
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


def take_back(r: redis.Redis, keys: Keys, producer: str, max_outstanding: int) -> tuple[int, int]:
    """The `_EXPIRE` script on the budget's current version (again when a grant moved it): (taken back, budget
    added). Callers go through rollstream/pacing/expiry.py `expire_lease`, which tells the revoked watches."""
    while True:
        version = current_budget(r, keys)[0]
        res: Any = _script(r, _EXPIRE)(
            keys=[*_base_keys(keys, version), keys.consumed_bits(producer), keys.revoked_bits(producer)],
            args=[version, max_outstanding, producer],
            client=r,
        )
        if int(res[0]) >= 0:
            return int(res[0]), int(res[1])


def ask_lease(r: redis.Redis | Any, keys: Keys, producer: str, total: int) -> None:
    """Producer side: ask for leases up to `total` prompts in all (its own key; the Leaser grants)."""
    r.set(keys.producer_want(producer), total)


def mark_published(pipe: Any, keys: Keys, producer: str, count: int = 1) -> None:
    """Queue, on the producer's publish pipeline, that `count` more of its leased prompts are on the log."""
    pipe.incrby(keys.producer_published(producer), count)
