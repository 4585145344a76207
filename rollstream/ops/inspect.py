"""`rollstream inspect` / `tail`: any stream entry as readable JSON — arrays summarised unless full,
rollout tokens decoded to text with the run's tokenizer, dead letters with their original entry. `inspect`
reads the whole log (an archived entry as well as one in Redis); `tail` shows and follows Redis."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np
import redis

from rollstream.bus import iter_stream, text
from rollstream.bus.streams import PAGE
from rollstream.config import PipelineConfig
from rollstream.keys import ROLLOUTS, STATS, Keys
from rollstream.model import CharTokenizer, Tokenizer
from schemas import DataProto, DeadLetter, DecodeError, RolloutSample, decode
from schemas.ragged import RESPONSE_MASK, RaggedBatch

#: Short stream names an operator types (besides each producer's `rollouts:<name>` and `stats:<name>`).
STREAM_NAMES = (
    "metrics",
    "records",
    "params",
    "dead",
    "dead:aggregator",
    "fates",
    "dispatch_log",
)
#: Values shown of an array in summary mode.
FIRST_VALUES = 8
_ID = re.compile(r"^(-\d+|\d+(-\d+)?)$")
_ARRAY_FIELD = re.compile(r"^a\d+$")


class InspectError(ValueError):
    """Unknown stream or entry."""


def stream_key(keys: Keys, short: str) -> str:
    """The Redis key of a short stream name: one of STREAM_NAMES, or a producer's `rollouts:<name>` or
    `stats:<name>`."""
    kind, _, producer = short.partition(":")
    if kind in (ROLLOUTS, STATS):
        if not producer:
            raise InspectError(f"name the producer: {kind}:<producer> (e.g. {kind}:rollout_00)")
        return keys.rollouts_of(producer) if kind == ROLLOUTS else keys.stats_of(producer)
    if short not in STREAM_NAMES:
        raise InspectError(
            f"unknown stream {short!r} (one of {', '.join(STREAM_NAMES)}, rollouts:<producer>, "
            "stats:<producer>)"
        )
    return str(getattr(keys, short.replace(":", "_")))


def looks_like_id(text: str) -> bool:
    """True for an entry id (1700000000000-0, 7 for records step 7) or -N (the Nth entry from the end)."""
    return bool(_ID.match(text))


def tokenizer_for(cfg: PipelineConfig) -> Tokenizer | None:
    """The run's tokenizer: CharTokenizer for the tiny backend, the HF one for backend=hf (None if absent)."""
    if cfg.model.backend == "tiny":
        return CharTokenizer()
    try:
        from transformers import AutoTokenizer

        from rollstream.model.hf import HFTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(cfg.model.hf_path), cfg.model.chat_template,
                           cfg.model.system_prompt)
    except Exception:  # noqa: BLE001 - inspect still works without text
        return None


def _number(x: Any) -> float | int:
    value = x.item() if isinstance(x, np.generic) else x
    return value if isinstance(value, int) else round(float(value), 6)


def summarise_array(arr: np.ndarray) -> dict[str, Any]:
    """dtype, shape, min/max/mean (numeric) and the first values."""
    out: dict[str, Any] = {"dtype": str(arr.dtype), "shape": list(arr.shape)}
    flat = arr.reshape(-1)
    if arr.dtype.kind in "biuf" and flat.size:
        out.update(min=_number(flat.min()), max=_number(flat.max()), mean=round(float(flat.mean()), 6))
    out["first"] = [
        _number(v) if arr.dtype.kind in "biuf" else jsonable(v, full=True) for v in flat[:FIRST_VALUES]
    ]
    return out


def jsonable(value: Any, full: bool = False) -> Any:
    """Plain JSON data of a decoded value: arrays summarised (or listed when full), bytes as text or hex."""
    if isinstance(value, DataProto):
        return {
            "tensors": {k: jsonable(v, full) for k, v in value.tensors.items()},
            "non_tensors": {k: jsonable(v, full) for k, v in value.non_tensors.items()},
            "meta_info": jsonable(value.meta_info, full),
        }
    if isinstance(value, RaggedBatch):
        arrays = {
            "prompt_lens": value.prompt_lens,
            "prompt_ids": value.prompt_ids,
            "response_lens": value.response_lens,
            "response_ids": value.response_ids,
        }
        return {
            **{k: jsonable(v, full) for k, v in arrays.items()},
            "tokens": {k: jsonable(v, full) for k, v in value.tokens.items()},
            "rows": {k: jsonable(v, full) for k, v in value.rows.items()},
            "non_tensors": {k: jsonable(v, full) for k, v in value.non_tensors.items()},
            "meta_info": jsonable(value.meta_info, full),
        }
    if isinstance(value, np.ndarray):
        if full:
            return jsonable(value.tolist(), full)
        return summarise_array(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            decoded = raw.decode()
            if decoded.isprintable() and (full or len(decoded) <= 200):
                return decoded
        except UnicodeDecodeError:
            pass
        return {"bytes": len(raw), "hex": raw.hex() if full else raw[:32].hex()}
    if isinstance(value, Mapping):
        return {text(k): jsonable(v, full) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, full) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def response_turns(ids: list[int], mask: list[int], tok: Tokenizer) -> list[dict[str, Any]]:
    """A response as its turns: each run of tokens the model wrote (`response_mask` 1: trained) or the tool
    turn between them (0: not trained), decoded; the last model turn holds the final answer."""
    turns: list[dict[str, Any]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            trained = bool(mask[start])
            turns.append({"role": "model" if trained else "tool", "trained": trained,
                          "text": tok.decode(ids[start:k])})
            start = k
    return turns


def decode_texts(sample: RolloutSample, tok: Tokenizer) -> list[dict[str, Any]]:
    """Per trajectory: prompt and response text (pad/bos/eos dropped), reward when present; a multi-turn
    response (tool tokens in it: `response_mask` 0) also as its `turns` (`response_turns`)."""
    b = sample.full_batch
    rewards = b.rows.get("rewards")
    mask = b.tokens.get(RESPONSE_MASK)
    po, ro, plen = b.prompt_offsets(), b.response_offsets(), b.row_prompt_lens()
    out = []
    for i in range(len(b)):
        ids = b.response_ids[ro[i] : ro[i + 1]].tolist()
        row: dict[str, Any] = {
            "prompt": tok.decode(b.prompt_ids[po[i] : po[i] + plen[i]].tolist()),
            "response": tok.decode(ids),
        }
        if mask is not None and not mask[ro[i] : ro[i + 1]].all():
            row["turns"] = response_turns(ids, mask[ro[i] : ro[i + 1]].tolist(), tok)
        if rewards is not None:
            row["reward"] = _number(rewards[i])
        out.append(row)
    return out


def entry_to_json(
    stream: str, entry_id: str, fields: Mapping[bytes, Any], tok: Tokenizer | None = None, full: bool = False
) -> dict[str, Any]:
    """One entry as JSON data: its id, readable header fields, and the decoded event (or raw fields for
    entries that are not events, such as fates and dispatch_log)."""
    header = {
        text(k): text(v)
        for k, v in fields.items()
        if text(k) != "payload" and not _ARRAY_FIELD.match(text(k))
    }
    out: dict[str, Any] = {"stream": stream, "id": entry_id}
    if b"payload" not in fields:
        out["fields"] = {text(k): jsonable(v, full) for k, v in fields.items()}
        return out
    out["header"] = header
    try:
        event = decode(fields)
    except DecodeError as e:
        out["decode_error"] = str(e)
        return out
    if isinstance(event, RolloutSample) and tok is not None:
        out["text"] = decode_texts(event, tok)
    body = {name: getattr(event, name) for name in type(event).model_fields}
    out["event"] = jsonable(body, full)
    if isinstance(event, DeadLetter):
        out["original"] = _original(event, tok, full)
    return out


def _original(dl: DeadLetter, tok: Tokenizer | None, full: bool) -> dict[str, Any]:
    if dl.omitted:  # a bounded copy of an oversize entry: its header is in `event.fields`
        return {"omitted_bytes": dict(dl.omitted), "sha256": dl.sha256}
    try:
        event = decode(dl.fields)
    except DecodeError as e:
        return {"decode_error": str(e)}
    body: dict[str, Any] = {"event": jsonable({n: getattr(event, n) for n in type(event).model_fields}, full)}
    if isinstance(event, RolloutSample) and tok is not None:
        body["text"] = decode_texts(event, tok)
    return body


def read_entry(r: redis.Redis, key: str, which: str = "-1") -> tuple[str, Mapping[bytes, Any]]:
    """One entry of a stream's log (archive or Redis): by id (a bare number N means the first entry of
    millisecond N, so records step 7 is `7`), or -N for the Nth from the end. InspectError when there is
    none."""
    if not looks_like_id(which):
        raise InspectError(f"{which!r} is not an entry id or -N")
    if which.startswith("-"):
        n = int(which[1:])
        if n < 1:
            raise InspectError("-N counts from 1 (-1 = the last entry)")
        rows = list(islice(iter_stream(r, key, reverse=True, page=min(n, PAGE)), n))
        if len(rows) < n:
            raise InspectError(f"{key} has only {len(rows)} entries")
        return rows[-1]
    end = which if "-" in which else f"{which}-18446744073709551615"
    row = next(iter_stream(r, key, which, end, page=1), None)
    if row is None:
        raise InspectError(f"no entry {which} in {key}")
    return row


def follow(
    r: redis.Redis,
    key: str,
    count: int = 5,
    block_ms: int = 1000,
    stop: threading.Event | None = None,
) -> Iterator[tuple[str, Mapping[bytes, Any]]]:
    """The last `count` entries of the log (archive or Redis), then each new one as it arrives (XREAD BLOCK)
    until stop is set."""
    last = "$"
    if count > 0:
        rows = list(islice(iter_stream(r, key, reverse=True, page=min(count, PAGE)), count))
        for entry_id, fields in reversed(rows):
            last = text(entry_id)
            yield last, fields
    if last == "$":
        tail: Any = r.xrevrange(key, count=1)
        last = text(tail[0][0]) if tail else "0-0"
    while stop is None or not stop.is_set():
        got: Any = r.xread({key: last}, count=100, block=block_ms)
        for _, entries in got or []:
            for entry_id, fields in entries:
                last = text(entry_id)
                yield last, fields


def dumps(data: Any, pretty: bool = True, indent: int = 0) -> str:
    """JSON text of an entry: indented with short lists of scalars kept on one line, or one line (tail)."""
    if not pretty:
        return json.dumps(data, ensure_ascii=False, default=str)
    pad, inner = "  " * indent, "  " * (indent + 1)
    flat = json.dumps(data, ensure_ascii=False, default=str)
    if (
        isinstance(data, dict)
        and data
        and (len(flat) > 100 or any(isinstance(v, dict | list) for v in data.values()))
    ):
        items = [
            f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {dumps(v, True, indent + 1)}"
            for k, v in data.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(data, list) and data and any(isinstance(v, dict | list) for v in data):
        return "[\n" + ",\n".join(f"{inner}{dumps(v, True, indent + 1)}" for v in data) + f"\n{pad}]"
    return flat


def print_entries(
    entries: Iterator[tuple[str, Mapping[bytes, Any]]],
    stream: str,
    tok: Tokenizer | None,
    write: Callable[[str], Any],
    full: bool = False,
    limit: int | None = None,
) -> int:
    """Write each entry as one JSON line; stop after `limit` entries; returns how many were written."""
    n = 0
    for entry_id, fields in entries:
        write(dumps(entry_to_json(stream, entry_id, fields, tok, full), pretty=False) + "\n")
        n += 1
        if limit is not None and n >= limit:
            break
    return n
