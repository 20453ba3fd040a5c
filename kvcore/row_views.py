"""A strided KV buffer as dense rows, and where each unit an engine names lies in them.

kvcore's mover copies rows of dense tensors by index. An engine's KV buffer is often
strided: an SGLang host buffer interleaves its layers, a vLLM host chunk holds every layer
of its pages in one row. The memory from such a buffer's first element to its last is
still a run of dense rows (:func:`dense_rows`), and a unit the engine indexes by (SGLang: a
slot; vLLM: a page) is a few consecutive rows of it at a fixed stride (:class:`RowMap`).
The adapters only read their engine's geometry into these two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcore.runs import check_index, span_of


def dense_rows(tensor: torch.Tensor, row_shape: Sequence[int]) -> torch.Tensor:
    """``tensor``'s memory from its first element to its last as a dense tensor of rows
    shaped ``row_shape`` (a view). ValueError unless that span is whole rows."""
    row = math.prod(row_shape)
    span = 0
    if tensor.numel():
        dims = zip(tensor.shape, tensor.stride(), strict=True)
        span = 1 + sum((size - 1) * stride for size, stride in dims)
    if row == 0 or span % row:
        raise ValueError(f"{span} elements are not whole rows of {tuple(row_shape)}")
    shape = (span // row, *row_shape)
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tensor.as_strided(shape, strides)


# Rows per unit up to which rows_of_array adds row by row rather than by broadcast.
_ROW_LOOP_WIDTH = 16


@dataclass(frozen=True, slots=True)
class RowMap:
    """Where each of ``units`` units lies among a dense view's rows: unit ``i`` is ``width``
    consecutive rows from ``(i // group) * period + (i % group) * width``, that is
    ``group`` units side by side and a group every ``period`` rows."""

    units: int
    group: int
    period: int
    width: int = 1
    index_name: str = field(default="index", compare=False)
    """What the engine calls the indices, for errors."""
    identity: bool = field(init=False, compare=False)
    """Whether unit ``i`` is row ``i``: one-row units in one group, or in groups that abut."""

    def __post_init__(self) -> None:
        same = self.width == 1 and (self.units <= self.group or self.period == self.group)
        object.__setattr__(self, "identity", same)

    @property
    def span(self) -> int:
        """Rows from the first unit's first row to the last unit's last row: the length of
        a view that holds every unit and no row past the last one."""
        if self.units == 0:
            return 0
        last = self.units - 1
        return (last // self.group) * self.period + (last % self.group) * self.width + self.width

    def rows_of(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of the units ``index`` names, unit after unit, as a CPU int64 tensor.

        Where the rows are the units (:attr:`identity`) the index comes back as it came
        (as int64) and unchecked: a view of :attr:`span` rows then has exactly
        :attr:`units` rows, so the plan made against it checks this very bound, and the
        caller passes over its indices once, not twice. Otherwise ValueError for a unit
        out of range, before the arithmetic could wrap it (int64) back into range.
        """
        index = check_index(index, self.index_name)
        if self.identity:
            return index
        values = index.numpy()
        span_of(values, self.units, self.index_name)
        # NumPy: each torch op on a CPU index costs several microseconds of dispatch, and
        # this runs on a reload's first call.
        return torch.from_numpy(self.rows_of_array(values))

    def rows_of_array(self, index: np.ndarray) -> np.ndarray:
        """:meth:`rows_of` for an int64 array of units the engine's own allocator handed
        out, unchecked: short of int64 overflow, which such ids never reach, a unit out of
        range lands out of the view (below row 0 or past :attr:`span`), where the plan
        made against the view refuses it."""
        if self.group == 1:
            first = index * self.period
        else:
            # groups * period + within * width, with within = index - groups * group.
            first = index // self.group
            first *= self.period - self.group * self.width
            first += index if self.width == 1 else index * self.width
        if self.width == 1:
            return first
        if self.width > _ROW_LOOP_WIDTH:
            return (first[:, None] + np.arange(self.width, dtype=np.int64)).ravel()
        # One strided add per row of a unit: NumPy's broadcast add over [n, width] costs
        # several times that for the few rows per unit the engines use.
        rows = np.empty((first.size, self.width), dtype=np.int64)
        for row in range(self.width):
            np.add(first, row, out=rows[:, row])
        return rows.reshape(-1)
