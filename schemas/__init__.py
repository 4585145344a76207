"""rollstream's wire contract: event models, the DataProto and ragged batches, the one msgpack codec, and the
plain-text entries (fates, dispatch logs, producer cursors).

Importing this package never imports torch or redis.
"""

from schemas.batch import DataProto
from schemas.codec import (
    DEFAULT_LIMITS,
    INLINE_MAX_BYTES,
    Fields,
    Limits,
    decode,
    decode_as,
    decode_payload,
    encode,
    encode_payload,
)
from schemas.errors import DecodeError
from schemas.events import (
    DEAD_COPY_MAX_BYTES,
    DEAD_FIELD_KEEP_BYTES,
    EVENT_MODELS,
    DeadLetter,
    Event,
    EventBase,
    ParamVersion,
    ProducerStats,
    RolloutSample,
    StepMetrics,
    SyncStepRecord,
    ValidateMetrics,
    dead_letter_of,
)
from schemas.ragged import RaggedBatch
from schemas.text_entries import (
    DROPPED,
    EVICTED,
    FILTER_GROUPS,
    ROLLOUT_FAILURE,
    SKIPPED,
    TRAINED,
    DispatchRecord,
    Fate,
    decode_cursor,
    decode_dispatch,
    decode_fate,
    encode_cursor,
    encode_fate,
)

__all__ = [
    "DEAD_COPY_MAX_BYTES",
    "DEAD_FIELD_KEEP_BYTES",
    "DEFAULT_LIMITS",
    "DROPPED",
    "EVICTED",
    "SKIPPED",
    "FILTER_GROUPS",
    "EVENT_MODELS",
    "INLINE_MAX_BYTES",
    "DataProto",
    "DeadLetter",
    "DecodeError",
    "DispatchRecord",
    "Event",
    "EventBase",
    "Fate",
    "Limits",
    "ParamVersion",
    "ROLLOUT_FAILURE",
    "ProducerStats",
    "RaggedBatch",
    "RolloutSample",
    "StepMetrics",
    "SyncStepRecord",
    "TRAINED",
    "ValidateMetrics",
    "Fields",
    "dead_letter_of",
    "decode",
    "decode_as",
    "decode_cursor",
    "decode_dispatch",
    "decode_fate",
    "decode_payload",
    "encode",
    "encode_cursor",
    "encode_fate",
    "encode_payload",
]
