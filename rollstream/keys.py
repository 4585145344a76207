"""Every Redis key of a run, built from the run name, and the fields of the `trainer` hash. No other module
writes a key string or a trainer hash field (stream entry fields are defined in schemas/)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Kinds of per-producer stream: `rollouts:<producer>`, `stats:<producer>`.
ROLLOUTS = "rollouts"
STATS = "stats"

# Consumer groups.
TRAINER_GROUP = "trainer"
AGGREGATOR_GROUP = "aggregator"

# Fields of the `trainer` hash. The trainer writes them (its step commit, heartbeat and budget grants);
# committed_step and training_step bound what the aggregator accepts (consumers/aggregator/admission.py),
# budget_version is read by pacing (rollstream/pacing/: grants, leases, top-ups).
GLOBAL_STEP_FIELD = "global_step"  # last committed global step
PARAM_VERSION_FIELD = "param_version"  # the version published with that commit
COMMITTED_STEP_FIELD = "committed_step"  # last global step whose commit (with its step_end) executed
CONSUMED_STEP_FIELD = "consumed_step"  # last global step counted toward the `consumed` counter
TRAINING_STEP_FIELD = "training_step"  # highest global step the trainer has begun (never decreases)
HEARTBEAT_FIELD = "heartbeat"  # unix seconds of the trainer's last poll, local update or commit
PROGRESS_AT_FIELD = "progress_at"  # unix seconds the trainer (re)started or last completed a global step
BUDGET_VERSION_FIELD = "budget_version"  # the version whose dispatch budget is granted (pacing)
BUDGET_CAP_FIELD = "budget_cap"  # that grant's memory back-pressure cap on the budget left (-1: none)
DROPPED_STALE_FIELD = "dropped_stale"  # samples dropped as stale over the whole run (written in the commit)
REPLAYED_VERSIONS_FIELD = "replayed_versions"  # replay copies: the source had published versions up to this
# set on a replay copy (`rollstream replay trainer`): its rollouts were copied by an admin, not published
# under the pacing's leases, so the trainer does not check sample ids against leases (rollstream/pacing/)
REPLAY_COPY_FIELD = "replay_copy"
WORLD_SIZE_FIELD = "world_size"  # data-parallel trainer ranks (written by rank 0 at start)
#: Prefix of a data-parallel rank's own heartbeat field, `heartbeat:r<rank>` (rank 0 also writes `heartbeat`).
RANK_HEARTBEAT_PREFIX = "heartbeat:r"


def rank_heartbeat_field(rank: int) -> str:
    """The trainer hash field of one data-parallel rank's heartbeat."""
    return f"{RANK_HEARTBEAT_PREFIX}{rank}"

# rollouts dead-lettered so far (incremented in the dead-letter's own script; for status, not for pacing)
DEAD_LETTERED_FIELD = "dead_lettered"

# Field of the `archive` hash: the folder retention archives the run's streams into (written by the trainer).
ARCHIVE_DIR_FIELD = "dir"

# `source` of the aggregator's notes on `dead` (reports about the log, not dead-lettered entries).
AGGREGATOR_NOTE_SOURCE = "aggregator"


@dataclass(frozen=True)
class Keys:
    """The key layout of one run: rs:{<run>}:<name>. The braces keep a run in one Cluster slot."""

    run: str

    @property
    def prefix(self) -> str:
        """Common prefix of every key of this run."""
        return f"rs:{{{self.run}}}:"

    def _k(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def rollouts_of(self, producer: str) -> str:
        """Stream of one producer's RolloutSample entries (that producer -> trainer); only its user may XADD
        to it, so the stream names who wrote each entry."""
        return self._k(f"{ROLLOUTS}:{producer}")

    def rollouts_streams(self, producers: Iterable[str]) -> list[str]:
        """The rollouts stream of each producer, in the order given."""
        return [self.rollouts_of(p) for p in producers]

    @property
    def metrics(self) -> str:
        """Stream of the trainer's StepMetrics / ValidateMetrics (-> aggregator); only the trainer writes
        it."""
        return self._k("metrics")

    def stats_of(self, producer: str) -> str:
        """Stream of one producer's ProducerStats (that producer -> aggregator); only its user may XADD to
        it; the trainer never writes it."""
        return self._k(f"{STATS}:{producer}")

    def stats_streams(self, producers: Iterable[str]) -> list[str]:
        """The stats stream of each producer, in the order given."""
        return [self.stats_of(p) for p in producers]

    def stream_producer(self, stream: str) -> str:
        """The producer a per-producer rollouts or stats stream belongs to (its key's last part); '' for
        any other key."""
        for kind in (ROLLOUTS, STATS):
            head = self._k(f"{kind}:")
            if stream.startswith(head):
                return stream[len(head) :]
        return ""

    def stream_pattern(self, kind: str) -> str:
        """ACL key pattern of every per-producer stream of one kind (`rollouts` or `stats`)."""
        return self._k(f"{kind}:*")

    @property
    def producers(self) -> str:
        """Set of the run's producer names (written by setup_run; only the trainer and admin may write it):
        which per-producer streams tools without a config read."""
        return self._k("producers")

    @property
    def records(self) -> str:
        """Stream of SyncStepRecord entries with explicit id <global_step>-1."""
        return self._k("records")

    @property
    def params(self) -> str:
        """Stream of ParamVersion entries (trainer -> producers)."""
        return self._k("params")

    @property
    def dead(self) -> str:
        """Dead-letter stream of the trainer (rollouts it cannot train)."""
        return self._k("dead")

    @property
    def records_outbox(self) -> str:
        """List: the aggregator's records, RPUSHed (its user may not XADD `records`, so it cannot trim it);
        the trainer moves them into `records` (rollstream/bus/outbox.py)."""
        return self._k("outbox:records")

    @property
    def dead_aggregator_outbox(self) -> str:
        """List: the aggregator's dead letters and notes, RPUSHed; the trainer moves them into
        `dead:aggregator` (rollstream/bus/outbox.py)."""
        return self._k("outbox:dead:aggregator")

    @property
    def dead_aggregator(self) -> str:
        """Dead-letter stream of the aggregator (metrics and stats entries it cannot fold, and its notes): its
        own, so that its user cannot write, trim or erase the trainer's dead letters."""
        return self._k("dead:aggregator")

    @property
    def fates(self) -> str:
        """Stream of per-sample outcomes recorded by the trainer (schemas.text_entries.Fate), one entry per
        id."""
        return self._k("fates")

    def weights(self, version: int) -> str:
        """String holding the safetensors bytes of a parameter version."""
        return self._k(f"weights:{version}")

    def budget(self, version: int) -> str:
        """Counter: dispatch budget left for a version, not yet leased (only the trainer writes it)."""
        return self._k(f"budget:{version}")

    @property
    def dispatched(self) -> str:
        """Counter: prompts leased to all producers so far (only the trainer writes it)."""
        return self._k("dispatched")

    @property
    def consumed(self) -> str:
        """Counter: leased prompts the trainer finished with (trained, dropped, evicted, dead-lettered)."""
        return self._k("consumed")

    @property
    def lease(self) -> str:
        """Hash: producer name -> prompts leased to it so far (only the trainer writes it;
        rollstream/pacing/)."""
        return self._k("lease")

    def consumed_bits(self, producer: str) -> str:
        """Bitmap: bit `seq` set once the trainer counted `producer`'s prompt `seq` as consumed."""
        return self._k(f"consumed:{producer}")

    def revoked_bits(self, producer: str) -> str:
        """Bitmap: bit `seq` set when the trainer took `producer`'s prompt `seq` back (its lease expired,
        rollstream/pacing/); a sample of that seq is then dead-lettered ("lease expired")."""
        return self._k(f"revoked:{producer}")

    @property
    def fenced(self) -> str:
        """Hash: producer name -> why the trainer fenced it (a memory flood; rollstream/pacing/fence.py
        FloodFence). Only the trainer writes it; the warden (rollstream/ops/warden.py) reads it and switches
        that producer's ACL user off."""
        return self._k("fenced")

    # A producer's own state lives under producer:<name>:…: its ACL user may write only the four keys below.

    def producer_prefix(self, producer: str) -> str:
        """Prefix of every key one producer owns (its ACL user may write only these and the log streams it
        appends to)."""
        return self._k(f"producer:{producer}:")

    def producer_want(self, producer: str) -> str:
        """String: the lease total this producer asks for (what it used plus one dispatch; pacing's
        Leaser grants up to it)."""
        return self.producer_prefix(producer) + "want"

    def producer_published(self, producer: str) -> str:
        """Counter: leased prompts this producer has published (its next seq), moved with each publish."""
        return self.producer_prefix(producer) + "published"

    def producer_cursor(self, producer: str) -> str:
        """String: this producer's next prompt (schemas.text_entries.encode_cursor; advanced with each
        publish, resumed on restart)."""
        return self.producer_prefix(producer) + "cursor"

    def producer_version(self, producer: str) -> str:
        """String: the param_version this producer generates with (for weight garbage collection and
        status)."""
        return self.producer_prefix(producer) + "version"

    def producer_keys(self, producer: str) -> tuple[str, str, str, str]:
        """The four keys a producer writes besides its streams: cursor, published, want, version."""
        return (
            self.producer_cursor(producer), self.producer_published(producer), self.producer_want(producer),
            self.producer_version(producer),
        )

    def producer_of(self, key: str) -> str:
        """The producer name a per-producer key belongs to."""
        return key.removeprefix(self._k("producer:")).rsplit(":", 1)[0]

    def producer_pattern(self, what: str) -> str:
        """SCAN pattern matching one kind of per-producer key (`inflight`, `cursor`, `version`, …)."""
        return self._k(f"producer:*:{what}")

    @property
    def dispatch_log(self) -> str:
        """Stream: one entry per budget grant, top-up and lease by the trainer
        (schemas.text_entries.DispatchRecord) for audit."""
        return self._k("dispatch_log")

    @property
    def trainer(self) -> str:
        """Hash of the trainer's progress: the *_FIELD names above (global_step, committed_step, heartbeat
        …)."""
        return self._k("trainer")

    @property
    def archive(self) -> str:
        """Hash: where the run's log archive lives (ARCHIVE_DIR_FIELD); set once something is archived."""
        return self._k("archive")

    @property
    def setup(self) -> str:
        """String set once the run's streams and groups exist (publishers then use NOMKSTREAM)."""
        return self._k("setup")

    @property
    def sink_cursor(self) -> str:
        """Hash: aggregator sink name -> last global step it wrote (so a restart never writes a step
        twice)."""
        return self._k("sink_cursor")

    def all_streams(self, producers: Iterable[str] = ()) -> list[str]:
        """Every stream of the run with the given producers (each one's rollouts and stats stream), for
        status, retention and cleanup."""
        names = list(producers)
        return [*self.rollouts_streams(names), self.metrics, *self.stats_streams(names), self.records,
                self.params, self.dead, self.dead_aggregator, self.fates, self.dispatch_log]

    def pattern(self) -> str:
        """SCAN pattern matching every key of the run."""
        return f"{self.prefix}*"


_KEY = re.compile(r"^rs:\{([A-Za-z0-9_.-]{1,64})\}:(.+)$", re.S)


def split_key(key: str) -> tuple[Keys, str] | None:
    """(the run's Keys, the name inside the run) of a run key (`rs:{demo}:rollouts` -> Keys("demo"),
    "rollouts"); None for a key outside any run."""
    m = _KEY.match(key)
    return (Keys(m.group(1)), m.group(2)) if m else None


def producer_names(count: int) -> list[str]:
    """The producer worker names of a run with `count` producers: rollout_00 … rollout_NN."""
    return [f"rollout_{i:02d}" for i in range(count)]
