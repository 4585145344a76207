"""The old wire schemas, read only, in one place: schemas/codec.py and schemas/payload.py write and read the
current schema and ask this module only for what an older encoder wrote.

- `upgrade`: an old payload dict upcast one schema version at a time (rollout 2 -> 3: a padded batch becomes
  ragged; other steps only add fields with defaults or change the wire layout).
- `from_padded` and `from_compact`: the rollout batches of schemas 1 and 2 (a padded verl DataProto; the
  compact layout) in the ragged form (schemas/ragged.py).
- `LEGACY_EXTS`: the ext types only older encoders wrote (schema 2's compact batch, schema 3's ragged batch),
  each with its decoder; the codec's unpacker asks for a code it does not write itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from schemas.arrays import array_from_flat
from schemas.batch import DataProto
from schemas.errors import DecodeError
from schemas.ragged import ID_KINDS, LOG_PROBS, RESPONSE_MASK, RaggedBatch, check_lengths, describe

# --- ext types only older encoders wrote ------------------------------------------------------------

# packed [layout, tensors, non_tensors, meta_info]: a RolloutSample's batch in schema 2 (the compact layout,
# read into the ragged form by `from_compact` below).
EXT_COMPACT_BATCH = 6
# packed [prompt_lens, prompt_ids, response_lens, response_ids, tokens, rows, non_tensors, meta_info]: a
# RaggedBatch in schema 3. Arrays are flat array headers (bins); tokens and rows map names to
# them, non_tensors as in schemas/payload.py's EXT_DATAPROTO.
EXT_RAGGED_BATCH_3 = 7


class BinLimits(Protocol):
    """The decode limit the legacy decoders read."""

    @property
    def max_bin_len(self) -> int:
        """Most bytes of one inline array."""
        ...


class Unpacking(Protocol):
    """What the legacy ext decoders need of the codec's unpacker (schemas/payload.py `Unpacker`)."""

    @property
    def limits(self) -> BinLimits:
        """The decode limits."""
        ...

    def unpack_list(self, data: bytes, size: int, what: str) -> list[Any]:
        """Unpack an ext body that must be a list of `size` items."""
        ...

    def parts(self, tensors: Any, non_tensors: Any, meta_info: Any, what: str) -> tuple[dict[str, Any], ...]:
        """(tensors, non_tensors, meta_info) maps with their arrays decoded."""
        ...

    def field(self, ref: Any) -> Any:
        """The raw bytes of an out-of-band field (or inline bytes as given)."""
        ...


def _compact_batch(u: Unpacking, data: bytes) -> RaggedBatch:
    """A RaggedBatch from an EXT_COMPACT_BATCH body (schema 2)."""
    layout, tensors, non_tensors, meta_info = u.unpack_list(data, 4, "compact batch")
    return from_compact(layout, *u.parts(tensors, non_tensors, meta_info, "compact batch"))


def _flat(u: Unpacking, value: Any, name: str) -> np.ndarray:
    """One array of a ragged batch from its flat header bin (or an older array ExtType, already
    decoded)."""
    if type(value) is bytes:
        value = array_from_flat(value, u.field, u.limits.max_bin_len)
    if not isinstance(value, np.ndarray):
        raise DecodeError(f"ragged batch: {name} is {type(value).__name__}, not an array")
    return value


def _ragged_batch_3(u: Unpacking, data: bytes) -> RaggedBatch:
    """A RaggedBatch from an EXT_RAGGED_BATCH_3 body; its sizes are checked against its lengths."""
    plen, prompt, rlen, resp, tokens, rows, non_tensors, meta_info = u.unpack_list(data, 8, "ragged batch")
    if not (type(tokens) is dict and type(rows) is dict):
        raise DecodeError("malformed ragged batch ext: tokens and rows must be maps")
    tokens = {key: _flat(u, value, f"tokens[{key!r}]") for key, value in tokens.items()}
    rows, non_tensors, meta_info = u.parts(rows, non_tensors, meta_info, "ragged batch")
    return RaggedBatch(
        _flat(u, prompt, "prompt_ids"),
        _flat(u, plen, "prompt_lens"),
        _flat(u, resp, "response_ids"),
        _flat(u, rlen, "response_lens"),
        tokens,
        rows,
        non_tensors,
        meta_info,
    )


#: Ext type code -> its decoder, for the codes only older encoders wrote.
LEGACY_EXTS: dict[int, Callable[[Unpacking, bytes], Any]] = {
    EXT_COMPACT_BATCH: _compact_batch,
    EXT_RAGGED_BATCH_3: _ragged_batch_3,
}


# --- schema upgrades --------------------------------------------------------------------------------

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


# --- the rollout batches of schemas 1 and 2, read into the ragged form ------------------------------


def _total(lens: np.ndarray) -> int:
    """Sum of lengths as a Python int (no wrap-around)."""
    return sum(lens.tolist())


def from_padded(batch: DataProto) -> RaggedBatch:
    """The ragged form of a padded verl batch (schema 1): `responses` [n, R] with `input_ids` /
    `attention_mask` [n, P+R] (a left-padded prompt, a right-padded response; `prompts` when input_ids is
    absent; no attention mask = nothing padded); [n, R] arrays become per-token arrays (their attended
    values), 1-d ones per-row arrays; [n, P+R] arrays other than ids and mask (position_ids) are dropped."""
    t = batch.tensors
    responses = t.get("responses")
    if not isinstance(responses, np.ndarray) or responses.ndim != 2:
        raise ValueError(f"a padded batch needs 2-d responses, got {describe(responses)}")
    n, R = responses.shape
    ids = t.get("input_ids")
    prompts = (
        ids[:, : ids.shape[1] - R] if isinstance(ids, np.ndarray) and ids.ndim == 2 else t.get("prompts")
    )
    if not isinstance(prompts, np.ndarray) or prompts.ndim != 2 or prompts.shape[0] != n:
        raise ValueError(
            f"a padded batch needs input_ids or prompts with n={n} rows, got {describe(prompts)}"
        )
    P = prompts.shape[1]
    plen, rlen = _padded_lengths(t.get("attention_mask"), n, P, R)
    pbits = np.arange(P)[None, :] >= (P - plen)[:, None]  # [n, P]
    rbits = np.arange(R)[None, :] < rlen[:, None]  # [n, R]
    id_dt = ids.dtype if isinstance(ids, np.ndarray) else prompts.dtype
    tokens, rows = _padded_tensors(t, rbits, P, R)
    if RESPONSE_MASK in tokens and bool((tokens[RESPONSE_MASK] == 1).all()):
        del tokens[RESPONSE_MASK]  # every attended token generated: the lengths say it
    prompt_rows = prompts[pbits]
    if (
        n > 1
        and bool((plen == plen[0]).all())
        and bool((prompt_rows.reshape(n, -1) == prompt_rows[: plen[0]]).all())
    ):
        prompt_ids, prompt_lens = prompt_rows[: int(plen[0])], plen[:1]
    else:
        prompt_ids, prompt_lens = prompt_rows, plen
    return RaggedBatch(
        prompt_ids=np.ascontiguousarray(prompt_ids, dtype=id_dt),
        prompt_lens=np.ascontiguousarray(prompt_lens, dtype=np.int32),
        response_ids=np.ascontiguousarray(responses[rbits], dtype=id_dt),
        response_lens=rlen,
        tokens=tokens,
        rows=rows,
        non_tensors=dict(batch.non_tensors),
        meta_info=dict(batch.meta_info),
    )


def _padded_lengths(mask: Any, n: int, P: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, response lengths) [n] int32 of a padded batch from its attention mask [n, P+R] (None:
    nothing padded), which must be a left-padded prompt and a right-padded response on every row."""
    if mask is None:
        return np.full(n, P, np.int32), np.full(n, R, np.int32)
    if not isinstance(mask, np.ndarray) or mask.shape != (n, P + R):
        raise ValueError(f"attention_mask is {describe(mask)}, expected [{n}, {P + R}]")
    plen = np.count_nonzero(mask[:, :P], axis=1).astype(np.int32)
    rlen = np.count_nonzero(mask[:, P:], axis=1).astype(np.int32)
    bits = np.zeros((n, P + R), bool)
    for i, (p, r) in enumerate(zip(plen.tolist(), rlen.tolist(), strict=True)):
        bits[i, P - p : P + r] = True
    if not bool((mask == bits).all()):
        raise ValueError(
            "attention_mask is not a left-padded prompt and a right-padded response on every row"
        )
    return plen, rlen


def _padded_tensors(
    t: dict[str, np.ndarray], rbits: np.ndarray, P: int, R: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(per-token arrays: the attended values of [n, R] tensors, per-row arrays: 1-d and other-width ones) of
    a padded batch's tensors other than ids, mask, prompts and responses; [n, P+R] ones are dropped."""
    tokens: dict[str, np.ndarray] = {}
    rows: dict[str, np.ndarray] = {}
    for key, arr in t.items():
        if key in ("input_ids", "attention_mask", "prompts", "responses"):
            continue
        if arr.ndim == 2 and arr.shape[1] == R and key != "position_ids":
            tokens[key] = np.ascontiguousarray(arr[rbits])
        elif arr.ndim == 2 and arr.shape[1] == P + R:
            continue
        elif arr.ndim == 1 or (arr.ndim >= 2 and arr.shape[1] not in (R, P + R)):
            rows[key] = arr
        else:
            raise ValueError(f"tensor {key!r} of shape {list(arr.shape)} fits neither P={P} nor R={R}")
    return tokens, rows


def _layout_int(layout: dict[str, Any], name: str, most: int) -> int:
    """An int field of a schema-2 layout within [0, most]."""
    value = layout.get(name)
    if type(value) is not int or not 0 <= value <= most:
        raise ValueError(f"compact batch: {name}={value!r:.40} is not an int in [0, {most}]")
    return value


def _layout_vector(layout: dict[str, Any], name: str, size: int | None, kinds: str) -> np.ndarray:
    """A 1-d array field of a schema-2 layout (of `size` values when given) of one of the kinds."""
    arr = layout.get(name)
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in kinds:
        raise ValueError(f"compact batch: {name} is {describe(arr)}, not a 1-d array of kinds {kinds!r}")
    if size is not None and arr.size != size:
        raise ValueError(f"compact batch: {name} has {arr.size} values, expected {size}")
    return arr


def _compact_mask(spec: Any, n_resp: int) -> np.ndarray | None:
    """A schema-2 layout's response mask, [dtype, bits or nil], as one 0/1 value per response token (None:
    absent, or nil bits = every token generated)."""
    if spec is None:
        return None
    if type(spec) is not list or len(spec) != 2:
        raise ValueError(f"compact batch: {RESPONSE_MASK} must be [dtype, bits or nil], got {spec!r:.40}")
    bits = spec[1]
    if bits is None:
        return None
    size = math.ceil(n_resp / 8)
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint8 or bits.ndim != 1 or bits.size != size:
        raise ValueError(f"compact batch: {RESPONSE_MASK} bits must be {size} uint8 bytes")
    return np.unpackbits(bits, count=n_resp)


def from_compact(
    layout: Any, rest: dict[str, np.ndarray], non_tensors: dict[str, np.ndarray], meta_info: dict[str, Any]
) -> RaggedBatch:
    """The ragged form of a schema-2 compact batch: its layout (lengths, the prompt once or per row, the
    attended response tokens, log-probs and mask bits) is ragged already; [n, R] rest tensors
    (token_level_scores) keep their attended values, 1-d ones are per-row arrays."""
    if type(layout) is not dict:
        raise ValueError(f"compact batch: layout is {type(layout).__name__}, not a map")
    n = _layout_int(layout, "n", 1 << 31)
    P = _layout_int(layout, "P", 1 << 40)
    R = _layout_int(layout, "R", 1 << 40)
    plen = _layout_vector(layout, "plen", n, ID_KINDS)
    rlen = _layout_vector(layout, "rlen", n, ID_KINDS)
    check_lengths(plen, "compact batch: plen", n)
    check_lengths(rlen, "compact batch: rlen", n)
    if rlen.size and int(rlen.max()) > R:
        raise ValueError(f"compact batch: rlen holds {int(rlen.max())}, over R={R}")
    shared = layout.get("shared")
    if type(shared) is not bool or (shared and n and not bool((plen == plen[0]).all())):
        raise ValueError(f"compact batch: shared={shared!r:.40} with prompt lengths {plen[:8].tolist()}")
    n_resp = _total(rlen)
    prompt_lens = plen[:1] if shared and n else plen
    prompt = _layout_vector(layout, "prompt", _total(prompt_lens), ID_KINDS)
    resp = _layout_vector(layout, "resp", n_resp, ID_KINDS)
    tokens: dict[str, np.ndarray] = {}
    mask = _compact_mask(layout.get(RESPONSE_MASK), n_resp)
    if mask is not None:
        tokens[RESPONSE_MASK] = mask
    if LOG_PROBS in layout:
        tokens[LOG_PROBS] = _layout_vector(layout, LOG_PROBS, n_resp, "f")
    rbits: np.ndarray | None = None
    rows: dict[str, np.ndarray] = {}
    for key, arr in rest.items():
        if not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
            raise ValueError(f"compact batch: tensor {key!r} is {describe(arr)}")
        if key in ("input_ids", "attention_mask", "responses", "prompts") or key in tokens:
            raise ValueError(f"compact batch: tensor {key!r} is both in the layout and in the rest")
        if arr.ndim == 2 and arr.shape == (n, R):
            if rbits is None:
                rbits = np.arange(R)[None, :] < rlen[:, None]
            tokens[key] = np.ascontiguousarray(arr[rbits])
        elif arr.ndim == 2 and arr.shape == (n, P + R):
            continue  # (position_ids: derived from the lengths)
        elif arr.ndim >= 1 and arr.shape[0] == n:
            rows[key] = arr
        else:
            raise ValueError(f"compact batch: tensor {key!r} of shape {list(arr.shape)} fits no row layout")
    return RaggedBatch(
        prompt_ids=prompt,
        prompt_lens=prompt_lens,
        response_ids=resp,
        response_lens=rlen,
        tokens=tokens,
        rows=rows,
        non_tensors=non_tensors,
        meta_info=meta_info,
    )
