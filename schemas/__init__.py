"""rollstream's wire contract: event models, the DataProto batch, and the one msgpack codec.

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
)
from schemas.upgrades import register_upgrade, unregister_upgrade

__all__ = [
    "DEFAULT_LIMITS",
    "EVENT_MODELS",
    "INLINE_MAX_BYTES",
    "DataProto",
    "DeadLetter",
    "DecodeError",
    "Event",
    "EventBase",
    "Limits",
    "ParamVersion",
    "ProducerStats",
    "RolloutSample",
    "StepMetrics",
    "SyncStepRecord",
    "ValidateMetrics",
    "Fields",
    "decode",
    "decode_as",
    "decode_payload",
    "encode",
    "encode_payload",
    "register_upgrade",
    "unregister_upgrade",
]
