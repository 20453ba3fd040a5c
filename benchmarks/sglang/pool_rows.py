"""Which rows of an SGLang pool a copy names, and the byte checks of a copy against them.

:func:`index_pairs` draws a request's host and device slots at a host fragmentation level;
:func:`host_rows` and :func:`get_rows` address slots of one layer in a host buffer as
SGLang's layout defines it; :func:`check_load` and :func:`check_backup` compare a
:class:`~benchmarks.sglang.pool_case.PoolCase`'s buffers byte for byte with what the copy
should have left, the rows outside it included. Shared by the A/B, the sweep's cells and
the soak.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.sglang.pool_case import HOST_LEVELS, PoolCase
from kvcore.bench.suite import scattered_layout


def index_pairs(
    tokens: int, level: str, page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host and device slots (int64, CPU) for ``tokens`` tokens in pools twice that size.

    ``level`` of the host's pages (tokens, at page_size 1) sit away from one run, as churn
    leaves them; the device side is fully scattered by pages, as SGLang's allocator gives.
    """
    host = scattered_layout(tokens, HOST_LEVELS[level], page_size, gen)
    device = scattered_layout(tokens, 1.0, page_size, gen)
    return host, device


def host_rows(buffer: torch.Tensor, layout: str, page: int, layer: int, slots: torch.Tensor) -> Any:
    """(view, index) selecting ``slots`` of ``layer`` in one host buffer, per SGLang's layout."""
    if layout == "layer_first":
        return buffer[layer], slots
    if layout == "page_first":
        return buffer[:, layer], slots
    return buffer[:, layer], (slots // page, slots % page)


def get_rows(buffer: torch.Tensor, layout: str, page: int, layer: int, slots: torch.Tensor):
    view, index = host_rows(buffer, layout, page, layer, slots)
    return view[index]


def _set_rows(
    buffer: torch.Tensor, layout: str, page: int, layer: int, slots: torch.Tensor, rows: Any
) -> None:
    view, index = host_rows(buffer, layout, page, layer, slots)
    view[index] = rows


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def check_load(case: PoolCase, layer: int, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> bool:
    """Device layer ``layer`` holds the host rows at ``dev_idx``; every other row its poison."""
    h, d = host_idx.to(case.opts.device), dev_idx.to(case.opts.device)
    for c in case.components:
        for i, (actual, poison) in enumerate(zip(c.devices, c.poison, strict=True)):
            expected = poison
            if i == layer:
                expected = poison.clone()
                expected[d] = get_rows(c.mirror, case.layout, case.page_size, layer, h)
            if not bytes_equal(actual, expected):
                return False
    return True


def check_backup(case: PoolCase, host_idx: torch.Tensor, dev_idx: torch.Tensor) -> bool:
    """The host buffers hold every layer's device rows at ``host_idx``; other rows their poison."""
    h, d = host_idx.to(case.opts.device), dev_idx.to(case.opts.device)
    for c in case.components:
        expected = c.mirror.clone()
        for layer, poison in enumerate(c.poison):
            _set_rows(expected, case.layout, case.page_size, layer, h, poison[d])
        if not bytes_equal(c.host.to(case.opts.device), expected):
            return False
    return True
