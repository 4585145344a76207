"""A local update's mini-batch, from the samples' ragged rows to the tensors the learner trains on, padded
once.

  MiniBatch   the samples' rows as they arrived (schemas/ragged.py: nothing padded), in sample order (a
              sample's n rows together: its GRPO group), with what the update reads per row before any
              padding (rewards, token counts); what assemble_batch_from_rollout_samples returns
  Padded      the one padded tensor set of the rows an update trains (`MiniBatch.padded`: the one place a
              sample's tokens are padded, by rollstream/model/scoring.py's padder, straight from the ragged
              arrays): prompts left-padded, responses and every per-token array right-padded, each to the
              rows' widest, in the dtypes the forward and the loss take. Its micro-batches
              are row views of it, each cut to its own rows' widest prompt and response, carrying which of
              its rows share a prompt (as the ragged form numbers them) to the forward; a per-token array
              derived for the trained rows ([kept, W]: advantages, frozen log-probs, masks) is laid out as
              the set is, and a micro-batch takes its part of one as a view (`Padded.view`)
  Prepared    what every epoch of the update shares (the derived arrays, what the loss divides by)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollstream.model import PromptGroups
from rollstream.model.base import common_prefix_len
from rollstream.model.scoring import pad_ids, pad_values
from rollstream.rl.rollout_correction import Correction
from schemas.ragged import LOG_PROBS, RESPONSE_MASK, TOKEN_SCORES, RaggedBatch


def micro_slices(rows: int, micro_batch_size: int) -> list[slice]:
    """Row ranges of the micro-batches of a `rows`-row mini-batch (one range when micro_batch_size is 0)."""
    size = micro_batch_size if micro_batch_size > 0 else max(rows, 1)
    return [slice(s, min(s + size, rows)) for s in range(0, rows, size)]


def _loss_tokens(b: RaggedBatch) -> np.ndarray:
    """Each row's tokens that count for the loss [n]: its response_mask's sum, else its response length."""
    mask = b.tokens.get(RESPONSE_MASK)
    if mask is None:
        return b.response_lens.astype(np.float64)
    sums = np.concatenate([[0.0], np.cumsum(mask, dtype=np.float64)])
    offsets = b.response_offsets()
    return sums[offsets[1:]] - sums[offsets[:-1]]


@dataclass
class MiniBatch:
    """A local update's rows as the samples sent them, in sample order, with the per-row values the update
    reads before any padding; `padded` builds the tensors it trains on."""

    batches: list[RaggedBatch]  # the samples' ragged batches, in order
    rewards: Tensor  # [B] float32 on the CPU
    row_tokens: Tensor  # [B] float64 on the CPU: each row's prompt + response tokens
    response_tokens: Tensor  # [B] float64 on the CPU: each row's loss tokens (its response mask's sum)
    meta_info: dict[str, Any]  # verl's names (consumers/trainer/assembly.py)

    @classmethod
    def of(cls, batches: Sequence[RaggedBatch], meta_info: dict[str, Any]) -> MiniBatch:
        """The rows of `batches` (every one carries `rewards`) with their per-row values."""
        rewards = np.concatenate([b.rows["rewards"] for b in batches])
        tokens = [p + r for b in batches for p, r in zip(b.row_prompt_lens(), b.response_lens.tolist(),
                                                         strict=True)]
        return cls(
            batches=list(batches), rewards=torch.from_numpy(rewards).float(),
            row_tokens=torch.tensor(tokens, dtype=torch.float64),
            response_tokens=torch.from_numpy(np.concatenate([_loss_tokens(b) for b in batches])),
            meta_info=meta_info,
        )

    def __len__(self) -> int:
        """Number of rows."""
        return int(self.rewards.shape[0])

    @property
    def group_sizes(self) -> list[int]:
        """Rows per sample, in order (GRPO's groups)."""
        return list(self.meta_info["group_sizes"])

    def padded(self, keep: Tensor | None, device: torch.device) -> Padded:
        """The one padded tensor set of the rows `keep` marks ([B] bool; None: every row), in order, with
        each row's prompt label (the rows of a sample that sent its prompt once share one) and the leading
        tokens every distinct prompt shares; token tensors on `device`, lengths and scores on the CPU."""
        bs, cat = self.batches, np.concatenate
        # every row's prompt and response as runs of the batches' arrays, concatenated
        p_base = np.cumsum([0] + [b.prompt_ids.size for b in bs])
        r_base = np.cumsum([0] + [b.response_ids.size for b in bs])
        p_start = cat([np.asarray(b.prompt_offsets()[:-1], np.int64) + p_base[k] for k, b in enumerate(bs)])
        r_start = cat([np.asarray(b.response_offsets()[:-1], np.int64) + r_base[k] for k, b in enumerate(bs)])
        p_len = cat([np.asarray(b.row_prompt_lens(), np.int64) for b in bs])
        r_len = cat([b.response_lens.astype(np.int64) for b in bs])
        first_label = np.cumsum([0] + [1 if b.prompt_lens.size == 1 else len(b) for b in bs])
        labels = cat([np.full(len(b), first_label[k]) if b.prompt_lens.size == 1
                      else first_label[k] + np.arange(len(b)) for k, b in enumerate(bs)])
        if keep is not None:
            rows = keep.cpu().numpy()
            p_start, r_start, p_len, r_len = p_start[rows], r_start[rows], p_len[rows], r_len[rows]
            labels = labels[rows]
        prompts = (cat([b.prompt_ids for b in bs]), p_start, p_len)
        ids, mask, W = pad_ids(prompts, (cat([b.response_ids for b in bs]), r_start, r_len))  # [k, P+W]

        def per_token(key: str, absent: int | None = None) -> Tensor:
            """A per-token array of every batch (`absent`: the value of a batch that has none), padded."""
            flat = cat([b.tokens[key] if key in b.tokens or absent is None
                        else np.full(b.response_ids.size, absent, np.uint8) for b in bs])
            return pad_values((flat, r_start, r_len), W)  # [k, W] float32

        # the tokens every distinct prompt starts with (one row of each label)
        firsts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]]) if labels.size else labels
        distinct = [prompts[0][p_start[i] : p_start[i] + p_len[i]] for i in firsts]
        return Padded(
            ids=ids.to(device), mask=mask.to(device),
            resp_mask=per_token(RESPONSE_MASK, absent=1).to(device), behave=per_token(LOG_PROBS).to(device),
            scores=per_token(TOKEN_SCORES) if TOKEN_SCORES in bs[0].tokens else None,
            prompt_lens=torch.from_numpy(p_len), response_lens=torch.from_numpy(r_len),
            labels=labels, prefix_len=common_prefix_len(distinct) if len(distinct) > 1 else 0,
            rows=slice(None),
        )


@dataclass
class Padded:
    """The one padded tensor set of a local update's trained rows, or a micro-batch of it: views of some of
    its rows without the columns that are padding in every one of them (`micro_batches`)."""

    ids: Tensor  # [b, p+w] long, on the device
    mask: Tensor  # [b, p+w] long
    resp_mask: Tensor  # [b, w] float: the loss mask (0 at padding and at tokens a tool wrote)
    behave: Tensor  # [b, w] float: the sampling log-probs
    scores: Tensor | None  # [b, w] float token_level_scores on the CPU, or None (a micro-batch: None)
    prompt_lens: Tensor  # [b] long, on the CPU
    response_lens: Tensor  # [b] long, on the CPU
    labels: np.ndarray  # [b] each row's prompt, as the ragged form numbers them (one label per prompt)
    prefix_len: int  # leading tokens every distinct prompt of the mini-batch shares (0: none)
    rows: slice  # its rows of the mini-batch (the mini-batch: all)
    groups: PromptGroups | None = None  # (a micro-batch) its rows that share a prompt, for the forward

    def __len__(self) -> int:
        """Number of rows."""
        return len(self.labels)

    @property
    def width(self) -> int:
        """The response columns W (a micro-batch: its own rows' widest response, at least 1)."""
        return int(self.resp_mask.shape[1])

    def micro_batches(self, micro_batch_size: int) -> list[Padded]:
        """Micro-batches of micro_batch_size rows (0: one of every row): row views of this set, each without
        the columns that are padding in every one of its rows (the leading prompt and the trailing response
        ones: still views, at its rows' widest prompt and response, at least one response column)."""
        W = self.width
        P = self.ids.shape[1] - W
        out = []
        for rows in micro_slices(len(self.labels), micro_batch_size):
            plens, rlens, labels = self.prompt_lens[rows], self.response_lens[rows], self.labels[rows]
            p, w = int(plens.max()), min(max(int(rlens.max()), 1), W)
            cols = slice(P - p, P + w)
            out.append(Padded(
                self.ids[rows, cols], self.mask[rows, cols], self.resp_mask[rows, :w], self.behave[rows, :w],
                None, plens, rlens, labels, self.prefix_len, rows,
                PromptGroups.from_labels(labels, self.prefix_len, self.ids.device),
            ))
        return out

    def view(self, t: Tensor) -> Tensor:
        """This micro-batch's part of a tensor laid out as the mini-batch ([B] per row or [B, W] per token):
        a view of its rows (and of its response columns)."""
        return t[self.rows] if t.ndim == 1 else t[self.rows, : self.width]


@dataclass
class Prepared:
    """What every epoch of a local update shares, taken once before its first: the trained rows' tensors and
    micro-batches, their advantages, the log-probs before the update and the rollout correction (each laid
    out as the trained rows: [kept] or [kept, W]), and what the loss divides by."""

    mini: Padded  # the trained rows' padded tensor set [kept, P+W]
    micro: list[Padded]  # its micro-batches (row views at their own widths)
    adv: Tensor  # [kept] outcome or [kept, W] token-level advantages
    old: Tensor | None  # [kept, W] proximal (bypass mode with rejection: the policy's own) log-probs
    ref: Tensor | None  # [kept, W] reference log-probs (KL)
    correction: Correction | None  # rollout correction over the mini-batch
    loss_mask: Tensor  # [kept, W] the response mask after rejection
    total: float  # what this rank's loss aggregation divides by
    trained_total: float  # the same over the trained rows (the metrics' means)
    tokens: float  # loss-mask tokens of the trained rows
    every_total: float  # `total` summed over the data-parallel ranks
    ranks: int  # the ranks whose gradients DDP averages
    left_out: bool  # zero-advantage rows were left out (never padded)
    temp: float  # the sampling temperature the log-probs are taken at

    @property
    def is_w(self) -> Tensor | None:
        """[kept, W] IS weights (decoupled mode), the correction's."""
        return self.correction.weights if self.correction is not None else None
