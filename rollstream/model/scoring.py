"""What a scoring forward (the log-probs of responses) takes: rows padded into the one layout every
backend scores, each row's prompt left-padded and its response right-padded, and which rows share a prompt
(`PromptGroups`: what the ragged form says, carried to the forward so that each prompt runs once).

The one padder: rows as `Runs` (a flat array, where each row starts in it and how long it is: the ragged
form's own layout, schemas/ragged.py) go into the layout in one vectorized copy per array (`pad_ids`,
`pad_values`); the trainer's mini-batch pads its rows so, and `build_batch` / `pad_right` pad lists of rows
(the warm starts, tests) through the same two functions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

#: One row's ids or per-token values: a list, or a 1-d array.
Row = Sequence[int] | Sequence[float] | np.ndarray
#: Rows as runs of one flat array: (the values [N], where each row's run starts [B], its length [B]).
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]


def runs_of(rows: Sequence[Row], dtype: type = np.int64) -> Runs:
    """Rows (lists or 1-d arrays) as runs of one flat array of `dtype`."""
    lens = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    flat: np.ndarray = np.fromiter(itertools.chain.from_iterable(rows), dtype, int(lens.sum()))
    return flat, np.cumsum(lens) - lens, lens


#: Mean run length from which rows are copied one slice each (memcpy speed) rather than in one fancy-indexed
#: copy, whose per-token index arrays cost more than a Python loop over long rows.
SLICE_RUN_LEN = 64


def _scatter(out: np.ndarray, runs: Runs, right_aligned: bool) -> None:
    """Row i's run into out[i] [B, width]: at its end (left padding) when right_aligned, else at its start;
    one fancy-indexed copy for short rows, one slice copy per row for long ones. The rest of `out` stays as
    it is."""
    flat, starts, lens = runs
    if lens.size and lens.sum() >= SLICE_RUN_LEN * lens.size:
        width = out.shape[1]
        for i, (start, n) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
            col = width - n if right_aligned else 0
            out[i, col : col + n] = flat[start : start + n]
        return
    row_of = np.repeat(np.arange(lens.size), lens)  # [N] each value's row
    within = np.arange(row_of.size) - np.repeat(np.cumsum(lens) - lens, lens)  # [N] its place in its run
    cols = within + np.repeat(out.shape[1] - lens, lens) if right_aligned else within
    out[row_of, cols] = flat[np.repeat(starts, lens) + within]


def pad_ids(prompts: Runs, responses: Runs, pad_id: int = 0) -> tuple[Tensor, Tensor, int]:
    """Rows of prompt and response ids in the scoring layout: each prompt left-padded to the widest P, each
    response right-padded to the widest R -> (ids [B, P+R] long, `pad_id` where padded; attention mask
    [B, P+R] long; R)."""
    plens, rlens = prompts[2], responses[2]
    if plens.size != rlens.size:
        raise ValueError(f"{plens.size} prompts but {rlens.size} responses")
    P, R = int(plens.max(initial=0)), int(rlens.max(initial=0))
    ids = torch.full((plens.size, P + R), pad_id, dtype=torch.long)
    ids_np = ids.numpy()  # a view: the copies below write the tensor
    _scatter(ids_np[:, :P], prompts, right_aligned=True)
    _scatter(ids_np[:, P:], responses, right_aligned=False)
    cols = np.arange(P + R)
    mask = (cols >= P - plens[:, None]) & (cols < P + rlens[:, None])  # [B, P+R]
    return ids, torch.from_numpy(mask.astype(np.int64)), R


def pad_values(values: Runs, width: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-token values of each row's response right-padded with 0 to `width`: [B, width] in `dtype`, the
    layout of pad_ids' response columns."""
    out = torch.zeros((values[2].size, width), dtype=dtype)
    _scatter(out.numpy(), values, right_aligned=False)
    return out


def build_batch(
    prompts: Sequence[Row], responses: Sequence[Row], pad_id: int = 0
) -> tuple[Tensor, Tensor, int]:
    """pad_ids of rows given as lists (or 1-d arrays) of ids -> (ids [B, P+R], mask [B, P+R], R)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return pad_ids(runs_of(prompts), runs_of(responses), pad_id)


def pad_right(rows: Sequence[Row], width: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """pad_values of rows given as lists (or 1-d arrays) of per-token values -> [B, width]."""
    return pad_values(runs_of(rows, np.float64), width, dtype)


@dataclass(frozen=True)
class PromptGroups:
    """Which rows of a scoring batch share a prompt, and how many leading tokens every prompt has in common:
    what the ragged form says (a sample's n rows share its one prompt: schemas/ragged.py), handed to the
    forward so that it runs each prompt once (HFPolicy._shared_forward). Tensors on the batch's device."""

    first: Tensor  # [U] long: the first row of each distinct prompt
    of_row: Tensor  # [B] long: each row's distinct prompt, an index into `first`
    prefix_len: int = 0  # leading tokens every distinct prompt starts with (0: none known)

    @classmethod
    def from_labels(
        cls, labels: Sequence[int] | np.ndarray, prefix_len: int = 0, device: torch.device | str = "cpu"
    ) -> PromptGroups:
        """From each row's prompt label: neighbouring rows with one label share a prompt."""
        labels = np.asarray(labels)
        starts = np.ones(labels.size, bool)
        starts[1:] = labels[1:] != labels[:-1]  # [B] a row whose prompt differs from the row before
        first, of_row = np.flatnonzero(starts), np.cumsum(starts) - 1
        return cls(torch.from_numpy(first).to(device), torch.from_numpy(of_row).to(device), prefix_len)

    @property
    def shares(self) -> bool:
        """Whether running each prompt once pays: at most half as many distinct prompts as rows (GRPO's n
        samples of a prompt)."""
        rows = self.of_row.shape[0]
        return rows >= 2 and 2 * self.first.shape[0] <= rows
