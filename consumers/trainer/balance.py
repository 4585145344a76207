"""Balance an assembled batch's tokens across data-parallel ranks (verl's `balance_batch`), by whole groups.

verl reorders single rows because it groups GRPO rows by `uid`; our learner reads a group as contiguous
rows (`meta_info["group_sizes"]`), so whole groups move. Each of `world_size` ranks gets the same number
of groups (train_batch_size / world_size samples, as the trainer takes them) and about the same number of
tokens: groups are taken largest first and each goes to the rank with the fewest tokens that still has
room (greedy LPT). Rank r's groups are then rows [r * rows/world_size …) of the result when all groups
have the same size n.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from schemas import DataProto

#: meta_info lists with one entry per group / per row, permuted with the groups.
PER_GROUP_META = ("sample_ids", "group_sizes", "rollout_param_versions")
PER_ROW_META = ("trajectory_param_versions",)


def partition_groups(tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Group indices per rank: equal counts, token sums balanced greedily (largest group first)."""
    if world_size < 1 or len(tokens) % world_size:
        raise ValueError(f"{len(tokens)} groups cannot be split evenly over world_size={world_size}")
    room = len(tokens) // world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    sums = [0] * world_size
    for g in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world_size) if len(parts[r]) < room), key=lambda r: (sums[r], r))
        parts[rank].append(g)
        sums[rank] += tokens[g]
    return [sorted(p) for p in parts]


def balance_groups_by_tokens(world_size: int) -> Callable[[DataProto], DataProto]:
    """A `balance_batch` callable for assemble_batch_from_rollout_samples that spreads tokens over ranks."""

    def balance(batch: DataProto) -> DataProto:
        """The batch with its groups reordered rank by rank (meta_info lists permuted alike)."""
        sizes = [int(n) for n in batch.meta_info["group_sizes"]]
        starts = np.cumsum([0, *sizes])
        mask = batch.tensors["attention_mask"]
        tokens = [int(mask[starts[i] : starts[i + 1]].sum()) for i in range(len(sizes))]
        order = [g for part in partition_groups(tokens, world_size) for g in part]
        rows = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in order])
        out = batch[rows]
        meta = dict(batch.meta_info)
        for key in PER_GROUP_META:
            if key in meta:
                meta[key] = [meta[key][g] for g in order]
        for key in PER_ROW_META:
            if key in meta:
                meta[key] = [meta[key][int(i)] for i in rows]
        out.meta_info = meta
        return out

    return balance
