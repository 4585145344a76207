"""Writing a file so that readers and crashes see either the old file or the whole new one, into folders
that are private to their user."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

#: File mode bits a run's files never carry (group and other): the umask of the run's programs and of every
#: redis-server a command starts for a run.
PRIVATE_UMASK = 0o077


def private_dir(path: Path) -> Path:
    """Create `path` and every missing parent 0700 (whatever the umask), and make `path` itself 0700;
    returns it. Parents that already exist keep their mode."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)
        p.chmod(0o700)
    path.chmod(0o700)
    return path


@contextmanager
def _atomic_tmp(path: Path) -> Iterator[tuple[int, str]]:
    """A temp file beside `path` (fd, name; 0600, from mkstemp) that replaces `path` when the block ends
    without an error, after it and then the folder are fsynced; removed on error. Missing folders are
    created 0700."""
    if not path.parent.is_dir():
        private_dir(path.parent)
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
