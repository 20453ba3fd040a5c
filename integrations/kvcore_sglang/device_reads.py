"""Host copies of the device indices SGLang moves, read back under ``KVCORE_SGLANG_DMA_IN_PLACE``.

With the ``kernel`` io backend SGLang's device indices exist only on the GPU, so kvcore
plans around them: a staged copy or a gather, each a kernel on the transfer stream, which
waits for SMs behind the model's kernels. Copying pages by DMA straight into place needs
every destination address on the host. So where the setting is on, the move hook starts
one device-to-host copy of the device indices on the stream that made them, when SGLang
hands them over (``HiCacheController.move_indices``), and the request's first transfer
call waits for it: the read SGLang's own ``direct`` backend makes with ``.cpu()`` in the
same place, started earlier.

:class:`DeviceIndexReads` keeps each read by the device tensor's identity, valid while
the tensor lives and was not written since (its version counter), as
:class:`kvcore_sglang.call_memos.HostIndexMemo` keeps moved host indices. The read
itself is a :data:`Reader`, so that the logic runs on a CPU machine with a stand-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch

from kvcore.runs import version_of

from .call_memos import ByTensor
from .pool_rows import pool_row_bytes

Reader = Callable[[torch.Tensor], tuple[torch.Tensor, Callable[[], None]]]
"""device indices -> (their host copy, a wait until the copy holds their values)."""

DMA_BELOW_TOKENS = 32768
"""Requests of this many tokens or more keep the plan made around their device indices (the
layer ring, for few long host runs), and are not read for: beside a 4096-token prefill, a
32k-token MHA reload by DMA into place left the hit's own forward 1.16x its ideal pipeline,
the ring 0.99-1.05x (docs/performance.md, "Pages by DMA straight into place")."""


def read_on_cuda(device_indices: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """One asynchronous copy of ``device_indices`` into pinned host memory, queued on the
    current stream of their device (the allocator's, which made them), and its event's wait."""
    stream = torch.cuda.current_stream(device_indices.device)
    on_host = device_indices.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(stream)
    return on_host, copied.synchronize


class DeviceIndexReads(ByTensor[tuple[torch.Tensor, Callable[[], None], int]]):
    """The host copies of device-index tensors read back at their move, by identity."""

    def __init__(self, reader: Reader = read_on_cuda) -> None:
        super().__init__()
        self._reader = reader

    def start(self, device_indices: torch.Tensor) -> None:
        """Start reading ``device_indices`` back; not for an inference tensor, whose later
        writes could not be seen."""
        version = version_of(device_indices)
        if version is None:
            return
        on_host, wait = self._reader(device_indices)
        self._keep(device_indices, (on_host, wait, version))

    def recall(self, device_indices: torch.Tensor) -> torch.Tensor | None:
        """The host copy of ``device_indices`` once it holds their values, or None where none
        was read or the tensor was written since."""
        kept = self._kept_for(device_indices)
        if kept is None or device_indices._version != kept[2]:
            return None
        kept[1]()
        return kept[0]


def pages_by_dma(pool: Any, io_backend: str, min_page_bytes: int) -> bool:
    """Whether ``pool``'s pages may go by DMA straight into place once their device indices
    are read: the ``kernel`` backend's ``layer_first`` pools whose page of one layer holds
    ``min_page_bytes`` or more (``page_first`` keeps a slot's layers together, so one layer's
    rows lie a slot apart on the host and never make a run)."""
    if io_backend != "kernel" or getattr(pool, "layout", None) != "layer_first":
        return False
    row_bytes, page_size = pool_row_bytes(pool), getattr(pool, "page_size", None)
    if row_bytes is None or not isinstance(page_size, int):
        return False
    return page_size > 1 and page_size * row_bytes >= min_page_bytes


def worth_reading(
    device_indices: Any, controller: Any, min_page_bytes: int
) -> TypeGuard[torch.Tensor]:
    """Whether a move's device indices may go by DMA once read: a one-dimensional device
    tensor of fewer than :data:`DMA_BELOW_TOKENS` entries, for a pool whose pages go by DMA
    (:func:`pages_by_dma`)."""
    return (
        isinstance(device_indices, torch.Tensor)
        and device_indices.device.type != "cpu"
        and device_indices.dim() == 1
        and device_indices.numel() < DMA_BELOW_TOKENS
        and pages_by_dma(
            getattr(controller, "mem_pool_host", None),
            getattr(controller, "io_backend", ""),
            min_page_bytes,
        )
    )
