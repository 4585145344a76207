"""The Redis Streams bus: connections, publishing, the group reader (the consumer loop), stream reading
(archive + Redis), retention and the log archive."""

from rollstream.bus.archive import Archive, ArchiveError
from rollstream.bus.connection import (
    CONNECTION_ERRORS,
    connect,
    read_password,
    retry_on_connection,
    wait_until_ready,
)
from rollstream.bus.ids import parse_id, text
from rollstream.bus.publish import (
    Publisher,
    RunNotSetUpError,
    delete_run,
    ensure_group,
    run_producers,
    setup_run,
)
from rollstream.bus.reader import EntryRef, GroupReader, Message, ReaderStats, entry_limits, group_refs
from rollstream.bus.retention import Janitor, Moved, PassResult, move_to_archive, safe_min_id, stream_floor
from rollstream.bus.streams import iter_stream, run_archive

__all__ = [
    "Archive",
    "ArchiveError",
    "CONNECTION_ERRORS",
    "EntryRef",
    "GroupReader",
    "Janitor",
    "Message",
    "Moved",
    "PassResult",
    "Publisher",
    "ReaderStats",
    "RunNotSetUpError",
    "connect",
    "delete_run",
    "entry_limits",
    "ensure_group",
    "group_refs",
    "iter_stream",
    "move_to_archive",
    "parse_id",
    "read_password",
    "retry_on_connection",
    "run_producers",
    "run_archive",
    "safe_min_id",
    "setup_run",
    "stream_floor",
    "text",
    "wait_until_ready",
]
