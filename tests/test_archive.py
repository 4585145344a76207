"""The log archive (segments on disk) and the one log view (`iter_stream`: archive, then Redis), against a
real Redis: the segment format's torn tails and damage, commits, duplicates skipped by id, moves that
archive before they trim (a crash in between leaves no gap), reads racing a janitor, and the budget."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import P0, PRODUCERS

from rollstream.bus import (
    Archive,
    ArchiveError,
    Janitor,
    iter_stream,
    move_to_archive,
    run_archive,
    setup_run,
)
from rollstream.bus import archive as archive_mod
from rollstream.bus.retention import CAP_BIT, KILL_BEFORE_TRIM_ENV
from rollstream.bus.segments import MAGIC, SegmentError, encode_record, read_records
from rollstream.config import ConfigError, load_config
from rollstream.keys import ARCHIVE_DIR_FIELD, TRAINER_GROUP, Keys
from rollstream.ops.inspect import read_entry
from rollstream.ops.status import collect_status, format_status

ROOT = Path(__file__).resolve().parent.parent


def fill(r: redis.Redis, key: str, n: int, size: int = 100) -> list[tuple[str, dict[bytes, bytes]]]:
    """n entries with a few fields (binary values included); returns them as Redis gives them back."""
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(key, {"type": "x", "i": str(i), "blob": bytes([i % 256]) * size + b"\x00\xff"})
    pipe.execute()
    return [(i.decode(), f) for i, f in r.xrange(key)]


def read_group(r: redis.Redis, key: str, count: int, ack: bool = True) -> list[str]:
    """Deliver `count` entries to the trainer group (acked unless told)."""
    got = r.xreadgroup(TRAINER_GROUP, "c", {key: ">"}, count=count)
    ids = [i.decode() for i, _ in got[0][1]] if got else []
    if ack and ids:
        r.xack(key, TRAINER_GROUP, *ids)
    return ids


# -- the segment format -----------------------------------------------------------------------------


def test_segment_records_round_trip_and_a_torn_tail_is_ignored(tmp_path: Path) -> None:
    rows = [(f"{i}-0", {b"k": bytes([i]) * 5, b"s": b"x"}) for i in range(1, 4)]
    path = tmp_path / "s.seg"
    data = MAGIC + b"".join(encode_record(i, f) for i, f in rows)
    path.write_bytes(data + encode_record("9-0", {b"k": b"torn"})[:7])  # a crash mid-write
    with open(path, "rb") as f:
        got = [(i, fields) for _, i, fields in read_records(f)]
        assert got == rows  # field order and bytes kept, the torn record ignored
        assert [(i, fields) for _, i, fields in read_records(f, limit=len(data))] == rows
        with pytest.raises(SegmentError, match="damaged or missing"):
            list(read_records(f, limit=len(data) + 5))  # committed bytes must be whole records


def test_segment_damage_inside_committed_bytes_raises(tmp_path: Path) -> None:
    data = bytearray(MAGIC + b"".join(encode_record(f"{i}-0", {b"v": b"abc"}) for i in range(1, 4)))
    data[len(MAGIC) + 10] ^= 0xFF
    path = tmp_path / "s.seg"
    path.write_bytes(bytes(data))
    with open(path, "rb") as f, pytest.raises(SegmentError):
        list(read_records(f, limit=len(data)))
    path.write_bytes(b"not a segment at all")
    with open(path, "rb") as f, pytest.raises(SegmentError, match="magic"):
        list(read_records(f))


# -- the archive ------------------------------------------------------------------------------------


def test_commit_makes_entries_visible_and_the_files_private(tmp_path: Path) -> None:
    arc = Archive(tmp_path / "archive")
    key = "rs:{x}:rollouts"
    rows = [(f"{i}-1", {b"a": str(i).encode()}) for i in range(1, 6)]
    with arc.writer(key) as w:
        assert w.write(rows[:3]) == 3
        assert list(arc.entries(key)) == []  # not committed yet
        w.commit()
        assert w.write(rows[1:]) == 2  # ids at or below the last one archived are skipped
        w.commit()
    assert list(arc.entries(key)) == rows
    assert list(arc.entries(key, after="2-1", upto="4-1")) == rows[2:4]
    assert list(arc.entries(key, reverse=True)) == rows[::-1]
    idx = arc.index(key)
    assert (idx.entries, idx.last, idx.stream) == (5, "5-1", key)
    folder = arc.stream_dir(key)
    assert folder.name == "rollouts"
    for p in [arc.root, folder, *folder.iterdir()]:
        want = 0o700 if p.is_dir() else 0o600
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_an_uncommitted_tail_is_invisible_then_cut_off(tmp_path: Path) -> None:
    arc = Archive(tmp_path)
    key = "rs:{x}:fates"
    with arc.writer(key) as w:
        w.write([("1-1", {b"a": b"1"})])
        w.commit()
        w.write([("2-1", {b"a": b"2"})])  # fsynced or not, never committed: the writer "crashed"
    seg = arc.stream_dir(key) / arc.index(key).segments[0].file
    with open(seg, "ab") as f:
        f.write(b"\x00\x00\x01")  # and a torn record after it
    assert [i for i, _ in arc.entries(key)] == ["1-1"]
    with arc.writer(key) as w:  # the next writer truncates to the committed length, then appends
        w.write([("2-1", {b"a": b"2"}), ("3-1", {b"a": b"3"})])
        w.commit()
    assert [i for i, _ in arc.entries(key)] == ["1-1", "2-1", "3-1"]


def test_segments_roll_and_duplicates_across_them_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_mod, "SEGMENT_BYTES", 200)
    arc = Archive(tmp_path)
    key = "rs:{x}:rollouts"
    with arc.writer(key) as w:
        for i in range(1, 21):
            w.write([(f"{i}-0", {b"v": b"y" * 40})])
        w.commit()
    idx = arc.index(key)
    assert len(idx.segments) > 3 and idx.entries == 20
    # a damaged index that lists overlapping segments (e.g. one copied twice): each id is read once
    doc = json.loads((arc.stream_dir(key) / "index.json").read_text())
    doc["segments"].insert(1, doc["segments"][0])
    (arc.stream_dir(key) / "index.json").write_text(json.dumps(doc))
    assert [i for i, _ in arc.entries(key)] == [f"{i}-0" for i in range(1, 21)]
    (arc.stream_dir(key) / idx.segments[-1].file).unlink()
    with pytest.raises(ArchiveError):
        list(arc.entries(key))


# -- one log view: archive, then Redis --------------------------------------------------------------


def test_iter_stream_reads_archive_then_redis_as_one_log(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.rollouts_of(P0), 30)
    read_group(r, keys.rollouts_of(P0), 12)
    arc = Archive(tmp_path / "archive")
    r.hset(keys.archive, ARCHIVE_DIR_FIELD, str(arc.root))
    moved = move_to_archive(r, arc, keys.rollouts_of(P0), below=full[20][0])
    assert (moved.archived, moved.trimmed) == (20, 20) and r.xlen(keys.rollouts_of(P0)) == 10
    assert list(iter_stream(r, keys.rollouts_of(P0), page=7)) == full  # fields exactly as Redis returned them
    assert list(iter_stream(r, keys.rollouts_of(P0), archive=False)) == full[20:]
    assert list(iter_stream(r, keys.rollouts_of(P0), reverse=True, page=4)) == full[::-1]
    ids = [i for i, _ in full]
    assert [i for i, _ in iter_stream(r, keys.rollouts_of(P0), ids[5], ids[24])] == ids[5:25]
    assert [i for i, _ in iter_stream(r, keys.rollouts_of(P0), "(" + ids[5], "(" + ids[24])] == ids[6:24]
    stream = keys.rollouts_of(P0)
    assert [i for i, _ in iter_stream(r, stream, ids[3], ids[18], reverse=True)] == ids[3:19][::-1]
    assert read_entry(r, keys.rollouts_of(P0), ids[2]) == full[2]  # inspect sees an archived entry
    assert read_entry(r, keys.rollouts_of(P0), "-25") == full[5]
    assert run_archive(r, keys.rollouts_of(P0)) is not None and run_archive(r, "no-run-key") is None


def test_a_crash_between_commit_and_trim_leaves_duplicates_read_once(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.metrics, 10)
    arc = Archive(tmp_path)
    r.hset(keys.archive, ARCHIVE_DIR_FIELD, str(arc.root))

    def crash(stream: str) -> None:
        raise KeyboardInterrupt("killed between the archive's commit and XTRIM")

    with pytest.raises(KeyboardInterrupt):
        move_to_archive(r, arc, keys.metrics, below=full[6][0], after_commit=crash)
    assert r.xlen(keys.metrics) == 10 and arc.index(keys.metrics).entries == 6  # in both places
    assert list(iter_stream(r, keys.metrics)) == full
    assert list(iter_stream(r, keys.metrics, reverse=True)) == full[::-1]
    again = move_to_archive(r, arc, keys.metrics, below=full[6][0])  # the next pass only trims
    assert (again.archived, again.trimmed, arc.index(keys.metrics).entries) == (0, 6, 6)
    assert list(iter_stream(r, keys.metrics)) == full


def test_a_reader_racing_the_janitor_sees_no_gap(r: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.metrics, 40)
    arc = Archive(tmp_path)
    r.hset(keys.archive, ARCHIVE_DIR_FIELD, str(arc.root))
    move_to_archive(r, arc, keys.metrics, below=full[10][0])
    it = iter_stream(r, keys.metrics, page=5)
    got = [next(it) for _ in range(10)]  # the whole archive part; the next step reads Redis
    move_to_archive(r, arc, keys.metrics, below=full[20][0])  # archived and trimmed before that read
    got += [next(it) for _ in range(7)]  # into Redis paging (cursor at 17)
    move_to_archive(r, arc, keys.metrics, below=full[30][0])  # trims past the cursor
    got += list(it)
    assert got == full
    it = iter_stream(r, keys.metrics, reverse=True, page=3)
    back = [next(it) for _ in range(4)]
    move_to_archive(r, arc, keys.metrics, below=full[38][0])
    assert back + list(it) == full[::-1]
    it = iter_stream(r, keys.metrics)
    got = [next(it) for _ in range(38)]  # the archive's part
    move_to_archive(r, arc, keys.metrics, below=None)  # everything left, so Redis answers nothing at all
    assert r.xlen(keys.metrics) == 0 and got + list(it) == full


def test_an_archive_that_cannot_be_read_is_an_error_not_a_gap(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.fates, 5)
    arc = Archive(tmp_path / "a")
    r.hset(keys.archive, ARCHIVE_DIR_FIELD, str(arc.root))
    move_to_archive(r, arc, keys.fates, below=full[3][0])
    (arc.stream_dir(keys.fates) / "index.json").write_text("{not json")
    with pytest.raises(ArchiveError):
        list(iter_stream(r, keys.fates))
    st = collect_status(r, keys)
    assert {s.name: s.archived for s in st.streams}["fates"] is None and "?" in format_status(st, "redis://x")
    r.hset(keys.archive, ARCHIVE_DIR_FIELD, str(tmp_path / "elsewhere"))  # e.g. read on another host
    with pytest.raises(ArchiveError, match="not here"):
        list(iter_stream(r, keys.fates))


def test_writers_of_a_stream_take_turns(tmp_path: Path) -> None:
    arc = Archive(tmp_path)
    key = "rs:{x}:metrics"
    order: list[str] = []
    first = arc.writer(key)
    first.write([("1-1", {b"a": b"1"})])

    def second() -> None:
        with arc.writer(key) as w:  # waits for the first writer, then sees its commit
            order.append(f"second sees {w.index.last}")
            w.write([("1-1", {b"a": b"dup"}), ("2-1", {b"a": b"2"})])
            w.commit()

    t = threading.Thread(target=second)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # blocked on the first writer's lock
    first.commit()
    first.close()
    t.join(5)
    assert order == ["second sees 1-1"]
    assert list(arc.entries(key)) == [("1-1", {b"a": b"1"}), ("2-1", {b"a": b"2"})]


# -- the janitor ------------------------------------------------------------------------------------


def test_the_archive_folder_is_configured_as_a_local_path(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=a"])
    assert cfg.bus.retention and cfg.bus.archive_dir(cfg.run_dir()) == tmp_path / "a" / "archive"
    assert load_config(None, ["bus.archive_uri=file:///data/x"]).bus.archive_dir(tmp_path) == Path("/data/x")
    with pytest.raises(ConfigError, match="only a local path"):
        load_config(None, ["bus.archive_uri=s3://bucket/x"])


def janitor(r: redis.Redis, keys: Keys, tmp_path: Path, budget: int, **kw: Any) -> Janitor:
    return Janitor(r, keys, Archive(tmp_path / "archive"), budget_bytes=budget, every_s=60.0, **kw)


def test_over_budget_only_read_entries_leave_redis_and_status_shows_both(
    r: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.rollouts_of(P0), 200, size=2000)
    fill(r, keys.fates, 50)
    read_group(r, keys.rollouts_of(P0), 150)
    pending = read_group(r, keys.rollouts_of(P0), 10, ack=False)  # delivered, not acked: still needed
    used = int(r.memory_usage(keys.rollouts_of(P0)) or 0)
    jan = janitor(r, keys, tmp_path, budget=used // 2, keep_newest={keys.fates: 20})
    res = jan.maybe_run(now=1000.0)
    assert res is not None and jan.maybe_run(now=1001.0) is None  # not due yet
    left = [i for i, _ in iter_stream(r, keys.rollouts_of(P0), archive=False)]
    assert pending[0] in left and set(left) >= set(pending)  # nothing at or after the floor moved
    assert len(left) < 200 and res.used_after < res.used_before and not res.over_budget
    assert r.xlen(keys.fates) == 20 and r.hget(keys.archive, ARCHIVE_DIR_FIELD) == str(
        (tmp_path / "archive").resolve()).encode()
    assert list(iter_stream(r, keys.rollouts_of(P0))) == full  # the reader finds the archive through Redis
    st = {s.name: s for s in collect_status(r, keys).streams}
    mine = st[f"rollouts:{P0}"]
    assert mine.length + mine.archived == 200 and mine.archived_bytes > 0
    assert (st["fates"].length, st["fates"].archived) == (20, 30)
    assert " archived " in format_status(collect_status(r, keys), "redis://x")


def test_unread_data_over_budget_is_reported_and_the_cap_still_archives(
    r: redis.Redis, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.rollouts_of(P0), 100, size=2000)
    read_group(r, keys.rollouts_of(P0), 10)
    jan = janitor(r, keys, tmp_path, budget=64 << 10)
    res = jan.run_pass()
    assert res.over_budget and jan.over_budget  # 90 unread entries take more than 64 KiB
    assert r.xlen(keys.rollouts_of(P0)) == 90 and "paced to one global step" in caplog.text
    capped = janitor(r, keys, tmp_path, budget=64 << 10, max_stream_bytes=100 << 10).run_pass()
    assert capped.capped == [keys.rollouts_of(P0)] and CAP_BIT in caplog.text
    assert list(iter_stream(r, keys.rollouts_of(P0))) == full  # cut from Redis, never from the log


def test_a_pass_the_archive_fails_trims_nothing_and_paces(
    r: redis.Redis, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    setup_run(r, keys, PRODUCERS)
    fill(r, keys.rollouts_of(P0), 50, size=2000)
    read_group(r, keys.rollouts_of(P0), 50)
    (tmp_path / "archive").write_text("a file where the archive folder should be")
    jan = janitor(r, keys, tmp_path, budget=1 << 16)
    res = jan.maybe_run(now=1.0)
    assert res is not None and res.error and jan.over_budget
    assert r.xlen(keys.rollouts_of(P0)) == 50 and "retention pass failed" in caplog.text


def test_sigkill_between_archive_fsync_and_xtrim_loses_nothing(
    r: redis.Redis, keys: Keys, tmp_path: Path, redis_url: str
) -> None:
    """A janitor process is SIGKILLed by the fault hook right after its commit; the re-run only trims."""
    setup_run(r, keys, PRODUCERS)
    full = fill(r, keys.rollouts_of(P0), 60, size=1000)
    read_group(r, keys.rollouts_of(P0), 50)
    script = textwrap.dedent(f"""
        import redis
        from rollstream.bus import Archive, Janitor
        from rollstream.keys import Keys
        r = redis.Redis.from_url({redis_url!r})
        Janitor(r, Keys({keys.run!r}), Archive({str(tmp_path / 'archive')!r}), budget_bytes=1024,
                every_s=1).run_pass()
    """)
    env = {**os.environ, KILL_BEFORE_TRIM_ENV: "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-2000:]
    arc = Archive(tmp_path / "archive")
    stream = keys.rollouts_of(P0)
    assert arc.index(stream).entries == 50 and r.xlen(stream) == 60  # archived, not trimmed
    assert list(iter_stream(r, keys.rollouts_of(P0))) == full
    env.pop(KILL_BEFORE_TRIM_ENV)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert arc.index(keys.rollouts_of(P0)).entries == 50 and r.xlen(keys.rollouts_of(P0)) == 10
    assert list(iter_stream(r, keys.rollouts_of(P0))) == full
