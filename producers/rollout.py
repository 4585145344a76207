"""Rollouts: prompts -> the `GenerationRequest` a dispatch generates (token lists, one per row; a prompt's
n rows are its `prepare_single_generation_data`), the `Trajectory` an agent loop fills, and finished
trajectories -> one RolloutSample in the wire conventions the trainer reads (`build_rollout_sample`: ragged
arrays, nothing padded). Producers publish what this module builds, and the test and benchmark fakes
(rollstream/testing/fakes.py) are built with it too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollstream.model import Tokenizer
from rollstream.model.chat import encode_prompt
from rollstream.tasks import Prompt, RewardResult
from schemas import RolloutSample
from schemas.batch import object_array
from schemas.ragged import RaggedBatch

#: Agent loop names (verl's): multi-turn tool agent, and plain single-turn generation.
AGENT_TOOL = "async_partial_tool_agent"
AGENT_SINGLE_TURN = "partial_single_turn_agent"


@dataclass
class Trajectory:
    """One trajectory of an agent loop (one or more generate calls, tool results between them): tokens,
    per-token masks and log-probs, versions, timings.

    `response_mask[i]` is 1 for a model-generated token and 0 for a tool-result token; `log_probs[i]`
    is the behaviour log-prob of a generated token (0.0 for tool tokens). `version_start`/`version_end`
    are the param versions that generated the first/last generated token; `turn_versions` holds, per model
    turn, the versions of its first and last token (a swap between turns shows where it happened).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False
    num_turns: int = 0
    version_start: int = -1
    version_end: int = -1
    processing_time_s: float = 0.0
    tool_call_s: list[float] = field(default_factory=list)
    turn_versions: list[list[int]] = field(default_factory=list)

    def extend(self, ids: Sequence[int], log_probs: Sequence[float] | None, generated: bool) -> None:
        """Append tokens: generated ones with their log-probs (mask 1), tool ones with 0.0 (mask 0)."""
        self.response_ids.extend(ids)
        self.response_mask.extend([int(generated)] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    @property
    def generated_tokens(self) -> int:
        """Number of model-generated response tokens."""
        return sum(self.response_mask)


@dataclass(frozen=True)
class GenerationRequest:
    """What a dispatch hands its generation: each row's prompt ids, unpadded (prompts x n rows,
    prompt-major: a prompt's n rows are contiguous), and the agent loop (`agent`, one per request) that
    generates them. Token lists straight through, nothing padded: the agent loops, the engines
    (`generate(prompts: list[list[int]], ...)`) and the latency model read nothing else; the group's sample
    id, the prompt text and its answer stay with the producer, which packs each group's trajectories with
    them (`build_rollout_sample`)."""

    rows: list[list[int]]  # read only: a prompt's n rows are one list (each Trajectory copies its own)
    agent: str = AGENT_SINGLE_TURN

    def __post_init__(self) -> None:
        if self.agent not in (AGENT_SINGLE_TURN, AGENT_TOOL):
            raise ValueError(f"unknown agent {self.agent!r} (expected {AGENT_SINGLE_TURN} or {AGENT_TOOL})")

    def __len__(self) -> int:
        return len(self.rows)


def prepare_single_generation_data(
    prompt: Prompt, n: int, multi_turn: bool, tokenizer: Tokenizer
) -> GenerationRequest:
    """One prompt's generation request, its row repeated `n` times (verl's seed name for it; the trainer's
    counterpart is `assemble_batch_from_rollout_samples` in consumers/trainer/assembly.py): the prompt's ids
    (`encode_prompt`: the chat template's rendering when the tokenizer uses one, else bos + prompt ids) as
    n rows sharing one read-only list, without the padded tensors nothing reads; agent
    `async_partial_tool_agent` when multi-turn is on, else `partial_single_turn_agent`."""
    if n < 1:
        raise ValueError(f"rollout.n must be >= 1, got {n}")
    ids = encode_prompt(tokenizer, prompt.text)
    return GenerationRequest([ids] * n, AGENT_TOOL if multi_turn else AGENT_SINGLE_TURN)


def generation_request(
    prompts: Sequence[Prompt], n: int, multi_turn: bool, tokenizer: Tokenizer
) -> GenerationRequest:
    """Several prompts as one dispatch's request: each prompt's `prepare_single_generation_data`, in order
    (prompts x n rows, prompt-major)."""
    rows: list[list[int]] = []
    for prompt in prompts:
        rows.extend(prepare_single_generation_data(prompt, n, multi_turn, tokenizer).rows)
    return GenerationRequest(rows, AGENT_TOOL if multi_turn else AGENT_SINGLE_TURN)


def failed_trajectories(request: GenerationRequest, param_version: int, seconds: float) -> list[Trajectory]:
    """One empty trajectory per row of a generation request whose generation failed: the row's prompt, no
    response, unfinished (the producer still publishes the group, marked as a rollout failure)."""
    return [
        Trajectory(
            prompt_ids=list(row), version_start=param_version, version_end=param_version,
            processing_time_s=seconds,
        )
        for row in request.rows
    ]


def token_scores(
    tokenizer: Tokenizer, response_ids: Sequence[int], response_mask: Sequence[int], reward: RewardResult
) -> np.ndarray:
    """Per-token credit [len(response_ids)] float32 of one response: each generated token gets the
    `char_scores` of the characters it decodes to; when the tokens' texts do not line up with the
    characters (or the task gives no char_scores) the whole score goes on the last generated token."""
    out = np.zeros(len(response_ids), dtype=np.float32)
    chars = reward.char_scores
    if chars is not None:
        lengths = [len(tokenizer.decode([t])) for t in response_ids]
        if sum(lengths) == len(chars) and all(
            m or not n for m, n in zip(response_mask, lengths, strict=True)
        ):
            pos = 0
            for i, n in enumerate(lengths):
                out[i] = sum(chars[pos : pos + n])
                pos += n
            return out
    generated = [i for i, m in enumerate(response_mask) if m]
    if generated:
        out[generated[-1]] = reward.score
    return out


def ragged_batch(
    trajectories: Sequence[Trajectory], vocab_size: int, token_scores_rows: Sequence[np.ndarray] | None = None
) -> RaggedBatch:
    """The trajectories' tokens as ragged arrays (`RaggedBatch.from_rows`: the prompt once when every row
    has the same one, behaviour log-probs 0.0 where a tool wrote the token, the loss mask only when one did,
    ids in the narrowest dtype holding the vocabulary; ValueError naming the row when an id is outside it)."""
    return RaggedBatch.from_rows(
        [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories],
        [t.response_mask for t in trajectories], [t.log_probs for t in trajectories], vocab_size,
        token_scores_rows,
    )


def build_rollout_sample(
    *,
    sample_id: str,
    epoch: int,
    param_version: int,
    producer: str,
    trajectories: Sequence[Trajectory],
    rewards: Sequence[RewardResult],
    raw_prompt: str,
    tokenizer: Tokenizer,
    rollout_status: Mapping[str, float | int],
    tool_calls: Sequence[float] = (),
    ground_truth: str | None = None,
    response_texts: Sequence[str] | None = None,
) -> RolloutSample:
    """Pack one prompt's n trajectories as a RolloutSample, ragged (`ragged_batch`: nothing padded);
    token-level `token_level_scores` are added when every reward splits its score over the text
    (char_scores), non-tensor `ground_truth` (the reference answer, per row) when given; `tool_calls` holds
    each trajectory's total tool seconds (or nothing); `response_texts` are the decoded responses when the
    caller already has them (decoded here otherwise)."""
    n = len(trajectories)
    if n == 0 or len(rewards) != n:
        raise ValueError(f"need >= 1 trajectory and one reward each, got {n} and {len(rewards)}")
    scores = None
    if all(rw.char_scores is not None for rw in rewards):  # the task splits its reward over the text
        scores = [token_scores(tokenizer, t.response_ids, t.response_mask, rw)
                  for t, rw in zip(trajectories, rewards, strict=True)]
    batch = ragged_batch(trajectories, tokenizer.vocab_size, scores)
    batch.rows["rewards"] = np.asarray([rw.score for rw in rewards], dtype=np.float32)
    texts = (
        list(response_texts)
        if response_texts is not None
        else [tokenizer.decode(t.response_ids) for t in trajectories]
    )
    batch.non_tensors.update({
        "uid": object_array([sample_id] * n),
        "raw_prompt": object_array([raw_prompt] * n),
        "response_text": object_array(texts),
        **({"ground_truth": object_array([ground_truth] * n)} if ground_truth is not None else {}),
    })
    batch.check()
    outputs = [
        {
            "num_turns": t.num_turns,
            "response_length": len(t.response_ids),
            "reward": float(rw.score),
            "exact": bool(rw.exact),
            "finished": bool(t.finished),
            **({"turn_versions": [list(v) for v in t.turn_versions]} if t.num_turns > 1 else {}),
        }
        for t, rw in zip(trajectories, rewards, strict=True)
    ]
    return RolloutSample(
        sample_id=sample_id,
        epoch=epoch,
        param_version=param_version,
        full_batch=batch,
        agent_loop_output_list=outputs,
        processing_times=[t.processing_time_s for t in trajectories],
        tool_calls=list(tool_calls),
        param_version_start=[
            t.version_start if t.version_start >= 0 else param_version for t in trajectories
        ],
        param_version_end=[t.version_end if t.version_end >= 0 else param_version for t in trajectories],
        rollout_status=dict(rollout_status),
        producer=producer,
    )
