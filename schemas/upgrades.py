"""Schema upgrade registry: functions that upcast an old payload dict one schema version at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.batch import DataProto
from schemas.errors import DecodeError
from schemas.ragged import from_padded

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


def _same_fields(data: dict[str, Any]) -> dict[str, Any]:
    """An upgrade whose fields are unchanged (only the wire layout changed; the codec already decoded it)."""
    return data


def _ragged_batch(data: dict[str, Any]) -> dict[str, Any]:
    """rollout 2 -> 3: a padded DataProto batch (schema 1, or schema 2 where the compact layout did not fit)
    becomes its ragged form; a compact batch the codec already read as ragged stays."""
    if isinstance(data.get("full_batch"), DataProto):
        data["full_batch"] = from_padded(data["full_batch"])
    return data


# Built-in upgrades. rollout 1 -> 2: schema 2 sent the batch in the compact layout (issue 17); a schema-1
# entry's batch is a plain DataProto, the same value once decoded. rollout 2 -> 3: the batch is ragged
# (schemas.ragged; the codec reads a compact layout straight into it). rollout 3 -> 4: only the ragged batch's
# wire layout changed (the codec reads both). local_update / step_end 1 -> 2:
# schema 2 adds rank and world_size (issue 16); a schema-1 event is rank 0 of a world of one (the defaults).
_UPGRADES: dict[tuple[str, int], Upgrade] = {
    ("rollout", 1): _same_fields,
    ("rollout", 2): _ragged_batch,
    ("rollout", 3): _same_fields,
    ("local_update", 1): _same_fields,
    ("step_end", 1): _same_fields,
    ("dead", 1): _same_fields,  # schema 2 adds omitted and sha256 (a bounded copy); a schema-1 copy is whole
}


def register_upgrade(event_type: str, from_version: int, fn: Upgrade) -> None:
    """Register fn turning a `event_type` payload dict of schema `from_version` into `from_version + 1`."""
    key = (event_type, from_version)
    if key in _UPGRADES:
        raise ValueError(f"an upgrade for {event_type!r} from schema {from_version} is already registered")
    _UPGRADES[key] = fn


def unregister_upgrade(event_type: str, from_version: int) -> None:
    """Remove a registered upgrade (no-op if absent); used by tests."""
    _UPGRADES.pop((event_type, from_version), None)


def upgrade(event_type: str, data: dict[str, Any], current: int) -> dict[str, Any]:
    """Apply registered upgrades in sequence until `data` is at schema `current`."""
    version = data.get("schema_version")
    if type(version) is not int:
        raise DecodeError(f"{event_type}: payload has no int schema_version")
    if version > current:
        raise DecodeError(f"{event_type}: schema_version {version} is newer than supported {current}")
    while version < current:
        fn = _UPGRADES.get((event_type, version))
        if fn is None:
            raise DecodeError(f"{event_type}: no upgrade from schema_version {version}")
        data = fn(dict(data))
        version += 1
        data["schema_version"] = version
    return data
