"""`DataProto`: a verl-like, numpy-backed batch of rows (trajectories) with per-row arrays: the padded
batch a schema-1 rollout carried, still decoded (schemas/payload.py) and read into the ragged form
(schemas/legacy.py `from_padded`); `object_array`: the per-row object arrays of every batch's non_tensors."""

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
