"""The layered UVA gather: the same rows of many buffer pairs (one a layer) in one launch.

``layer_table`` checks the pairs once and holds each as an offset from the first pair;
``gather_layers_uva`` launches over a table through Triton's JIT, and ``LayeredLaunch``
launches the compiled kernel directly after its first launch, as every SGLang layer's
transfer does. Apart from the one-pair gather (:mod:`~kvcore.kernels.triton_rows`) because
the table, its device offsets and the direct launch are state of this path alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.kernels.triton_kernels import triton
from kvcore.kernels.triton_tile import (
    I32_LIMIT,
    VECTOR_BYTES,
    Launch,
    check_ctas,
    check_index,
    check_indices,
    check_rows,
    kernel_device,
    widest_word,
)
from kvcore.row_words import check_word_views

if triton is not None:
    from kvcore.kernels.triton_kernels import gather_layers_kernel


@dataclass(frozen=True, eq=False)
class LayerTable:
    """Pairs of row views that one layered gather launch copies, checked once.

    The kernel addresses pair ``i`` as the first pair's buffers plus ``offsets[i]`` words
    (sources) and ``offsets[layers + i]`` words (destinations).
    """

    src_words: tuple[torch.Tensor, ...]
    """The sources as views of the kernel's word type (they keep the buffers alive)."""
    dst_words: tuple[torch.Tensor, ...]
    offsets: torch.Tensor
    """CPU int64 ``[2 * layers]``: to upload before each launch's first use."""
    align: int
    """Words that every offset and both pitches are a multiple of (at most 16 bytes)."""
    device: torch.device
    launch: Launch
    """The tile and warps for the pairs' rows, fixed with the table."""
    src_address: int = 0
    """Where the kernel reaches the first source's first row (``address`` of it)."""
    dst_address: int = 0

    @property
    def layers(self) -> int:
        return len(self.src_words)


def layer_table(
    src_words: Sequence[torch.Tensor],
    dst_words: Sequence[torch.Tensor],
    address: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr,
) -> LayerTable:
    """The table of :func:`gather_layers_uva` for these pairs of ``[rows, words]`` views.

    Every pair is checked as :func:`~kvcore.kernels.triton_rows.gather_rows_uva` checks one
    (so each host buffer's pinning once, here); all sources must share one row pitch, all
    destinations another.
    ``address(view)`` is where the kernel reaches a view's first row: the launch passes
    the first pair's buffers, which Triton translates as the GPU sees them, and the others
    are offsets from them, so on CUDA every address must be the GPU's.
    """
    if triton is None:
        raise RuntimeError("layer_table needs Triton, which is not installed")
    if not src_words or len(src_words) != len(dst_words):
        raise ValueError(
            f"need as many sources as destinations, at least one: {len(src_words)}, "
            f"{len(dst_words)}"
        )
    devices = set()
    for src, dst in zip(src_words, dst_words, strict=True):
        check_word_views(src, dst)
        check_rows(src, "src_words")
        check_rows(dst, "dst_words")
        devices.add(kernel_device(src, dst))
    if len(devices) > 1:
        raise ValueError(f"the pairs run on different devices: {sorted(map(str, devices))}")
    if len({t.dtype for t in src_words}) > 1 or len({t.shape[1] for t in src_words}) > 1:
        raise ValueError("the pairs' rows differ in word type or width")
    for side, name in ((src_words, "sources"), (dst_words, "destinations")):
        if len({t.stride(0) for t in side}) > 1:
            raise ValueError(f"the {name} differ in row pitch")
    word = min(
        (widest_word(s, d) for s, d in zip(src_words, dst_words, strict=True)),
        key=lambda dtype: dtype.itemsize,
    )
    srcs = tuple(t.view(word) for t in src_words)
    dsts = tuple(t.view(word) for t in dst_words)
    src_base, dst_base = address(srcs[0]), address(dsts[0])
    offsets = [(address(t) - src_base) // word.itemsize for t in srcs]
    offsets += [(address(t) - dst_base) // word.itemsize for t in dsts]
    align = math.gcd(srcs[0].stride(0), dsts[0].stride(0), VECTOR_BYTES // word.itemsize, *offsets)
    return LayerTable(
        src_words=srcs,
        dst_words=dsts,
        offsets=torch.tensor(offsets, dtype=torch.int64),
        align=align,
        device=devices.pop(),
        launch=Launch(srcs[0].shape[1], word.itemsize, None, None, None),
        src_address=src_base,
        dst_address=dst_base,
    )


def gather_layers_uva(
    table: LayerTable,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    offsets: torch.Tensor,
    *,
    ctas: int = 8,
) -> None:
    """:func:`~kvcore.kernels.triton_rows.gather_rows_uva` for every pair of ``table`` at once,
    in one launch.

    ``offsets`` is ``table.offsets`` on the kernel's device (uploaded with the indices).
    """
    if triton is None:
        raise RuntimeError("gather_layers_uva needs Triton, which is not installed")
    device = table.device
    check_indices(src_idx, dst_idx, device)
    check_index(offsets, "offsets", device)
    if offsets.numel() != table.offsets.numel():
        raise ValueError(f"{offsets.numel()} offsets for {table.layers} pairs")
    check_ctas(ctas)
    src, dst = table.src_words[0], table.dst_words[0]
    n_rows = src_idx.numel()
    if n_rows == 0 or src.shape[1] == 0:
        return
    launch = table.launch
    args = (src, dst, offsets, src_idx, dst_idx, n_rows, table.layers, src.stride(0), dst.stride(0))
    tiles = -(-n_rows // launch.rows) * table.layers
    launch.run(gather_layers_kernel, args, tiles, ctas, table.align, device)


# Private but long-standing (Triton and inductor read streams through it); absent in CPU
# builds, where no compiled kernel is launched.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device_index = getattr(torch._C, "_cuda_getDevice", None)


def launch_hooked() -> bool:
    """Whether a launch hook (a profiler's) wants to see Triton launches. Triton 3.6 keeps
    the hooks in a chain that is never None; older releases hold one callable or None."""
    hook = triton.knobs.runtime.launch_enter_hook if triton is not None else None
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


class LayeredLaunch:
    """:func:`gather_layers_uva` over one table, its offsets kept on the device.

    The first launch goes through Triton's JIT, which compiles (or finds) the kernel; every
    later one calls that kernel's launcher directly, with the table's addresses as plain
    integers. Triton's front end (binding, specialisation, cache key) costs more host time
    than the launch itself, on every layer of every request; the kernel it would find is
    always this one, because everything it specialises on (the buffers, their pitches, the
    offsets' address, the tile) is fixed here and the per-call arguments (the rows and the
    indices' addresses) are left out of its specialisation. A launch hook (a profiler's),
    another current device, or a row count past 32 bits take the JIT path again.
    """

    def __init__(self, table: LayerTable, offsets: torch.Tensor, ctas: int) -> None:
        check_index(offsets, "offsets", table.device)
        if offsets.numel() != table.offsets.numel():
            raise ValueError(f"{offsets.numel()} offsets for {table.layers} pairs")
        check_ctas(ctas)
        self.table = table
        self.offsets = offsets
        self.ctas = ctas
        self.device = table.device
        self._compiled: Any = None
        src, dst = table.src_words[0], table.dst_words[0]
        self._fixed_head = (table.src_address, table.dst_address, offsets.data_ptr())
        self._fixed_tail = (
            table.layers,
            src.stride(0),
            dst.stride(0),
            *table.launch.constants(table.align),
        )
        self._empty = src.shape[1] == 0

    @property
    def direct(self) -> bool:
        """Whether the next launch skips Triton's JIT front end."""
        return self._compiled is not None

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """Copy rows ``src_idx`` of every source to rows ``dst_idx`` of its destination, on
        the current stream; int64 indices on the kernel's device, checked by the caller."""
        self.rows_between(src_idx, dst_idx, 0, src_idx.numel())

    def rows_between(
        self, src_idx: torch.Tensor, dst_idx: torch.Tensor, begin: int, end: int
    ) -> None:
        """:meth:`__call__` with entries ``begin`` to ``end`` of the indices (contiguous, of
        equal length; ``0 <= begin <= end <=`` their length), read in place: no slice is made
        where the launch is direct (host time on every piece of a staged load)."""
        n_rows = end - begin
        if n_rows <= 0 or self._empty:
            return
        table = self.table
        launch = table.launch
        tiles = -(-n_rows // launch.rows) * table.layers
        compiled = self._compiled
        device_index = self.device.index
        if (
            compiled is None
            or n_rows >= I32_LIMIT
            or _current_raw_stream is None
            or _current_device_index is None
            or _current_device_index() != device_index
            or launch_hooked()
        ):
            whole = begin == 0 and end == src_idx.numel()
            src_rows = src_idx if whole else src_idx[begin:end]
            dst_rows = dst_idx if whole else dst_idx[begin:end]
            self._jit(src_rows, dst_rows, n_rows, tiles)
            return
        compiled.run(
            min(self.ctas, tiles),
            1,
            1,
            _current_raw_stream(device_index),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *self._fixed_head,
            src_idx.data_ptr() + begin * src_idx.element_size(),
            dst_idx.data_ptr() + begin * dst_idx.element_size(),
            n_rows,
            *self._fixed_tail,
        )

    def _jit(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, n_rows: int, tiles: int) -> None:
        check_indices(src_idx, dst_idx, self.device)
        table = self.table
        src, dst = table.src_words[0], table.dst_words[0]
        args = (
            src,
            dst,
            self.offsets,
            src_idx,
            dst_idx,
            n_rows,
            table.layers,
            src.stride(0),
            dst.stride(0),
        )
        compiled = table.launch.run(
            gather_layers_kernel, args, tiles, self.ctas, table.align, self.device
        )
        if self.device.type == "cuda" and n_rows < I32_LIMIT and hasattr(compiled, "run"):
            self._compiled = compiled
