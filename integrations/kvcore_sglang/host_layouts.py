"""Dense per-layer row views of SGLang's host KV buffers, for every host layout kvcore serves.

The mover copies rows of dense tensors. SGLang's host layouts keep one layer of a
token run dense only in ``layer_first``; in ``page_first`` and ``page_first_direct``
a layer's rows are interleaved with the other layers'. Every served layout is the
same shape seen differently: ``[blocks, layers, block, *row]``, a block being a run
of slots that one layer keeps contiguous (``layer_first``: all slots; ``page_first``:
one slot; ``page_first_direct``: one page). Flattening the first three dims gives a
dense tensor of rows; layer ``L``'s rows start ``L * block`` rows in and repeat every
``layers * block`` rows, so one dense view per layer and one slot-to-row map
(:class:`kvcore.row_views.RowMap`), the same for every layer, describe any served
layout. Plans made for one layer rebind to the others unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcore.row_views import RowMap, dense_rows
from kvcore.runs import check_index


@dataclass(frozen=True)
class BlockRows:
    """One host buffer as ``[blocks, layers, block, *row]`` rows."""

    rows: torch.Tensor
    """The whole buffer as a dense ``[blocks * layers * block, *row]`` view."""
    layers: int
    slot_map: RowMap
    """Where slot ``s`` lies in every :meth:`layer` view: ``block`` slots side by side, a
    block every ``layers * block`` rows (:meth:`RowMap.rows_of` checks the slots)."""

    @property
    def geometry(self) -> tuple[int, RowMap]:
        return self.layers, self.slot_map

    def layer(self, layer: int) -> torch.Tensor:
        """Dense view whose row ``slot_map.rows_of(s)[k]`` is slot ``s[k]`` of ``layer``, and
        no row past the layer's last slot."""
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} outside [0, {self.layers})")
        first = layer * self.slot_map.group
        return self.rows[first : first + self.slot_map.span]


def block_rows(
    buffer: torch.Tensor, layout: str, layers: int, page_size: int, row_shape: torch.Size
) -> BlockRows | str:
    """``buffer`` (one host component: K, V, KV or index) as :class:`BlockRows` whose rows have
    ``row_shape`` (the device rows'), or why it cannot be viewed so."""
    if not buffer.is_contiguous() or buffer.dim() < 2:
        return "sglang_host_buffer_layout"
    if layout == "layer_first":
        blocks, block = 1, buffer.shape[1]
        if buffer.shape[0] != layers:
            return "sglang_host_buffer_layout"
    elif layout in ("page_first", "page_first_direct"):
        blocks = buffer.shape[0]
        block = 1 if layout == "page_first" else page_size
        if buffer.shape[1] != layers:
            return "sglang_host_buffer_layout"
    else:
        return f"sglang_layout_{layout}"
    row_numel = math.prod(row_shape)
    if row_numel == 0 or buffer.numel() != blocks * layers * block * row_numel:
        return "row_shape_mismatch"
    slot_map = RowMap(
        units=blocks * block, group=block, period=layers * block, index_name="host_indices"
    )
    return BlockRows(dense_rows(buffer, row_shape), layers, slot_map)


def is_paged(host_slots: torch.Tensor, device_slots: torch.Tensor, page_size: int) -> bool:
    """Whether both index tensors are whole pages: groups of ``page_size`` consecutive slots,
    each host group starting on a page boundary.

    SGLang's ``page_first_direct`` copies read one index per page (the page's first)
    and move the whole page; on indices of this shape that equals a per-index copy.
    """
    host = check_index(host_slots, "host_indices")
    device = check_index(device_slots, "device_indices")
    if host.numel() != device.numel() or host.numel() % page_size:
        return False
    if host.numel() == 0 or page_size == 1:
        return True
    step = torch.arange(page_size)
    host_pages = host.view(-1, page_size)
    device_pages = device.view(-1, page_size)
    return bool(
        (host_pages[:, 0] % page_size == 0).all()
        and torch.equal(host_pages, host_pages[:, :1] + step)
        and torch.equal(device_pages, device_pages[:, :1] + step)
    )
