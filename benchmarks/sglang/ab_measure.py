"""The A/B's timing: each path on freshly restored buffers, then every byte checked.

:func:`measure` times one :class:`~benchmarks.sglang.ab_paths.PathRun` beside the pinned
contiguous ceiling and reads from kvcore's metrics which paths it took; :func:`run_case`
runs every path of one pool case at each host fragmentation level; and
:func:`prefix_round_trip` evicts a prefix to host and reloads it layer by layer, stock and
kvcore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.sglang.ab_paths import (
    LOAD_LAYER,
    METHOD_NAMES,
    OPS,
    PathRun,
    direct_model_path,
    host_pool_class,
    kvcore_gpu_indices_path,
    kvcore_path,
    stock_indices,
    stock_path,
)
from benchmarks.sglang.ab_report import row_line
from benchmarks.sglang.pool_case import LAYOUT_BACKENDS, PoolCase, sync_device
from benchmarks.sglang.pool_rows import bytes_equal, check_backup, check_load, index_pairs
from kvcore.bench.suite import timed
from kvcore.mover import Mover


def _kvcore_sms(mover: Mover, metrics_before: dict[str, Any]) -> tuple[str, list[str], dict]:
    """(SMs the copy held, the mover paths taken, new fallback reasons) since ``metrics_before``."""
    assert mover.metrics is not None
    after = mover.metrics.snapshot()
    seen = {(t["direction"], t["path"]): t["count"] for t in metrics_before["transfers"]}
    paths = sorted(
        {
            t["path"]
            for t in after["transfers"]
            if t["count"] > seen.get((t["direction"], t["path"]), 0)
        }
    )
    fallbacks = {
        k: v - metrics_before["fallbacks"].get(k, 0)
        for k, v in after["fallbacks"].items()
        if v > metrics_before["fallbacks"].get(k, 0)
    }
    parts = []
    for path in paths:
        if path == "gather":
            policy = mover.policy
            parts.append(
                f"gather kernel, {policy.gather_ctas} CTAs to device, "
                f"{policy.gather_ctas_to_host} to host"
            )
        elif path == "staged":
            parts.append("DMA to staging, 0 SMs on PCIe (+ device index_copy_)")
        else:
            parts.append(f"{path}: DMA, 0 SMs")
    return "; ".join(parts), paths, fallbacks


def _ceiling(case: PoolCase, nbytes: int, op: str) -> float:
    """GB/s of one pinned contiguous copy of ``nbytes`` in the op's direction."""
    host = case.components[0].host.reshape(-1).view(torch.uint8)
    nbytes = min(nbytes, host.numel())
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=case.opts.device)
    src, dst = (host[:nbytes], scratch) if op == "load" else (scratch, host[:nbytes])
    seconds, _ = timed(lambda: dst.copy_(src, non_blocking=True), case.opts.device, 3)
    case.restore_host()
    return nbytes / seconds / 1e9


def op_bytes(case: PoolCase, op: str, tokens: int) -> int:
    layers = 1 if op == "load" else case.opts.layers
    return tokens * case.row_bytes * layers


def measure(
    case: PoolCase,
    op: str,
    run: PathRun,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    ceiling: float,
    mover: Mover | None = None,
) -> dict[str, Any]:
    """Time one path on freshly restored buffers, then check every byte."""
    nbytes = op_bytes(case, op, host_idx.numel())
    result: dict[str, Any] = {
        "pool": case.kind,
        "layout": case.layout,
        "page_size": case.page_size,
        "op": op,
        "path": run.name,
        "bytes": nbytes,
        "ceiling_gbps": ceiling,
    }
    if run.fn is None:
        return {**result, "gbps": None, "identical": None, "not_runnable": run.not_runnable}
    case.restore_host()
    case.restore_device()
    before = mover.metrics.snapshot() if mover is not None and mover.metrics else None
    try:
        seconds, host_seconds = timed(run.fn, case.opts.device, case.opts.repeats)
        sync_device(case.opts.device)
    except Exception as exc:  # a stock op this machine lacks, or a JIT build that failed
        sync_device(case.opts.device)
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return {**result, "gbps": None, "identical": None, "not_runnable": why}
    if op == "load":
        identical = check_load(case, LOAD_LAYER, host_idx, dev_idx)
    else:
        identical = check_backup(case, host_idx, dev_idx)
    gbps = nbytes / seconds / 1e9
    # Faster than the link means the copy escaped the timed stream: flag, never trust it.
    result["suspect_timing"] = bool(ceiling) and gbps > 1.1 * ceiling
    result.update(
        gbps=gbps,
        share_of_ceiling=gbps / ceiling if ceiling else None,
        submit_us=host_seconds * 1e6,
        identical=identical,
        sms=run.sms,
        not_runnable=None,
    )
    if before is not None and mover is not None:
        sms, paths, fallbacks = _kvcore_sms(mover, before)
        result.update(sms=sms, kvcore_paths=paths, fallbacks=fallbacks, **run.detail)
    return result


def run_case(case: PoolCase, mover: Mover, progress: Callable[[str], None]) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(case.opts.seed)
    ceilings = {op: _ceiling(case, op_bytes(case, op, case.opts.tokens), op) for op in OPS}
    for level in case.opts.host_levels:
        host_idx, dev_idx = index_pairs(case.opts.tokens, level, case.page_size, gen)
        for op in OPS:
            backends = LAYOUT_BACKENDS[case.layout]
            runs = [stock_path(case, op, b, host_idx, dev_idx) for b in backends]
            if "direct" in backends:
                runs.append(direct_model_path(case, op, host_idx, dev_idx))
            # The hook does the same work for either io backend of a layout.
            backend = LAYOUT_BACKENDS[case.layout][0]
            runs.append(kvcore_path(case, op, backend, host_idx, dev_idx, mover))
            if backend == "kernel" and case.opts.device.type == "cuda":
                runs.append(kvcore_gpu_indices_path(case, op, host_idx, dev_idx, mover))
            for run in runs:
                is_kvcore = run.name.startswith("kvcore")
                row = measure(
                    case, op, run, host_idx, dev_idx, ceilings[op], mover if is_kvcore else None
                )
                row["host_fragmentation"] = level
                results.append(row)
                progress(row_line(row))
    return results


def prefix_round_trip(case: PoolCase, mover: Mover, level: str) -> list[dict[str, Any]]:
    """A prefix of ``tokens`` evicted to host (backup) and reloaded layer by layer into the
    same device slots after they were overwritten; the device must end as it began."""
    gen = torch.Generator().manual_seed(case.opts.seed + 1)
    host_idx, dev_idx = index_pairs(case.opts.tokens, level, case.page_size, gen)
    backend = LAYOUT_BACKENDS[case.layout][0]
    layers = range(case.opts.layers)
    d = dev_idx.to(case.opts.device)
    results = []
    for make in ("stock", "kvcore"):
        if make == "stock":
            backup = stock_path(case, "backup", backend, host_idx, dev_idx)
            load_run = stock_path(case, "load", backend, host_idx, dev_idx)
        else:
            backup = kvcore_path(case, "backup", backend, host_idx, dev_idx, mover)
            load_run = kvcore_path(case, "load", backend, host_idx, dev_idx, mover)
        row: dict[str, Any] = {
            "pool": case.kind,
            "layout": case.layout,
            "page_size": case.page_size,
            "host_fragmentation": level,
            "path": backup.name,
            "tokens": case.opts.tokens,
            "layers": case.opts.layers,
        }
        if backup.fn is None or load_run.fn is None:
            results.append({**row, "not_runnable": backup.not_runnable or load_run.not_runnable})
            continue
        pool_class = host_pool_class(case)
        method = vars(pool_class)[METHOD_NAMES["load"]]
        if make == "kvcore":
            from benchmarks.sglang.hook_adapter import pool_method_hook

            hook = pool_method_hook(pool_class, METHOD_NAMES["load"])

            def method(*args: Any, _hook: Any = hook) -> None:
                _hook(lambda *a, **k: None, *args)

            h, dd = host_idx, dev_idx
        else:
            h, dd = stock_indices(case, "load", backend, host_idx, dev_idx)

        def reload_all(method: Any = method, h: Any = h, dd: Any = dd) -> None:
            for layer in layers:
                method(case.pool, case.device_pool, h, dd, layer, backend)

        case.restore_host()
        case.restore_device()
        try:
            evict_s, _ = timed(backup.fn, case.opts.device, case.opts.repeats)
            for c in case.components:
                for layer in c.devices:
                    layer[d] = torch.bitwise_not(layer[d].view(torch.uint8)).view(layer.dtype)
            reload_s, _ = timed(reload_all, case.opts.device, case.opts.repeats)
            sync_device(case.opts.device)
        except Exception as exc:
            sync_device(case.opts.device)
            results.append({**row, "not_runnable": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        restored = all(
            bytes_equal(layer, poison)
            for c in case.components
            for layer, poison in zip(c.devices, c.poison, strict=True)
        )
        nbytes = case.opts.tokens * case.row_bytes * case.opts.layers
        row.update(
            bytes=nbytes,
            evict_gbps=nbytes / evict_s / 1e9,
            reload_gbps=nbytes / reload_s / 1e9,
            reload_ms=reload_s * 1e3,
            identical=restored,
            not_runnable=None,
        )
        results.append(row)
    return results
