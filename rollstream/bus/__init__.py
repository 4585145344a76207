"""The Redis Streams bus: connections, publishing, the group reader (the consumer loop), stream reading and
retention."""

from rollstream.bus.connection import (
    CONNECTION_ERRORS,
    connect,
    read_password,
    retry_on_connection,
    wait_until_ready,
)
from rollstream.bus.publish import Publisher, RunNotSetUpError, delete_run, ensure_group, setup_run
from rollstream.bus.reader import GroupReader, Message, ReaderStats, entry_limits
from rollstream.bus.retention import Janitor, TrimResult, safe_min_id, trim_stream
from rollstream.bus.streams import iter_stream, parse_id, text

__all__ = [
    "CONNECTION_ERRORS",
    "GroupReader",
    "Janitor",
    "Message",
    "Publisher",
    "ReaderStats",
    "RunNotSetUpError",
    "TrimResult",
    "connect",
    "delete_run",
    "entry_limits",
    "ensure_group",
    "iter_stream",
    "parse_id",
    "read_password",
    "retry_on_connection",
    "safe_min_id",
    "setup_run",
    "text",
    "trim_stream",
    "wait_until_ready",
]
