"""Writing a file so that readers and crashes see either the old file or the whole new one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, data: bytes | Callable[[str], None]) -> Path:
    """Write `data` (bytes, or a function writing the file at the path it is given) to a temp file beside
    `path`, fsync it, os.replace it over `path` and fsync the folder; the temp file is removed on failure.
    Creates missing parent folders; the file is 0600 (mkstemp). Returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        if isinstance(data, bytes | bytearray | memoryview):
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            os.close(fd)
            data(tmp)
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
    return path
