"""The sides of the SGLang sweep's requests (:mod:`benchmarks.sglang.sweep`).

A :class:`Side` is one way to make a request over a pool: :func:`stock_side` is SGLang's
own pool method (or, where this machine lacks it, the copies ``direct`` makes issued from
Python, :func:`model_method`), :func:`kvcore_side` kvcore's AROUND hook as SGLang's
HookRegistry calls it, and :func:`rule_off` that hook with the serve-or-pass rule off.
Apart from the timing and checks of a cell (:mod:`benchmarks.sglang.sweep_cells`)
because the host-cost bench drives the same sides.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.sglang.ab_paths import (
    METHOD_NAMES,
    direct_copies,
    stock_indices,
    stock_kernel_sms,
)
from benchmarks.sglang.pool_case import Component, PoolCase
from benchmarks.sglang.sgl_kernel_stub import StockNotRunnable, sgl_kernel_stubbed

# The direct model issues one Python copy_ per page run, layer and buffer; past this many per
# request it would measure Python alone.
MAX_MODEL_COPIES = 20000


@dataclass
class Side:
    """One way to make a request: ``call(indices)`` issues every call of it."""

    name: str
    call: Callable[[tuple[torch.Tensor, torch.Tensor]], None] | None
    prepare: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """The request's CPU indices as this side receives them (moved where SGLang moves them)."""
    not_runnable: str | None = None
    label: str = ""


def pool_method(case: PoolCase, op: str) -> Callable[..., Any]:
    """SGLang's method that ``op`` calls, as the pool's class defines it (unhooked)."""
    return vars(type(case.pool))[METHOD_NAMES[op]]


def pool_hook(case: PoolCase, op: str) -> Callable[..., Any]:
    """kvcore's AROUND hook for the method that ``op`` calls on the pool's class."""
    from benchmarks.sglang.hook_adapter import pool_method_hook

    return pool_method_hook(type(case.pool), METHOD_NAMES[op])


def _request(
    case: PoolCase, op: str, backend: str, layers: int, method: Callable[..., Any]
) -> Callable[[tuple[torch.Tensor, torch.Tensor]], None]:
    pool, device_pool = case.pool, case.device_pool
    if op == "backup":

        def backup(indices: tuple[torch.Tensor, torch.Tensor]) -> None:
            method(pool, device_pool, indices[0], indices[1], backend)

        return backup

    def reload(indices: tuple[torch.Tensor, torch.Tensor]) -> None:
        host, device = indices
        for layer in range(layers):
            method(pool, device_pool, host, device, layer, backend)

    return reload


def stock_side(case: PoolCase, op: str, backend: str, layers: int) -> Side:
    """SGLang's own method; where this machine lacks it (``direct`` without sgl-kernel, or
    no CUDA at all), the copies ``direct`` makes, issued from Python (:func:`model_method`)."""
    _, reason = stock_kernel_sms(case, op, backend)
    runnable = reason is None and not (backend == "direct" and sgl_kernel_stubbed())
    if not runnable:
        if backend == "kernel" and case.opts.device.type == "cuda":
            return Side("stock", None, _cpu, reason or "stock kernel not runnable")
        model = model_method(case, op)
        return Side("stock", _request(case, op, backend, layers, model), _cpu, label=MODEL)

    def prepare(h: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stock_indices(case, op, backend, h, d)

    method = pool_method(case, op)
    return Side("stock", _request(case, op, backend, layers, method), prepare, label="stock")


MODEL = "model:direct"


def model_method(case: PoolCase, op: str) -> Callable[..., None]:
    """A stand-in for the pool method: the copies stock ``direct`` makes for one call (one
    per page run, layer and buffer, :func:`benchmarks.sglang.ab_paths.direct_copies`), one
    ``copy_`` each. Raises :class:`~benchmarks.sglang.sgl_kernel_stub.StockNotRunnable` past
    :data:`MAX_MODEL_COPIES` copies a call."""
    page = case.page_size
    last: list[Any] = [None, None, []]

    def copies(host_idx: torch.Tensor, dev_idx: torch.Tensor) -> list[tuple[int, int, int]]:
        if last[0] is not host_idx or last[1] is not dev_idx:
            last[:] = [host_idx, dev_idx, direct_copies(case, host_idx.cpu(), dev_idx.cpu())]
        return last[2]

    def host_block(c: Component, layer: int, slot: int, rows: int) -> torch.Tensor:
        if case.layout == "page_first_direct":
            return c.host[slot // page, layer]
        if case.layout == "page_first":
            return c.host[slot : slot + rows, layer]
        return c.host[layer, slot : slot + rows]

    def move(host_idx: torch.Tensor, dev_idx: torch.Tensor, layer_ids: Sequence[int]) -> None:
        runs = copies(host_idx, dev_idx)
        if len(runs) * len(layer_ids) * len(case.components) > MAX_MODEL_COPIES:
            raise StockNotRunnable(f"{len(runs)} copies a layer: over the model's limit")
        for layer in layer_ids:
            for c in case.components:
                for h, d, rows in runs:
                    host, device = host_block(c, layer, h, rows), c.devices[layer][d : d + rows]
                    if op == "load":
                        device.copy_(host, non_blocking=True)
                    else:
                        host.copy_(device, non_blocking=True)

    def load(
        pool: Any,
        device_pool: Any,
        host_idx: Any,
        dev_idx: Any,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        move(host_idx, dev_idx, [layer_id])

    def backup(pool: Any, device_pool: Any, host_idx: Any, dev_idx: Any, io_backend: str) -> None:
        move(host_idx, dev_idx, range(case.opts.layers))

    return load if op == "load" else backup


def _cpu(h: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return h, d


def kvcore_side(
    case: PoolCase, op: str, backend: str, layers: int, *, direct: bool = False
) -> Side:
    """The AROUND hook as SGLang's HookRegistry calls it, the stock method as ``original``;
    a reload's indices go through the ``move_indices`` hook first, as SGLang moves them
    (the move itself is not timed on either side)."""

    hook = pool_hook(case, op)
    stock_run = stock_side(case, op, backend, layers)
    original = pool_method(case, op) if stock_run.label == "stock" else model_method(case, op)
    name = METHOD_NAMES[op]

    pool, device_pool = case.pool, case.device_pool
    # As Python looks the method up: a binding kvcore set on the pool comes first, with no
    # frame of its own; else SGLang's HookRegistry wrapper, one frame around the hook.
    bindings: dict[str, Any] = {} if direct else pool.__dict__

    def through_registry(*args: Any) -> Any:
        return hook(original, pool, *args)

    def request(indices: tuple[torch.Tensor, torch.Tensor]) -> None:
        host, device = indices
        if op == "backup":
            (bindings.get(name) or through_registry)(device_pool, host, device, backend)
            return
        for layer in range(layers):
            (bindings.get(name) or through_registry)(device_pool, host, device, layer, backend)

    from benchmarks.sglang.hook_adapter import move_indices

    # What the hook reads of SGLang's cache controller: the host pool it moves indices for,
    # and the io backend (under KVCORE_SGLANG_DMA_IN_PLACE the kernel backend's device
    # indices are read back there).
    controller = types.SimpleNamespace(mem_pool_host=pool, io_backend=backend)

    def prepare(h: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Where SGLang's controller puts the indices (stock's side says), through kvcore's
        # move_indices hook, as SGLang moves every reload's (which remembers the CPU host
        # indices of those moved to the GPU); a backup's only where SGLang moves them.
        stock_h, stock_d = stock_indices(case, op, backend, h, d)
        if stock_h is h and op == "backup":
            return h, stock_d

        def to_place(controller: Any, host: torch.Tensor, device: torch.Tensor) -> Any:
            return stock_h, stock_d

        moved = move_indices(to_place, controller, h, d)
        return moved[0], moved[1]

    return Side("kvcore", request, prepare, label="kvcore")


@contextmanager
def serve_rule_off() -> Iterator[None]:
    """kvcore's SGLang hooks with the serve-or-pass rule off while inside, for calls made
    to the hook itself: a binding kvcore left on a pool keeps deciding by the rule (an
    engine's setting is fixed for its life), so that the rule-on side's bindings outlive
    the rule-off side's turns, as they would in an engine."""
    from benchmarks.sglang.hook_adapter import serve_rule

    with serve_rule(False):
        yield


@contextmanager
def device_indices_unread() -> Iterator[None]:
    """kvcore's SGLang hooks planning every call around its device indices, as they do on
    a GPU with the ``kernel`` backend (SGLang moves those indices to the GPU itself, and
    kvcore never reads them back): on a CPU the same Python then runs as on the GPU
    machine, the device indices being CPU tensors left unread."""
    from benchmarks.sglang.hook_adapter import call_indices_through

    def unread(found_by: Callable[..., Any]) -> Callable[..., Any]:
        def found_unread(*args: Any) -> Any:
            found = found_by(*args)
            if isinstance(found, str):
                return found
            return dataclasses.replace(found, device_opaque=True)

        return found_unread

    with call_indices_through(unread):
        yield


@contextmanager
def device_indices_read() -> Iterator[None]:
    """kvcore's SGLang hooks as under ``KVCORE_SGLANG_DMA_IN_PLACE`` on a GPU with the
    ``kernel`` backend: every call's device indices on the device, with their host copy
    read back at the move. On a CPU the device indices are CPU tensors marked on the
    device, and a copy of them stands for the read."""
    from benchmarks.sglang.hook_adapter import call_indices_through

    def read(found_by: Callable[..., Any]) -> Callable[..., Any]:
        def found_read(*args: Any) -> Any:
            found = found_by(*args)
            if isinstance(found, str):
                return found
            return dataclasses.replace(found, device_opaque=True, device_read=found.device.clone())

        return found_read

    with call_indices_through(read):
        yield


def rule_off(case: PoolCase, op: str, backend: str, layers: int) -> Side:
    """kvcore's hook called directly with the serve-or-pass rule off: its own paths
    wherever it can copy exactly, to read off where the rule should serve."""
    side = kvcore_side(case, op, backend, layers, direct=True)
    assert side.call is not None
    call = side.call

    def own(indices: tuple[torch.Tensor, torch.Tensor]) -> None:
        with serve_rule_off():
            call(indices)

    return Side("own", own, side.prepare, label="kvcore, rule off")
