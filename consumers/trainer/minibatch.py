"""A local update's mini-batch as the learner trains it: the padded tensors the assembly built, its rows and
micro-batches (row views, each without its all-padding columns) and what every epoch of the update shares
(its metrics: consumers/trainer/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollstream.rl.rollout_correction import Correction
from schemas import DataProto


def micro_slices(rows: int, micro_batch_size: int) -> list[slice]:
    """Row ranges of the micro-batches of a `rows`-row mini-batch (one range when micro_batch_size is 0)."""
    size = micro_batch_size if micro_batch_size > 0 else max(rows, 1)
    return [slice(s, min(s + size, rows)) for s in range(0, rows, size)]


def placed(parts: list[torch.Tensor], slices: list[slice], like: torch.Tensor) -> torch.Tensor | None:
    """Per micro-batch results [b, w] (its own response width) at its rows of a mini-batch tensor shaped like
    `like` [B, W], 0 in the columns its trim left off (one untrimmed micro-batch: its result as it is); None
    when there are none."""
    if not parts:
        return None
    if len(parts) == 1 and parts[0].shape == like.shape:
        return parts[0]
    out = torch.zeros_like(like)
    for part, rows in zip(parts, slices, strict=True):
        out[rows, : part.shape[1]] = part
    return out


@dataclass
class Padded:
    """A padded batch's tensors on the device: the mini-batch the assembly built, or rows of it (a
    micro-batch: views), with each row's prompt and response length (on the CPU) to trim by."""

    ids: torch.Tensor  # [b, P+w] long
    mask: torch.Tensor  # [b, P+w] long
    resp_mask: torch.Tensor  # [b, w] float
    behave: torch.Tensor  # [b, w] float
    prompt_lens: torch.Tensor  # [b] long, on the CPU
    response_lens: torch.Tensor  # [b] long, on the CPU

    def rows(self, sel: slice | torch.Tensor) -> Padded:
        """These rows: a slice gives views (no copy), a bool mask [b] the rows copied out."""
        cpu = sel.cpu() if isinstance(sel, torch.Tensor) else sel
        dev = sel.to(self.ids.device) if isinstance(sel, torch.Tensor) else sel
        return Padded(self.ids[dev], self.mask[dev], self.resp_mask[dev], self.behave[dev],
                      self.prompt_lens[cpu], self.response_lens[cpu])

    def trimmed(self) -> Padded:
        """Without the columns that are padding in every row (the leading prompt and the trailing response
        ones): views, the rows' own widest prompt and response (at least one response column)."""
        W = self.resp_mask.shape[1]
        P = self.ids.shape[1] - W
        p, r = int(self.prompt_lens.max()), min(max(int(self.response_lens.max()), 1), W)
        cols = slice(P - p, P + r)
        return Padded(self.ids[:, cols], self.mask[:, cols], self.resp_mask[:, :r], self.behave[:, :r],
                      self.prompt_lens, self.response_lens)


def padded_tensors(batch: DataProto, dev: torch.device) -> tuple[Padded, torch.Tensor, torch.Tensor | None]:
    """A padded batch's arrays as tensors, the token ones on dev -> (the batch, rewards [B] and
    token_level_scores [B, W] or None, on the CPU)."""
    t = batch.tensors

    def tensor(key: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(t[key]))

    mask = tensor("attention_mask").long()
    P = mask.shape[1] - t["response_mask"].shape[1]
    padded = Padded(
        ids=tensor("input_ids").long().to(dev), mask=mask.to(dev),
        resp_mask=tensor("response_mask").float().to(dev), behave=tensor("rollout_log_probs").float().to(dev),
        prompt_lens=mask[:, :P].sum(-1), response_lens=mask[:, P:].sum(-1),
    )
    scores = tensor("token_level_scores").float() if "token_level_scores" in t else None
    return padded, tensor("rewards").float(), scores


@dataclass
class Prepared:
    """What every epoch of a local update shares, taken once before its first: the trained rows'
    micro-batches and advantages, the log-probs before the update and the rollout correction, and what the
    loss divides by."""

    micro: list[Padded]  # the trained rows' micro-batches (views, trimmed)
    slices: list[slice]  # each micro-batch's rows of the trained rows
    adv: torch.Tensor  # [kept] outcome or [kept, W] token-level advantages
    resp_mask: torch.Tensor  # [kept, W] the trained rows' response mask
    behave: torch.Tensor  # [kept, W] their sampling log-probs
    old: torch.Tensor | None  # [kept, W] proximal (bypass mode with rejection: the policy's own) log-probs
    ref: torch.Tensor | None  # [kept, W] reference log-probs (KL)
    correction: Correction | None  # rollout correction over the mini-batch
    loss_mask: torch.Tensor  # [kept, W] the response mask after rejection
    total: float  # what this rank's loss aggregation divides by
    trained_total: float  # the same over the trained rows (the metrics' means)
    tokens: float  # loss-mask tokens of the trained rows
    every_total: float  # `total` summed over the data-parallel ranks
    ranks: int  # the ranks whose gradients DDP averages
    left_out: bool  # zero-advantage rows were left out of the forward
    temp: float  # the sampling temperature the log-probs are taken at

    @property
    def is_w(self) -> torch.Tensor | None:
        """[kept, W] IS weights (decoupled mode), the correction's."""
        return self.correction.weights if self.correction is not None else None
