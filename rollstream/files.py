"""Writing a file so that readers and crashes see either the old file or the whole new one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def _atomic_tmp(path: Path) -> Iterator[tuple[int, str]]:
    """A temp file beside `path` (fd, name; 0600, from mkstemp) that replaces `path` when the block ends
    without an error, after it and then the folder are fsynced; removed on error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        yield fd, tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """A binary file to write in pieces that becomes `path` atomically and durably when the block ends
    without an error (see atomic_write); creates missing parent folders."""
    with _atomic_tmp(path) as (fd, _), os.fdopen(fd, "wb") as f:
        yield f


def atomic_write(path: Path, data: bytes | Callable[[str], None]) -> Path:
    """Write `data` (bytes, or a function writing the file at the path it is given) to a temp file beside
    `path`, fsync it, os.replace it over `path` and fsync the folder; the temp file is removed on failure.
    Creates missing parent folders; the file is 0600 (mkstemp). Returns `path`."""
    if isinstance(data, bytes | bytearray | memoryview):
        with atomic_file(path) as f:
            f.write(data)
        return path
    with _atomic_tmp(path) as (fd, tmp):
        os.close(fd)
        data(tmp)
    return path
