"""Continuous generation (`rollout.vllm.continuous` on the vLLM engine, `rollout.continuous` on the built-in
one: rollstream/model/rows.py): one engine per producer stays busy.

The per-dispatch loop (producers/worker.py) generates `prompts_per_dispatch` x n rows as one batch: the engine
runs ever fewer rows through the batch's long tail, then idles while the producer scores, publishes and waits
for its lease. Here the producer keeps the engine at `prompts_per_dispatch` x n rows: after every engine step
it admits new leased prompts (a group of n rows each) into the room finished rows left, and publishes each
group as soon as its n rows are done and scored, as verl's rollouter, PipelineRL, AReaL and prime-rl do.

What stays as in the per-dispatch loop:
- **Exactly once.** Prompts are taken from the shard in order and numbered by `seq`; a group is published
  only after every group before it (in one MULTI with the published count and the cursor just past its
  prompt), so the published count and the cursor always name a prefix of the leased prompts and a restart
  dispatches the rest again under the same ids. A group that finishes early waits (scored) for the groups
  before it; the engine does not.
- **Leases first, then weights.** Admission reads the lease, then loads newer weights if any, so a prompt
  leased under version v is never generated with older weights; a group is stamped with the version loaded
  when it was admitted.
- **Swaps.** With `async_training.partial_rollout` every `sync_every_tokens` engine steps newer weights are
  loaded: the rows in flight pause, swap and resume (`Completion.swap_points`), and each row's first and last
  generating versions are recorded per row. Without it admission stops once a newer version is out, the
  engine drains, and the version loads with nothing in flight.
- Any error (a lost connection included) drops what is in flight; the producer's own handling then resyncs
  from Redis (the prompts are dispatched again), as for a dispatch.

The tool agent (built-in engine): a row whose turn ends with a complete tool call (`tool_cut`, as the
per-dispatch agent loop cuts it) runs the tool and goes back into the engine at once as its next turn
(prompt + everything so far), up to `max_turns`, while the others decode on; the group is done when every
row's last turn is. Each turn starts on the version loaded when it entered the engine and records its own
swaps, so a trajectory's `turn_versions`, first and last versions are those of its tokens, as in the
per-dispatch loop.

Measured with the engines' `clock` (EngineClock: engine busy time, rows in flight x time): see BENCHMARKS.md,
"Continuous generation".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from producers.agent import end_turn
from producers.rollout import Trajectory, prepare_single_generation_data
from rollstream.model import Completion, Tokenizer
from rollstream.model.base import EngineClock
from rollstream.model.rows import RowBatch
from rollstream.pacing.budget import ask_lease
from rollstream.pacing.counters import lease_of
from rollstream.tasks import Prompt, Task

if TYPE_CHECKING:
    import torch

    from producers.agent import GenerationSettings
    from producers.weight_sync import WeightSync
    from rollstream.config import PipelineConfig
    from rollstream.model import BasePolicy
    from rollstream.runtime.process import WorkerContext
    from rollstream.tasks import PromptSource

log = logging.getLogger(__name__)

#: Seconds to sleep when the engine is empty and no lease is left (as the per-dispatch loop's POLL_S).
IDLE_POLL_S = 0.005
#: Burst mode: how long an empty engine waits for a lease before the loop stops.
BURST_WAIT_S = 0.25
#: Most groups admitted and not yet published, in dispatches' worth (`prompts_per_dispatch`): finished groups
#: wait for a long one before them to be published in order; the engine keeps admitting up to this bound.
MAX_WAITING_DISPATCHES = 4
#: The built-in engine prefills new groups together once this share of a dispatch's prompts waits: one
#: SmolLM2 group's prompt alone cost one core ~75 ms, in a batch of 4 ~30 ms a prompt (BENCHMARKS.md,
#: Generation), while the rows held back cost a CPU nothing (its decode cost is per row).
ADMIT_SHARE = 1 / 8


@dataclass
class Turn:
    """A row's turn in the engine: its completion, the version it entered under, the version loaded at each of
    its swap points (aligned with `row.swap_points`), when it entered."""

    row: Completion
    version: int
    versions: list[int] = field(default_factory=list)
    since: float = field(default_factory=time.perf_counter)


@dataclass
class Group:
    """One leased prompt in the engine: its n trajectories, the version admitted under, the cursor around it,
    and the turn each unfinished row has in the engine."""

    seq: int
    sample_id: str
    epoch: int
    prompt: Prompt
    version: int
    before: tuple[int, int]  # the shard's cursor at this prompt
    after: tuple[int, int]  # and just past it (saved with its publish)
    trajs: list[Trajectory] = field(default_factory=list)
    turns: dict[int, Turn] = field(default_factory=dict)  # row -> its turn in the engine

    @property
    def ready(self) -> bool:
        """Every row's last turn finished (eos, its token budget, or no next turn)."""
        return not self.turns

    def end_turn(self, i: int, task: Task | None, tok: Tokenizer) -> bool:
        """Add row i's finished turn to its trajectory (producers/agent.py end_turn, as the per-dispatch agent
        loop does); True when the row goes on with another turn (it called the tool)."""
        turn = self.turns.pop(i)
        return end_turn(self.trajs[i], turn.row, task, tok, turn.version, turn.versions,
                        time.perf_counter() - turn.since)


class RowEngine(Protocol):
    """What the loop drives: an engine that rows enter and leave one at a time (producers/engines/vllm.py
    VLLMPolicy, rollstream/model/rows.py RowBatch)."""

    tokenizer: Tokenizer
    clock: EngineClock  # what its steps took (the generation benchmark reads it)

    @property
    def in_flight(self) -> int: ...
    @property
    def max_seq_len(self) -> int | None: ...
    def submit(self, row: Completion, max_new_tokens: int, temperature: float, top_p: float = 1.0,
               top_k: int = -1) -> None: ...
    def step(self) -> list[Completion]: ...
    def resume(self, swapped: bool) -> None: ...
    def abort(self) -> None: ...


class Host(Protocol):
    """What the loop uses of its producer (producers/worker.py Producer): its lease and prompt position, its
    weights, and its score-and-publish path."""

    ctx: WorkerContext
    name: str
    settings: GenerationSettings
    task: Task
    multi_turn: bool
    source: PromptSource
    weights: WeightSync
    leased: int
    next_seq: int

    def _refresh(self) -> tuple[bool, int]: ...
    def _newest_version(self) -> int: ...
    def _take_prompts(self, amount: int) -> tuple[list[tuple[int, int, Prompt]], int, list[str]]: ...
    def _status(self, failed: bool) -> dict[str, float | int]: ...
    def _finish(self, ids: list[str], items: list[tuple[int, int, Prompt]], param_version: int,
                trajs: list[Trajectory], gen_s: float, status: dict[str, float | int],
                before: tuple[int, int], after: tuple[int, int] | None = None) -> Any: ...
    def _maybe_stats(self) -> None: ...
    def _add_idle(self, seconds: float) -> None: ...


def builtin_engine(cfg: PipelineConfig, policy: BasePolicy, generator: torch.Generator) -> RowBatch:
    """The built-in engine's running batch for the loop (`rollout.continuous`): new rows prefilled together
    once ADMIT_SHARE of a dispatch's rows wait."""
    ro = cfg.rollout
    return RowBatch(policy, generator, admit_rows=ro.n * max(1, round(ro.prompts_per_dispatch * ADMIT_SHARE)))


class ContinuousLoop:
    """The continuous generation loop of one producer on its engine (module docstring)."""

    def __init__(self, producer: Host, engine: RowEngine) -> None:
        self.p = producer
        self.engine = engine
        cfg = producer.ctx.cfg
        self.n = cfg.rollout.n
        self.capacity = cfg.rollout.prompts_per_dispatch  # groups in the engine at once
        self.settings = producer.settings
        self.pending: deque[Group] = deque()  # admitted, in seq order, until published
        self.live: dict[int, tuple[Group, int]] = {}  # id of a turn's completion in the engine -> its row
        self.tool_task = producer.task if producer.multi_turn else None  # the tool agent's task, or None
        self.steps = 0
        self.asked = -1  # the lease total last asked for
        self.newer_waiting = False  # without partial rollout: a newer version waits for the engine to drain
        self.busy_since_publish = 0.0  # engine seconds since the last publish (that publish's gen_s)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, max_prompts: int | None, burst: bool) -> int:
        """Admit, step and publish until stop, `max_prompts` prompts published, or (burst) no lease within
        BURST_WAIT_S of an empty engine; returns the prompts published. On any error what is in flight is
        dropped (its prompts are dispatched again after the producer resyncs) and the error propagates."""
        published = 0
        idle_since: float | None = None
        try:
            while not self.p.ctx.stop.is_set():
                admitted_all = max_prompts is not None and published + len(self.pending) >= max_prompts
                self._sync_weights()
                if not admitted_all:
                    self._admit(None if max_prompts is None else max_prompts - published - len(self.pending))
                if not self.pending:
                    if max_prompts is not None and published >= max_prompts:
                        break
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if burst and now - idle_since > BURST_WAIT_S:
                        break
                    self._idle()
                    continue
                idle_since = None
                self._step()
                published += self._publish_ready()
        finally:
            self._drop()
        return published

    def _sync_weights(self) -> None:
        """Load newer weights when due: with partial rollout every `sync_every_tokens` steps (rows in flight
        pause, swap and resume), without it only when the engine is empty (and, at the same cadence, note
        whether a newer version is out, which stops admission until the engine drains)."""
        due = self.steps % max(1, self.settings.sync_every_tokens) == 0
        if self.settings.partial_rollout:
            if due:
                self._refresh()
        elif not self.pending:
            self._refresh()
            self.newer_waiting = False
        elif due:
            self.newer_waiting = self.p._newest_version() > self.p.weights.version

    def _refresh(self) -> None:
        """Load the newest version if newer; rows a load paused resume, recording the version they swap to."""
        swapped, version = self.p._refresh()
        self.engine.resume(swapped)
        if swapped:
            for group in self.pending:
                for turn in group.turns.values():
                    if len(turn.row.swap_points) > len(turn.versions):
                        turn.versions.append(version)

    def _admit(self, room_left: int | None) -> None:
        """Fill the engine up to `prompts_per_dispatch` x n rows with leased prompts' groups (at most
        `room_left` of them); ask for the room left when the lease runs out."""
        ctx = self.p.ctx
        if self.newer_waiting and self.pending:
            return  # a newer version waits for the engine to drain
        # room for whole groups in the engine's rows (a group's finished rows make room at once: one long row
        # holds one slot, not n), and a bound on groups waiting for an earlier one to be published
        free = min((self.capacity * self.n - self.engine.in_flight) // self.n,
                   MAX_WAITING_DISPATCHES * self.capacity - len(self.pending))
        if room_left is not None:
            free = min(free, room_left)
        if free <= 0:
            return
        if self.p.leased <= self.p.next_seq:  # read the lease (before the weights) only once it is used up
            self.p.leased = max(self.p.leased, lease_of(ctx.r, ctx.keys, self.p.name))
        if self.p.leased <= self.p.next_seq:
            want = self.p.next_seq + free
            if want > self.asked:
                ask_lease(ctx.r, ctx.keys, self.p.name, want)
                self.asked = want
            return
        if not self.pending:
            self._refresh()  # an empty engine takes the newest version before new prompts
        for _ in range(min(free, self.p.leased - self.p.next_seq)):
            before = self.p.source.cursor
            items, version, ids = self.p._take_prompts(1)
            if not items:
                return
            (epoch, _, prompt), sid = items[0], ids[0]
            self._start_group(Group(
                seq=self.p.next_seq - 1, sample_id=sid, epoch=epoch, prompt=prompt, version=version,
                before=before, after=self.p.source.cursor,
            ))

    def _start_group(self, group: Group) -> None:
        """Put a group's n rows into the engine."""
        multi_turn = self.tool_task is not None
        request = prepare_single_generation_data(group.prompt, self.n, multi_turn, self.engine.tokenizer)
        group.trajs = [Trajectory(prompt_ids=list(ids)) for ids in request.rows]
        self.pending.append(group)
        for i in range(len(group.trajs)):
            self._start_turn(group, i)

    def _start_turn(self, group: Group, i: int) -> bool:
        """Put row i's next turn (its prompt + everything so far) into the engine, under the loaded version;
        False when its context has no room left (the row ends unfinished)."""
        t, s = group.trajs[i], self.settings
        limit = self.engine.max_seq_len
        history = t.prompt_ids + t.response_ids
        max_new = s.max_new_tokens if limit is None else min(s.max_new_tokens, limit - len(history))
        if max_new <= 0:
            return False
        row = Completion(prompt_ids=history)
        group.turns[i] = Turn(row, self.p.weights.version)
        self.live[id(row)] = (group, i)
        self.engine.submit(row, max_new, s.temperature, s.top_p, s.top_k)
        return True

    def _step(self) -> None:
        """One engine step; each finished turn goes to its trajectory, and a tool call's row into the engine
        again for its next turn (up to max_turns)."""
        t0 = time.perf_counter()
        finished = self.engine.step()
        self.steps += 1
        self.busy_since_publish += time.perf_counter() - t0
        tok = self.engine.tokenizer
        for row in finished:
            group, i = self.live.pop(id(row))
            if group.end_turn(i, self.tool_task, tok) and group.trajs[i].num_turns < self.settings.max_turns:
                self._start_turn(group, i)

    def _publish_ready(self) -> int:
        """Publish, in seq order, every finished group at the head of the queue; returns how many."""
        count = 0
        while self.pending and self.pending[0].ready:
            group = self.pending[0]
            gen_s, self.busy_since_publish = self.busy_since_publish, 0.0
            self.p._finish(
                [group.sample_id], [(group.epoch, 0, group.prompt)], group.version, group.trajs,
                gen_s, self.p._status(False), group.before, after=group.after,
            )
            self.pending.popleft()
            count += 1
        if count:
            self.p._maybe_stats()
        return count

    def _idle(self) -> None:
        """Nothing in the engine and no lease: sleep a poll, counting idle time."""
        t0 = time.monotonic()
        time.sleep(IDLE_POLL_S)
        self.p._maybe_stats()
        self.p._add_idle(time.monotonic() - t0)

    def _drop(self) -> None:
        """Abort every row in the engine and forget the unpublished groups (they stay leased: the producer's
        resync dispatches them again)."""
        self.engine.abort()
        self.live.clear()
        if self.pending:
            first = self.pending[0]
            self.p.source.cursor = first.before
            self.p.next_seq = first.seq
            self.pending.clear()
