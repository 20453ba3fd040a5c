"""`kvcore bench --engine sglang`: SGLang 0.5.23's stock HiCache transfers against kvcore's hooks.

One SGLang host pool and device pool per (pool kind, layout, page size), built the way
SGLang builds them. For each host fragmentation level the same index pairs go to
every path: the stock method, with the indices where SGLang's cache controller puts
them (``move_indices``); the kvcore AROUND hook, called as SGLang's ``HookRegistry``
calls it, with CPU indices and, on CUDA for the ``kernel`` backend, with the indices on
the GPU as that backend hands them (``kvcore:kernel-gpu-indices``); and a pinned
contiguous copy of the same bytes (the ceiling). Every result is compared byte for byte
with a copy computed from SGLang's layout definition, and rows outside the copy must keep
their poison.

Without sgl-kernel (its 373 MB wheel cannot be carried to the GPU machine) SGLang's
``direct`` backend and its AOT ``kernel`` ops are absent: those paths report ``not
runnable`` with the reason, and ``model:direct`` issues the copies ``direct`` would make
(one ``copy_`` per run or page) from Python instead. The JIT kernels
(``sglang.kernels.ops.kvcache.hicache``, compiled by nvcc through apache-tvm-ffi) serve
``kernel`` for ``layer_first`` and ``page_first`` on CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvcore.bench.sglang.import_stubs import PackageStub, StubType
from kvcore.bench.suite import scattered_layout, timed
from kvcore.config import KVCoreConfig
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.path_policy import policy_from_config
from kvcore.runs import find_paired_runs

KINDS = ("mha", "mla")
LAYOUT_BACKENDS: dict[str, tuple[str, ...]] = {
    "layer_first": ("kernel", "direct"),
    "page_first": ("kernel",),
    "page_first_direct": ("direct",),
}
HOST_LEVELS = {"0%": 0.0, "50%": 0.5, "100%": 1.0}
PAGE_SIZES = (64, 1)
OPS = ("load", "backup")
# Geometry of the rows: MHA 8 KV heads x 128 (2 KiB of K and 2 KiB of V per token and
# layer), MLA DeepSeek's 512 + 64 latent (1152 B), both bf16.
MHA_HEADS, MHA_HEAD_DIM = 8, 128
MLA_RANK, MLA_ROPE = 512, 64
LOAD_LAYER = 1
# The direct model issues one Python copy_ per copy; past this many per call it would only
# measure Python.
MAX_MODEL_COPIES = 16384
SGL_KERNEL_MISSING = "sgl_kernel is not installed (the 373 MB sglang-kernel wheel is not carried)"
_POOL_CLASS = {"mha": "MHATokenToKVPoolHost", "mla": "MLATokenToKVPoolHost"}
METHOD_NAMES = {"load": "load_to_device_per_layer", "backup": "backup_from_device_all_layer"}


class StockNotRunnable(RuntimeError):
    """A stock SGLang op this machine does not have."""


# --- sgl_kernel stand-in ---------------------------------------------------------------------


class _Missing(StubType):
    """Anything sgl_kernel exports: calling it raises :class:`StockNotRunnable`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise StockNotRunnable(f"{cls.__qualname__}: {SGL_KERNEL_MISSING}")


class _SglKernelStub(PackageStub):
    """Serves ``sgl_kernel`` and its submodules; every name in them is a :class:`_Missing`.

    SGLang imports sgl_kernel names at module level on CUDA, some without a fallback.
    """

    def __init__(self) -> None:
        super().__init__("sgl_kernel", _Missing)


def install_sgl_kernel_stub() -> bool:
    """Let SGLang's CUDA modules import without sgl-kernel; True if the stub is in place.

    Its ops (``sgl_kernel.kvcacheio.transfer_*`` among them) raise :class:`StockNotRunnable`
    when called; SGLang's JIT kernels do not need it and still run. SGLang's probe for
    ``get_device_accessible_ptr`` also checks ``torch.ops.sgl_kernel``, which stays empty,
    so its pointer tables use the raw host addresses, as CUDA's unified addressing allows.
    """
    if any(isinstance(finder, _SglKernelStub) for finder in sys.meta_path):
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    sys.meta_path.append(_SglKernelStub())
    return True


def sgl_kernel_stubbed() -> bool:
    """Whether kvcore's stand-in serves ``sgl_kernel`` here (its ops then raise)."""
    return any(isinstance(finder, _SglKernelStub) for finder in sys.meta_path)


# --- options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    tokens: int = 131072
    layers: int = 2
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    kinds: tuple[str, ...] = KINDS
    layouts: tuple[str, ...] = tuple(LAYOUT_BACKENDS)
    page_sizes: tuple[int, ...] = PAGE_SIZES
    host_levels: tuple[str, ...] = tuple(HOST_LEVELS)
    repeats: int = 5
    prefix: bool = True
    """Also run the evicted-prefix round trip (page_size 64, all layers)."""
    seed: int = 1234


def options_for(args: argparse.Namespace) -> Options:
    cuda = torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu"
    quick = bool(getattr(args, "quick", False))
    default_tokens = (16384 if quick else 131072) if cuda else 1024
    return Options(
        tokens=getattr(args, "tokens", 0) or default_tokens,
        layers=2,
        device=torch.device("cuda" if cuda else "cpu"),
        repeats=3 if quick or not cuda else 5,
    )


# --- pools -----------------------------------------------------------------------------------


@dataclass
class Component:
    """One host buffer (K, V or MLA's KV), its device-side mirror and its device layers."""

    host: torch.Tensor
    mirror: torch.Tensor
    """The host buffer's intended bytes, kept on the device for fast restores and checks."""
    devices: tuple[torch.Tensor, ...]
    poison: tuple[torch.Tensor, ...]
    """Each device layer's intended bytes."""


@dataclass
class PoolCase:
    kind: str
    layout: str
    page_size: int
    pool: Any
    device_pool: Any
    components: list[Component]
    opts: Options

    @property
    def row_bytes(self) -> int:
        layer = self.components[0].devices[0]
        return sum(c.devices[0][0].numel() for c in self.components) * layer.element_size()

    def restore_host(self) -> None:
        for c in self.components:
            c.host.copy_(c.mirror, non_blocking=True)
        _sync(self.opts.device)

    def restore_device(self) -> None:
        for c in self.components:
            for layer, poison in zip(c.devices, c.poison, strict=True):
                layer.copy_(poison)
        _sync(self.opts.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_like(tensor: torch.Tensor, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random bytes (NaN patterns included, never zeros) shaped like ``tensor``, on ``device``."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    return raw.view(tensor.dtype).view(tensor.shape)


def _device_pool(kind: str, opts: Options, page_size: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(
        size=2 * opts.tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        layer_num=opts.layers,
        device=str(opts.device),
        enable_memory_saver=False,
    )
    if kind == "mha":
        return MHATokenToKVPool(head_num=MHA_HEADS, head_dim=MHA_HEAD_DIM, **common)
    return MLATokenToKVPool(kv_lora_rank=MLA_RANK, qk_rope_head_dim=MLA_ROPE, **common)


def _host_pool(kind: str, device_pool: Any, layout: str, page_size: int, opts: Options) -> Any:
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    from kvcore.bench.sglang.host_pools import mha_host_pool, mla_host_pool

    args = dict(
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=opts.device.type == "cuda",
        host_token_capacity=2 * opts.tokens,
    )
    # The budget check samples free memory, which a lent VM reports low until it is used.
    with host_memory_budget_scope(1 << 50):
        build = mha_host_pool if kind == "mha" else mla_host_pool
        return build(device_pool, **args)


@contextmanager
def pool_case(kind: str, layout: str, page_size: int, opts: Options) -> Iterator[PoolCase]:
    """Both pools filled with random bytes; the host pool is unregistered afterwards."""
    device_pool = _device_pool(kind, opts, page_size)
    pool = _host_pool(kind, device_pool, layout, page_size, opts)
    gen = torch.Generator(device=opts.device).manual_seed(opts.seed)
    if kind == "mha":
        pairs = [
            (pool.k_buffer, pool.device_k_buffers),
            (pool.v_buffer, pool.device_v_buffers),
        ]
    else:
        pairs = [(pool.kv_buffer, pool.device_kv_buffers)]
    components = []
    for host, devices in pairs:
        mirror = _random_like(host, opts.device, gen)
        poison = tuple(_random_like(layer, opts.device, gen) for layer in devices)
        components.append(Component(host, mirror, tuple(devices), poison))
    case = PoolCase(kind, layout, page_size, pool, device_pool, components, opts)
    case.restore_host()
    case.restore_device()
    try:
        yield case
    finally:
        # Copies still queued read the host buffer: finish them before unregistering.
        _sync(opts.device)
        pool.destroy()


# --- indices and references ------------------------------------------------------------------


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


# --- paths -----------------------------------------------------------------------------------


@dataclass
class PathRun:
    """One way to make a call: ``fn`` does it, or ``not_runnable`` says why it cannot."""

    name: str
    fn: Callable[[], None] | None
    sms: str
    not_runnable: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def _pool_class(case: PoolCase) -> type:
    return type(case.pool)


def _call(case: PoolCase, op: str, method: Callable[..., Any], h: Any, d: Any, backend: str):
    if op == "load":
        return lambda: method(case.pool, case.device_pool, h, d, LOAD_LAYER, backend)
    return lambda: method(case.pool, case.device_pool, h, d, backend)


def stock_indices(
    case: PoolCase, op: str, backend: str, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where SGLang 0.5.23's cache controller puts the indices before the pool sees them."""
    if backend == "direct":
        return host_idx, dev_idx
    staged_write_back = (
        op == "backup"
        and case.layout == "page_first"
        and getattr(case.pool, "can_use_write_back_jit", False)
    )
    host = host_idx if staged_write_back else host_idx.to(case.opts.device)
    return host, dev_idx.to(case.opts.device)


def stock_kernel_sms(case: PoolCase, op: str, backend: str) -> tuple[str, str | None]:
    """(what the stock call runs and the SMs it holds, or None; why it cannot run, or None)."""
    if case.opts.device.type != "cuda":
        return "", "stock transfers need CUDA"
    if backend == "direct":
        # sgl_kernel's transfer_kv_direct / *_direct_pf_lf: one copy_ per run or page.
        return "sgl_kernel direct copies (copy engines, 0 SMs)", None
    from sglang.kernels.ops.kvcache import hicache

    if op == "backup" and case.layout == "page_first" and case.pool.can_use_write_back_jit:
        quota = hicache.DEFAULT_BLOCK_QUOTA
        return f"JIT staged write-back: relayout kernel ({quota} CTAs) + page DMA", None
    if not case.pool.can_use_jit:
        return "sgl_kernel.kvcacheio kernel", None
    element = case.row_bytes // len(case.components)
    tma = hicache.use_hicache_tma_kernel(
        element_size=element, block_quota=hicache.TMA_BLOCK_QUOTA, page_size=case.page_size
    )
    if tma:
        return f"JIT TMA kernel, {hicache.TMA_BLOCK_QUOTA} CTAs", None
    return f"JIT register kernel, {hicache.DEFAULT_BLOCK_QUOTA} CTAs", None


def stock_path(
    case: PoolCase, op: str, backend: str, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> PathRun:
    name = f"stock:{backend}"
    sms, reason = stock_kernel_sms(case, op, backend)
    if reason is not None:
        return PathRun(name, None, "", reason)
    method = vars(_pool_class(case))[METHOD_NAMES[op]]
    h, d = stock_indices(case, op, backend, host_idx, dev_idx)
    return PathRun(name, _call(case, op, method, h, d, backend), sms)


def direct_copies(
    case: PoolCase, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> list[tuple[int, int, int]]:
    """(host slot, device slot, rows) of each copy sgl_kernel's ``direct`` ops issue per layer
    and buffer: ``layer_first`` one per run where host and device slots both step by one,
    after SGLang sorts the pairs by host slot; ``page_first_direct`` one per page."""
    if case.layout == "page_first_direct":
        page = case.page_size
        starts = zip(host_idx[::page].tolist(), dev_idx[::page].tolist(), strict=True)
        return [(h, d, page) for h, d in starts]
    order = host_idx.argsort()
    runs = find_paired_runs(host_idx[order], dev_idx[order])
    return list(
        zip(runs.src_starts.tolist(), runs.dst_starts.tolist(), runs.lengths.tolist(), strict=True)
    )


def direct_model_path(
    case: PoolCase, op: str, host_idx: torch.Tensor, dev_idx: torch.Tensor
) -> PathRun:
    """The copies stock ``direct`` makes, one ``copy_`` each, issued from Python.

    sgl_kernel issues the same copies from C++; only the host time per copy differs
    (Python's is the larger), so this bounds stock ``direct`` from below.
    """
    name = "model:direct"
    copies = direct_copies(case, host_idx, dev_idx)
    layers = [LOAD_LAYER] if op == "load" else list(range(case.opts.layers))
    calls = len(copies) * len(layers) * len(case.components)
    sms = f"copy engines, 0 SMs; {calls} copy_ calls from Python"
    if calls > MAX_MODEL_COPIES:
        return PathRun(name, None, sms, f"{calls} copies per call (over {MAX_MODEL_COPIES})")
    page = case.page_size

    def host_block(c: Component, layer: int, slot: int, rows: int) -> torch.Tensor:
        if case.layout == "page_first_direct":
            return c.host[slot // page, layer]
        return c.host[layer, slot : slot + rows]

    def run() -> None:
        for h, d, rows in copies:
            for layer in layers:
                for c in case.components:
                    host, device = host_block(c, layer, h, rows), c.devices[layer][d : d + rows]
                    if op == "load":
                        device.copy_(host, non_blocking=True)
                    else:
                        host.copy_(device, non_blocking=True)

    return PathRun(name, run, sms)


@contextmanager
def bench_mover(*, serve_rule: bool = False) -> Iterator[Mover]:
    """The hooks' process-wide mover replaced by one with its own metrics, for the run.

    The A/B measures kvcore's own paths, so the serve-or-pass rule is off unless asked for.
    """
    from kvcore_sglang import transfers

    mover = Mover(policy_from_config(KVCoreConfig.from_env()), metrics=Metrics())
    saved = transfers._mover, transfers.serve_rule_enabled
    transfers._mover = mover
    transfers.serve_rule_enabled = lambda: serve_rule  # type: ignore[assignment]
    try:
        yield mover
    finally:
        transfers._mover, transfers.serve_rule_enabled = saved


def kvcore_path(
    case: PoolCase,
    op: str,
    backend: str,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    mover: Mover,
) -> PathRun:
    """The AROUND hook as HookRegistry calls it: ``hook(original, pool, *args)``.

    The original recorded here copies nothing, so a call the hook hands to stock
    fails the byte check and is reported with the reason the mover counted.
    """
    from kvcore_sglang import transfers

    cls = _pool_class(case)
    hook = transfers.HOOKS[f"{cls.__module__}.{cls.__qualname__}.{METHOD_NAMES[op]}"]
    detail: dict[str, Any] = {"stock_calls": 0}

    def original(*args: Any, **kwargs: Any) -> None:
        detail["stock_calls"] += 1

    def around(*args: Any) -> None:
        hook(original, *args)

    run = PathRun(f"kvcore:{backend}", _call(case, op, around, host_idx, dev_idx, backend), "")
    run.detail = detail
    return run


def kvcore_gpu_indices_path(
    case: PoolCase, op: str, host_idx: torch.Tensor, dev_idx: torch.Tensor, mover: Mover
) -> PathRun:
    """The hook as a CUDA deployment with the ``kernel`` io backend calls it: the host
    indices moved to the GPU through the ``move_indices`` hook (which remembers the CPU
    ones), the device indices on the GPU, where kvcore plans around them unread."""
    from kvcore_sglang import transfers

    def to_device(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
        return h.to(case.opts.device), d

    moved, _ = transfers.move_indices_hook(to_device, None, host_idx, dev_idx)
    run = kvcore_path(case, op, "kernel", moved, dev_idx.to(case.opts.device), mover)
    run.name = "kvcore:kernel-gpu-indices"
    return run


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
            parts.append(f"gather kernel, {mover.policy.gather_ctas} CTAs")
        elif path == "staged":
            parts.append("DMA to staging, 0 SMs on PCIe (+ device index_copy_)")
        else:
            parts.append(f"{path}: DMA, 0 SMs")
    return "; ".join(parts), paths, fallbacks


# --- measuring -------------------------------------------------------------------------------


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
        _sync(case.opts.device)
    except Exception as exc:  # a stock op this machine lacks, or a JIT build that failed
        _sync(case.opts.device)
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
                progress(_row_line(row))
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
        pool_class = _pool_class(case)
        method = vars(pool_class)[METHOD_NAMES["load"]]
        if make == "kvcore":
            from kvcore_sglang import transfers

            hook = transfers.HOOKS[
                f"{pool_class.__module__}.{pool_class.__qualname__}.{METHOD_NAMES['load']}"
            ]

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
            _sync(case.opts.device)
        except Exception as exc:
            _sync(case.opts.device)
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


def warm_jit(opts: Options) -> dict[str, str]:
    """Build SGLang's JIT HiCache modules in parallel, before anything is timed."""
    if opts.device.type != "cuda":
        return {}
    from concurrent.futures import ThreadPoolExecutor

    from sglang.kernels.ops.kvcache import hicache

    builds: dict[str, Callable[[], Any]] = {
        "tma": partial(hicache._jit_hicache_tma_module, block_quota=hicache.TMA_BLOCK_QUOTA)
    }
    # The element sizes the pools below use (MHA K or V rows, MLA rows), with SGLang's defaults.
    for element in (MHA_HEADS * MHA_HEAD_DIM * 2, (MLA_RANK + MLA_ROPE) * 2):
        args = dict(
            element_size=element,
            unroll=hicache._default_unroll(element),
            block_quota=hicache.DEFAULT_BLOCK_QUOTA,
        )
        builds[f"register-{element}"] = partial(hicache._jit_hicache_module, **args)
        builds[f"staged-{element}"] = partial(hicache._jit_hicache_staged_module, **args)
    status: dict[str, str] = {}
    with ThreadPoolExecutor(len(builds)) as pool:
        futures = {name: pool.submit(build) for name, build in builds.items()}
        for name, future in futures.items():
            try:
                future.result()
                status[name] = "built"
            except Exception as exc:
                status[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return status


def run(opts: Options, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    stub = install_sgl_kernel_stub()
    import sglang

    jit = warm_jit(opts)
    results: list[dict[str, Any]] = []
    prefix: list[dict[str, Any]] = []
    stream = torch.cuda.Stream(opts.device) if opts.device.type == "cuda" else None
    with bench_mover() as mover, on_stream(stream):
        for kind in opts.kinds:
            for layout in opts.layouts:
                for page_size in opts.page_sizes:
                    progress(f"-- {kind} {layout} page_size {page_size}")
                    try:
                        with pool_case(kind, layout, page_size, opts) as case:
                            results += run_case(case, mover, progress)
                            if opts.prefix and page_size == 64 and layout != "page_first_direct":
                                for level in ("0%", "100%"):
                                    prefix += prefix_round_trip(case, mover, level)
                    except Exception as exc:  # one pool SGLang cannot build here: say so, go on
                        why = f"pool not built: {type(exc).__name__}: {exc}".splitlines()[0]
                        progress(why)
                        results.append(
                            {
                                "pool": kind,
                                "layout": layout,
                                "page_size": page_size,
                                "op": "",
                                "path": "",
                                "not_runnable": why[:300],
                            }
                        )
    device = torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "sglang": getattr(sglang, "__version__", "unknown"),
        "sgl_kernel": "stub (not installed)" if stub else "installed",
        "torch_dlpack_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
        "jit_modules": jit,
        "tokens": opts.tokens,
        "layers": opts.layers,
        "load_layer": LOAD_LAYER,
        "gather_ctas": mover.policy.gather_ctas,
        "results": results,
        "prefix_reload": prefix,
    }


@contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """A stream of our own, as SGLang's transfer engine uses (the batched copy API refuses
    the legacy default stream); SGLang's JIT kernels launch through tvm-ffi, told to use it."""
    if stream is None:
        yield
        return
    import tvm_ffi

    with torch.cuda.stream(stream), tvm_ffi.use_torch_stream():
        yield


# --- reporting -------------------------------------------------------------------------------


def _row_line(r: dict[str, Any]) -> str:
    where = f"{r['pool']}/{r['layout']}/p{r['page_size']}"
    if r["op"]:
        where += f"/host-{r['host_fragmentation']}/{r['op']}"
    if r.get("not_runnable"):
        return f"{where:<40} {r['path']:<15} not runnable: {r['not_runnable']}"
    ok = ("yes" if r["identical"] else "NO") + (" SUSPECT-TIMING" if r["suspect_timing"] else "")
    share = r.get("share_of_ceiling") or 0.0
    return (
        f"{where:<40} {r['path']:<15} {r['gbps']:>7.2f} GB/s {100 * share:>4.0f}% "
        f"of {r['ceiling_gbps']:.1f}  ok={ok}  {r.get('sms', '')}"
    )


def speedups(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvcore over each baseline (stock, or the direct model) on the same data, where both ran."""
    key = ("pool", "layout", "page_size", "host_fragmentation", "op")
    baselines: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r["path"].startswith(("stock", "model")) and r.get("gbps"):
            baselines.setdefault(tuple(r.get(k) for k in key), []).append(r)
    out = []
    for r in results:
        if not (r["path"].startswith("kvcore") and r.get("gbps")):
            continue
        for base in baselines.get(tuple(r.get(k) for k in key), []):
            ratio = r["gbps"] / base["gbps"]
            out.append({**{k: r[k] for k in key}, "vs": base["path"], "x": ratio})
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"device: {report['device']}  torch {report['torch']}  sglang {report['sglang']}  "
        f"sgl_kernel: {report['sgl_kernel']}",
        f"{report['tokens']} tokens, {report['layers']} layers; load = layer "
        f"{report['load_layer']}, backup = all layers",
        f"JIT modules: {report['jit_modules']}",
        "",
    ]
    lines += [_row_line(r) for r in report["results"]]
    ratios = speedups(report["results"])
    if ratios:
        lines.append("")
        lines.append("kvcore over each baseline, same indices:")
        for s in ratios:
            lines.append(
                f"  {s['pool']}/{s['layout']}/p{s['page_size']}/host-{s['host_fragmentation']}"
                f"/{s['op']}: {s['x']:.2f}x vs {s['vs']}"
            )
    if report["prefix_reload"]:
        lines.append("")
        lines.append("evicted-prefix round trip (backup all layers, overwrite, reload all layers):")
        for r in report["prefix_reload"]:
            where = f"{r['pool']}/{r['layout']}/p{r['page_size']}/host-{r['host_fragmentation']}"
            if r.get("not_runnable"):
                lines.append(f"  {where:<34} {r['path']:<15} not runnable: {r['not_runnable']}")
                continue
            lines.append(
                f"  {where:<34} {r['path']:<15} evict {r['evict_gbps']:.2f} GB/s  reload "
                f"{r['reload_gbps']:.2f} GB/s ({r['reload_ms']:.1f} ms)  "
                f"ok={'yes' if r['identical'] else 'NO'}"
            )
    return "\n".join(lines)


def failures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Results that ran and did not match byte for byte."""
    rows = [*report["results"], *report["prefix_reload"]]
    return [r for r in rows if not r.get("not_runnable") and r.get("identical") is False]


def main(args: argparse.Namespace) -> int:
    opts = options_for(args)
    quiet = bool(getattr(args, "no_progress", False))
    report = run(opts, progress=(lambda line: None) if quiet else _print_err)
    report["speedups"] = speedups(report["results"])
    print(format_table(report))
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    return 1 if failures(report) else 0


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = [
    "Options",
    "PoolCase",
    "StockNotRunnable",
    "check_backup",
    "check_load",
    "format_table",
    "index_pairs",
    "install_sgl_kernel_stub",
    "main",
    "measure",
    "pool_case",
    "run",
    "speedups",
]
