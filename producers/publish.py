"""Publishing a dispatch: its trajectories scored (the task's reward of each decoded response), packed as
one RolloutSample per prompt (producers/rollout.py) and published together with `mark_published` and the
producer's cursor in one MULTI/EXEC, so a restart resumes where the last publish left off and nothing is
published twice or skipped; a refused XADD is undone at once (`PublishError`). A dispatch whose generation
failed is published the same way, each prompt with empty responses marked as a rollout failure.

`Publishing` is the publishing half of the Producer (producers/worker.py, which mixes it in): its steps read
and update the producer's state (cursor, counters, stats window) under the producer's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from producers.rollout import GenerationRequest, Trajectory, build_rollout_sample, failed_trajectories
from producers.slots import Slots
from producers.stats import Counters, StatsWindow, rollout_status
from producers.weight_sync import WeightSync
from rollstream.bus import RunNotSetUpError
from rollstream.keys import producer_names
from rollstream.pacing.budget import mark_published
from rollstream.pacing.counters import rollout_counts
from rollstream.runtime.process import WorkerContext
from rollstream.tasks import Prompt, Task
from rollstream.tasks.source import PromptSource
from rollstream.topology.replication import execute_and_wait, require_acks
from schemas import ROLLOUT_FAILURE, RolloutSample, encode, encode_cursor

if TYPE_CHECKING:
    from producers.engines.vllm import VLLMPolicy
    from rollstream.model import BasePolicy


class PublishError(RuntimeError):
    """Redis refused a publish's XADD; the cursor and in-flight count were put back, the prompts are not
    lost."""


class Publishing:
    """The publishing steps of a Producer; the attributes below are the producer's (set in its __init__)."""

    ctx: WorkerContext
    name: str
    lock: threading.RLock
    slots: Slots
    source: PromptSource
    task: Task
    policy: BasePolicy | VLLMPolicy
    weights: WeightSync
    multi_turn: bool
    counters: Counters
    window: StatsWindow
    next_seq: int

    def _status(self, failed: bool) -> dict[str, float | int]:
        """The global rollout_status a dispatch's samples carry (`rollout_failure` = 1 when it failed: the
        trainer evicts such a sample with that reason and gives its room back)."""
        counts = rollout_counts(self.ctx.r, self.ctx.keys, producer_names(self.ctx.cfg.rollout.num_producers))
        status = rollout_status(counts, self.ctx.cfg, self.weights.version)
        if failed:
            status[ROLLOUT_FAILURE] = 1
        return status

    def _publish_failures(
        self,
        ids: list[str],
        items: list[tuple[int, int, Prompt]],
        param_version: int,
        request: GenerationRequest,
        t0: float,
        before: tuple[int, int],
    ) -> list[RolloutSample]:
        """Publish a dispatch whose generation (begun at `t0`) failed: each prompt with empty responses and
        rollout_status `rollout_failure` = 1; returns the samples."""
        elapsed = time.perf_counter() - t0
        trajs = failed_trajectories(request, param_version, elapsed)
        return self._finish(ids, items, param_version, trajs, elapsed, self._status(True), before)

    def _finish(
        self,
        ids: list[str],
        items: list[tuple[int, int, Prompt]],
        param_version: int,
        trajs: list[Trajectory],
        gen_s: float,
        status: dict[str, float | int],
        before: tuple[int, int],
        after: tuple[int, int] | None = None,
    ) -> list[RolloutSample]:
        """Count the generation time, score and pack each prompt's trajectories, publish (`before`: the cursor
        ahead of these prompts, restored when the publish fails; `after`: the cursor saved with them, default
        the shard's current one; slot-averaged `gen_s`); returns the samples ([] for a slot's dispatch taken
        before a reconnect, discarded: its prompts are dispatched again)."""
        n = self.ctx.cfg.rollout.n
        with self.lock:
            if self.slots.stale(len(items)):
                return []
            gen_s = self.slots.share(gen_s)
            self.counters.gen_s += gen_s
            self.window.gen_s += gen_s
            samples = []
            for k, (sid, (epoch, _, prompt)) in enumerate(zip(ids, items, strict=True)):
                group = trajs[k * n : (k + 1) * n]
                samples.append(self._sample(sid, epoch, param_version, prompt, group, status))
            self._publish(samples, before, after)
            return samples

    def _sample(
        self,
        sample_id: str,
        epoch: int,
        param_version: int,
        prompt: Prompt,
        group: list[Any],
        status: dict[str, float | int],
    ) -> RolloutSample:
        """Score one prompt's trajectories and pack them as a RolloutSample carrying the global `status`."""
        tok = self.policy.tokenizer
        texts = [tok.decode(t.response_ids) for t in group]
        rewards = [self.task.reward(prompt, text) for text in texts]
        self.window.add_sample(group, rewards)
        self.counters.tokens += sum(t.generated_tokens for t in group)
        self.counters.partial_swaps += sum(int(t.version_start < t.version_end) for t in group)
        self.counters.tool_calls += sum(len(t.tool_call_s) for t in group)
        tool_calls = [sum(t.tool_call_s) for t in group] if self.multi_turn else []  # per row, as verl
        self.counters.versions_loaded = self.weights.loads
        return build_rollout_sample(
            sample_id=sample_id,
            epoch=epoch,
            param_version=param_version,
            producer=self.name,
            trajectories=group,
            rewards=rewards,
            raw_prompt=prompt.text,
            ground_truth=prompt.answer,
            tokenizer=tok,
            rollout_status=status,
            tool_calls=tool_calls,
            response_texts=texts,
        )

    def _publish(
        self, samples: Sequence[RolloutSample], before: tuple[int, int], after: tuple[int, int] | None = None
    ) -> None:
        """XADD the samples, mark them published and advance the cursor, in one MULTI/EXEC. A transaction
        runs every command even when one fails (an XADD refused: the stream's last id is exhausted, or
        the stream is gone), so a failed publish is undone at once: the published count goes back down,
        the cursor back to `before` (the prompts' start) with the next seq, and PublishError is raised."""
        keys = self.ctx.keys
        pipe = self.ctx.r.pipeline(transaction=True)
        for s in samples:
            pipe.xadd(keys.rollouts_of(self.name), encode(s), nomkstream=True)  # type: ignore[arg-type]
        mark_published(pipe, keys, self.name, len(samples))
        epoch, index = after if after is not None else self.source.cursor
        pipe.set(keys.producer_cursor(self.name), encode_cursor(epoch, index))
        res, acked = execute_and_wait(pipe, raise_on_error=False)
        refused = [x for x in res[: len(samples)] if x is None or isinstance(x, Exception)]
        if refused:
            undo = self.ctx.r.pipeline(transaction=True)
            undo.decrby(keys.producer_published(self.name), len(samples))
            undo.set(keys.producer_cursor(self.name), encode_cursor(*before))
            undo.execute()
            self.source.cursor = before
            self.next_seq -= len(samples)
            if refused[0] is None:
                raise RunNotSetUpError.for_stream(keys.rollouts_of(self.name))
            raise PublishError(
                f"XADD to {keys.rollouts_of(self.name)} refused ({refused[0]}); cursor and published count "
                "kept"
            )
        # too few replicas acknowledged: a ConnectionError, so the loop's reconnect reloads the cursor and
        # published count from the primary (a failover that lost the write re-dispatches the same seqs)
        require_acks(self.ctx.r.connection_pool, acked, f"publish of {len(samples)} samples")
        self.counters.published += len(samples)
