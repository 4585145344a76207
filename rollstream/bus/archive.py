"""The log archive: the stream entries retention moved out of Redis, on local disk, in id order.

Layout under the archive root (`bus.archive_uri`, default `<run dir>/archive`; folders 0700, files 0600):

    <stream>/index.json        the committed segments: file, committed bytes, entries, first and last id
    <stream>/00000001.seg …    framed records (rollstream/bus/segments.py), appended in id order

`<stream>` is the key's name inside its run (`rollouts`, `fates`, `producer~rollout_00~dispatch_log`). Writers
of a stream take turns (an flock on `<stream>/lock`). A writer appends, fsyncs the segment and its folder,
then replaces index.json atomically (runtime/files.py): the index is the commit. Readers read the index, then
each segment up to its committed length, so they never see a half-written record, and a writer that crashed
before its commit left only bytes past the committed length, which the next writer truncates. Ids only grow: a
writer skips entries at or below the last id committed, and readers skip any id not above the last one they
yielded (duplicates are skipped by id).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rollstream.bus.ids import parse_id
from rollstream.bus.segments import SegmentError, encode_record, new_segment, read_records
from rollstream.keys import split_key
from rollstream.runtime.files import atomic_write, private_dir

INDEX = "index.json"
#: Held (flock) by the one writer of a stream at a time.
LOCK = "lock"
#: A writer starts a new segment once the current one holds this many bytes.
SEGMENT_BYTES = 256 << 20
FORMAT = 1


class ArchiveError(Exception):
    """The archive cannot be read or written as its index says (missing, damaged, or not ours)."""


@dataclass(frozen=True)
class Segment:
    """One committed segment file of a stream."""

    file: str
    bytes: int  # committed length (the file may be longer: a crashed writer's uncommitted tail)
    entries: int
    first: str
    last: str


@dataclass(frozen=True)
class StreamIndex:
    """What the archive holds of one stream: its committed segments, oldest first."""

    stream: str
    segments: tuple[Segment, ...] = ()

    @property
    def last(self) -> str | None:
        """The newest archived entry id (None when nothing is archived)."""
        return self.segments[-1].last if self.segments else None

    @property
    def entries(self) -> int:
        """Entries archived."""
        return sum(s.entries for s in self.segments)

    @property
    def bytes(self) -> int:
        """Committed bytes on disk (framing included)."""
        return sum(s.bytes for s in self.segments)


def stream_dirname(key: str) -> str:
    """The folder name of a stream key in its run's archive (`:` -> `~`, anything unsafe %-quoted)."""
    split = split_key(key)
    name = (split[1] if split else key).replace(":", "~")
    name = quote(name, safe="~-_.")
    return "%2E" + name[1:] if name.startswith(".") else name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Archive:
    """One run's archive folder: read committed entries, write (through `writer`) new ones."""

    def __init__(self, root: str | Path) -> None:
        """root: the archive folder (made, 0700, by `create` or the first writer)."""
        self.root = Path(root)

    def create(self) -> Archive:
        """Make the archive folder (private) if it is missing; returns self."""
        private_dir(self.root)
        return self

    def __repr__(self) -> str:
        return f"Archive({str(self.root)!r})"

    def stream_dir(self, key: str) -> Path:
        """The folder holding one stream's segments and index."""
        return self.root / stream_dirname(key)

    def signature(self, key: str) -> tuple[int, int, int] | None:
        """A cheap token that changes whenever the stream's index is replaced (None: no index yet)."""
        try:
            st = os.stat(self.stream_dir(key) / INDEX)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def index(self, key: str) -> StreamIndex:
        """The committed index of a stream (empty when nothing was archived); ArchiveError if unreadable."""
        path = self.stream_dir(key) / INDEX
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            if not self.root.is_dir():  # the log says it is here: reading on without it would leave a gap
                raise ArchiveError(
                    f"the run's archive folder {self.root} is not here (read the log on the host "
                    f"that holds it)"
                ) from None
            return StreamIndex(key)
        except (OSError, ValueError) as e:
            raise ArchiveError(f"cannot read {path}: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ArchiveError(f"{path}: not an archive index of format {FORMAT}")
        try:
            segments = tuple(Segment(**s) for s in raw["segments"])
        except (KeyError, TypeError) as e:
            raise ArchiveError(f"{path}: bad segment list: {e}") from None
        return StreamIndex(key, segments)

    def entries(
        self,
        key: str,
        index: StreamIndex | None = None,
        after: str | None = None,
        upto: str | None = None,
        reverse: bool = False,
    ) -> Iterator[tuple[str, dict[Any, Any]]]:
        """(id, fields) of the committed entries of `key` with after < id <= upto (None: unbounded), in id
        order (newest first when `reverse`: a segment is read whole, then reversed), duplicates skipped."""
        index = self.index(key) if index is None else index
        lo = parse_id(after) if after is not None else None
        hi = parse_id(upto) if upto is not None else None
        segments = [
            s
            for s in index.segments
            if (lo is None or parse_id(s.last) > lo) and (hi is None or parse_id(s.first) <= hi)
        ]
        if not reverse:
            last = lo
            for seg in segments:
                for entry_id, fields in self._read(key, seg):
                    k = parse_id(entry_id)
                    if (last is not None and k <= last) or (hi is not None and k > hi):
                        continue
                    last = k
                    yield entry_id, fields
            return
        newer: tuple[int, int] | None = None
        for seg in reversed(segments):
            rows = [(parse_id(i), i, f) for i, f in self._read(key, seg)]
            for k, entry_id, fields in reversed(rows):
                if (
                    (lo is not None and k <= lo)
                    or (hi is not None and k > hi)
                    or (newer is not None and k >= newer)
                ):
                    continue
                newer = k
                yield entry_id, fields

    def _read(self, key: str, seg: Segment) -> Iterator[tuple[str, dict[Any, Any]]]:
        path = self.stream_dir(key) / seg.file
        try:
            with open(path, "rb") as f:
                n = 0
                for _, entry_id, fields in read_records(f, limit=seg.bytes):
                    n += 1
                    yield entry_id, fields
        except (OSError, SegmentError) as e:
            raise ArchiveError(f"{path}: {e}") from None
        if n != seg.entries:
            raise ArchiveError(f"{path}: {n} entries where the index commits {seg.entries}")

    def writer(self, key: str) -> StreamWriter:
        """A writer appending to `key`'s archive (one writer per stream at a time)."""
        return StreamWriter(self, key)


class StreamWriter:
    """Appends entries to one stream's archive; nothing is visible to readers until `commit`."""

    def __init__(self, archive: Archive, key: str) -> None:
        """Open the stream's current segment, cutting off any uncommitted tail a crashed writer left."""
        self.archive, self.key = archive, key
        self.dir = archive.stream_dir(key)
        archive.create()
        private_dir(self.dir)
        self.f: Any = None
        self._cur: dict[str, Any] | None = None  # the open segment's row (file, bytes, entries, first, last)
        self.written = 0  # entries written since the last commit
        self._lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)  # released by close(); the index is read under it
            self.index = archive.index(key)
            self.segments = list(self.index.segments)
            self.last = parse_id(self.index.last) if self.index.last else None
            if self.segments and self.segments[-1].bytes < SEGMENT_BYTES:
                seg = self.segments.pop()
                self._open(seg.file, truncate_to=seg.bytes)
                self._cur = asdict(seg)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str, truncate_to: int | None = None) -> None:
        """Open a committed segment to append after its committed bytes, or (truncate_to None) a new one."""
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if truncate_to is None else 0), 0o600)
        except OSError as e:
            raise ArchiveError(f"cannot open {path}: {e}") from None
        self.f = os.fdopen(fd, "r+b")
        if truncate_to is None:
            new_segment(self.f)
            return
        size = os.fstat(fd).st_size
        if size < truncate_to:
            self.f.close()
            raise ArchiveError(f"{path} holds {size} bytes where the index commits {truncate_to}")
        self.f.truncate(truncate_to)
        self.f.seek(truncate_to)

    def _roll(self) -> None:
        """Close the current segment (durably) and start the next one."""
        if self.f is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            assert self._cur is not None
            self.segments.append(Segment(**self._cur))
        number = int(self.segments[-1].file.split(".")[0]) + 1 if self.segments else 1
        name = f"{number:08d}.seg"
        self._open(name)
        self._cur = {"file": name, "bytes": self.f.tell(), "entries": 0, "first": "", "last": ""}

    def write(self, rows: Iterable[tuple[str, Any]]) -> int:
        """Append entries (id order); ids at or below the last one archived are skipped. Returns how many
        were appended."""
        n = 0
        for entry_id, fields in rows:
            k = parse_id(entry_id)
            if self.last is not None and k <= self.last:
                continue
            if self._cur is None or self._cur["bytes"] >= SEGMENT_BYTES:
                self._roll()
            assert self._cur is not None
            record = encode_record(entry_id, fields)
            self.f.write(record)
            cur = self._cur
            cur["bytes"] += len(record)
            cur["entries"] += 1
            cur["first"] = cur["first"] or entry_id
            cur["last"] = entry_id
            self.last = k
            n += 1
        self.written += n
        return n

    def commit(self) -> StreamIndex:
        """Make everything written durable (segment fsync, folder fsync), then replace the index: from
        here on readers see it. Returns the new index."""
        segments = list(self.segments)
        if self.f is not None and self._cur is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
            if self._cur["entries"]:
                segments.append(Segment(**self._cur))
        _fsync_dir(self.dir)
        doc = {"format": FORMAT, "stream": self.key, "segments": [asdict(s) for s in segments]}
        atomic_write(self.dir / INDEX, json.dumps(doc, indent=1).encode())
        self.index = StreamIndex(self.key, tuple(segments))
        self.written = 0
        return self.index

    def close(self) -> None:
        """Close the open segment (what was not committed stays invisible and is cut off next time) and
        let the next writer in."""
        if self.f is not None:
            self.f.close()
            self.f = None
        if self._lock >= 0:
            os.close(self._lock)  # drops the flock
            self._lock = -1

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
