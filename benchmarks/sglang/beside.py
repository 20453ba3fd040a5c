"""`kvcore bench --engine sglang --sweep --beside-compute`: SGLang reloads beside the model.

A reload is what SGLang's HiCache does on a hit: ``HiCacheController.move_indices``, then
``L2TransferEngine.submit_host_to_device`` over the pool pair, one
``load_to_device_per_layer`` call per layer on the engine's host-to-device stream and a
per-layer event the forward can wait on (``on_layer_done``). Each request is timed
wall-clock from the index move until its copy is complete (the move is the first call
``start_loading`` makes; under ``KVCORE_SGLANG_DMA_IN_PLACE`` kvcore's read of the device
indices starts there), with new index tensors every time, in three situations:

- ``alone``: nothing else on the GPU;
- ``independent``: another batch's forward (:class:`benchmarks.model_forward.ModelForward`,
  replayed as one CUDA graph on a compute stream, sized to last about as long as stock's
  reload alone) runs beside it; its time alone and beside each side's reload says what the
  reload costs everyone else;
- ``dependent``: the hit's own forward, queued after the submission, waits for layer ``i``'s
  event before computing layer ``i``; its completion is compared with the ideal pipeline,
  the first layer's copy plus, per layer, the longer of its compute and its copy at the link.

With ``backups`` (``--stores``), each pool's backups follow its reloads: what ``start_writing``
does, the indices moved, then ``L2TransferEngine.submit_device_to_host`` (one
``backup_from_device_all_layer`` call on the device-to-host stream), alone and beside
another batch's forward (nothing waits for a backup, so there is no dependent situation);
their rows carry ``op`` "backup".

Stock is SGLang's own method; kvcore is its AROUND hook with stock's method as
``original``, as SGLang's HookRegistry calls it (``--no-rule``: the serve-or-pass rule off).
Both sides run in one process on the same pools, alternating request by request; after
timing, every side's result is checked byte for byte against SGLang's layout, every other
row keeping its poison. JSON rows carry ``engine case situation tokens page_size stock_ms
kvcore_ms link_ms forward_alone_ms forward_with_stock_ms forward_with_kvcore_ms identical``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from benchmarks.beside_cli import document, run_command, shared_options, write_json
from benchmarks.beside_rows import (
    LINK_GBPS,
    RowPlace,
    Tally,
    alternated,
    ideal_pipeline_ms,
    median,
    reload_row,
    summary_line,
)
from benchmarks.model_forward import COMPUTE_LOADS, ForwardGraph, measured_forward
from benchmarks.sglang.sweep_cells import _check, request_indices
from benchmarks.sglang.sweep_options import LAYERS
from benchmarks.sglang.sweep_sides import METHOD_NAMES, pool_hook, pool_method, serve_rule_off
from kvcore.bench.measure import sync_device
from kvcore.config import KVCoreConfig

SITUATIONS = ("alone", "independent", "dependent")


@dataclass(frozen=True)
class BesideOptions:
    kinds: tuple[str, ...] = ("mha", "mla")
    pages: tuple[int, ...] = (64, 16, 1)
    tokens: tuple[int, ...] = (8192, 32768)
    loads: tuple[str, ...] = tuple(COMPUTE_LOADS)
    repeats: int = 5
    host_level: str = "0%"
    """The host pages' fragmentation (kvcore's allocator keeps a request's slots in one run)."""
    serve_rule: bool = True
    with_own: bool = True
    """Also run kvcore with its rule off (``own``): its own path, where the rule passes."""
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    seed: int = 4321
    layers: dict[str, int] | None = None
    partial_json: str | None = None
    """Where to write the rows so far after every pool, so a run cut short keeps them."""
    backups: bool = False
    """Also time backups (device to host), alone and beside another batch's forward."""
    forward_span: float = 1.0
    """Another batch's forward lasts about this many times stock's copy alone (over 1: the
    GPU stays busy through the copy, as in an engine running forwards back to back)."""


@dataclass
class _Side:
    name: str
    method: Callable[..., Any]
    """What the pool class's method is during this side's requests."""
    move: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    rule: bool = True
    method_name: str = METHOD_NAMES["load"]


@contextmanager
def _as_side(case: Any, side: _Side) -> Iterator[None]:
    """The pool class's method set to this side's; stock's side, and kvcore's with its rule
    off, also without the bindings kvcore's rule leaves on the pool (stock's method, where
    the rule never serves: they stay for kvcore's next request, as in an engine)."""
    cls, name = type(case.pool), side.method_name
    saved_class = vars(cls)[name]
    saved_binding = case.pool.__dict__.pop(name, None) if side.name != "kvcore" else None
    setattr(cls, name, side.method)
    try:
        with contextlib.nullcontext() if side.rule else serve_rule_off():
            yield
    finally:
        setattr(cls, name, saved_class)
        if saved_binding is not None:
            case.pool.__dict__[name] = saved_binding


def _sides(case: Any, opts: BesideOptions, op: str = "load") -> list[_Side]:
    """Stock, kvcore, and kvcore with its rule off (where asked), for ``op``'s method."""
    import tvm_ffi
    from sglang.srt.managers.cache_controller import HiCacheController

    from benchmarks.sglang.hook_adapter import bench_adapter, move_indices

    original = pool_method(case, op)

    @functools.wraps(original)
    def stock(*args: Any, **kwargs: Any) -> Any:
        # SGLang's JIT kernels launch on tvm-ffi's stream: the current torch stream here,
        # which the transfer engine set to its host-to-device stream.
        with tvm_ffi.use_torch_stream():
            return original(*args, **kwargs)

    hook = pool_hook(case, op)

    @functools.wraps(stock)
    def hooked(pool: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(stock, pool, *args, **kwargs)

    def stock_move(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
        return HiCacheController.move_indices(controller, h, d)

    def kvcore_move(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
        return move_indices(HiCacheController.move_indices, controller, h, d)

    def own_move(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
        # The indices remembered (and read back) as kvcore's hook does, without telling the pool's
        # bindings of a move: they belong to the rule-on side, which must find them as its
        # own requests left them (a move here would turn a binding back on under the stock
        # method _as_side puts back).
        moved = HiCacheController.move_indices(controller, h, d)
        bench_adapter().indices_moved(controller, h, moved)
        return moved

    name = METHOD_NAMES[op]
    sides = [
        _Side("stock", stock, stock_move, method_name=name),
        _Side("kvcore", hooked, kvcore_move, opts.serve_rule, name),
    ]
    if opts.with_own and opts.serve_rule:
        sides.append(_Side("own", hooked, own_move, False, name))
    return sides


class _Reloads:
    """One pool pair's requests through SGLang's L2TransferEngine."""

    def __init__(self, case: Any, layers: int) -> None:
        from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine

        self.case, self.layers = case, layers
        self.device = case.opts.device
        self.engine = L2TransferEngine("kernel")
        self._transfer = L2Transfer
        self.controller = _Controller(case.pool, self.device)
        self.layer_done = [torch.cuda.Event() for _ in range(layers)]

    def request(self, cpu: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The request's indices as the controller holds them before ``start_loading``: new
        tensors of the request's values, the device indices where SGLang's allocator
        leaves them."""
        return cpu[0].clone(), cpu[1].to(self.device)

    def moved(self, side: _Side, request: tuple[torch.Tensor, ...]) -> Any:
        """The request's transfer as ``start_loading`` hands it over: its indices moved
        (``HiCacheController.move_indices``, timed with the transfer: kvcore's read of the
        device indices, where it makes one, starts there)."""
        moved = side.move(self.controller, request[0], request[1])
        return self._transfer(self.case.pool, self.case.device_pool, moved[0], moved[1])

    def prepared(self, side: _Side, cpu: tuple[torch.Tensor, torch.Tensor]) -> Any:
        """:meth:`moved` of a new :meth:`request`, untimed."""
        return self.moved(side, self.request(cpu))

    def submit(self, transfer: Any) -> Any:
        events = self.layer_done
        return self.engine.submit_host_to_device(
            [transfer],
            transfer_layer_id_max=self.layers,
            on_layer_done=lambda layer: events[layer].record(),
        )


class _Backups(_Reloads):
    """One pool pair's backups through SGLang's L2TransferEngine, as ``start_writing``
    submits them (its indices moved as ``_move_write_operation`` moves a layer_first
    pool's)."""

    def submit(self, transfer: Any) -> Any:
        return self.engine.submit_device_to_host([transfer])


@dataclass
class _Controller:
    """What ``HiCacheController.move_indices`` and kvcore's hook on it read of the controller."""

    mem_pool_host: Any
    device: torch.device
    io_backend: str = "kernel"


def _alone(reloads: _Reloads, side: _Side, cpu: tuple[torch.Tensor, torch.Tensor]) -> float:
    with _as_side(reloads.case, side):
        request = reloads.request(cpu)
        torch.cuda.synchronize(reloads.device)
        started = time.perf_counter()
        reloads.submit(reloads.moved(side, request)).finish_event.synchronize()
        return (time.perf_counter() - started) * 1e3


def _independent(
    reloads: _Reloads, side: _Side, cpu: tuple[torch.Tensor, torch.Tensor], forward: ForwardGraph
) -> tuple[float, float]:
    """(reload ms, forward ms) with the forward's graph replayed just before the submission."""
    with _as_side(reloads.case, side):
        request = reloads.request(cpu)
        torch.cuda.synchronize(reloads.device)
        events = forward.replay()
        started = time.perf_counter()
        reloads.submit(reloads.moved(side, request)).finish_event.synchronize()
        reload_ms = (time.perf_counter() - started) * 1e3
        events[1].synchronize()
        return reload_ms, events[0].elapsed_time(events[1])


def _dependent(
    reloads: _Reloads, side: _Side, cpu: tuple[torch.Tensor, torch.Tensor], forward: ForwardGraph
) -> tuple[float, float]:
    """(reload ms, completion ms): the hit's forward waits for each layer's load."""
    done, stream = reloads.layer_done, forward.stream

    def wait(layer: int) -> None:
        stream.wait_event(done[layer])

    with _as_side(reloads.case, side):
        request = reloads.request(cpu)
        torch.cuda.synchronize(reloads.device)
        started = time.perf_counter()
        completion = reloads.submit(reloads.moved(side, request))
        events = forward.model.queue(stream, before_layer=wait)
        assert events is not None
        completion.finish_event.synchronize()
        reload_ms = (time.perf_counter() - started) * 1e3
        events[1].synchronize()
        return reload_ms, (time.perf_counter() - started) * 1e3


def _identical(
    reloads: _Reloads, side: _Side, cpu: tuple[torch.Tensor, torch.Tensor], op: str
) -> bool:
    """One more request of this side, alone, checked: every layer's rows copied, every other
    row its poison (a backup's host rows their intended bytes)."""
    case = reloads.case
    case.restore_device()
    if op == "backup":
        case.restore_host()
    with _as_side(case, side):
        reloads.submit(reloads.prepared(side, cpu)).finish_event.synchronize()
    torch.cuda.synchronize(reloads.device)
    return bool(_check(case, op, reloads.layers, cpu[0], cpu[1]))


def _cells(
    case: Any,
    tokens: int,
    opts: BesideOptions,
    forwards: dict[str, ForwardGraph],
    metrics: Any,
    op: str = "load",
) -> Iterator[dict[str, Any]]:
    """One request size's rows for ``op``: alone, then beside each compute load's forward
    (reloads also feeding the hit's own forward)."""
    layers = case.opts.layers
    reloads = _Reloads(case, layers) if op == "load" else _Backups(case, layers)
    sides = _sides(case, opts, op)
    situations = ("independent", "dependent") if op == "load" else ("independent",)
    gen = torch.Generator().manual_seed(opts.seed + tokens + case.page_size)
    layer_bytes = tokens * case.row_bytes
    link_ms = layer_bytes * layers / LINK_GBPS / 1e6
    # A warm-up, then the requests timed, each with new indices (the checks draw their own).
    count = opts.repeats + 1
    identical = all(
        _identical(reloads, side, cpu, op)
        for side in sides
        for cpu in request_indices(case, tokens, opts.host_level, 1, gen)
    )
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    tally = Tally(metrics)
    for i, cpu in enumerate(request_indices(case, tokens, opts.host_level, count, gen)):
        for side in alternated(sides, i):
            ms = tally.timed(side, functools.partial(_alone, reloads, side, cpu))
            if i:
                times[side.name].append(ms)
    place = RowPlace(
        "sglang",
        f"{case.kind}/layer_first/kernel/p{case.page_size}",
        tokens,
        case.page_size,
        layers,
        case.row_bytes,
    )
    yield _with_op(
        reload_row(place, "alone", "none", link_ms, times, {}, None, identical, tally), op
    )
    stock_alone = median(times["stock"])
    for load in opts.loads:
        forward = forwards[load]
        forward.size_for(stock_alone * opts.forward_span)
        alone = []
        for situation in situations:
            reload_times: dict[str, list[float]] = {side.name: [] for side in sides}
            forward_times: dict[str, list[float]] = {side.name: [] for side in sides}
            requests = request_indices(case, tokens, opts.host_level, count, gen)
            tally = Tally(metrics)
            for i, cpu in enumerate(requests):
                if situation == "independent":
                    start, end = forward.replay()
                    end.synchronize()
                    if i:
                        alone.append(start.elapsed_time(end))
                for side in alternated(sides, i):
                    run = _independent if situation == "independent" else _dependent
                    reload_ms, forward_ms = tally.timed(
                        side, functools.partial(run, reloads, side, cpu, forward)
                    )
                    if i:
                        reload_times[side.name].append(reload_ms)
                        forward_times[side.name].append(forward_ms)
            if situation == "independent":
                reference = median(alone)
            else:
                reference = ideal_pipeline_ms(layer_bytes, layers, forward.layer_ms)
            row = reload_row(
                place,
                situation,
                load,
                link_ms,
                reload_times,
                forward_times,
                reference,
                identical,
                tally,
            )
            yield _with_op(row, op)
        sync_device(opts.device)


def _with_op(row: dict[str, Any], op: str) -> dict[str, Any]:
    """A backup's row says so; a reload's stays as rows always were."""
    return row if op == "load" else {**row, "op": op}


def run(opts: BesideOptions, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    from benchmarks.sglang.ab import bench_mover
    from benchmarks.sglang.import_stubs import install_torchvision_stub
    from benchmarks.sglang.jit_kernels import warm_jit
    from benchmarks.sglang.pool_case import Options, pool_case
    from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub
    from benchmarks.sglang.sweep import release_pools

    if opts.device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU: the forward's graph and the copies' streams")
    install_torchvision_stub()
    install_sgl_kernel_stub()
    import sglang

    warm_jit(Options(device=opts.device))
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    scheduler = torch.cuda.Stream(opts.device)
    with bench_mover(serve_rule=opts.serve_rule) as mover, torch.cuda.stream(scheduler):
        for kind in opts.kinds:
            layers = (opts.layers or LAYERS)[kind]
            forwards = {
                load: measured_forward(kind, load, layers, opts.device) for load in opts.loads
            }
            for page in opts.pages:
                base = Options(
                    tokens=max(opts.tokens), layers=layers, device=opts.device, seed=opts.seed
                )
                try:
                    with pool_case(kind, "layer_first", page, base) as case:
                        for op in ("load", "backup") if opts.backups else ("load",):
                            for tokens in (t for t in opts.tokens if t % page == 0):
                                for row in _cells(case, tokens, opts, forwards, mover.metrics, op):
                                    progress(summary_line(row))
                                    rows.append(row)
                except Exception as exc:  # one pool failing says why; the others still run
                    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    progress(f"{kind} p{page}: {why}")
                    skipped.append({"case": f"{kind}/layer_first/kernel/p{page}", "error": why})
                finally:
                    release_pools()
                if opts.partial_json:
                    write_json(opts.partial_json, _document(opts, sglang, rows, skipped))
            del forwards
            torch.cuda.empty_cache()
    return _document(opts, sglang, rows, skipped)


def _document(
    opts: BesideOptions, sglang: Any, rows: list[dict[str, Any]], skipped: list[dict[str, Any]]
) -> dict[str, Any]:
    return document(
        "sglang",
        opts.device,
        sglang,
        rows,
        skipped,
        serve_rule=opts.serve_rule,
        host_fragmentation=opts.host_level,
        sglang_dma_in_place=KVCoreConfig.from_env().sglang_dma_in_place,
        timed_from="move_indices",
        forward_span=opts.forward_span,
    )


def options_for(args: argparse.Namespace) -> BesideOptions:
    opts = replace(BesideOptions(), **shared_options(args))
    if getattr(args, "pages", None):
        opts = replace(opts, pages=tuple(int(page) for page in args.pages.split(",")))
    if getattr(args, "no_rule", False):
        opts = replace(opts, serve_rule=False)
    if getattr(args, "stores", False):
        opts = replace(opts, backups=True)
    return opts


def main(args: argparse.Namespace) -> int:
    opts = options_for(args)
    return run_command(args, lambda progress: run(opts, progress), "scripts/beside_compute_gpu.sh")
