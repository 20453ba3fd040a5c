"""The layer ring's scatter: one staging slot's rows of a layer's pairs (SGLang's K and V,
or MLA's one buffer) to their device rows, in one launch on a given stream.

The first launch of a shape goes through Triton's JIT on that stream; later ones call the
compiled kernel's launcher directly with the addresses as integers, as
:class:`~kvcore.kernels.triton_layers.LayeredLaunch` does, because the ring runs on every
layer of a reload, and SGLang queues the hit's forward only after every layer's call has
returned. Two ``index_copy_`` calls under a stream switch cost several times the launch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.kernels.triton_kernels import triton
from kvcore.kernels.triton_layers import launch_hooked
from kvcore.kernels.triton_tile import I32_LIMIT, VECTOR_BYTES, WORD_DTYPE_BY_SIZE, Launch

if triton is not None:
    from kvcore.kernels.triton_kernels import scatter_slot_kernel

logger = logging.getLogger(__name__)

_MOST_PAIRS = 2


@dataclass(frozen=True)
class _Shape:
    """What a compiled scatter is fixed for: the word it moves, the rows' width and the
    destination's pitch in words, the pairs, and the tile."""

    word: torch.dtype
    words: int
    dst_pitch: int
    pairs: int
    launch: Launch
    align: int

    def constants(self) -> tuple[int, ...]:
        return (self.pairs, *self.launch.constants(self.align))


def _shape_of(dst: torch.Tensor, pairs: int) -> _Shape | None:
    row_bytes = dst.shape[1] * dst.element_size()
    pitch_bytes = dst.stride(0) * dst.element_size()
    if row_bytes == 0:
        return None
    size = next(s for s in (8, 4, 2, 1) if row_bytes % s == 0 and pitch_bytes % s == 0)
    words, pitch = row_bytes // size, pitch_bytes // size
    launch = Launch(words, size, None, None, None)
    align = math.gcd(words, pitch, VECTOR_BYTES // size)
    return _Shape(WORD_DTYPE_BY_SIZE[size], words, pitch, pairs, launch, align)


def _alike(first: torch.Tensor, slot: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> bool:
    """Whether every slot view and destination has ``first``'s dtype and width, and every
    destination its pitch (slot views are dense rows of the staging buffer)."""
    dtype, width, pitch = first.dtype, first.shape[1], first.stride(0)
    return all(s.dtype == dtype and s.shape[1] == width for s in slot) and all(
        d.dtype == dtype and d.shape[1] == width and d.stride(0) == pitch for d in dsts
    )


class SlotScatter:
    """Scatters of staging slots on one process's devices, each shape compiled once.

    A call takes the slot's rows of every pair (views of the staging buffer, in order) and
    each pair's destination rows, all of one dtype, width and pitch, with addresses on
    16 bytes: the compiled kernel assumes that alignment, so a call off it is refused rather
    than launched. ``ctas`` bounds the grid: the scatter shares the SMs with the model.
    """

    def __init__(self, ctas: int) -> None:
        self.ctas = ctas
        self._shapes: dict[tuple[Any, ...], _Shape | None] = {}
        self._compiled: dict[tuple[Any, ...], Any] = {}

    def __call__(
        self,
        stream: torch.cuda.Stream | None,
        handle: int,
        slot: Sequence[torch.Tensor],
        dsts: Sequence[torch.Tensor],
        dst_idx: torch.Tensor,
    ) -> bool:
        """Copy row ``k`` of ``slot[p]`` to row ``dst_idx[k]`` of ``dsts[p]`` on ``stream``
        (raw ``handle``); False, with nothing launched, where this kernel cannot take the
        call (no Triton, more than two pairs, mixed shapes, an address off 16 bytes, too
        many rows): the caller then copies the rows its own way."""
        pairs, n_rows = len(dsts), dst_idx.shape[0]
        if triton is None or not 0 < pairs <= _MOST_PAIRS or not 0 < n_rows < I32_LIMIT:
            return False
        first = dsts[0]
        key = (first.device, first.dtype, first.shape[1], first.stride(0), pairs)
        if key in self._shapes:
            shape = self._shapes[key]
        else:
            shape = self._shapes.setdefault(key, _shape_of(first, pairs))
        if shape is None or len(slot) != pairs or not _alike(first, slot, dsts):
            return False
        addresses = [t.data_ptr() for t in slot] + [t.data_ptr() for t in dsts]
        if any(a % VECTOR_BYTES for a in addresses):
            return False
        if pairs == 1:
            addresses = [addresses[0], addresses[0], addresses[1], addresses[1]]
        tiles = -(-n_rows // shape.launch.rows) * pairs
        compiled = self._compiled.get(key)
        if compiled is None or launch_hooked():
            return self._jit(key, shape, stream, slot, dsts, dst_idx, tiles)
        compiled.run(
            min(self.ctas, tiles),
            1,
            1,
            handle,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *addresses,
            dst_idx.data_ptr(),
            n_rows,
            shape.dst_pitch,
            *shape.constants(),
        )
        return True

    def _jit(
        self,
        key: tuple[Any, ...],
        shape: _Shape,
        stream: torch.cuda.Stream | None,
        slot: Sequence[torch.Tensor],
        dsts: Sequence[torch.Tensor],
        dst_idx: torch.Tensor,
        tiles: int,
    ) -> bool:
        """The launch through Triton's JIT; False where it fails (a compiler or driver that
        refuses the kernel), and this shape is never tried again: the caller's own copy
        takes it from here."""
        srcs = [t.view(shape.word) for t in slot]
        targets = [t.view(shape.word) for t in dsts]
        if shape.pairs == 1:
            srcs, targets = srcs * 2, targets * 2
        args = (*srcs, *targets, dst_idx, dst_idx.shape[0], shape.dst_pitch, shape.pairs)
        device = dst_idx.device
        try:
            # The JIT launches on the current stream (None: Triton's interpreter, on a CPU).
            with torch.cuda.stream(stream):
                compiled = shape.launch.run(
                    scatter_slot_kernel, args, tiles, self.ctas, shape.align, device
                )
        except Exception as exc:  # a scatter that cannot launch leaves the rows to the caller
            self._shapes[key] = None
            logger.warning(
                "kvcore: the layer ring's scatter kernel failed to launch (%s: %s); "
                "index_copy_ scatters these rows from now on",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return False
        if device.type == "cuda" and hasattr(compiled, "run"):
            self._compiled[key] = compiled
        return True
