"""The one canonical parser of every id and count a role writes (rollstream/bus/ids.py), fuzzed: sample ids
`<producer>-<seq>` and counts are ASCII decimal without sign, space or leading zero, bounded; anything else
is refused with a reason naming the value, and the parsers never raise anything else (issue 41, item 1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.bus.ids import (
    COUNT_LIMIT,
    MAX_ENTRY_ID,
    SEQ_LIMIT,
    IdError,
    after,
    count_or_none,
    parse_count,
    parse_id,
    parse_sample_id,
    sample_id_reason,
    split_sample_id,
)

FUZZ = settings(max_examples=400, deadline=None, derandomize=True)

#: Digits `str.isdigit` accepts that are not ASCII (fullwidth, Arabic-Indic, Devanagari, superscripts, …).
UNICODE_DIGITS = "１２３０٠١٢٣۰۱०१২৩²³¹⁰₀₁①"


def canonical(s: str) -> bool:
    """The reference rule, written independently of the parser."""
    return (
        s != ""
        and all(c in "0123456789" for c in s)
        and (s == "0" or s[0] != "0")
    )


@pytest.mark.parametrize(
    "sid",
    [
        "rollout_00-05", "rollout_00-000005", "rollout_00-+5", "rollout_00--5", "rollout_00- 5",
        "rollout_00-5 ", "rollout_00-5\n", "rollout_00-", "-5", "rollout_00", "", "rollout_00-５",
        "rollout_00-٥", "rollout_00-²", "rollout_00-1_000", "rollout_00-0x10", "rollout_00-1e3",
        f"rollout_00-{SEQ_LIMIT}", "rollout_00-" + "9" * 40, "rollout_00-" + "1" * 300,
    ],
)
def test_non_canonical_sample_ids_are_refused_with_their_value(sid: str) -> None:
    assert split_sample_id(sid) is None
    with pytest.raises(IdError) as e:
        parse_sample_id(sid)
    assert repr(sid)[:20] in str(e.value) or "over" in str(e.value)


def test_canonical_sample_ids_parse_and_name_their_producer() -> None:
    assert parse_sample_id("rollout_00-0") == ("rollout_00", 0)
    assert parse_sample_id(b"rollout_00-17", "rollout_00") == ("rollout_00", 17)
    assert parse_sample_id(f"my-prod-{SEQ_LIMIT - 1}") == ("my-prod", SEQ_LIMIT - 1)  # the last dash splits
    with pytest.raises(IdError, match="for producer='rollout_01'"):
        parse_sample_id("rollout_00-1", "rollout_01")
    assert sample_id_reason("rollout_00-01") is not None and sample_id_reason("rollout_00-1") is None
    assert split_sample_id(b"rollout_00-\xff") is None and split_sample_id(None) is None


@FUZZ
@given(
    producer=st.text(min_size=0, max_size=12),
    seq=st.one_of(
        st.text(alphabet="0123456789", max_size=25),
        st.text(alphabet="0123456789 +-_.eE" + UNICODE_DIGITS, max_size=12),
        st.integers(min_value=-(10**30), max_value=10**30).map(str),
        st.text(max_size=8),
    ),
)
def test_sample_id_parser_fuzz(producer: str, seq: str) -> None:
    """Whatever the parts, the parser returns the canonical reading or refuses with IdError: never another
    exception, never a folded (`int()`-equivalent but different) id."""
    sid = f"{producer}-{seq}"
    try:
        name, n = parse_sample_id(sid)
    except IdError:
        ok = (
            producer != "" and not producer.endswith("-") and canonical(seq) and int(seq) < SEQ_LIMIT
            and len(sid) <= 200
        )
        assert not ok, sid
        return
    assert f"{name}-{n}" == sid  # canonical: the id is exactly what it parses to, so no two ids share a seq
    assert 0 <= n < SEQ_LIMIT and name and canonical(str(n))


@FUZZ
@given(
    raw=st.one_of(
        st.text(alphabet="0123456789 +-" + UNICODE_DIGITS, max_size=25),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.binary(max_size=12),
        st.text(max_size=10),
    )
)
def test_count_parser_fuzz(raw: str | bytes) -> None:
    s = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    expected = int(s) if canonical(s) and int(s) < COUNT_LIMIT else None
    assert count_or_none(raw, "published") == expected
    if expected is None:
        with pytest.raises(IdError, match="published="):
            parse_count(raw, "published")


def test_counts_name_the_field_and_value() -> None:
    with pytest.raises(IdError, match=r"version='abc' is not a canonical decimal"):
        parse_count(b"abc", "version")
    with pytest.raises(IdError, match=r"want='１０'"):
        parse_count("１０", "want")
    assert parse_count(b"0", "version") == 0 and parse_count(7, "x") == 7
    assert count_or_none(-1) is None and count_or_none(True) is None and count_or_none(2**63) is None


def test_entry_ids_and_the_last_possible_id() -> None:
    assert parse_id(b"5-3") == (5, 3) and parse_id("7") == (7, 0)
    assert parse_id(MAX_ENTRY_ID) == (2**64 - 1, 2**64 - 1)
    assert after("5-3") == "(5-3" and after(MAX_ENTRY_ID) is None
    for bad in ("x-1", "1-x", "-1", "1-", "١-1", f"{2**64}-0"):
        with pytest.raises(IdError, match="entry id"):
            parse_id(bad)
