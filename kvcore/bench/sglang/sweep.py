"""`kvcore bench --engine sglang --sweep`: whole SGLang requests, stock against kvcore's hooks.

A request is what SGLang's transfer engine does for one prefix: a reload is one
``load_to_device_per_layer`` call per layer, back to back on the load stream; a backup is
one ``backup_from_device_all_layer`` call. Every request gets new index tensors (same
values for both sides, never the same tensor objects), so nothing planned for one request
serves the next. Each side is timed wall-clock from its first call until its copies are
complete, host and device together, with the calls' host time alone beside it; the two
sides alternate request by request in one process on the same pools. kvcore runs as
SGLang's ``HookRegistry`` calls an AROUND hook, with the stock method as ``original``, and
its serve-or-pass rule on (``--no-rule``: off, kvcore's own paths everywhere it can).

Pools are built the way SGLang builds them (:mod:`kvcore.bench.sglang.ab`), filled with random
bytes; after timing, each side's result is checked byte for byte against SGLang's layout
definition, rows outside the copy keeping their poison. Where stock's ``direct`` ops are
absent (no sgl-kernel), the ``direct`` cells compare against the same copies issued one
``copy_`` each from Python (``extra["stock"] == "model:direct"``), which bounds stock's host
time from above.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvcore.bench import sweep_report
from kvcore.bench.sglang import ab
from kvcore.bench.suite import scattered_layout
from kvcore.bench.sweep_report import SweepRow
from kvcore.metrics import Metrics

# Model-like layer counts: a Llama-8B-shaped MHA model, a DeepSeek-shaped MLA model.
LAYERS = {"mha": 32, "mla": 61}
# (layout, io backend, page sizes) as SGLang runs them.
LAYOUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("layer_first", "kernel", (64, 1)),
    ("layer_first", "direct", (64, 1)),
    ("page_first", "kernel", (64, 1)),
    ("page_first_direct", "direct", (64,)),
)
TOKENS = (256, 1024, 4096, 16384, 65536)
HOST_LEVELS = ("0%", "100%")
OPS = ("load", "backup")
# The direct model issues one Python copy_ per page run, layer and buffer; past this many per
# request it would measure Python alone.
MAX_MODEL_COPIES = 20000


@dataclass(frozen=True)
class SweepOptions:
    tokens: tuple[int, ...] = TOKENS
    kinds: tuple[str, ...] = ("mha", "mla")
    layers: dict[str, int] | None = None
    layouts: tuple[tuple[str, str, tuple[int, ...]], ...] = LAYOUTS
    host_levels: tuple[str, ...] = HOST_LEVELS
    ops: tuple[str, ...] = OPS
    repeats: int = 5
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    serve_rule: bool = True
    seed: int = 4321
    gemm: bool = False
    """Also time a batch of bf16 GEMMs on a compute stream while each side's request runs
    (cells of 4096 tokens and more, CUDA only): what a reload costs the model."""
    with_own: bool = True
    """With the rule on, also time kvcore with it off (``extra["own_ms"]``)."""
    partial_json: str | None = None
    """Where to write the rows so far after every pool, so a run cut short keeps them."""

    def layer_count(self, kind: str) -> int:
        return (self.layers or LAYERS)[kind]


def repeats_for(repeats: int, tokens: int, device: torch.device) -> int:
    """Timed requests of a cell of ``tokens`` tokens for ``repeats`` asked: requests past
    32k tokens are long enough that fewer settle the median; on a GPU, requests of a few
    milliseconds (2k tokens and fewer) vary by several percent from one to the next, so
    they get four times as many, which costs little beside the longer cells."""
    if tokens >= 32768:
        return max(2, repeats - 2)
    return repeats * 4 if tokens <= 2048 and device.type == "cuda" else repeats


def options_for(args: argparse.Namespace) -> SweepOptions:
    cuda = torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu"
    opts = SweepOptions(device=torch.device("cuda" if cuda else "cpu"))
    if getattr(args, "quick", False) or not cuda:
        opts = replace(
            opts,
            tokens=(256, 1024) if cuda else (128, 256),
            layers={"mha": 4, "mla": 4},
            repeats=2,
        )
    if getattr(args, "tokens", 0):
        opts = replace(opts, tokens=(int(args.tokens),))
    if getattr(args, "rows", None):
        opts = replace(opts, kinds=tuple(args.rows.split(",")))
    if getattr(args, "host_levels", None):
        opts = replace(opts, host_levels=tuple(args.host_levels.split(",")))
    if getattr(args, "sizes", None):
        opts = replace(opts, tokens=tuple(int(size) for size in args.sizes.split(",")))
    if getattr(args, "repeats", 0):
        opts = replace(opts, repeats=int(args.repeats))
    if getattr(args, "layouts", None):
        wanted = set(args.layouts.split(","))
        opts = replace(opts, layouts=tuple(x for x in LAYOUTS if f"{x[0]}/{x[1]}" in wanted))
    if getattr(args, "no_rule", False):
        opts = replace(opts, serve_rule=False)
    if getattr(args, "gemm", False):
        opts = replace(opts, gemm=True)
    if getattr(args, "json", None):
        opts = replace(opts, partial_json=args.json)
    return opts


# --- one request per side --------------------------------------------------------------


@dataclass
class Side:
    """One way to make a request: ``call(indices)`` issues every call of it."""

    name: str
    call: Callable[[tuple[torch.Tensor, torch.Tensor]], None] | None
    prepare: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """The request's CPU indices as this side receives them (moved where SGLang moves them)."""
    not_runnable: str | None = None
    label: str = ""


def _method(case: ab.PoolCase, op: str) -> Callable[..., Any]:
    return vars(type(case.pool))[ab._METHOD[op]]


def _hook(case: ab.PoolCase, op: str) -> Callable[..., Any]:
    from kvcore_sglang import transfers

    cls = type(case.pool)
    return transfers.HOOKS[f"{cls.__module__}.{cls.__qualname__}.{ab._METHOD[op]}"]


def _request(
    case: ab.PoolCase, op: str, backend: str, layers: int, method: Callable[..., Any]
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


def stock_side(case: ab.PoolCase, op: str, backend: str, layers: int) -> Side:
    """SGLang's own method; where this machine lacks it (``direct`` without sgl-kernel, or
    no CUDA at all), the copies ``direct`` makes, issued from Python (:func:`model_method`)."""
    _, reason = ab.stock_kernel_sms(case, op, backend)
    runnable = reason is None and not (backend == "direct" and ab.sgl_kernel_stubbed())
    if not runnable:
        if backend == "kernel" and case.opts.device.type == "cuda":
            return Side("stock", None, _cpu, reason or "stock kernel not runnable")
        model = model_method(case, op)
        return Side("stock", _request(case, op, backend, layers, model), _cpu, label=MODEL)

    def prepare(h: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ab.stock_indices(case, op, backend, h, d)

    method = _method(case, op)
    return Side("stock", _request(case, op, backend, layers, method), prepare, label="stock")


MODEL = "model:direct"


def model_method(case: ab.PoolCase, op: str) -> Callable[..., None]:
    """A stand-in for the pool method: the copies stock ``direct`` makes for one call (one
    per page run, layer and buffer, :func:`kvcore.bench.sglang.ab.direct_copies`), one
    ``copy_`` each. Raises :class:`~kvcore.bench.sglang.ab.StockNotRunnable` past
    :data:`MAX_MODEL_COPIES` copies a call."""
    page = case.page_size
    last: list[Any] = [None, None, []]

    def copies(host_idx: torch.Tensor, dev_idx: torch.Tensor) -> list[tuple[int, int, int]]:
        if last[0] is not host_idx or last[1] is not dev_idx:
            last[:] = [host_idx, dev_idx, ab.direct_copies(case, host_idx.cpu(), dev_idx.cpu())]
        return last[2]

    def host_block(c: ab.Component, layer: int, slot: int, rows: int) -> torch.Tensor:
        if case.layout == "page_first_direct":
            return c.host[slot // page, layer]
        if case.layout == "page_first":
            return c.host[slot : slot + rows, layer]
        return c.host[layer, slot : slot + rows]

    def move(host_idx: torch.Tensor, dev_idx: torch.Tensor, layer_ids: Sequence[int]) -> None:
        runs = copies(host_idx, dev_idx)
        if len(runs) * len(layer_ids) * len(case.components) > MAX_MODEL_COPIES:
            raise ab.StockNotRunnable(f"{len(runs)} copies a layer: over the model's limit")
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
    case: ab.PoolCase, op: str, backend: str, layers: int, *, direct: bool = False
) -> Side:
    """The AROUND hook as SGLang's HookRegistry calls it, the stock method as ``original``;
    with ``kernel`` on CUDA the host indices go through the ``move_indices`` hook, as SGLang
    moves them (the move itself is not timed on either side)."""
    from kvcore_sglang import transfers

    hook = _hook(case, op)
    stock_run = stock_side(case, op, backend, layers)
    original = _method(case, op) if stock_run.label == "stock" else model_method(case, op)
    name = ab._METHOD[op]

    pool, device_pool = case.pool, case.device_pool

    def method(*args: Any) -> Any:
        # As Python looks the method up: a binding kvcore set on the pool comes first.
        bound = None if direct else pool.__dict__.get(name)
        if bound is not None:
            return bound(*args)
        return hook(original, pool, *args)

    def request(indices: tuple[torch.Tensor, torch.Tensor]) -> None:
        host, device = indices
        if op == "backup":
            method(device_pool, host, device, backend)
            return
        for layer in range(layers):
            method(device_pool, host, device, layer, backend)

    def prepare(h: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Where SGLang's controller puts the indices (stock's side says), the host indices
        # moved through kvcore's move_indices hook, which remembers the CPU ones.
        stock_h, stock_d = ab.stock_indices(case, op, backend, h, d)
        if stock_h is h:
            return h, stock_d

        def to_device(controller: Any, host: torch.Tensor, device: torch.Tensor) -> Any:
            return host.to(case.opts.device), stock_d

        moved = transfers.move_indices_hook(to_device, None, h, d)
        return moved[0], moved[1]

    return Side("kvcore", request, prepare, label="kvcore")


# --- timing ------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    # The whole device: whatever streams a side used, its copies are complete.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def serve_rule_off() -> Iterator[None]:
    """kvcore's SGLang hooks with the serve-or-pass rule off while inside."""
    from kvcore_sglang import transfers

    saved = transfers.serve_rule_enabled
    transfers.serve_rule_enabled = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        transfers.serve_rule_enabled = saved  # type: ignore[assignment]


def rule_off(case: ab.PoolCase, op: str, backend: str, layers: int) -> Side:
    """kvcore's hook called directly with the serve-or-pass rule off: its own paths
    wherever it can copy exactly, to read off where the rule should serve."""
    side = kvcore_side(case, op, backend, layers, direct=True)
    assert side.call is not None
    call = side.call

    def own(indices: tuple[torch.Tensor, torch.Tensor]) -> None:
        with serve_rule_off():
            call(indices)

    return Side("own", own, side.prepare, label="kvcore, rule off")


def _timed_request(
    side: Side, indices: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[float, float]:
    """(wall seconds first call to copy complete, host seconds of the calls)."""
    assert side.call is not None
    _sync(device)
    started = time.perf_counter()
    side.call(indices)
    issued = time.perf_counter()
    _sync(device)
    return time.perf_counter() - started, issued - started


def _requests(
    case: ab.PoolCase, tokens: int, level: str, count: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(count):
        host = scattered_layout(tokens, ab.HOST_LEVELS[level], case.page_size, gen)
        device = scattered_layout(tokens, 1.0, case.page_size, gen)
        out.append((host, device))
    return out


def _check(case: ab.PoolCase, op: str, layers: int, host: torch.Tensor, dev: torch.Tensor) -> bool:
    """Every layer of the request copied, every other row its poison (host rows their
    intended bytes)."""
    if op == "backup":
        return ab.check_backup(case, host, dev)
    h, d = host.to(case.opts.device), dev.to(case.opts.device)
    for c in case.components:
        for layer, (actual, poison) in enumerate(zip(c.devices, c.poison, strict=True)):
            expected = poison.clone()
            if layer < layers:
                expected[d] = ab.get_rows(c.mirror, case.layout, case.page_size, layer, h)
            if not ab.bytes_equal(actual, expected):
                return False
    return True


def _checked_request(
    case: ab.PoolCase, side: Side, op: str, layers: int, cpu: tuple[torch.Tensor, torch.Tensor]
) -> bool:
    _restore_rows(case, op)
    side.call(side.prepare(cpu[0].clone(), cpu[1].clone()))  # type: ignore[misc]
    _sync(case.opts.device)
    return _check(case, op, layers, cpu[0], cpu[1])


def _restore_rows(case: ab.PoolCase, op: str) -> None:
    """Put back what earlier requests wrote: device layers their poison (on the device,
    cheap), and before a backup the host buffers their intended bytes (loads only read
    them, and every load cell of a pool runs before its backups)."""
    case.restore_device()
    if op == "backup":
        case.restore_host()


def measure_cell(
    case: ab.PoolCase,
    op: str,
    backend: str,
    tokens: int,
    level: str,
    opts: SweepOptions,
    mover_metrics: Metrics,
) -> SweepRow | dict[str, Any]:
    layers = case.opts.layers
    stock, kvcore = stock_side(case, op, backend, layers), kvcore_side(case, op, backend, layers)
    where = f"{case.kind}/{case.layout}/{backend}/p{case.page_size}/host-{level}/{op}"
    if stock.call is None:
        return {"case": where, "tokens": tokens, "not_runnable": stock.not_runnable}
    gen = torch.Generator().manual_seed(opts.seed + tokens)
    repeats = repeats_for(opts.repeats, tokens, opts.device)
    cpu = _requests(case, tokens, level, repeats + 2, gen)
    times: dict[str, list[tuple[float, float]]] = {"stock": [], "kvcore": [], "own": []}
    own = rule_off(case, op, backend, layers) if opts.serve_rule and opts.with_own else None
    kvcore_requests = 0
    submissions = 0.0
    passes: dict[str, float] = {}
    paths: set[str] = set()
    try:
        for i, indices in enumerate(cpu[:-1]):
            # Every side gets its own tensors of the same values; the first is a warm-up
            # (JIT builds, first-use set-up), the sides' order alternates.
            order = [stock, kvcore] if i % 2 == 0 else [kvcore, stock]
            for side in order:
                given = side.prepare(indices[0].clone(), indices[1].clone())
                before = mover_metrics.snapshot()
                timed = _timed_request(side, given, opts.device)
                if side is kvcore:
                    after = mover_metrics.snapshot()
                    kvcore_requests += 1
                    served, reasons = _served(before, after, 1)
                    submissions += served
                    for reason, count in reasons.items():
                        passes[reason] = passes.get(reason, 0.0) + count
                    paths.update(_paths(before, after))
                if i:
                    times[side.name].append(timed)
            if own is not None:
                given = own.prepare(indices[0].clone(), indices[1].clone())
                timed = _timed_request(own, given, opts.device)
                if i:
                    times["own"].append(timed)
    except ab.StockNotRunnable as exc:
        _sync(opts.device)
        return {"case": where, "tokens": tokens, "not_runnable": str(exc)[:300]}
    # kvcore's result is checked (stock's is the reference it must equal); restoring a whole
    # host pool between two checks would cost more than the cell.
    identical = _checked_request(case, kvcore, op, layers, cpu[-1])
    stock_ms = statistics.median(t for t, _ in times["stock"]) * 1e3
    # kvcore's own paths too (the rule off): whether a gather it would serve with costs the
    # model more SMs than stock's copy is what the rule must weigh.
    gemm_sides = (stock, kvcore) if own is None else (stock, kvcore, own)
    gemm = (
        gemm_interference(gemm_sides, cpu[-1], opts.device, stock_ms)
        if opts.gemm and tokens >= GEMM_MIN_TOKENS
        else {}
    )
    served = submissions / kvcore_requests
    reasons = {reason: count / kvcore_requests for reason, count in passes.items()}
    calls = layers if op == "load" else 1
    return SweepRow(
        engine="sglang",
        case=where,
        tokens=tokens,
        layers=layers,
        nbytes=tokens * case.row_bytes * layers,
        stock_ms=statistics.median(t for t, _ in times["stock"]) * 1e3,
        kvcore_ms=statistics.median(t for t, _ in times["kvcore"]) * 1e3,
        stock_host_ms=statistics.median(h for _, h in times["stock"]) * 1e3,
        kvcore_host_ms=statistics.median(h for _, h in times["kvcore"]) * 1e3,
        identical=identical,
        calls=calls,
        kvcore_served=min(calls, round(served)),
        pass_reasons=reasons,
        paths=sorted(paths),
        extra={
            "op": op,
            "kind": case.kind,
            "layout": case.layout,
            "io_backend": backend,
            "page_size": case.page_size,
            "host_fragmentation": level,
            "stock": stock.label,
            "repeats": len(times["kvcore"]),
            **_own_times(times["own"]),
            **gemm,
        },
    )


GEMM_MIN_TOKENS = 4096
_GEMM_SIZE = 4096


def gemm_interference(
    sides: Sequence[Side],
    cpu: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    request_ms: float,
) -> dict[str, float]:
    """Milliseconds a batch of bf16 GEMMs takes on a stream of its own, alone and while
    each side's request runs on the load stream, the batch sized to last about as long as
    the request. A copy engine's DMA leaves the GEMMs' SMs alone; a copy kernel takes
    some of them."""
    if device.type != "cuda":
        return {}
    a = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    compute = torch.cuda.Stream(device)

    def batch(count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            start.record()
            for _ in range(count):
                torch.mm(a, b, out=c)
            end.record()
        return start, end

    start, end = batch(8)
    _sync(device)
    each_ms = start.elapsed_time(end) / 8
    count = max(8, round(request_ms / each_ms))
    start, end = batch(count)
    _sync(device)
    out = {"gemm_count": float(count), "gemm_alone_ms": start.elapsed_time(end)}
    for side in sides:
        assert side.call is not None
        given = side.prepare(cpu[0].clone(), cpu[1].clone())
        _sync(device)
        start, end = batch(count)
        side.call(given)
        _sync(device)
        out[f"gemm_with_{side.name}_ms"] = start.elapsed_time(end)
    return out


def _own_times(own: list[tuple[float, float]]) -> dict[str, float]:
    if not own:
        return {}
    return {
        "own_ms": statistics.median(t for t, _ in own) * 1e3,
        "own_host_ms": statistics.median(h for _, h in own) * 1e3,
    }


def _served(
    before: dict[str, Any], after: dict[str, Any], requests: int
) -> tuple[float, dict[str, float]]:
    """kvcore's own submissions and its passes per request, from its metrics."""
    seen = {(t["direction"], t["path"]): t["count"] for t in before["transfers"]}
    submissions = sum(
        t["count"] - seen.get((t["direction"], t["path"]), 0) for t in after["transfers"]
    )
    passes = {
        reason: (count - before["fallbacks"].get(reason, 0)) / requests
        for reason, count in after["fallbacks"].items()
        if count > before["fallbacks"].get(reason, 0)
    }
    return submissions / requests, passes


def _paths(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    seen = {(t["direction"], t["path"]): t["count"] for t in before["transfers"]}
    return sorted(
        {
            t["path"]
            for t in after["transfers"]
            if t["count"] > seen.get((t["direction"], t["path"]), 0)
        }
    )


# --- the sweep ---------------------------------------------------------------------------


@contextmanager
def _pool(kind: str, layout: str, page: int, opts: SweepOptions) -> Iterator[ab.PoolCase]:
    base = ab.Options(
        tokens=max(opts.tokens),
        layers=opts.layer_count(kind),
        device=opts.device,
        repeats=opts.repeats,
        seed=opts.seed,
    )
    with ab.pool_case(kind, layout, page, base) as case:
        yield case


def _pool_cells(
    case: ab.PoolCase,
    backend: str,
    opts: SweepOptions,
    metrics: Metrics,
    progress: Callable[[str], None],
) -> Iterator[SweepRow | dict[str, Any]]:
    """Every cell of one pool: ops x host levels x request sizes."""
    for op in opts.ops:
        for level in opts.host_levels:
            for tokens in (t for t in opts.tokens if t % case.page_size == 0):
                try:
                    cell = measure_cell(case, op, backend, tokens, level, opts, metrics)
                except Exception as exc:  # one cell failing says why; the others still run
                    _sync(opts.device)
                    where = f"{case.kind}/{case.layout}/{backend}/p{case.page_size}/{level}/{op}"
                    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    cell = {"case": where, "tokens": tokens, "not_runnable": why}
                if isinstance(cell, SweepRow):
                    progress(sweep_report.format_table([cell]).split("\n")[-1])
                else:
                    progress(f"{cell['case']} {tokens}: {cell['not_runnable']}")
                yield cell


def _one_pool(
    kind: str,
    layout: str,
    backend: str,
    page: int,
    opts: SweepOptions,
    mover: Any,
    progress: Callable[[str], None],
) -> tuple[list[SweepRow], list[dict[str, Any]]]:
    """Every cell of one pool; the pool (tens of GB on both sides) is gone on return."""
    rows: list[SweepRow] = []
    skipped: list[dict[str, Any]] = []
    try:
        with _pool(kind, layout, page, opts) as case:
            for cell in _pool_cells(case, backend, opts, mover.metrics, progress):
                if isinstance(cell, SweepRow):
                    rows.append(cell)
                else:
                    skipped.append(cell)
    except Exception as exc:  # a pool SGLang cannot build here: say so, go on
        why = f"pool not built: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        progress(why)
        skipped.append({"case": f"{kind}/{layout}/{backend}/p{page}", "not_runnable": why})
    finally:
        _release_pools()
    return rows, skipped


def _release_pools() -> None:
    """Drop what kvcore keeps of a pool's requests, then the memory itself."""
    from kvcore_sglang import transfers

    transfers.LOAD_REQUESTS.clear()
    transfers.POOL_LAYERS.clear()
    transfers.restore_bypassed()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(opts: SweepOptions, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    stub = ab.install_sgl_kernel_stub()
    import sglang

    jit = ab.warm_jit(ab.Options(device=opts.device))
    rows: list[SweepRow] = []
    skipped: list[dict[str, Any]] = []
    stream = torch.cuda.Stream(opts.device) if opts.device.type == "cuda" else None
    with ab.bench_mover(serve_rule=opts.serve_rule) as mover, ab.on_stream(stream):
        assert mover.metrics is not None
        for kind, (layout, backend, pages) in itertools.product(opts.kinds, opts.layouts):
            for page in pages:
                progress(f"-- {kind} {layout} {backend} page {page}")
                pool_rows, pool_skipped = _one_pool(
                    kind, layout, backend, page, opts, mover, progress
                )
                rows += pool_rows
                skipped += pool_skipped
                if opts.partial_json:
                    partial = _result(opts, rows, skipped, sglang, stub, jit)
                    sweep_report.write_json(opts.partial_json, partial["document"])
    return _result(opts, rows, skipped, sglang, stub, jit)


def _result(
    opts: SweepOptions,
    rows: list[SweepRow],
    skipped: list[dict[str, Any]],
    sglang: Any,
    stub: bool,
    jit: dict[str, str],
) -> dict[str, Any]:
    device = torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else "cpu"
    return {
        "document": sweep_report.report(
            device,
            rows,
            engine="sglang",
            version=getattr(sglang, "__version__", "unknown"),
            torch=torch.__version__,
            sgl_kernel="stub (not installed)" if stub else "installed",
            jit_modules=jit,
            serve_rule=opts.serve_rule,
            repeats=opts.repeats,
            not_runnable=skipped,
        ),
        "rows": rows,
    }


def main(args: argparse.Namespace) -> int:
    opts = options_for(args)
    quiet = bool(getattr(args, "no_progress", False))
    result = run(opts, progress=(lambda line: None) if quiet else _print_err)
    rows: Sequence[SweepRow] = result["rows"]
    print(sweep_report.format_table(rows))
    print()
    print(sweep_report.LEGEND)
    print(sweep_report.summary(rows))
    for line in gemm_summary(rows):
        print(line)
    if getattr(args, "json", None):
        sweep_report.write_json(args.json, result["document"])
    if getattr(args, "plot", None):
        sweep_report.plot(rows, args.plot, title="SGLang: kvcore / stock, whole requests")
    return 1 if any(not row.identical for row in rows) else 0


def gemm_summary(rows: Sequence[SweepRow]) -> list[str]:
    """A line per cell that timed GEMMs beside its request: their throughput kept."""
    lines = []
    for row in rows:
        alone = row.extra.get("gemm_alone_ms")
        if not alone:
            continue
        kept = {
            side: alone / row.extra[f"gemm_with_{side}_ms"]
            for side in ("stock", "kvcore", "own")
            if row.extra.get(f"gemm_with_{side}_ms")
        }
        shares = ", ".join(f"{side} {100 * share:.0f}%" for side, share in kept.items())
        lines.append(f"GEMM throughput kept during {row.case} {row.tokens}: {shares}")
    return lines


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
