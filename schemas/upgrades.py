"""Schema upgrades: old payload dicts upcast one schema version at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.batch import DataProto
from schemas.errors import DecodeError
from schemas.ragged import from_padded

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


def _ragged_batch(data: dict[str, Any]) -> dict[str, Any]:
    """rollout 2 -> 3: a padded DataProto batch (schema 1, or schema 2 where the compact layout did not fit)
    becomes its ragged form; a compact batch the codec already read as ragged stays."""
    if isinstance(data.get("full_batch"), DataProto):
        data["full_batch"] = from_padded(data["full_batch"])
    return data


#: Payload changes between schema versions, keyed by (event type, the version upgraded from). rollout 2 -> 3:
#: the batch is ragged (schemas.ragged; the codec reads a compact layout straight into it).
_UPGRADES: dict[tuple[str, int], Upgrade] = {
    ("rollout", 2): _ragged_batch,
}

#: Oldest schema still decoded, per event type (default: only the current one). A step between it and the
#: current schema without an upgrade above leaves the fields as they are, because the newer schema only
#: changed the wire layout or added fields with defaults: rollout 1 -> 2 sent the batch in a compact layout,
#: the same DataProto once decoded; rollout 3 -> 4 changed only the ragged batch's wire layout and 4 -> 5
#: moved it out of its ext into the payload (the codec reads all three); local_update / step_end 1 -> 2 add
#: rank and world_size (a schema-1 event is rank 0 of a world of one); dead 1 -> 2 adds omitted and sha256 (a
#: schema-1 copy is whole).
_OLDEST: dict[str, int] = {"rollout": 1, "local_update": 1, "step_end": 1, "dead": 1}


def upgrade(event_type: str, data: dict[str, Any], current: int) -> dict[str, Any]:
    """Upgrade `data` one schema version at a time until it is at schema `current`."""
    version = data.get("schema_version")
    if type(version) is not int:
        raise DecodeError(f"{event_type}: payload has no int schema_version")
    if version > current:
        raise DecodeError(f"{event_type}: schema_version {version} is newer than supported {current}")
    if version < _OLDEST.get(event_type, current):
        raise DecodeError(f"{event_type}: no upgrade from schema_version {version}")
    while version < current:
        fn = _UPGRADES.get((event_type, version))
        data = dict(data) if fn is None else fn(dict(data))
        version += 1
        data["schema_version"] = version
    return data
