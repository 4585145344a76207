# Over 400 lines on purpose: one Collector, the admission rules and the verdicts in the order they apply.
"""Collecting a local update's samples: the consumer loop's batches -> a buffer of fresh, deduplicated,
usable samples -> this rank's share of a mini-batch (stale ones dropped and recorded).

A `Collector` is the trainer's reading half: it owns the rollouts buffer, the sample ids already seen
(committed, buffered, or, with several ranks, claimed by any rank: consumers/trainer/rounds.py) and
the producers' leases as last read. A sample whose id is not `<producer>-<seq>` inside its producer's
lease is dead-lettered (rollstream/pacing/), and so is one whose seq the trainer took back when its
producer's lease expired ("lease expired": the `revoked:<name>` bitmap, read only for producers that have
one: rollstream/pacing/expiry.py). Before its first pass (catching what a previous process left) and after
each pass that dead-lettered rollouts (with several ranks: after every pass, for the other ranks' letters)
it reads the new entries of `dead` and has pacing count the prompts of the letters that end their id as
consumed, each once, which gives their room back to the current version's budget (a top-up), so producers
replace them before the next version (else sync mode, whose window is one global batch, would wait forever
for them).

One fate per id: an id with a dead letter that ended it (any reason but the refusals of
schemas.REFUSED_COPY_REASONS) is never trained later. The collector keeps those ids (`ended`: read from
`dead` before the first pass, added as it dead-letters), and a later copy is dead-lettered "already ended"
instead of trained; a copy of an id already buffered or committed is acked as a duplicate before any other
check (so no copy ends an id another copy is about to end). A copy refused as outside the lease ends
nothing: the same id published later inside the lease is trained. A world of one polls until it
has its share; data-parallel ranks collect in rounds they agree on (one poll each, then an all-gather of what
each took), so they start and abandon every local update together, never train one sample id twice, and none
reads more entries than it still needs (the others would wait for what it hoards).

Each sample taken gets a verdict (`verdict`): trained; evicted as a rollout failure (the producer's generation
failed and it published the prompts with empty responses, rollout_status `rollout_failure`); dropped as too
stale (staleness over trainer.max_off_policy_threshold, unless trainer.max_off_policy_strategy=train); or
evicted by dynamic sampling (algorithm.filter_groups.enable: every trajectory of its group has the same
reward, so GRPO gives it no gradient). An eviction is counted as consumed at once and its room given back to
the current version's budget (rollstream/pacing/budget.py `consume`), so producers refill the batch; the
collector keeps reading until the share has enough samples to train. Stale drops are counted at once the same
way.

Transport (`timing_s/transport` of a local update, `transport_since_last`: the reader's `transport_s` since
the last one): time moving rollouts out of Redis and decoding them, not time waiting for producers. A poll of
the consumer loop that returns entries without blocking counts in full; when none are ready the loop waits in
a blocking poll, and of that poll only the decoding counts (the reply of a blocked read carries the few
entries that woke it; its transfer is not separable from the wait).

Warmup (`trainer.num_warmup_batches`, as in verl): before the run's first update (global step 1) the
trainer waits until that many mini-batches of samples have arrived.

Burst (`--burst`, used by `rollstream replay trainer`): the shared consumer loop's burst rule; once the
rollouts stream is drained (a read of new entries found none) and the buffer is empty, the trainer
abandons the step it is in, unacked, and exits 0, so a replay on a copied range ends when its samples are
used up.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import redis

from consumers.trainer.distributed import DataParallel
from consumers.trainer.effects import TrainerEffects
from consumers.trainer.guard import identity_reason, unusable_reason, value_reason, version_reason
from consumers.trainer.ledger import StepLedger
from consumers.trainer.rounds import RoundClaim, RoundResult, resolve_round
from consumers.trainer.staleness import mean_response_length, staleness
from rollstream.bus import EntryRef, GroupReader, Message, entry_limits
from rollstream.bus.ids import IdError, parse_sample_id, split_sample_id
from rollstream.config import PipelineConfig
from rollstream.keys import DEAD_LETTERED_FIELD, TRAINER_GROUP, Keys, producer_names
from rollstream.pacing.expiry import RevokedWatch
from rollstream.tasks import REWARD_RANGE
from schemas import DROPPED, EVICTED, FILTER_GROUPS, ROLLOUT_FAILURE, DeadLetter, Fate, RolloutSample, decode
from schemas.events import ALREADY_ENDED, LEASE_EXPIRED, OUTSIDE_LEASE, refused_copy

log = logging.getLogger(__name__)


def rollouts_reader(
    cfg: PipelineConfig, r: redis.Redis, keys: Keys, name: str, stop: threading.Event
) -> GroupReader:
    """The trainer's reader of every producer's `rollouts:<p>` stream: group `trainer`, consumer `name`; it
    counts each dead letter in the trainer hash."""
    return GroupReader(
        r,
        keys.rollouts_streams(producer_names(cfg.rollout.num_producers)),
        TRAINER_GROUP,
        name,
        dead_stream=keys.dead,
        block_ms=cfg.bus.block_ms,
        count=cfg.bus.read_count,
        claim_idle_s=cfg.bus.claim_idle_s,
        max_deliveries=cfg.bus.max_deliveries,
        limits=entry_limits(cfg.bus.max_entry_bytes),
        stop=stop,
        dead_count=(keys.trainer, DEAD_LETTERED_FIELD),
    )


def _own_sample_id(keys: Keys, letter: DeadLetter) -> str | None:
    """The sample id a dead-lettered rollout's header names, when it is one of the producer whose stream it
    came from (a forged id of another producer counts nothing for that one); None otherwise."""
    producer = keys.stream_producer(letter.source)
    raw = letter.fields.get("sample_id")
    if not producer or not letter.source.startswith(keys.rollouts_of("")) or raw is None:
        return None
    sid = raw.decode(errors="replace")
    return sid if split_sample_id(sid, producer) is not None else None


def failed(ev: RolloutSample) -> bool:
    """True for a rollout failure: the producer's generation failed, its prompts came with empty responses."""
    return bool(ev.rollout_status.get(ROLLOUT_FAILURE))


def zero_variance_reward(ev: RolloutSample) -> float | None:
    """The reward every trajectory of a group of more than one shares (DAPO's filter_groups test: no GRPO
    signal), or None when the rewards differ or the group has one trajectory."""
    rewards = np.asarray(ev.full_batch.rows["rewards"], dtype=np.float64).reshape(-1)
    if rewards.size > 1 and float(np.std(rewards)) == 0.0:
        return float(rewards[0])
    return None


@dataclass
class Collected:
    """A local update's share: the samples to train (with staleness), and what was set aside taking them."""

    kept: list[tuple[Message, int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # staleness of each sample dropped as stale
    dropped_lengths: list[float] = field(default_factory=list)  # their mean response lengths
    evicted: list[float] = field(default_factory=list)  # the shared reward of each filter_groups eviction
    failed: int = 0  # rollout failures evicted


class Collector:
    """The trainer's rollouts buffer and the rules that fill it and take mini-batch shares from it."""

    def __init__(
        self,
        cfg: PipelineConfig,
        effects: TrainerEffects,
        reader: GroupReader,
        dp: DataParallel,
        stop: threading.Event,
        burst: bool,
        vocab_size: int,
        max_seq_len: int | None,
    ) -> None:
        """Read through `reader`'s consumer loop; samples must fit the policy's vocabulary and positions;
        every other Redis call is an effect of `effects` (retried there), and each pass ends with this
        rank's heartbeat."""
        self.cfg, self.effects, self.keys, self.reader = cfg, effects, effects.keys, reader
        self.dp, self.stop, self.burst = dp, stop, burst
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.share = cfg.actor.ppo_mini_batch_size // dp.world_size  # this rank's samples per local update
        self._batches: Iterator[list[Message]] = reader.batches(burst=burst)  # the shared consumer loop
        reader.ended_id = self.id_taken  # an undecodable copy of a taken id is refused, not a second end
        self.buffer: deque[Message] = deque()  # decoded, deduplicated, not yet used
        self.seen: set[str] = set()  # sample ids committed, in uncommitted ledgers, or buffered
        self.ended: set[str] = set()  # sample ids a dead letter ended (never trained later)
        # data parallel: sample ids any rank took since the start (rounds.py)
        self.claimed: set[str] = set()
        # newest version on `params`: after a restart from an older checkpoint, versions published past it
        # (by steps the crash abandoned) exist and producers may have stamped samples with them
        self.newest_published = 0
        self.used_up = False  # burst: the consumer loop ended with the rollouts stream drained
        self.step_dead = 0  # dead-lettered rollouts since the step began
        self._own_dead = 0  # non-rollout entries we dead-lettered ourselves (not prompts)
        self._dead_seen = 0  # this process's dead-lettered rollouts when pacing last counted them
        self._dead_checked = False
        self._dead_cursor = "-"  # the last `dead` entry whose prompt pacing counted ("-": none read yet)
        self.leases: dict[str, int] = {}  # producer -> prompts leased to it, as last read
        # which producers had seqs taken back (rank 0's Leaser expires leases in this process; other ranks
        # read again each pass): a revoked bit is read only for those (rollstream/pacing/expiry.py)
        self.revoked = RevokedWatch(self.keys, producer_names(cfg.rollout.num_producers),
                                    local=dp.roles.expires_leases())
        # a replay copy's rollouts were copied by an admin, not published under leases: not checked
        self.check_leases = not effects.is_replay_copy()
        self._transport_mark = 0.0  # the reader's transport_s at the last transport_since_last

    def transport_since_last(self) -> float:
        """The reader's transport seconds since the last call (a local update's `timing_s/transport`)."""
        total = self.reader.stats.transport_s
        since, self._transport_mark = total - self._transport_mark, total
        return since

    def fill(self) -> bool:
        """One pass of the consumer loop: buffer new samples, ack duplicates of seen ids, count
        dead-lettered rollouts; False once the loop has ended (stop requested, or in burst mode the
        rollouts stream drained: then `used_up`)."""
        msgs = next(self._batches, None)
        if msgs is None:
            if self.burst and not self.stop.is_set() and not self.used_up:
                log.info("burst: no rollouts left to read")
                self.used_up = True
            return False
        dupes: list[EntryRef] = []
        dead = self.reader.stats.dead - self._own_dead
        if not self._dead_checked or dead > self._dead_seen:  # what a previous process or this read (the
            self._count_dead(dead)  # reader's own letters) dead-lettered, before any copy is admitted
        self.revoked.new_pass()
        for m in msgs:
            to_dead = partial(self.reader.dead_letter, m.id, m.fields, stream=m.stream)
            try:
                self._admit(m, to_dead, dupes)
            except (redis.RedisError, OSError):
                raise  # the connection's, not the entry's: retried by the reader's or the effect's policy
            except Exception as e:  # noqa: BLE001 - a poison entry is dead-lettered once, never a crash loop
                log.exception("dead-lettering a rollout whose checks raised")
                why = f"{type(e).__name__}: {str(e)[:200]}"
                self._dead_ending(m, to_dead, f"unreadable: checking it raised {why}")
        if dupes:
            log.warning("acking %d redelivered/duplicate samples without training", len(dupes))
            self.effects.ack_duplicates(self.reader, dupes)
        dead = self.reader.stats.dead - self._own_dead
        if dead > self._dead_seen:
            self._count_dead(dead)
        else:  # several ranks: another rank's letters end ids here too
            self.dp.roles.if_several(self._count_dead, dead)
        self.effects.heartbeat()
        return True

    def _admit(self, m: Message, to_dead: Callable[..., Any], dupes: list[EntryRef]) -> None:
        """Buffer one delivered entry, or dead-letter it (with the reason), or queue it in `dupes` to ack."""
        ev = m.event
        owner = self.keys.stream_producer(m.stream)
        if isinstance(ev, RolloutSample) and ev.sample_id.startswith(f"{owner}-"):
            if ev.sample_id in self.seen or ev.sample_id in self.claimed:
                dupes.append(m.ref)  # the original is committed or still pending: safe to ack this copy
                return
            if ev.sample_id in self.ended:  # the letter that ended it counted its prompt: counts nothing
                to_dead(f"{ALREADY_ENDED}: sample_id={ev.sample_id!r} has a dead letter (one fate per id)")
                return
        ending = partial(self._dead_ending, m, to_dead)
        if not isinstance(ev, RolloutSample):
            self._own_dead += 1
            to_dead(f"not a rollout: {ev.type}", counted=False)  # no prompt
        elif (why := identity_reason(ev, owner)) is not None:
            ending(f"impersonation: {why}")  # counted as consumed below
        elif (why := self.lease_reason(ev)) is not None:
            to_dead(f"{OUTSIDE_LEASE}: {why}")  # counts nothing, ends nothing
        elif (why := self.expired_reason(ev)) is not None:
            to_dead(f"{LEASE_EXPIRED}: {why}")  # already counted when it was taken back: counts nothing
        elif (why := version_reason(ev, self.newest_published)) is not None:
            ending(f"invalid: {why}")  # counted as consumed below
        elif (why := unusable_reason(ev, self.vocab_size, self.max_seq_len)) is not None:
            ending(f"unusable: {why}")  # counted as consumed below
        elif (why := value_reason(ev, REWARD_RANGE)) is not None:
            ending(f"out of domain: {why}")  # counted as consumed below
        else:
            self.seen.add(ev.sample_id)
            self.buffer.append(m)

    def id_taken(self, sample_id: str) -> bool:
        """True when `sample_id` already ended by a dead letter, or a copy of it is buffered, committed or
        claimed by a rank: no other copy may end it."""
        return sample_id in self.seen or sample_id in self.claimed or sample_id in self.ended

    def _dead_ending(self, m: Message, to_dead: Callable[..., Any], reason: str) -> None:
        """Dead-letter a rollout with a reason that ends its sample id: a later copy is refused."""
        to_dead(reason)
        sid = getattr(m.event, "sample_id", "")
        if sid and sid.startswith(f"{self.keys.stream_producer(m.stream)}-"):
            self.ended.add(sid)

    def lease_reason(self, ev: RolloutSample) -> str | None:
        """Why a sample is outside its producer's lease (its id is not `<producer>-<seq>` with seq below the
        prompts leased to that producer), or None (always on a replay copy). The leases are read again when
        a seq is past them."""
        if not self.check_leases:
            return None
        try:  # the one canonical parser (rollstream/bus/ids.py): ASCII seq, no leading zero, bounded
            producer, seq = parse_sample_id(ev.sample_id, ev.producer)
        except IdError as e:
            return str(e)
        if seq >= self.leases.get(producer, 0):
            self.leases = self.effects.read_leases()
        if seq >= (leased := self.leases.get(producer, 0)):
            return f"sample_id={ev.sample_id!r}: seq {seq} >= {leased} prompts leased to {producer!r}"
        return None

    def expired_reason(self, ev: RolloutSample) -> str | None:
        """Why a sample's prompt is no longer its producer's (the trainer took it back when its lease expired:
        rollstream/pacing/), or None (always on a replay copy). Call after `lease_reason` passed."""
        if not self.check_leases:
            return None
        producer, seq = parse_sample_id(ev.sample_id, ev.producer)
        if self.effects.is_revoked(self.revoked, producer, seq):
            return (
                f"sample_id={ev.sample_id!r}: seq {seq} was taken back from {producer!r} "
                f"(no prompt of it finished for rollout.lease_timeout_s={self.cfg.rollout.lease_timeout_s})"
            )
        return None

    def _count_dead(self, dead: int) -> None:
        """Have pacing count the prompts of the rollouts dead-lettered since the last look (the first look
        reads all of `dead`, catching what a previous process left uncounted) as consumed, each once,
        topping the budget up by the room they freed, and remember the ids those letters ended. Refusals
        (schemas.REFUSED_COPY_REASONS) count nothing: an outside-lease copy's seq may be leased since."""
        ids: list[str] = []
        for entry_id, fields in self.effects.read_dead_letters(self._dead_start()):
            self._dead_cursor = entry_id
            try:
                letter = decode(fields)
            except Exception:  # noqa: BLE001 - not ours to judge here: the audit reports a bad dead letter
                continue
            if (
                isinstance(letter, DeadLetter)
                and refused_copy(letter.reason) is None  # a refused copy ended nothing (counted at expiry)
                and (sid := _own_sample_id(self.keys, letter)) is not None
            ):
                ids.append(sid)
                self.ended.add(sid)
        counted, added = self.effects.consume(ids, "dead")
        if counted:
            log.info("%d dead-lettered rollouts counted as consumed: budget topped up by %d", counted, added)
        self.step_dead += dead - self._dead_seen
        self._dead_seen, self._dead_checked = dead, True

    def _dead_start(self) -> str:
        """Where the next look at `dead` starts: past the last entry read."""
        return "-" if self._dead_cursor == "-" else f"({self._dead_cursor}"

    def starve(self, need: int) -> bool:
        """The buffer lacks `need` samples: run one more pass of the loop; True when the caller must give up
        (stop requested, or in burst mode no rollout is left). With several ranks a pass reads at most
        `need` entries, so no rank hoards what the others wait for (pacing caps what is outstanding)."""
        self.dp.roles.if_several(self._read_at_most, need)
        return self.stop.is_set() or not self.fill()

    def _read_at_most(self, n: int) -> None:
        """Cap the consumer loop's next reads at `n` entries (and at bus.read_count)."""
        self.reader.count = max(1, min(self.cfg.bus.read_count, n))

    def wait_warmup(self) -> None:
        """Before the run's first update: wait until num_warmup_batches mini-batches have arrived (this
        rank's share of them; ranks wait in agreed rounds)."""
        want = self.cfg.trainer.num_warmup_batches * self.share
        while True:
            ended = self.stop.is_set() or self.used_up
            if len(self.buffer) < want and not ended:
                ended = self.starve(want - len(self.buffer))
            if self.dp.roles.agreed_or(ended or len(self.buffer) >= want, self._warmup_round, ended, want):
                break
        log.info("warmup: %d samples buffered before the first update", len(self.buffer))

    def _warmup_round(self, ended: bool, want: int) -> bool:
        """One agreed warmup round: True when every rank has `want` samples buffered or some rank must
        stop."""
        res = self.agree(RoundClaim(ended or self.stop.is_set(), len(self.buffer)), want)
        return res.all_ready or res.any_ended

    def verdict(self, m: Message, st: int) -> str | None:
        """None: train it; EVICTED: a rollout failure or (filter_groups) no reward variance; DROPPED:
        staleness over the threshold (strategy drop)."""
        tc = self.cfg.trainer
        if failed(m.event):  # type: ignore[arg-type]
            return EVICTED
        if st > tc.max_off_policy_threshold and tc.max_off_policy_strategy == "drop":
            return DROPPED
        if self.cfg.algorithm.filter_groups.enable and zero_variance_reward(m.event) is not None:  # type: ignore[arg-type]
            return EVICTED
        return None

    def take(self, g: int, need: int) -> list[tuple[Message, int]]:
        """Pop samples off the buffer until `need` of them are to be trained (those met on the way that are
        to be dropped or evicted are taken too); (message, staleness) each."""
        out: list[tuple[Message, int]] = []
        while need > 0 and self.buffer:
            m = self.buffer.popleft()
            st = staleness(g, m.event.param_version)  # type: ignore[union-attr]
            out.append((m, st))
            need -= self.verdict(m, st) is None
        return out

    def agree(self, claim: RoundClaim, want: int) -> RoundResult:
        """Exchange one collection round's claims with the other ranks and resolve them
        (rounds.py)."""
        claims = [RoundClaim.from_plain(d) for d in self.dp.all_gather_plain(claim.to_plain())]
        return resolve_round(claims, self.claimed, want, self.dp.rank)

    def collect(self, g: int, ledger: StepLedger) -> Collected | None:
        """Take this rank's share of a mini-batch (ppo_mini_batch_size / world_size samples to train); drop
        (and record) the too stale, evict (record, and give their budget back) the zero-variance groups.
        None when stop was requested (on any rank) or, in burst mode, no rollout is left."""
        want = self.share
        got = Collected()
        while True:
            taken = self.take(g, want - len(got.kept))
            ended = self.stop.is_set()
            short = want - len(got.kept) - sum(self.verdict(m, st) is None for m, st in taken)
            if short > 0 and not ended:
                ended = self.starve(short)
                taken += self.take(g, short)
            ready = len(got.kept) + sum(self.verdict(m, st) is None for m, st in taken) >= want
            ready, ended, taken = self.dp.roles.agreed_or(
                (ready, ended, taken), self._collect_round, taken, ended, len(got.kept), want
            )
            self._sort(g, ledger, taken, got)
            if ended:
                return None
            if ready:
                return got

    def _collect_round(
        self, taken: list[tuple[Message, int]], ended: bool, kept_before: int, want: int
    ) -> tuple[bool, bool, list[tuple[Message, int]]]:
        """One agreed collection round over the samples this rank took (`taken`): (every rank has its share,
        some rank must stop, `taken` less the samples another rank claimed first, which are acked here)."""
        claim = RoundClaim(
            ended or self.stop.is_set(),
            kept_before,
            [(m.event.sample_id, self.verdict(m, st) is None) for m, st in taken],  # type: ignore[union-attr]
        )
        res = self.agree(claim, want)
        dupes = [taken[i][0].ref for i in res.duplicates]
        if dupes:
            log.warning("acking %d samples another rank took first, without training", len(dupes))
            self.effects.ack_duplicates(self.reader, dupes)
            taken = [x for i, x in enumerate(taken) if i not in set(res.duplicates)]
        return res.all_ready, res.any_ended, taken

    def _sort(self, g: int, ledger: StepLedger, taken: list[tuple[Message, int]], got: Collected) -> None:
        """Keep, drop or evict each taken sample (fates of the last two in the ledger); drops and evictions
        count as consumed at once, giving their room back to the current version's budget."""
        early: list[str] = []
        for m, st in taken:
            ev: Any = m.event
            verdict = self.verdict(m, st)
            if verdict is None:
                got.kept.append((m, st))
                continue
            reason = "" if verdict == DROPPED else ROLLOUT_FAILURE if failed(ev) else FILTER_GROUPS
            ledger.fates.append(Fate(ev.sample_id, m.id, verdict, st, ev.param_version, g, reason=reason))
            ledger.ack_ids.append(m.ref)
            early.append(ev.sample_id)
            if verdict == DROPPED:
                got.dropped.append(st)
                got.dropped_lengths.append(mean_response_length(ev))
                continue
            if reason == ROLLOUT_FAILURE:
                got.failed += 1
            else:
                got.evicted.append(zero_variance_reward(ev))  # type: ignore[arg-type]
        if early:
            n, added = self.effects.consume(early, "evicted")
            log.info(
                "%d samples dropped or evicted (stale, rollout failures, zero-variance groups): %d counted, "
                "budget topped up by %d", len(early), n, added,
            )
