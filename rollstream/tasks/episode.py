"""Tool episodes outside the producers: where a turn is cut at its tool call (`tool_cut`, which the producers'
agent loop uses too), and greedy episodes with the tool run between turns (`greedy_episodes`) for the
trainer's validation, the warm start's report and the scripts, so each is scored as the producers run it.

An episode's response is the model's turns and the tool turns between them in one id list: a turn is cut
after its first complete call, the tool's result follows as the chat template's tool turn
(`encode_tool_result`), and the next turn is generated with the whole history as its prompt, up to
`max_turns` turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollstream.model import BasePolicy, Tokenizer
from rollstream.model.chat import encode_tool_result
from rollstream.tasks.base import Task


def tool_cut(task: Task, tokenizer: Tokenizer, ids: Sequence[int]) -> int | None:
    """Length of the shortest prefix of `ids` that ends with a complete tool call (None: no call before
    eos)."""
    for k in range(1, len(ids) + 1):
        if ids[k - 1] == tokenizer.eos_id:
            return None
        if task.tool(tokenizer.decode(ids[:k])) is not None:
            return k
    return None


@dataclass
class Episode:
    """One greedy episode: its response ids (model turns and tool turns), which of them the model wrote
    (`generated`: 1, tool turn: 0) and its turns."""

    response_ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    turns: int = 0

    def extend(self, ids: Sequence[int], generated: bool) -> None:
        """Append `ids`, written by the model or not."""
        self.response_ids.extend(ids)
        self.generated.extend([int(generated)] * len(ids))


def greedy_episodes(
    policy: BasePolicy,
    task: Task,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    max_turns: int,
) -> list[Episode]:
    """Greedy-decode each prompt through the tool loop (one turn when the task has no tool or `max_turns` is
    1): `max_new_tokens` per turn, a turn cut after its first complete call and the tool's turn appended, the
    next turn generated from the whole history, within the model's `max_seq_len`."""
    tok = policy.tokenizer
    limit = policy.max_seq_len
    turns = max_turns if task.multi_turn else 1
    episodes = [Episode() for _ in prompt_ids]
    active = list(range(len(prompt_ids)))
    for turn in range(turns):
        if not active:
            break
        histories = [prompt_ids[i] + episodes[i].response_ids for i in active]
        room = max_new_tokens if limit is None else limit - max(len(h) for h in histories)
        new_tokens = min(max_new_tokens, room)
        if new_tokens <= 0:
            break
        out = policy.generate(histories, n=1, max_new_tokens=new_tokens, greedy=True)
        still: list[int] = []
        for i, completion in zip(active, out, strict=True):
            ep = episodes[i]
            ids = completion.response_ids
            cut = tool_cut(task, tok, ids) if turns > 1 else None
            ep.extend(ids if cut is None else ids[:cut], generated=True)
            ep.turns += 1
            if cut is None:
                continue
            ep.extend(encode_tool_result(tok, task.tool(tok.decode(ids[:cut])) or ""), generated=False)
            if turn + 1 < turns:
                still.append(i)
        active = still
    return episodes
