"""`DataProto`: a verl-like, numpy-backed batch of rows (trajectories) with per-row arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def object_array(values: Sequence[Any]) -> np.ndarray:
    """Build a 1-d object array holding `values` as they are (no nested-list broadcasting)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


class DataProto:
    """A batch: `tensors` and `non_tensors` share their first dim (rows); `meta_info` is batch-level."""

    __slots__ = ("tensors", "non_tensors", "meta_info")

    def __init__(
        self,
        tensors: Mapping[str, np.ndarray] | None = None,
        non_tensors: Mapping[str, np.ndarray] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> None:
        """Store the arrays and check that every one has the same first dimension."""
        self.tensors: dict[str, np.ndarray] = dict(tensors or {})
        self.non_tensors: dict[str, np.ndarray] = dict(non_tensors or {})
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self._check()

    @classmethod
    def adopt(
        cls, tensors: dict[str, Any], non_tensors: dict[str, Any], meta_info: dict[str, Any]
    ) -> DataProto:
        """Build a batch that takes ownership of fresh dicts (no copies; the codec's decode path); checked as
        in
        __init__."""
        self = cls.__new__(cls)
        self.tensors, self.non_tensors, self.meta_info = tensors, non_tensors, meta_info
        self._check()
        return self

    def _check(self) -> None:
        """Raise ValueError naming the first key whose type or first dimension is wrong."""
        first_key: str | None = None
        rows = -1
        for group, arrays in (("tensors", self.tensors), ("non_tensors", self.non_tensors)):
            tensors = group == "tensors"
            for key, arr in arrays.items():
                if not isinstance(key, str):
                    raise ValueError(f"DataProto {group} key {key!r} is not a str")
                if not isinstance(arr, np.ndarray):
                    raise ValueError(f"DataProto {group}[{key!r}] is {type(arr).__name__}, not a numpy array")
                shape = arr.shape
                if not shape:
                    raise ValueError(f"DataProto {group}[{key!r}] is 0-d; rows need a first dimension")
                if tensors and arr.dtype.hasobject:
                    raise ValueError(f"DataProto tensors[{key!r}] has object dtype; put it in non_tensors")
                if shape[0] != rows:
                    if first_key is not None:
                        raise ValueError(
                            f"DataProto {group}[{key!r}] has first dim {shape[0]}, "
                            f"expected {rows} (as {first_key!r})"
                        )
                    first_key, rows = key, shape[0]

    def __len__(self) -> int:
        """Number of rows (0 for an empty batch)."""
        for arrays in (self.tensors, self.non_tensors):
            for arr in arrays.values():
                return int(arr.shape[0])
        return 0

    def __repr__(self) -> str:
        """Short description: rows, keys with shapes and dtypes."""
        t = {k: f"{v.dtype}{list(v.shape)}" for k, v in self.tensors.items()}
        nt = {k: f"{v.dtype}{list(v.shape)}" for k, v in self.non_tensors.items()}
        return f"DataProto(len={len(self)}, tensors={t}, non_tensors={nt}, meta_info={list(self.meta_info)})"

    @staticmethod
    def concat(items: Sequence[DataProto]) -> DataProto:
        """Concatenate batches row-wise (same keys required); meta_info comes from the first."""
        if not items:
            raise ValueError("DataProto.concat needs at least one batch")
        first = items[0]
        for i, item in enumerate(items[1:], start=1):
            if (
                item.tensors.keys() != first.tensors.keys()
                or item.non_tensors.keys() != first.non_tensors.keys()
            ):
                raise ValueError(f"DataProto.concat: batch {i} has different keys than batch 0")
        return DataProto(
            {k: np.concatenate([it.tensors[k] for it in items], axis=0) for k in first.tensors},
            {k: np.concatenate([it.non_tensors[k] for it in items], axis=0) for k in first.non_tensors},
            first.meta_info,
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat rows: interleave gives r0,r0,…,r1,r1,…; otherwise the whole batch is tiled."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")

        def rep(arr: np.ndarray) -> np.ndarray:
            """Repeat one array along its first dim."""
            if interleave:
                return np.repeat(arr, repeat_times, axis=0)
            return np.tile(arr, (repeat_times,) + (1,) * (arr.ndim - 1))

        return DataProto(
            {k: rep(v) for k, v in self.tensors.items()},
            {k: rep(v) for k, v in self.non_tensors.items()},
            self.meta_info,
        )

    def select(
        self, tensor_keys: Sequence[str] | None = None, non_tensor_keys: Sequence[str] | None = None
    ) -> DataProto:
        """Keep only the named keys (None keeps all of that group); KeyError for an unknown key."""
        t = self.tensors if tensor_keys is None else {k: self.tensors[k] for k in tensor_keys}
        nt = (
            self.non_tensors if non_tensor_keys is None else {k: self.non_tensors[k] for k in non_tensor_keys}
        )
        return DataProto(t, nt, self.meta_info)

    def __getitem__(self, index: slice | np.ndarray | Sequence[int]) -> DataProto:
        """Rows by slice, integer index array or boolean mask (use [i:i+1] for a single row)."""
        if isinstance(index, int | np.integer):
            raise TypeError("DataProto[int] is not supported; use a slice [i:i+1] or an index array")
        if not isinstance(index, slice):
            index = np.asarray(index)
            if index.size == 0:
                index = index.astype(np.intp)
            if index.dtype.kind not in "biu":
                raise TypeError(f"DataProto index array must be int or bool, got {index.dtype}")
        return DataProto(
            {k: v[index] for k, v in self.tensors.items()},
            {k: v[index] for k, v in self.non_tensors.items()},
            self.meta_info,
        )
