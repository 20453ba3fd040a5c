"""`kvcore bench --engine vllm --sweep --beside-compute`: vLLM's CPU-tier loads beside the model.

A load is what vLLM's offloading worker does for a hit: the connector submits the job
(``transfer_async``: each handler's copies first wait for what the compute stream has
queued), the engine goes on with the running batch's forward, and the worker waits for the
job and collects it (``wait``, ``get_finished``) before the request is scheduled. Each
request is timed wall-clock from the first submission until every job is reported, with
new block ids every time, in two situations:

- ``alone``: nothing else on the GPU;
- ``independent``: another batch's forward (:class:`benchmarks.model_forward.ForwardGraph`,
  a Llama-3-8B-shaped layer beside MHA pages, a DeepSeek-V3-shaped one beside MLA pages,
  replayed as one CUDA graph on a compute stream sized to last about as long as stock's load
  alone) is queued right after the submissions, as the engine's next step is; its time alone
  and beside each side's load says what the load costs everyone else. A control row field,
  ``forward_harness_only_ms``, times it inside a request of no job (the bench's own steps,
  no copy), to tell a stretch the copies cause from one the bench does.
  kvcore's load handler runs at the highest CUDA priority unless
  ``KVCORE_HIGH_PRIORITY_LOADS=0``, as in an engine.

vLLM schedules a request only once its loads are reported, so no forward waits layer by
layer on them: there is no ``dependent`` situation as in SGLang's bench
(:mod:`benchmarks.sglang.beside`).

Stock is vLLM's own handler (its compiled copy op, or the same driver call where that is
not built); kvcore is its handler over a copy of stock's; ``own`` is kvcore's with its
serve-or-pass rule off. The sides alternate request by request on the same pools, and every
request is checked byte for byte, every other row keeping its bytes. Rows are
:func:`benchmarks.beside_rows.reload_row`'s: ``engine case situation tokens page_size
stock_ms kvcore_ms link_ms forward_alone_ms forward_with_stock_ms forward_with_kvcore_ms
identical``, ``page_size`` being vLLM's 16-token block, and ``plain_copy_gbps``: one
contiguous pinned copy of up to 1 GiB that way in the same process, from the same host
region (a process whose region sits far from the GPU is slower in every cell, and this says
so), and ``submit_host_ms``: per side, how long the request's ``transfer_async`` calls held
the host (the engine's thread, which queues the next forward only after them; the
independent forward here is queued after them too, so its own time does not show it).
``forward_done_ms`` (per side) times the independent forward's end from the request's start
instead, and ``forward_done_alone_ms`` from its own queueing with no request: what the
running batch waits in all, the submissions' hold included. ``--engine-steps`` adds, per
cell, the engine's step loop (:mod:`benchmarks.vllm.beside_steps`): the hit ready at the end
of the step that reports its last job, and the running batch's steps until then.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from benchmarks.beside_cli import document, run_command, shared_options, write_json
from benchmarks.beside_rows import (
    LINK_GBPS,
    RowPlace,
    SideSamples,
    Tally,
    alternated,
    median,
    reload_row,
    side_medians,
    summary_line,
)
from benchmarks.model_forward import COMPUTE_LOADS, measured_forward
from benchmarks.vllm.beside_steps import steps_row
from benchmarks.vllm.offload_handlers import stock_handler
from benchmarks.vllm.sweep import host_region, link_ceilings, request_through
from benchmarks.vllm.sweep_plan import BLOCK_TOKENS, MHA_PAGE_BYTES, MLA_PAGE_BYTES, ModelLayout
from benchmarks.vllm.sweep_pools import Pools, RequestDrawer, slice_blocks
from benchmarks.vllm.sweep_sides import Side, kvcore_side, stock_side
from kvcore.bench.suite_options import PAGE_LEVELS

LAYOUTS: dict[str, ModelLayout] = {
    "mha": ModelLayout(False, 32, "mha", MHA_PAGE_BYTES),
    "mla": ModelLayout(False, 61, "mla", MLA_PAGE_BYTES),
    "mha-64k": ModelLayout(False, 32, "mha", 2 * MHA_PAGE_BYTES),
    "mha-cross": ModelLayout(True, 32, "mha", MHA_PAGE_BYTES),
    "mla-cross": ModelLayout(True, 61, "mla", MLA_PAGE_BYTES),
    "mha-cross-24k": ModelLayout(True, 12, "mha", 2 << 10),
}
"""The layouts by ``--rows`` name: per-layer KV tensors, as vLLM's connector registers a
model's layers (``mha``, ``mla``; ``mha-64k``: pages of 64 KiB, where vLLM's rule keeps
stores stock's and serves jobs from 2048 pages), or one tensor whose block holds every
layer's page (``-cross``: blocks of 1 MiB and more, whose scattered loads the rule keeps
stock's; ``mha-cross-24k``: blocks of 24 KiB, under the 28 KiB up to which vLLM loads with
its Triton kernel, whose scattered loads the rule keeps stock's too). The forward beside
them is the model of their page (``ModelLayout.page``)."""


@dataclass(frozen=True)
class VllmBesideOptions:
    kinds: tuple[str, ...] = ("mha", "mla")
    tokens: tuple[int, ...] = (8192, 32768)
    loads: tuple[str, ...] = tuple(COMPUTE_LOADS)
    repeats: int = 5
    frag: float = 0.0
    """The host blocks' fragmentation (kvcore's allocator keeps a request's chunks in a run)."""
    gpu_frag: float | None = None
    """The GPU blocks' (None: as the host's, so 0% puts both sides in one run)."""
    with_own: bool = True
    stores: bool = False
    """Also time stores (GPU to CPU: the page-outs of what the forward just wrote)."""
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    seed: int = 4321
    partial_json: str | None = None
    """Where to write the rows so far after every layout, so a run cut short keeps them."""
    forward_span: float = 1.0
    """Another batch's forward lasts about this many times stock's load alone."""
    engine_steps: bool = False
    """Also each cell's ``steps`` rows (:mod:`benchmarks.vllm.beside_steps`)."""


class Forward(Protocol):
    """What the cells need of a forward (:class:`benchmarks.model_forward.ForwardGraph`)."""

    def size_for(self, target_ms: float) -> None: ...

    def size_layers(self, count: int) -> None: ...

    def replay(self) -> tuple[Any, Any]: ...

    def mark(self) -> Any: ...


@dataclass(frozen=True)
class _Beside:
    """One request of a side with the other batch's forward queued after its submissions."""

    load_ms: float
    checked: bool
    forward_ms: float
    """The forward's own time, from its first kernel to its last."""
    launch_ms: float
    """The host's time to queue the forward."""
    submit_ms: float
    """How long the request's submissions held the host before the forward could be queued."""
    forward_done_ms: float
    """From the request's first submission to the forward's end: the other batch's wait."""


class _Loads:
    """One layout's pools, its request drawer and the job ids handed out so far."""

    def __init__(self, pools: Pools, blocks: int, seed: int) -> None:
        self.pools = pools
        self.drawer = RequestDrawer(blocks, np.random.default_rng(seed))
        self.next_id = 0

    def new_ids(self, count: int) -> list[int]:
        """``count`` job ids never handed out before."""
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def through(
        self,
        side: Side,
        request: Any,
        between: Callable[[], object] | None = None,
        before_check: Callable[[], object] | None = None,
    ) -> tuple[float, bool, float]:
        """(ms, checked ok, ms the submissions held the host) of one request through
        ``side``."""
        ids = self.new_ids(len(request.jobs))
        wall, host, errors = request_through(side, self.pools, request, ids, between, before_check)
        return wall * 1e3, not errors, host * 1e3


class _Metrics:
    """kvcore's side's mover paths and handler passes as one snapshot, for :class:`Tally`."""

    def __init__(self, side: Side) -> None:
        self.side = side

    def snapshot(self) -> dict[str, Any]:
        mover, handler = self.side.mover_metrics, self.side.handler_metrics
        return {
            "transfers": mover.snapshot()["transfers"] if mover is not None else [],
            "fallbacks": handler.snapshot()["fallbacks"] if handler is not None else {},
        }


def cells(
    model: ModelLayout,
    loads: _Loads,
    sides: Sequence[Side],
    forwards: dict[str, Forward],
    opts: VllmBesideOptions,
    gpu_to_cpu: bool = False,
) -> Iterator[dict[str, Any]]:
    """Each request size's rows: alone, then beside each compute load's forward, then (with
    ``opts.engine_steps``) in the step loop of each; loads, or stores where ``gpu_to_cpu``."""
    kvcore = next(side for side in sides if side.name == "kvcore")
    op = "store" if gpu_to_cpu else "load"
    for tokens in opts.tokens:
        blocks = tokens // BLOCK_TOKENS
        link_ms = blocks * model.block_bytes / LINK_GBPS / 1e6
        place = RowPlace("vllm", f"{model.name}/{_levels(opts)}/{op}", tokens, 16, model.layers)
        ok = True
        times: dict[str, list[float]] = {side.name: [] for side in sides}
        submits: dict[str, list[float]] = {side.name: [] for side in sides}
        tally = Tally(_Metrics(kvcore))
        # A warm-up, then the requests timed, each with new block ids.
        for i in range(opts.repeats + 1):
            request = loads.drawer.draw(
                blocks, opts.frag, 1, gpu_to_cpu=gpu_to_cpu, gpu_frag=opts.gpu_frag
            )
            for side in alternated(sides, i):
                ms, checked, submit_ms = tally.timed(
                    side, functools.partial(loads.through, side, request)
                )
                ok &= checked
                if i:
                    times[side.name].append(ms)
                    submits[side.name].append(submit_ms)
        row = reload_row(place, "alone", "none", link_ms, times, {}, None, ok, tally)
        yield row | {"submit_host_ms": side_medians(submits)}
        reference = median(times["stock"]) if times.get("stock") else median(times["kvcore"])
        for load in opts.loads:
            forward = forwards[load]
            forward.size_for(reference * opts.forward_span)
            samples = SideSamples(
                [side.name for side in sides],
                ["load_ms", "forward_ms", "launch_ms", "submit_ms", "forward_done_ms"],
            )
            alone: list[float] = []
            done_alone: list[float] = []
            harness_only: list[float] = []
            tally = Tally(_Metrics(kvcore))
            for i in range(opts.repeats + 1):
                queued = forward.mark()
                start, end = forward.replay()
                end.synchronize()
                control = _harness_only(kvcore, forward)
                if i:
                    alone.append(start.elapsed_time(end))
                    done_alone.append(queued.elapsed_time(end))
                    harness_only.append(control)
                request = loads.drawer.draw(
                    blocks, opts.frag, 1, gpu_to_cpu=gpu_to_cpu, gpu_frag=opts.gpu_frag
                )
                for side in alternated(sides, i):
                    beside_one: _Beside = tally.timed(
                        side, functools.partial(_beside, loads, side, request, forward)
                    )
                    ok &= beside_one.checked
                    if i:
                        samples.add(side.name, beside_one)
            row = reload_row(
                place,
                "independent",
                load,
                link_ms,
                samples["load_ms"],
                samples["forward_ms"],
                median(alone),
                ok,
                tally,
            )
            row["forward_launch_host_ms"] = samples.medians("launch_ms")
            row["submit_host_ms"] = samples.medians("submit_ms")
            row["forward_done_alone_ms"] = median(done_alone)
            row["forward_done_ms"] = samples.medians("forward_done_ms")
            row["forward_harness_only_ms"] = median(harness_only)
            yield row
        if opts.engine_steps:
            for load in opts.loads:
                yield steps_row(
                    place,
                    load,
                    link_ms,
                    loads,
                    sides,
                    forwards[load],
                    functools.partial(
                        loads.drawer.draw,
                        blocks,
                        opts.frag,
                        1,
                        gpu_to_cpu=gpu_to_cpu,
                        gpu_frag=opts.gpu_frag,
                    ),
                    opts.repeats,
                    Tally(_Metrics(kvcore)),
                )


def _beside(loads: _Loads, side: Side, request: Any, forward: Forward) -> _Beside:
    """One request with the forward queued right after its submissions. The launch's host
    time tells a forward held back on the host (its start event already queued) from one
    slowed on the GPU; the submissions' tells how long the engine's thread was held before
    it could queue the forward at all; the forward's end from the request's start, what the
    other batch waited in all."""
    events: list[tuple[Any, Any]] = []
    launch: list[float] = []

    def queue_forward() -> None:
        began = time.perf_counter()
        events.append(forward.replay())
        launch.append((time.perf_counter() - began) * 1e3)

    def forward_done() -> None:
        # The check's kernels would otherwise run beside the forward's tail and stretch it.
        events[0][1].synchronize()

    queued = forward.mark()
    ms, ok, submit_ms = loads.through(side, request, queue_forward, forward_done)
    start, end = events[0]
    return _Beside(ms, ok, start.elapsed_time(end), launch[0], submit_ms, queued.elapsed_time(end))


def _harness_only(side: Side, forward: Forward) -> float:
    """The forward's ms queued where :func:`_beside` queues it, inside ``side``'s request
    with no job submitted: what the bench's own steps (the side's synchronisation before
    it submits, the handler's wait and collection) do to the forward, with no copy."""
    events: list[tuple[Any, Any]] = []
    side.run([], lambda: events.append(forward.replay()))
    start, end = events[0]
    end.synchronize()
    return float(start.elapsed_time(end))


def run(
    opts: VllmBesideOptions, progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    import vllm

    if opts.device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU: the forward's graph and the copies' streams")
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    blocks = slice_blocks(max(opts.tokens) // BLOCK_TOKENS)
    layouts = [LAYOUTS[kind] for kind in opts.kinds]
    host = host_region(max(m.layout(blocks).host_row_bytes for m in layouts) * blocks, opts.device)
    generator = torch.Generator().manual_seed(opts.seed)
    try:
        for model in layouts:
            try:
                rows += _layout_rows(model, host.tensor, blocks, generator, opts, progress)
            except Exception as exc:  # one layout failing says why; the others still run
                why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                progress(f"{model.name}: {why}")
                skipped.append({"case": model.name, "error": why})
            if opts.partial_json:
                write_json(opts.partial_json, _document(opts, vllm, rows, skipped))
            torch.cuda.empty_cache()
    finally:
        host.close()
    return _document(opts, vllm, rows, skipped)


def _layout_rows(
    model: ModelLayout,
    region: torch.Tensor,
    blocks: int,
    generator: torch.Generator,
    opts: VllmBesideOptions,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    pools = Pools(model.layout(blocks), region.view(torch.int8), opts.device, generator)
    forwards = {
        load: measured_forward(model.page, load, model.layers, opts.device) for load in opts.loads
    }
    loads = _Loads(pools, blocks, opts.seed)
    plain_copy_gbps = link_ceilings(pools)
    rows = []
    for gpu_to_cpu in (False, True) if opts.stores else (False,):
        stock = stock_handler(pools.gpu, pools.host, pools.layout, gpu_to_cpu=gpu_to_cpu)
        label, stock_run = stock_side(stock, opts.device)
        if stock_run is None:
            raise RuntimeError(f"stock's handler cannot run here: {label}")
        sides = [stock_run, kvcore_side(stock, opts.device)]
        if opts.with_own:
            sides.append(kvcore_side(stock, opts.device, rule=False))
        try:
            for row in cells(model, loads, sides, dict(forwards), opts, gpu_to_cpu):
                row["stock_copy"] = label
                row["plain_copy_gbps"] = plain_copy_gbps["store" if gpu_to_cpu else "load"]
                progress(summary_line(row))
                rows.append(row)
        finally:
            for side in sides:
                side.handler.shutdown()
    if not pools.verify_all():
        for row in rows:
            row["identical"] = False
    return rows


def _document(
    opts: VllmBesideOptions, vllm: Any, rows: list[dict[str, Any]], skipped: list[dict[str, Any]]
) -> dict[str, Any]:
    return document(
        "vllm",
        opts.device,
        vllm,
        rows,
        skipped,
        host_fragmentation=opts.frag,
        gpu_fragmentation=opts.frag if opts.gpu_frag is None else opts.gpu_frag,
        forward_span=opts.forward_span,
    )


def _levels(opts: VllmBesideOptions) -> str:
    """The case's blocks part: ``host-0%``, with ``+gpu-100%`` where the GPU's level is set."""
    host = f"host-{opts.frag:.0%}"
    return host if opts.gpu_frag is None else f"{host}+gpu-{opts.gpu_frag:.0%}"


def options_for(args: argparse.Namespace) -> VllmBesideOptions:
    opts = replace(
        VllmBesideOptions(),
        **shared_options(args),
        stores=bool(getattr(args, "stores", False)),
        engine_steps=bool(getattr(args, "engine_steps", False)),
    )
    host = _level("--host-levels", getattr(args, "host_levels", None))
    gpu = _level("--gpu-levels", getattr(args, "gpu_levels", None))
    if host is not None:
        opts = replace(opts, frag=host)
    return opts if gpu is None else replace(opts, gpu_frag=gpu)


def _level(option: str, level: str | None) -> float | None:
    """The fragmentation ``option``'s value names (None where not given): the share of a
    request's host (GPU) blocks not next to the one before."""
    if not level:
        return None
    if level not in PAGE_LEVELS:
        raise ValueError(
            f"{option} {level}: vLLM's beside-compute bench takes one of {', '.join(PAGE_LEVELS)}"
        )
    return PAGE_LEVELS[level]


def main(args: argparse.Namespace) -> int:
    try:
        opts = options_for(args)
    except ValueError as exc:
        print(f"kvcore bench: {exc}", file=sys.stderr)
        return 2
    unknown = [kind for kind in opts.kinds if kind not in LAYOUTS]
    if unknown:
        print(
            f"kvcore bench --rows {','.join(opts.kinds)}: vLLM's beside-compute bench has "
            f"{', '.join(LAYOUTS)}",
            file=sys.stderr,
        )
        return 2
    return run_command(
        args, lambda progress: run(opts, progress), "scripts/beside_compute_vllm_gpu.sh"
    )
