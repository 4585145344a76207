"""The events on the log: pydantic v2 models with a `type` discriminator and a schema version."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.ragged import LOG_PROBS, TOKEN_SCORES, RaggedBatch

HeaderValue = str | int | float


class EventBase(BaseModel):
    """Common fields: `type` (set by each subclass), `schema_version`, `created_at` (unix seconds)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    SCHEMA: ClassVar[int] = 1
    # Names of fields copied, in this order, into the human-readable XADD header (after type, schema).
    HEADER: ClassVar[tuple[str, ...]] = ()
    # Header fields older encoders wrote that this one no longer does: where an entry has one, decode still
    # holds it to the payload's value (a `tokens` field renders num_tokens).
    OLD_HEADER: ClassVar[tuple[str, ...]] = ()

    type: str
    schema_version: int = 1
    created_at: float = Field(default_factory=time.time)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, when the class is made, a subclass whose schema_version does not default to its SCHEMA (one
        that bumps SCHEMA declares `schema_version: int = SCHEMA`): an event built without a schema_version
        gets the current one, with no validator run on every event."""
        super().__pydantic_init_subclass__(**kwargs)
        default = cls.model_fields["schema_version"].default
        if default != cls.SCHEMA:
            raise TypeError(
                f"{cls.__name__}.SCHEMA is {cls.SCHEMA} but schema_version defaults to {default!r}: declare "
                "`schema_version: int = SCHEMA` in its body"
            )

    @model_validator(mode="after")
    def _check_schema(self) -> EventBase:
        """Only the current schema version is a valid model; older ones are upgraded by the codec."""
        if self.schema_version != self.SCHEMA:
            raise ValueError(f"schema_version {self.schema_version} != current {self.SCHEMA}")
        return self

    def header(self) -> dict[str, HeaderValue]:
        """Human-readable header values for the XADD entry (informational; the payload is authoritative)."""
        return {name: getattr(self, name) for name in self.HEADER}


#: check_finite looks at a 1-d float array of at most this many values one value at a time.
SMALL_FINITE = 32


def check_finite(arrays: Sequence[tuple[np.ndarray | None, str]]) -> None:
    """Raise ValueError naming the first float (or complex) array that holds NaN or inf; None and other kinds
    pass. A 1-d float array of at most SMALL_FINITE values (the rewards) is looked at value by value in
    Python (cheaper than any numpy call at that size). Any other takes one pass: numpy's vdot of the array
    with itself (BLAS for float32/float64), a sum of squared magnitudes, is finite only when every value is
    (NaN and inf stay NaN or inf, no two terms cancel); only a result that is not, NaN/inf or an overflow of
    huge finite values, is looked at closer. vdot, unlike dot, raises no floating-point warning on that
    overflow, so no np.errstate is needed (it costs as much as the dot of a few thousand values);
    tests/test_schemas_flat.py holds it to that with warnings as errors."""
    for arr, what in arrays:
        if arr is None or arr.dtype.kind not in "fc":
            continue
        if arr.size <= SMALL_FINITE and arr.ndim == 1 and arr.dtype.kind == "f":
            if not all(map(math.isfinite, arr.tolist())):  # a few values (rewards): cheaper than a numpy call
                raise ValueError(f"{what} contains NaN/inf")
        elif not math.isfinite(np.vdot(arr, arr).real) and np.count_nonzero(np.isfinite(arr)) != arr.size:
            raise ValueError(f"{what} contains NaN/inf")


# RolloutSample's lists with one entry per trajectory, in the order _check_rollout reports them.
PER_TRAJECTORY_LISTS = (
    "agent_loop_output_list",
    "processing_times",
    "param_version_start",
    "param_version_end",
)


class RolloutSample(EventBase):
    """One prompt's group of n trajectories, as a producer publishes it (verl's RolloutSample)."""

    # 5: the batch's parts right in the payload (no ext); 4 (the same parts in an ext: lengths as int lists,
    # 1-d arrays as [dtype code, data]), 3 (the batch ragged, a flat header per array), 2 (compact layout)
    # and 1 (padded DataProto) still decode
    SCHEMA: ClassVar[int] = 5
    # the facts an operator looks up (`rollstream audit` reads these three); epoch, n and tokens were header
    # fields up to main at b0225e4 (they cost a field each on every entry, and no reader used them)
    HEADER: ClassVar[tuple[str, ...]] = ("sample_id", "param_version", "producer")
    OLD_HEADER: ClassVar[tuple[str, ...]] = ("epoch", "n", "num_tokens")

    type: Literal["rollout"] = "rollout"
    schema_version: int = SCHEMA
    sample_id: str
    epoch: int = Field(ge=0)
    param_version: int = Field(ge=0)
    full_batch: RaggedBatch
    agent_loop_output_list: list[dict[str, Any]]
    processing_times: list[float]
    # per trajectory: total tool seconds ([] = no tools)
    tool_calls: list[float] = Field(default_factory=list)
    param_version_start: list[int]
    param_version_end: list[int]
    rollout_status: dict[str, float | int] = Field(default_factory=dict)
    producer: str

    @model_validator(mode="after")
    def _check_rollout(self) -> RolloutSample:
        """Per-trajectory lists match the batch; versions ordered; log-probs and rewards finite (the batch's
        sizes were checked against its lengths when it was built)."""
        n = len(self.full_batch)
        if n < 1:
            raise ValueError("full_batch has no trajectories")
        starts, ends = self.param_version_start, self.param_version_end
        lengths = (len(self.agent_loop_output_list), len(self.processing_times), len(starts), len(ends))
        if lengths != (n, n, n, n):
            for name, got in zip(PER_TRAJECTORY_LISTS, lengths, strict=True):
                if got != n:
                    raise ValueError(f"{name} has {got} entries, full_batch has {n}")
        if self.tool_calls and len(self.tool_calls) != n:
            raise ValueError(
                f"tool_calls has {len(self.tool_calls)} entries (one per trajectory or none), full_batch has "
                f"{n}"
            )
        if starts != ends:  # equal lists (the usual case: no swap mid-generation) are ordered
            for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
                if start > end:
                    raise ValueError(f"param_version_start[{i}]={start} > param_version_end[{i}]={end}")
        tokens, rows = self.full_batch.tokens, self.full_batch.rows
        lp = tokens.get(LOG_PROBS)
        if lp is not None and lp.dtype.kind != "f":
            raise ValueError(f"{LOG_PROBS} must be float, got {lp.dtype}")
        check_finite(
            ((lp, LOG_PROBS), (tokens.get(TOKEN_SCORES), TOKEN_SCORES), (rows.get("rewards"), "rewards"))
        )
        return self

    @property
    def n(self) -> int:
        """Number of trajectories in the group."""
        return len(self.full_batch)

    @property
    def num_tokens(self) -> int:
        """Response tokens that count for the loss: the response_mask's sum, else every response token."""
        return self.full_batch.num_tokens()


class ParamVersion(EventBase):
    """A published policy version: where the weights are and how to check them."""

    HEADER: ClassVar[tuple[str, ...]] = ("version", "uri", "sha256", "bytes", "global_step")

    type: Literal["param_version"] = "param_version"
    version: int = Field(ge=0)
    uri: str
    sha256: str
    bytes: int = Field(ge=0)
    global_step: int
    # the swap check (rollstream/weights/fingerprint.py): a fixed probe sequence and the trainer's log-probs
    # of it under this version (empty: not checked, e.g. a version published before the check existed)
    probe_ids: list[int] = Field(default_factory=list, max_length=4096)
    probe_logprobs: list[float] = Field(default_factory=list, max_length=4096)


class StepMetrics(EventBase):
    """Trainer metrics of one local update (of one data-parallel rank), or the end of a global step
    (`step_end`)."""

    SCHEMA: ClassVar[int] = 2  # 2: rank and world_size (data-parallel trainer); 1 decodes as rank 0 of 1
    HEADER: ClassVar[tuple[str, ...]] = ("global_step", "local_step", "sample_count", "rank")

    type: Literal["local_update", "step_end"]
    schema_version: int = SCHEMA
    global_step: int
    local_step: int
    sample_count: int
    num_local_updates: int = 0
    rank: int = Field(0, ge=0)  # the trainer rank that emitted it (step_end: rank 0)
    # step_end: ranks whose num_local_updates local updates complete the step
    world_size: int = Field(1, ge=1)
    metrics: dict[str, float] = Field(default_factory=dict)
    # dict-valued metrics, {name: {key: count}} (verl's `_dapo_filtered_reward_counts`: reward value ->
    # groups)
    counts: dict[str, dict[str, float]] = Field(default_factory=dict)


class SyncStepRecord(EventBase):
    """Metrics of one global (sync) step, folded from its local updates by the aggregator."""

    HEADER: ClassVar[tuple[str, ...]] = ("global_step", "num_local_updates")

    type: Literal["record"] = "record"
    global_step: int
    num_local_updates: int
    metrics: dict[str, float] = Field(default_factory=dict)
    # dict metrics, merged (MetricsAggregator)
    counts: dict[str, dict[str, float]] = Field(default_factory=dict)
    source_ids: list[str] = Field(default_factory=list)


class ValidateMetrics(EventBase):
    """Validation metrics of one param version."""

    HEADER: ClassVar[tuple[str, ...]] = ("param_version", "global_step")

    type: Literal["validation"] = "validation"
    param_version: int
    global_step: int
    metrics: dict[str, float] = Field(default_factory=dict)


class ProducerStats(EventBase):
    """Periodic statistics of one rollout producer."""

    HEADER: ClassVar[tuple[str, ...]] = ("producer", "param_version", "samples", "tokens")

    type: Literal["producer"] = "producer"
    producer: str
    param_version: int
    samples: int
    tokens: int
    gen_tokens_per_s: float
    idle_ratio: float
    versions_in_use: list[int] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)


#: What a producer's sampled answers scored in a stats window (producers/stats.py writes them, the aggregator
#: copies them into the step records): the share exactly right and the mean reward, and each metric the task
#: scores an answer with under ANSWER_METRIC_PREFIX.
ANSWER_METRICS = ("producer/acc", "producer/reward_mean")
ANSWER_METRIC_PREFIX = "producer/reward/"
#: How long a stats window lasted, how much of it the producer spent generating and how much waiting (seconds;
#: producers/stats.py writes them in the window's metrics): the aggregator merges the windows of a step's span
#: with them (gen_tokens_per_s = tokens / generation seconds, idle_ratio = idle / window seconds).
WINDOW_S = "producer/window_s"
WINDOW_GEN_S = "producer/gen_s"
WINDOW_IDLE_S = "producer/idle_s"


#: A dead copy holds the original entry whole up to this many bytes (names and values together) ...
DEAD_COPY_MAX_BYTES = 1 << 20
#: ... and of a larger entry only the fields up to this size each (its readable header), while they fit
#: in DEAD_COPY_MAX_BYTES; the others are listed in `omitted` with their sizes, and `sha256` names the whole.
DEAD_FIELD_KEEP_BYTES = 4096


class DeadLetter(EventBase):
    """An entry that failed to decode or handle: where it came from, why, and its original fields (bounded:
    see `dead_letter_of`)."""

    SCHEMA: ClassVar[int] = 2  # 2: omitted + sha256 (a bounded copy); 1 decodes as a whole copy
    HEADER: ClassVar[tuple[str, ...]] = ("source", "source_id", "reason")

    type: Literal["dead"] = "dead"
    schema_version: int = SCHEMA
    source: str
    source_id: str
    reason: str
    fields: dict[str, bytes] = Field(default_factory=dict)
    omitted: dict[str, int] = Field(default_factory=dict)  # field -> bytes of a value left out of the copy
    sha256: str = ""  # of the whole original entry (each name and value length-prefixed, in order)


#: Reasons (each a dead letter's reason prefix, before ': ') that refuse a copy of a sample id without
#: ending the id: its seq was not leased when the copy came ("outside lease"), the trainer had taken it back
#: ("lease expired": the expiry ended it), or the id had already ended by a dead letter ("already ended").
#: Any other dead-lettered rollout ends its id; the audit counts a refused copy as the id's end only when the
#: id has no other (rollstream/ops/audit.py).
OUTSIDE_LEASE, LEASE_EXPIRED, ALREADY_ENDED = "outside lease", "lease expired", "already ended"
REFUSED_COPY_REASONS: tuple[str, ...] = (OUTSIDE_LEASE, LEASE_EXPIRED, ALREADY_ENDED)


def refused_copy(reason: str) -> str | None:
    """The refusal a dead letter's reason names (one of REFUSED_COPY_REASONS), or None when the dead letter
    ends its sample id."""
    head = reason.split(":", 1)[0]
    return head if head in REFUSED_COPY_REASONS else None


def entry_digest(fields: dict[str, bytes]) -> str:
    """sha256 hex of an entry: each name and value as an 8-byte little-endian length and its bytes, in
    order."""
    h = hashlib.sha256()
    for name, value in fields.items():
        for part in (name.encode(), value):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def dead_letter_of(source: str, source_id: str, reason: str, fields: dict[str, bytes]) -> DeadLetter:
    """The dead copy of an entry: whole up to DEAD_COPY_MAX_BYTES; beyond, its fields up to
    DEAD_FIELD_KEEP_BYTES each (first come, while the copy stays under DEAD_COPY_MAX_BYTES), the sizes of the
    others and the digest of the whole, never the payload."""
    total = sum(len(k) + len(v) for k, v in fields.items())
    if total <= DEAD_COPY_MAX_BYTES:
        return DeadLetter(
            source=source, source_id=source_id, reason=reason, fields=fields, sha256=entry_digest(fields)
        )
    kept: dict[str, bytes] = {}
    omitted: dict[str, int] = {}
    used = 0
    for name, value in fields.items():
        if len(value) <= DEAD_FIELD_KEEP_BYTES and used + len(name) + len(value) <= DEAD_COPY_MAX_BYTES:
            kept[name] = value
            used += len(name) + len(value)
        else:
            omitted[name] = len(value)
    return DeadLetter(source=source, source_id=source_id, reason=reason, fields=kept, omitted=omitted,
                      sha256=entry_digest(fields))


Event = Annotated[
    RolloutSample
    | ParamVersion
    | StepMetrics
    | SyncStepRecord
    | ValidateMetrics
    | ProducerStats
    | DeadLetter,
    Field(discriminator="type"),
]

EVENT_MODELS: dict[str, type[EventBase]] = {
    "rollout": RolloutSample,
    "param_version": ParamVersion,
    "local_update": StepMetrics,
    "step_end": StepMetrics,
    "record": SyncStepRecord,
    "validation": ValidateMetrics,
    "producer": ProducerStats,
    "dead": DeadLetter,
}
