"""Entry ids, sample ids, counters and reply text: the one canonical parser of every id and count a role
writes, and the one text helper (redis-py replies are bytes; ids, names and header values are wanted as
str). Below both streams.py and archive.py, which use them.

Whatever a producer (or the aggregator) writes is input to the other roles. A sample id is
`<producer>-<seq>` and a count (a producer's `published`, `want`, `version`; a header's `param_version`) is
a canonical non-negative decimal: ASCII digits only, no sign, no spaces, no leading zero (`0`, `1`, `17`, …
but never `01`, `+1`, ` 1`, `１`, `١` or `²`, which `str.isdigit` accepts and `int()` folds or refuses), at
most a bounded number of digits. The parsers here never raise anything but `IdError` (a ValueError whose
message names the field and the value), and the `*_or_none` forms never raise at all.
"""

from __future__ import annotations

import re
from typing import Any

#: A sample id's seq is below this: a Redis bitmap's largest offset + 1 (pacing counts prompts by seq bits).
SEQ_LIMIT = 2**32
#: A count a role writes (published, want, version, param_version) is below this: Redis' INCRBY range.
COUNT_LIMIT = 2**63
#: Longest sample id accepted, in characters (a producer name is at most a few dozen).
SAMPLE_ID_MAX_CHARS = 200
#: The largest stream entry id Redis accepts: nothing comes after it.
MAX_ENTRY_ID = f"{2**64 - 1}-{2**64 - 1}"

# ASCII decimal without a leading zero (re.ASCII is implied by the explicit class; fullmatch: no "\n" tail)
_CANONICAL = re.compile(r"0|[1-9][0-9]*")
_SHOWN = 60  # characters of a bad value shown in a reason


class IdError(ValueError):
    """An id or count that is not in its canonical form; the message names the field and the value."""


def text(x: Any, errors: str = "replace") -> str:
    """A reply value as str: bytes decoded as UTF-8 (undecodable bytes handled per `errors`), else str(x)."""
    return x.decode(errors=errors) if isinstance(x, (bytes, bytearray)) else str(x)


def shown(value: Any) -> str:
    """`value` for a message: its repr, cut to a few dozen characters (a flood shows as its start)."""
    s = repr(text(value) if isinstance(value, (bytes, bytearray)) else value)
    return s if len(s) <= _SHOWN else s[: _SHOWN - 1] + "…'"


def parse_count(raw: Any, field: str, limit: int = COUNT_LIMIT) -> int:
    """A canonical non-negative decimal below `limit` (bytes or str; an int is taken as it is if in range);
    IdError naming `field` and the value otherwise."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if 0 <= raw < limit:
            return raw
        raise IdError(f"{field}={raw!r} is outside [0, {limit})")
    if isinstance(raw, (bytes, bytearray)):
        try:
            s = raw.decode("ascii")
        except UnicodeDecodeError:
            raise IdError(f"{field}={shown(raw)} is not an ASCII decimal") from None
    elif isinstance(raw, str):
        s = raw
    else:
        raise IdError(f"{field}={shown(raw)} is not an ASCII decimal")
    if not _CANONICAL.fullmatch(s):
        raise IdError(
            f"{field}={shown(s)} is not a canonical decimal (ASCII digits, no sign, spaces or leading zero)"
        )
    if len(s) > len(str(limit)) or int(s) >= limit:  # the length first: int() of a flood is slow
        raise IdError(f"{field}={shown(s)} is not below {limit}")
    return int(s)


def count_or_none(raw: Any, field: str = "count", limit: int = COUNT_LIMIT) -> int | None:
    """`parse_count`, or None for anything that is not a canonical count (never raises)."""
    try:
        return parse_count(raw, field, limit)
    except IdError:
        return None


def parse_sample_id(sample_id: Any, producer: str | None = None) -> tuple[str, int]:
    """(producer, seq) of a sample id `<producer>-<seq>` (seq canonical, below SEQ_LIMIT; the producer part
    non-empty, and equal to `producer` when given); IdError naming the value otherwise."""
    if isinstance(sample_id, (bytes, bytearray)):
        try:
            sample_id = sample_id.decode()
        except UnicodeDecodeError:
            raise IdError(f"sample_id={shown(sample_id)} is not UTF-8") from None
    if not isinstance(sample_id, str):
        raise IdError(f"sample_id={shown(sample_id)} is not a string")
    if len(sample_id) > SAMPLE_ID_MAX_CHARS:
        raise IdError(f"sample_id={shown(sample_id)} is over {SAMPLE_ID_MAX_CHARS} characters")
    name, dash, seq = sample_id.rpartition("-")
    if not dash or not name or name.endswith("-"):  # `<p>--5` would read as a sign
        raise IdError(f"sample_id={shown(sample_id)} is not '<producer>-<seq>'")
    if producer is not None and name != producer:
        raise IdError(f"sample_id={shown(sample_id)} is not '<producer>-<seq>' for producer={producer!r}")
    try:
        return name, parse_count(seq, "seq", SEQ_LIMIT)
    except IdError as e:
        raise IdError(f"sample_id={shown(sample_id)}: {e}") from None


def split_sample_id(sample_id: Any, producer: str | None = None) -> tuple[str, int] | None:
    """`parse_sample_id`, or None for any other id (never raises)."""
    try:
        return parse_sample_id(sample_id, producer)
    except IdError:
        return None


def sample_id_reason(sample_id: Any, producer: str | None = None) -> str | None:
    """Why `sample_id` is not a canonical `<producer>-<seq>` (of `producer` when given), or None."""
    try:
        parse_sample_id(sample_id, producer)
    except IdError as e:
        return str(e)
    return None


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """(milliseconds, sequence) of a stream entry id `<ms>-<seq>` as Redis writes it (a bare `<ms>` has
    sequence 0): its order key, and its parts for id arithmetic. IdError for anything else."""
    s = text(entry_id)
    ms, dash, seq = s.partition("-")
    try:
        return parse_count(ms, "entry id ms", 2**64), parse_count(seq if dash else "0", "entry id seq", 2**64)
    except IdError as e:
        raise IdError(f"entry id {shown(s)}: {e}") from None


def after(entry_id: bytes | str) -> str | None:
    """The exclusive XRANGE start `(<id>` of the entries after `entry_id`; None at the largest id Redis
    accepts (nothing can follow it, and Redis refuses `(` of it as an invalid start)."""
    s = text(entry_id)
    return None if parse_id(s) == (2**64 - 1, 2**64 - 1) else "(" + s
