"""Log entries and values written as plain text fields (no payload), so `redis-cli` reads them as they are.

`fates`: one entry per sample the trainer consumed, id `<global_step>-<i>`, written in the step commit:
    sample_id  source_id (its rollouts entry id)  fate (trained | dropped | evicted)  staleness  param_version
    global_step  [reason (evicted: filter_groups = every trajectory of the group scored the same;
    rollout_failure = the producer's generation failed)]
`dispatch_log` (the trainer's grants, leases and top-ups), written by the trainer's pacing Lua scripts
(rollstream/pacing/), fields in this order:
    grant:   op version amount outstanding max_outstanding
    topup:   op version amount outstanding max_outstanding  (budget added back after early consumption)
    lease:   op version amount outstanding producer  (prompts leased to that producer)
    expire:  op version amount outstanding producer  (prompts taken back from it: lease expired)
Logs of older runs also hold a producer's own takes and releases (`producer:<name>:dispatch_log`):
    take:    op version amount outstanding producer
    release: op amount producer
`producer:<name>:cursor`: the producer's next prompt as "<epoch>:<index>".

Writers use the encode functions (the Lua scripts `dispatch_lua_fields`), readers the decode functions,
which raise DecodeError on a malformed entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from schemas.errors import DecodeError

TRAINED = "trained"
DROPPED = "dropped"  # as too stale
EVICTED = "evicted"  # not trained for a reason (Fate.reason), its budget given back at once
SKIPPED = "skipped"  # in a local update whose optimizer step was skipped (non-finite loss or gradient)
FATES = (TRAINED, DROPPED, EVICTED, SKIPPED)
FILTER_GROUPS = "filter_groups"  # eviction reason: a zero-variance group (DAPO dynamic sampling)
# eviction reason: the producer's generation failed (engine error, timeout); also the rollout_status key
# (value 1) by which such a sample, published with empty responses so that its prompt is never lost, says so
ROLLOUT_FAILURE = "rollout_failure"


def _text(value: Any) -> str:
    return bytes(value).decode() if isinstance(value, bytes | bytearray | memoryview) else str(value)


def _get(entry: Mapping[Any, Any], name: str, what: str) -> str:
    """Field `name` of a Redis entry (bytes or str keys) as text; DecodeError when absent or not UTF-8."""
    raw = entry.get(name.encode(), entry.get(name))
    if raw is None:
        raise DecodeError(f"{what} entry has no {name!r} field")
    try:
        return _text(raw)
    except UnicodeDecodeError as e:
        raise DecodeError(f"{what} entry field {name!r} is not UTF-8") from e


def _int(entry: Mapping[Any, Any], name: str, what: str) -> int:
    text = _get(entry, name, what)
    try:
        return int(text)
    except ValueError as e:
        raise DecodeError(f"{what} entry field {name}={text!r} is not an int") from e


# -- fates ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fate:
    """The outcome of one consumed sample: a `fates` entry (and a line of the trainer's StepLedger)."""

    sample_id: str
    source_id: str  # the rollouts entry it was read from
    fate: str  # TRAINED, DROPPED (as stale), EVICTED or SKIPPED
    staleness: int  # global step - param_version
    param_version: int
    global_step: int  # the step that consumed it
    reason: str = ""  # why EVICTED (FILTER_GROUPS); not written when empty


FATE_FIELDS = tuple(f.name for f in fields(Fate))


def encode_fate(fate: Fate) -> dict[str, str | int]:
    """The XADD fields of a `fates` entry (`reason` only when set)."""
    return {name: getattr(fate, name) for name in FATE_FIELDS if name != "reason" or fate.reason}


def decode_fate(entry: Mapping[Any, Any]) -> Fate:
    """A `fates` entry as a Fate; DecodeError when a field is missing or malformed."""
    fate = _get(entry, "fate", "fates")
    if fate not in FATES:
        raise DecodeError(f"fates entry field fate={fate!r} is not one of {FATES}")
    return Fate(
        sample_id=_get(entry, "sample_id", "fates"),
        source_id=_get(entry, "source_id", "fates"),
        fate=fate,
        staleness=_int(entry, "staleness", "fates"),
        param_version=_int(entry, "param_version", "fates"),
        global_step=_int(entry, "global_step", "fates"),
        reason=_get(entry, "reason", "fates")
        if entry.get(b"reason", entry.get("reason")) is not None
        else "",
    )


# -- dispatch_log -----------------------------------------------------------------------------------

GRANT = "grant"
TOPUP = "topup"
LEASE = "lease"
EXPIRE = "expire"  # prompts taken back from a producer that published nothing for rollout.lease_timeout_s
TAKE = "take"  # older runs: a producer took budget itself
RELEASE = "release"  # older runs: a restarted producer gave back what it took and never published
DISPATCH_OPS = (GRANT, TOPUP, LEASE, EXPIRE, TAKE, RELEASE)


@dataclass(frozen=True)
class DispatchRecord:
    """One budget grant, top-up or lease (trainer), or an older run's take or release (a producer) on a
    dispatch log."""

    op: str  # GRANT, TOPUP, LEASE, EXPIRE (or an older run's TAKE, RELEASE)
    version: int | None  # the version the budget is for (None on a release)
    amount: int  # prompts granted, added, leased, taken back (expire), taken or released
    outstanding: int | None  # dispatched - consumed after the operation (None on a release)
    max_outstanding: int | None  # the bound the grant or top-up was computed for (trainer's entries only)
    producer: str | None  # who was leased, lost a lease, took or released (None on grants and top-ups)


DISPATCH_FIELDS = tuple(f.name for f in fields(DispatchRecord))
_DISPATCH_REQUIRED = {
    GRANT: ("version", "amount", "outstanding", "max_outstanding"),
    TOPUP: ("version", "amount", "outstanding", "max_outstanding"),
    LEASE: ("version", "amount", "outstanding", "producer"),
    EXPIRE: ("version", "amount", "outstanding", "producer"),
    TAKE: ("version", "amount", "outstanding", "producer"),
    RELEASE: ("amount", "producer"),
}


def dispatch_lua_fields(op: str, **values: str) -> str:
    """The field/value arguments of a dispatch log XADD as Lua source: `'op', '<op>'` then each field of
    `op` in DISPATCH_FIELDS order with its Lua expression (`values`: field name -> Lua expression)."""
    want = _DISPATCH_REQUIRED[op]
    if set(values) != set(want):
        raise ValueError(f"a {op} entry has fields {want}, got {sorted(values)}")
    return ", ".join(
        [f"'op', '{op}'", *(f"'{name}', {values[name]}" for name in DISPATCH_FIELDS if name in values)]
    )


def decode_dispatch(entry: Mapping[Any, Any]) -> DispatchRecord:
    """A dispatch log entry as a DispatchRecord; DecodeError when a field is missing or malformed."""
    op = _get(entry, "op", "dispatch_log")
    if op not in DISPATCH_OPS:
        raise DecodeError(f"dispatch_log entry field op={op!r} is not one of {DISPATCH_OPS}")
    have = _DISPATCH_REQUIRED[op]

    def num(name: str) -> int | None:
        return _int(entry, name, "dispatch_log") if name in have else None

    return DispatchRecord(
        op=op,
        version=num("version"),
        amount=_int(entry, "amount", "dispatch_log"),
        outstanding=num("outstanding"),
        max_outstanding=num("max_outstanding"),
        producer=_get(entry, "producer", "dispatch_log") if "producer" in have else None,
    )


# -- producer cursor --------------------------------------------------------------------------------


def encode_cursor(epoch: int, index: int) -> str:
    """The value of `producer:<name>:cursor`: the next prompt's epoch and index."""
    return f"{epoch}:{index}"


def decode_cursor(raw: bytes | str) -> tuple[int, int]:
    """(epoch, index) from a cursor value; DecodeError when it is not "<int>:<int>"."""
    try:
        epoch, index = _text(raw).split(":")
        return int(epoch), int(index)
    except ValueError as e:  # UnicodeDecodeError included
        raise DecodeError(f"producer cursor {raw!r} is not <epoch>:<index>") from e
