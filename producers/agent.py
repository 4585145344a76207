"""Agent loops: generation requests (prompt ids per row) -> finished Trajectories.

`partial_single_turn_agent`: one `policy.generate` call for all rows (prompts x n).
`async_partial_tool_agent` (arith + calculator): generate a turn, cut it after its first complete
`[calc:EXPR]`, run the tool, append the result tokens (response_mask 0, log-prob 0; with a chat template,
the template's end of the assistant turn, a `tool` message and the next assistant prompt), and generate
the next turn with the whole history as the prompt, up to `max_turns` turns.

Weight sync: with partial rollout on, every `sync_every_tokens` decoded tokens (and between turns) the
loop asks its `VersionSource` to load newer weights; `Completion.swap_points` then says from which
token on each row used them, which gives each trajectory's first and last generating version.
With partial rollout off, weights never change inside a call (start == end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from producers.rollout import AGENT_TOOL, GenerationRequest, Trajectory
from rollstream.config import PipelineConfig
from rollstream.model import Completion, Tokenizer
from rollstream.model.chat import encode_tool_result
from rollstream.tasks import Task
from rollstream.tasks.episode import tool_cut


class GeneratingPolicy(Protocol):
    """What an agent loop needs from a policy (BasePolicy, or a scripted fake in tests)."""

    tokenizer: Tokenizer

    @property
    def max_seq_len(self) -> int | None:
        """Longest prompt + response the model allows, or None."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        sync_every_tokens: int = 0,
        on_chunk: Callable[[], bool] | None = None,
        top_k: int = -1,
    ) -> list[Completion]:
        """Sample n responses per prompt (prompt-major)."""
        ...


class VersionSource(Protocol):
    """The weights a loop generates with: their version, and a way to load newer ones."""

    @property
    def version(self) -> int:
        """Param version currently loaded in the policy."""
        ...

    def refresh(self) -> bool:
        """Load the newest published weights when newer than `version`; True when it did."""
        ...


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling and sync settings of the agent loops (from `rollout.*` and `data.max_response_length`)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    partial_rollout: bool = True
    sync_every_tokens: int = 4
    max_turns: int = 3

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> GenerationSettings:
        """The settings a pipeline config describes."""
        ro = cfg.rollout
        return cls(
            max_new_tokens=cfg.data.max_response_length,
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            partial_rollout=cfg.async_training.partial_rollout,
            sync_every_tokens=ro.sync_every_tokens,
            max_turns=ro.multi_turn.max_turns,
        )


def _generate_turn(
    policy: GeneratingPolicy,
    histories: list[list[int]],
    max_new_tokens: int,
    settings: GenerationSettings,
    weights: VersionSource,
    generator: torch.Generator | None,
) -> tuple[list[Completion], int, list[int]]:
    """One generate call over `histories` (n=1 each) -> (trajectories, version at start, version after each
    swap)."""
    swaps: list[int] = []

    def on_chunk() -> bool:
        if weights.refresh():
            swaps.append(weights.version)
            return True
        return False

    start = weights.version
    out = policy.generate(
        histories,
        n=1,
        max_new_tokens=max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        generator=generator,
        sync_every_tokens=settings.sync_every_tokens if settings.partial_rollout else 0,
        on_chunk=on_chunk if settings.partial_rollout else None,
    )
    return out, start, swaps


def version_of_last_token(traj: Completion, kept: int, start: int, swaps: list[int]) -> int:
    """Version that generated token kept-1: a row alive at swap k saw swaps 0..k, so count its swap points."""
    seen = sum(1 for s in traj.swap_points if s < kept)
    return swaps[seen - 1] if seen else start


def end_turn(t: Trajectory, g: Completion, task: Task | None, tok: Tokenizer, start: int, swaps: list[int],
             turn_s: float) -> bool:
    """Add a finished turn to trajectory `t`: completion `g`, begun under version `start` with the versions
    loaded at its swap points `swaps`, `turn_s` seconds; cut after its first complete tool call when `task`
    runs the tool agent, the tool then run and its result appended. True when a tool was called (another turn
    may follow)."""
    cut = tool_cut(task, tok, g.response_ids) if task is not None else None
    kept = len(g.response_ids) if cut is None else cut
    if kept:
        first = version_of_last_token(g, 1, start, swaps)
        if t.version_start < 0:
            t.version_start = first
        t.version_end = version_of_last_token(g, kept, start, swaps)
        t.turn_versions.append([first, t.version_end])
    t.extend(g.response_ids[:kept], g.log_probs[:kept], generated=True)
    t.num_turns += 1
    t.processing_time_s += turn_s
    if cut is None or task is None:
        t.finished = g.finished
        return False
    c0 = time.perf_counter()
    result = task.tool(tok.decode(g.response_ids[:kept])) or ""
    t.tool_call_s.append(time.perf_counter() - c0)
    t.processing_time_s += t.tool_call_s[-1]
    t.extend(encode_tool_result(tok, result), None, generated=False)
    return True


def run_agent_loop(
    policy: GeneratingPolicy,
    task: Task,
    request: GenerationRequest,
    settings: GenerationSettings,
    weights: VersionSource,
    generator: torch.Generator | None = None,
) -> list[Trajectory]:
    """Generate every row of `request` (its prompt ids) with the agent loop it names; returns one
    Trajectory per row, in row order."""
    agent = request.agent
    max_turns = settings.max_turns if agent == AGENT_TOOL else 1
    tok = policy.tokenizer
    limit = policy.max_seq_len

    trajs = [Trajectory(prompt_ids=list(r)) for r in request.rows]
    active = list(range(len(trajs)))
    for turn in range(max_turns):
        if not active:
            break
        if turn > 0 and settings.partial_rollout:
            weights.refresh()  # between turns: newer weights for the next turn
        histories = [trajs[i].prompt_ids + trajs[i].response_ids for i in active]
        room = settings.max_new_tokens if limit is None else limit - max(len(h) for h in histories)
        max_new = min(settings.max_new_tokens, room)
        if max_new <= 0:
            break  # no room left in the context window: trajectories end unfinished
        t0 = time.perf_counter()
        out, start, swaps = _generate_turn(policy, histories, max_new, settings, weights, generator)
        turn_s = time.perf_counter() - t0

        tool_task = task if agent == AGENT_TOOL else None
        called = [i for i, g in zip(active, out, strict=True)
                  if end_turn(trajs[i], g, tool_task, tok, start, swaps, turn_s)]
        active = called if turn + 1 < max_turns else []
    return trajs
