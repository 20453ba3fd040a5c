"""One cell of the SGLang sweep (:mod:`benchmarks.sglang.sweep`): its requests, timed and checked.

:func:`measure_cell` times requests of one size and host fragmentation through stock and
kvcore in alternating order (and kvcore with its rule off), checks kvcore's last result
byte for byte against SGLang's layout definition, and reads from kvcore's metrics how
many calls it served, why it passed the others and which paths it took;
:func:`gemm_interference` times a GEMM batch beside each side's request. Apart from the
sweep over pools so that the host-cost bench times the same requests the same way.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.gemm_share import GemmBatch
from benchmarks.metric_deltas import paths_taken, served_per_request
from benchmarks.paired_speed import paired_speed
from benchmarks.sglang.pool_case import HOST_LEVELS, PoolCase
from benchmarks.sglang.pool_rows import bytes_equal, check_backup, get_rows
from benchmarks.sglang.sgl_kernel_stub import StockNotRunnable
from benchmarks.sglang.sweep_options import SweepOptions, repeats_for
from benchmarks.sglang.sweep_sides import Side, kvcore_side, rule_off, stock_side
from benchmarks.sweep_report import SweepRow
from kvcore.bench.measure import sync_device
from kvcore.bench.suite import scattered_layout
from kvcore.metrics import Metrics


def _timed_request(
    side: Side, indices: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[float, float]:
    """(wall seconds first call to copy complete, host seconds of the calls)."""
    assert side.call is not None
    sync_device(device)
    started = time.perf_counter()
    side.call(indices)
    issued = time.perf_counter()
    sync_device(device)
    return time.perf_counter() - started, issued - started


def request_indices(
    case: PoolCase, tokens: int, level: str, count: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` requests of ``tokens`` tokens as (host, device) CPU index pairs: host pages
    scattered as ``level`` (a key of ``HOST_LEVELS``) says, device pages all scattered."""
    out = []
    for _ in range(count):
        host = scattered_layout(tokens, HOST_LEVELS[level], case.page_size, gen)
        device = scattered_layout(tokens, 1.0, case.page_size, gen)
        out.append((host, device))
    return out


def _check(case: PoolCase, op: str, layers: int, host: torch.Tensor, dev: torch.Tensor) -> bool:
    """Every layer of the request copied, every other row its poison (host rows their
    intended bytes)."""
    if op == "backup":
        return check_backup(case, host, dev)
    h, d = host.to(case.opts.device), dev.to(case.opts.device)
    for c in case.components:
        for layer, (actual, poison) in enumerate(zip(c.devices, c.poison, strict=True)):
            expected = poison.clone()
            if layer < layers:
                expected[d] = get_rows(c.mirror, case.layout, case.page_size, layer, h)
            if not bytes_equal(actual, expected):
                return False
    return True


def _checked_request(
    case: PoolCase, side: Side, op: str, layers: int, cpu: tuple[torch.Tensor, torch.Tensor]
) -> bool:
    _restore_rows(case, op)
    side.call(side.prepare(cpu[0].clone(), cpu[1].clone()))  # type: ignore[misc]
    sync_device(case.opts.device)
    return _check(case, op, layers, cpu[0], cpu[1])


def _restore_rows(case: PoolCase, op: str) -> None:
    """Put back what earlier requests wrote: device layers their poison (on the device,
    cheap), and before a backup the host buffers their intended bytes (loads only read
    them, and every load cell of a pool runs before its backups)."""
    case.restore_device()
    if op == "backup":
        case.restore_host()


def measure_cell(
    case: PoolCase,
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
    cpu = request_indices(case, tokens, level, repeats + 2, gen)
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
                    served, reasons = served_per_request(before, after, 1)
                    submissions += served
                    for reason, count in reasons.items():
                        passes[reason] = passes.get(reason, 0.0) + count
                    paths.update(paths_taken(before, after))
                if i:
                    times[side.name].append(timed)
            if own is not None:
                given = own.prepare(indices[0].clone(), indices[1].clone())
                timed = _timed_request(own, given, opts.device)
                if i:
                    times["own"].append(timed)
    except StockNotRunnable as exc:
        sync_device(opts.device)
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
        paired=paired_speed([t for t, _ in times["stock"]], [t for t, _ in times["kvcore"]]),
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


def gemm_interference(
    sides: Sequence[Side],
    cpu: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    request_ms: float,
) -> dict[str, float]:
    """Milliseconds a GEMM batch (:class:`benchmarks.gemm_share.GemmBatch`) takes alone
    and while each side's request runs on the load stream; nothing off CUDA."""
    if device.type != "cuda":
        return {}
    batch = GemmBatch(device, request_ms)
    out = {"gemm_count": float(batch.count), "gemm_alone_ms": batch.alone_ms()}
    for side in sides:
        assert side.call is not None
        given = side.prepare(cpu[0].clone(), cpu[1].clone())
        out[f"gemm_with_{side.name}_ms"] = batch.beside_ms(functools.partial(side.call, given))
    return out


def _own_times(own: list[tuple[float, float]]) -> dict[str, float]:
    if not own:
        return {}
    return {
        "own_ms": statistics.median(t for t, _ in own) * 1e3,
        "own_host_ms": statistics.median(h for _, h in own) * 1e3,
    }
