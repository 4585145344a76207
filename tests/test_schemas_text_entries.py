"""The plain-text entries of the wire contract (schemas/text_entries.py): fates, dispatch logs and producer
cursors read back from real Redis as they were written, and malformed ones refused with a reason."""

from __future__ import annotations

import pytest
import redis
from conftest import PRODUCERS

from rollstream.bus import setup_run
from rollstream.keys import Keys
from rollstream.pacing.budget import ask_lease, consume, grant_budget, lease_pass
from rollstream.pacing.counters import dispatch_entries
from schemas import (
    DROPPED,
    DecodeError,
    DispatchRecord,
    Fate,
    decode_cursor,
    decode_dispatch,
    decode_fate,
    encode_cursor,
    encode_fate,
)
from schemas.text_entries import GRANT, dispatch_lua_fields


def test_a_fate_reads_back_as_written(r: redis.Redis, keys: Keys) -> None:
    fate = Fate("s-1", "1700000000000-3", DROPPED, 3, 4, 7)
    r.xadd(keys.fates, encode_fate(fate), id="7-1")  # type: ignore[arg-type]
    (entry_id, fields), = r.xrange(keys.fates)  # type: ignore[misc]
    assert entry_id == b"7-1" and decode_fate(fields) == fate
    assert list(fields) == [
        b"sample_id",
        b"source_id",
        b"fate",
        b"staleness",
        b"param_version",
        b"global_step",
    ]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({b"fate": b"eaten"}, "fate='eaten' is not one of"),
        ({b"staleness": b"x"}, "staleness='x' is not an int"),
        ({b"sample_id": None}, "no 'sample_id' field"),
        ({b"source_id": b"\xff"}, "'source_id' is not UTF-8"),
    ],
)
def test_a_malformed_fate_is_a_decode_error(change: dict[bytes, bytes | None], reason: str) -> None:
    fields = {k.encode(): str(v).encode() for k, v in encode_fate(Fate("s", "1-0", DROPPED, 2, 0, 2)).items()}
    for name, value in change.items():
        if value is None:
            del fields[name]
        else:
            fields[name] = value
    with pytest.raises(DecodeError, match=reason):
        decode_fate(fields)


def test_grants_leases_and_top_ups_read_back_as_dispatch_records(r: redis.Redis, keys: Keys) -> None:
    setup_run(r, keys, PRODUCERS)
    assert grant_budget(r, keys, 0, max_outstanding=5) == (5, 0)
    ask_lease(r, keys, "rollout_00", 5)
    assert lease_pass(r, keys, ["rollout_00"]) == 5
    assert consume(r, keys, ["rollout_00-0", "rollout_00-1", "rollout_00-2"], 5) == (3, 3)  # evicted early
    assert dispatch_entries(r, keys) == [
        DispatchRecord("grant", version=0, amount=5, outstanding=0, max_outstanding=5, producer=None),
        DispatchRecord(
            "lease", version=0, amount=5, outstanding=5, max_outstanding=None, producer="rollout_00"
        ),
        DispatchRecord("topup", version=0, amount=3, outstanding=2, max_outstanding=5, producer=None),
    ]


def test_an_older_runs_takes_and_releases_still_read_back() -> None:
    take = {
        b"op": b"take",
        b"version": b"0",
        b"amount": b"3",
        b"outstanding": b"3",
        b"producer": b"rollout_00",
    }
    release = {b"op": b"release", b"amount": b"3", b"producer": b"rollout_00"}
    assert decode_dispatch(take) == DispatchRecord("take", 0, 3, 3, None, "rollout_00")
    assert decode_dispatch(release) == DispatchRecord("release", None, 3, None, None, "rollout_00")


def test_a_malformed_dispatch_entry_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="op='steal' is not one of"):
        decode_dispatch({b"op": b"steal", b"amount": b"1"})
    with pytest.raises(DecodeError, match="no 'producer' field"):
        decode_dispatch({b"op": b"take", b"version": b"0", b"amount": b"1", b"outstanding": b"1"})


def test_the_lua_fields_of_a_dispatch_entry_come_in_one_order_and_only_for_its_op() -> None:
    lua = dispatch_lua_fields(
        GRANT, max_outstanding="ARGV[2]", amount="budget", version="ARGV[1]", outstanding="o"
    )
    assert (
        lua
        == "'op', 'grant', 'version', ARGV[1], 'amount', budget, 'outstanding', o, 'max_outstanding', ARGV[2]"
    )
    with pytest.raises(ValueError, match="a grant entry has fields"):
        dispatch_lua_fields(GRANT, version="ARGV[1]", amount="budget", outstanding="o", producer="ARGV[3]")


def test_a_cursor_reads_back_and_a_malformed_one_is_a_decode_error() -> None:
    assert decode_cursor(encode_cursor(2, 17).encode()) == (2, 17)
    with pytest.raises(DecodeError, match="is not <epoch>:<index>"):
        decode_cursor(b"2-17")
    with pytest.raises(DecodeError, match="is not <epoch>:<index>"):
        decode_cursor(b"\xff\xfe:1")  # not UTF-8: a DecodeError too, not a UnicodeDecodeError
