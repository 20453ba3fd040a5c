"""SGLang host-pool transfers through kvcore's mover, against a per-index reference on CPU.

SGLang's own transfer ops need CUDA, so the served calls are compared with a copy
computed here row by row, addressing SGLang's buffers the way each layout defines
them; calls that must stay stock are checked to reach the original method once,
unchanged, with their reason counted. Runs on 0.5.22 and 0.5.23, whose pools the
reference addresses alike (host layer ``L`` mirrors ``device_*_buffers[L]`` unless a
test says otherwise); the release-specific cases are marked.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.metadata
import logging
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")
import torch
from hicache_cpu import cpu_hicache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang_pools import dsa_host, mha_device, mha_host, mla_device, mla_host

from benchmarks.sglang.hook_adapter import (
    bench_adapter,
    drop_own_adapter,
    move_indices,
    register_transfer_hooks,
)
from benchmarks.sglang.hook_adapter import hook as adapter_hook
from benchmarks.sglang.host_pools import mha_host_pool, mla_host_pool
from kvcore.engine_status import release_of
from kvcore.kernels import REFERENCE, KernelSet
from kvcore.metrics import METRICS
from kvcore.mover import Mover
from kvcore.planning.path_policy import PathPolicy
from kvcore.staging import StagingBuffers
from kvcore.stock_share import REASON as STOCK_SHARE
from kvcore.stock_share import StockShare
from kvcore.warm_up import WarmUp
from kvcore_sglang import (
    call_memos,
    call_plans,
    device_reads,
    guard,
    layer_loads,
    load_requests,
    plugin,
    pool_jobs,
    pool_rows,
    pool_warm_up,
    release_jobs,
    transfers,
)

VERSION = release_of(importlib.metadata.version("sglang"))
RELEASES = ("0.5.22", "0.5.23")
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        VERSION not in RELEASES,
        reason="kvcore's SGLang transfer hooks are tested on 0.5.22 and 0.5.23",
    ),
]
ONLY_0_5_22 = pytest.mark.skipif(
    VERSION != "0.5.22", reason="0.5.22's pools: device pool and layer sharding"
)
ONLY_0_5_23 = pytest.mark.skipif(VERSION != "0.5.23", reason="0.5.23's pools: slot maps")
PAGE = 16
DSA_PAGE = 64  # DSA's index pages need page_size 64
TOKENS = 512
LAYERS = 3
POOL_CLASSES = {"mha": MHATokenToKVPoolHost, "mla": MLATokenToKVPoolHost, "dsa": DSAIndexerPoolHost}
METHODS = ("load_to_device_per_layer", "backup_from_device_all_layer")
# Collected at import, before any test applies hooks.
STOCK = {
    **{(cls, name): vars(cls)[name] for cls in POOL_CLASSES.values() for name in METHODS},
    (HiCacheController, "move_indices"): vars(HiCacheController)["move_indices"],
    **{
        (cls, "__init__"): vars(cls)["__init__"]
        for cls in (MHATokenToKVPoolHost, MLATokenToKVPoolHost)
    },
}
# Short "long" runs, so that every mover path is taken on small pools; plans take staging
# for copies up to 1 MiB, which the small movers run through a buffer of 16 KiB (two DSA
# pages), in chunks.
SMALL_POLICY = PathPolicy(
    staging_bytes=1 << 20, long_run_bytes=64, max_dma_runs=8, max_batched_runs=8
)
SMALL_STAGING = 16 << 10


def small_policy_mover(staging_bytes: int = SMALL_STAGING) -> Mover:
    return Mover(SMALL_POLICY, metrics=METRICS, staging=StagingBuffers(staging_bytes))


# Layout -> the io backends SGLang accepts for it.
LAYOUT_BACKENDS = {
    "layer_first": ("kernel", "direct"),
    "page_first": ("kernel",),
    "page_first_direct": ("direct",),
}
SERVED = [
    (kind, layout, backend)
    for kind in POOL_CLASSES
    for layout, backends in LAYOUT_BACKENDS.items()
    for backend in backends
]


@functools.cache
def pool_for(kind: str, layout: str) -> Any:
    if kind == "mha":
        return mha_host(TOKENS, PAGE, layout, layers=LAYERS, heads=2)
    if kind == "mla":
        return mla_host(TOKENS, PAGE, layout, layers=LAYERS)
    return dsa_host(TOKENS, DSA_PAGE, layout, layers=LAYERS)


# --- the per-index reference ---------------------------------------------------------------

HostRow = Callable[[torch.Tensor, int, int], torch.Tensor]


def host_row(layout: str, page: int) -> HostRow:
    """(buffer, layer, slot) -> that slot's row, as SGLang's layout defines it."""
    if layout == "layer_first":
        return lambda buffer, layer, slot: buffer[layer, slot]
    if layout == "page_first":
        return lambda buffer, layer, slot: buffer[slot, layer]
    return lambda buffer, layer, slot: buffer[slot // page, layer, slot % page]


@dataclass(frozen=True)
class Component:
    """One host buffer (K, V, KV or index pages) and the device layers it mirrors."""

    host: torch.Tensor
    row: HostRow
    devices: tuple[torch.Tensor, ...]


def components(kind: str, pool: Any) -> list[Component]:
    if kind == "mha":
        row = host_row(pool.layout, pool.page_size)
        return [
            Component(pool.k_buffer, row, tuple(pool.device_k_buffers)),
            Component(pool.v_buffer, row, tuple(pool.device_v_buffers)),
        ]
    if kind == "mla":
        row = host_row(pool.layout, pool.page_size)
        return [Component(pool.kv_buffer, row, tuple(pool.device_kv_buffers))]
    # Index pages: one row per page, in every layout ([pages, layers, 1, bytes] when page-major).
    index_row = host_row("layer_first" if pool.layout == "layer_first" else "page_first", 1)
    devices = tuple(pool.packed_device_index_buffers)
    assert all(
        a is b
        for a, b in zip(devices, pool.device_pool.index_k_with_scale_buffer[:LAYERS], strict=True)
    )
    return [Component(pool.index_k_with_scale_buffer, index_row, devices)]


def reference_slots(kind: str, pool: Any, host_idx, device_idx) -> tuple[list[int], list[int]]:
    """The (host slot, device row) pairs stock copies; DSA copies one row per index page."""
    if kind == "dsa" and host_idx.numel():
        page = pool.page_size
        host_idx = host_idx.reshape(-1, page)[:, 0] // page
        device_idx = device_idx.reshape(-1, page)[:, 0] // page
    return host_idx.tolist(), device_idx.tolist()


def randomise(tensors: list[torch.Tensor], generator: torch.Generator) -> None:
    """Random bits (NaN payloads included) in every tensor: data and poison alike."""
    for tensor in tensors:
        bits = tensor.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=generator))


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone().view(torch.uint8) for t in tensors]


def all_tensors(parts: list[Component]) -> list[torch.Tensor]:
    return [t for part in parts for t in (part.host, *part.devices)]


# --- indices -------------------------------------------------------------------------------


def device_slots(kind: str, pool: Any) -> int:
    """Device token slots; DSA's device index pages hold ``page_size`` tokens each."""
    rows = components(kind, pool)[0].devices[0].shape[0]
    return rows * pool.page_size if kind == "dsa" else rows


def make_indices(
    kind: str, pool: Any, shape: str, n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host slots and device slots as SGLang hands them over: whole pages where the layout
    copies pages (page_first_direct, DSA) or ``shape`` says so (``pages-contiguous``,
    ``pages-scattered``), else any ``shape`` of about ``n`` slots."""
    total = device_slots(kind, pool)
    if kind == "dsa" or pool.layout == "page_first_direct" or shape.startswith(WHOLE_PAGES):
        page = pool.page_size
        host_pages, device_pages = pool.size // page, total // page
        count = min(max(n // page, 1), host_pages, device_pages - 1)
        return _paged(
            shape.removeprefix(WHOLE_PAGES), count, page, host_pages, device_pages, generator
        )
    n = min(n, total - 1, 320)
    if shape == "contiguous":
        start = int(torch.randint(0, pool.size - n + 1, (1,), generator=generator))
        host_idx = torch.arange(start, start + n)
    elif shape == "merged":
        # Five loads merged into one call: five short runs, each in its own 64-slot stretch.
        lengths = [n // 5 + (i < n % 5) for i in range(5)]
        starts = (torch.randperm(pool.size // 64, generator=generator)[:5] * 64).tolist()
        host_idx = torch.cat(
            [torch.arange(s, s + length) for s, length in zip(starts, lengths, strict=True)]
        )
    else:
        host_idx = torch.randperm(pool.size, generator=generator)[:n]
    # Device slot 0 is SGLang's padding slot; real loads never write it.
    device_idx = torch.randperm(total - 1, generator=generator)[:n] + 1
    return host_idx, device_idx


def _paged(
    shape: str, count: int, page: int, host_pages: int, device_pages: int, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if shape == "contiguous":
        first = int(torch.randint(0, host_pages - count + 1, (1,), generator=generator))
        host = torch.arange(first, first + count)
    else:
        host = torch.randperm(host_pages, generator=generator)[:count]
    device = torch.randperm(device_pages - 1, generator=generator)[:count] + 1
    step = torch.arange(page)
    return (host[:, None] * page + step).reshape(-1), (device[:, None] * page + step).reshape(-1)


WHOLE_PAGES = "pages-"

# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def kvcore_serves_every_call() -> Iterator[None]:
    """The serve-or-pass rule off, and no request kept from another test: these pools are far
    smaller than any request the rule serves, and these tests are about kvcore's own copies
    (test_serve_rule.py covers the rule). Its own patcher, so that tests which undo theirs
    keep it."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv("KVCORE_SERVE_RULE", "0")
        yield


@pytest.fixture
def transfer_hooks(sglang_hooks) -> Iterator[Callable[..., Any]]:
    """Applies the plugin with the transfer hooks; its uninstall restores the pool methods
    afterwards (``sglang_hooks`` checks that it did).

    The serve-or-pass rule is off: these pools are far smaller than any request the rule
    serves, and the tests are about kvcore's own copies (test_serve_rule.py covers the rule).
    """

    def apply() -> Any:
        status = register_transfer_hooks()
        HookRegistry.apply_hooks()
        return status

    yield apply


@pytest.fixture
def small_mover(use_mover, monkeypatch) -> Mover:
    chosen = small_policy_mover()
    use_mover(chosen)
    return chosen


def fallbacks() -> dict[str, int]:
    return dict(METRICS.snapshot()["fallbacks"])


def paths_taken() -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in METRICS.snapshot()["transfers"]:
        counts[row["path"]] = counts.get(row["path"], 0) + row["count"]
    return counts


def device_pool_of(kind: str, pool: Any) -> Any:
    # What SGLang passes: the device pool. 0.5.23's MHA and MLA host pools keep none (and
    # read none); 0.5.22's read its layer sharding.
    return getattr(pool, "device_pool", None)


# --- served calls --------------------------------------------------------------------------


def check_served_call(kind, layout, io_backend, direction, shape, n, seed) -> None:
    pool = pool_for(kind, layout)
    generator = torch.Generator().manual_seed(seed)
    parts = components(kind, pool)
    randomise(all_tensors(parts), generator)
    host_idx, device_idx = make_indices(kind, pool, shape, n, generator)
    pairs = list(zip(*reference_slots(kind, pool, host_idx, device_idx), strict=True))
    before = fallbacks()
    if direction == "load":
        layer = int(torch.randint(0, LAYERS, (1,), generator=generator))
        targets = [device for part in parts for device in part.devices]
        sources = [part.host for part in parts]
        expected = as_bytes(targets)
        for p, part in enumerate(parts):
            want = expected[p * LAYERS + layer]
            for slot, row in pairs:
                want[row] = part.row(part.host.view(torch.uint8), layer, slot)
        source_bytes = as_bytes(sources)
        pool.load_to_device_per_layer(
            device_pool_of(kind, pool), host_idx, device_idx, layer, io_backend
        )
    else:
        targets = [part.host for part in parts]
        sources = [device for part in parts for device in part.devices]
        expected = as_bytes(targets)
        for want, part in zip(expected, parts, strict=True):
            for layer, device in enumerate(part.devices):
                for slot, row in pairs:
                    part.row(want, layer, slot).copy_(device.view(torch.uint8)[row])
        source_bytes = as_bytes(sources)
        pool.backup_from_device_all_layer(
            device_pool_of(kind, pool), host_idx, device_idx, io_backend
        )
    for target, want in zip(targets, expected, strict=True):
        assert torch.equal(target.view(torch.uint8), want)
    for source, want in zip(sources, source_bytes, strict=True):
        assert torch.equal(source.view(torch.uint8), want), "a source was written"
    assert fallbacks() == before


def test_kernel_backend_calls_plan_around_device_indices(
    use_mover, transfer_hooks, device_indices_unread
):
    """With SGLang's kernel io backend the device indices stay on the GPU: the call is
    planned from the host indices alone (staged or gather) and copies what stock does.
    On a CPU the device indices are CPU tensors, marked opaque as on a GPU."""
    transfer_hooks()
    use_mover(small_policy_mover())
    before = paths_taken()
    cases = [("contiguous", 100), ("scattered", 150), ("merged", 200)]
    for kind, layout, io_backend in SERVED:
        if io_backend != "kernel":
            continue
        for direction in ("load", "backup"):
            for seed, (shape, n) in enumerate(cases):
                check_served_call(kind, layout, io_backend, direction, shape, n, seed)
    taken = {p: c - before.get(p, 0) for p, c in paths_taken().items() if c != before.get(p, 0)}
    assert set(taken) == {"staged", "gather"}, taken


# Runs of whole pages (16 rows of 32-64 B) go by DMA; one token's row (32-64 B) does not.
DMA_POLICY = PathPolicy(
    staging_bytes=1 << 20, long_run_bytes=256, max_dma_runs=8, max_batched_runs=4096
)


def test_device_indices_read_back_move_whole_pages_by_dma_alone(
    use_mover, transfer_hooks, device_indices_read
):
    """Under KVCORE_SGLANG_DMA_IN_PLACE the kernel backend's device indices are read back
    at their move (a copy of the CPU tensors here): calls of whole pages are planned from
    both sides and copied by DMA alone, as stock copies them; calls whose plan from both
    sides would need a kernel keep the plan made around the device indices: tokens
    scattered one by one, and page_first's layers, whose host rows lie a slot apart."""
    transfer_hooks()
    use_mover(Mover(DMA_POLICY, metrics=METRICS, staging=StagingBuffers(SMALL_STAGING)))
    taken: dict[tuple[str, str], dict[str, int]] = {}
    for seed, (shape, n) in enumerate(
        [("pages-contiguous", 96), ("pages-scattered", 128), ("scattered", 150)]
    ):
        for layout in ("layer_first", "page_first"):
            before = paths_taken()
            for kind in ("mha", "mla"):
                for direction in ("load", "backup"):
                    check_served_call(kind, layout, "kernel", direction, shape, n, seed)
            taken[layout, shape] = {
                path: count - before.get(path, 0)
                for path, count in paths_taken().items()
                if count != before.get(path, 0)
            }
    dma = {"batched_runs", "single_copy"}
    for shape in ("pages-contiguous", "pages-scattered"):
        assert set(taken["layer_first", shape]) <= dma, taken
    assert taken["layer_first", "pages-scattered"].get("batched_runs"), taken
    for layout, shape in [
        ("layer_first", "scattered"),
        *(("page_first", s) for s in ("pages-contiguous", "pages-scattered", "scattered")),
    ]:
        assert set(taken[layout, shape]) <= {"staged", "gather"}, taken


def test_device_indexed_loads_plan_from_the_sides_kept_with_their_layer(
    use_mover, transfer_hooks, monkeypatch, device_indices_unread
):
    """Each request's first load call checks only its indices: the layer's buffers were
    checked when they were kept, and every later request's job is made of those buffers."""
    transfer_hooks()
    use_mover(small_policy_mover())
    planners: list[str] = []
    for name in ("plan_device_indexed", "plan_device_indexed_for"):
        planner = getattr(call_plans, name)

        def spy(*args: Any, _name: str = name, _planner: Any = planner, **kwargs: Any) -> Any:
            planners.append(_name)
            return _planner(*args, **kwargs)

        monkeypatch.setattr(call_plans, name, spy)
    for seed, shape in enumerate(["scattered", "contiguous", "scattered"]):
        check_served_call("mha", "layer_first", "kernel", "load", shape, 120, seed)
    assert planners == ["plan_device_indexed_for"] * 3


def _plugin_installed() -> Any:
    """The plugin installed as SGLang installs it: over an adapter built from the
    environment."""
    status = plugin.register_hooks(with_transfers=True)
    HookRegistry.apply_hooks()
    return status


def test_uninstall_restores_every_original_and_drops_what_the_hooks_kept(sglang_hooks):
    status = _plugin_installed()
    assert status.plugin_applied and plugin.applied_status() is status
    target = f"{MHATokenToKVPoolHost.__module__}.MHATokenToKVPoolHost.load_to_device_per_layer"
    assert target in plugin.INSTALLATION.targets
    assert (
        vars(MHATokenToKVPoolHost)["load_to_device_per_layer"]
        is not STOCK[(MHATokenToKVPoolHost, "load_to_device_per_layer")]
    )
    check_served_call("mha", "layer_first", "direct", "load", "scattered", 64, 1)
    adapter = plugin.installed_adapter()
    assert adapter is not None and len(adapter.load_requests) == 1
    assert adapter.movers.built() is not None
    held = weakref.ref(adapter)
    del adapter
    plugin.uninstall()
    for (cls, name), original in STOCK.items():
        assert vars(cls)[name] is original, f"{cls.__name__}.{name}"
    assert plugin.applied_status() is None and plugin.INSTALLATION.targets == []
    assert plugin.installed_adapter() is None
    gc.collect()
    assert held() is None, "something still holds the uninstalled adapter"
    assert not any(target in HookRegistry._patched for target in transfers.TARGETS)
    # And again, as a new engine instance in the same process would.
    assert _plugin_installed().plugin_applied
    assert (
        vars(MHATokenToKVPoolHost)["load_to_device_per_layer"]
        is not STOCK[(MHATokenToKVPoolHost, "load_to_device_per_layer")]
    )


def test_an_install_after_an_uninstall_reads_the_settings_again(sglang_hooks, monkeypatch):
    """What the hooks read from the environment once (the stock share's draws among it) is
    dropped with them: the plugin installed again follows the environment as it is then."""
    monkeypatch.setenv("KVCORE_STOCK_SHARE", "0.5")
    _plugin_installed()
    first = plugin.installed_adapter()
    assert first is not None and first.stock_share.share == 0.5 and not first.serve_rule
    plugin.uninstall()
    monkeypatch.setenv("KVCORE_STOCK_SHARE", "0")
    monkeypatch.setenv("KVCORE_SERVE_RULE", "1")
    assert _plugin_installed().plugin_applied
    again = plugin.installed_adapter()
    assert again is not None and again is not first
    assert again.stock_share.share == 0 and again.serve_rule


def test_uninstall_keeps_another_plugins_hook_on_a_shared_target(transfer_hooks):
    target = f"{MHATokenToKVPoolHost.__module__}.MHATokenToKVPoolHost.load_to_device_per_layer"
    seen: list[int] = []

    def other_plugin(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        seen.append(args[4])  # the layer id
        return original(*args, **kwargs)

    HookRegistry.register(target, other_plugin, HookType.AROUND)
    transfer_hooks()
    plugin.uninstall()
    method = vars(MHATokenToKVPoolHost)["load_to_device_per_layer"]
    stock = STOCK[(MHATokenToKVPoolHost, "load_to_device_per_layer")]
    assert method is not stock and target in HookRegistry._patched  # the other hook stays
    assert [hook for _, hook, _ in HookRegistry._hooks[target]] == [other_plugin]
    before = paths_taken()
    with cpu_hicache():
        check_stock_only_call(2)
    assert seen == [2] and paths_taken() == before  # its hook ran; kvcore's did not
    # The test's own stand-in plugin goes too (SGLang has no way to unregister it).
    MHATokenToKVPoolHost.load_to_device_per_layer = stock  # type: ignore[method-assign]
    HookRegistry._hooks.pop(target)
    HookRegistry._patched.discard(target)


def check_stock_only_call(layer: int) -> None:
    """One direct-backend MHA load through the class method, checked byte for byte."""
    pool = pool_for("mha", "layer_first")
    parts = components("mha", pool)
    generator = torch.Generator().manual_seed(layer)
    randomise(all_tensors(parts), generator)
    host_idx, device_idx = make_indices("mha", pool, "scattered", 32, generator)
    pairs = list(zip(*reference_slots("mha", pool, host_idx, device_idx), strict=True))
    expected = as_bytes([device for part in parts for device in part.devices])
    for p, part in enumerate(parts):
        for slot, row in pairs:
            expected[p * LAYERS + layer][row] = part.row(part.host.view(torch.uint8), layer, slot)
    pool.load_to_device_per_layer(
        device_pool_of("mha", pool), host_idx, device_idx, layer, "direct"
    )
    devices = [device for part in parts for device in part.devices]
    assert all(torch.equal(d.view(torch.uint8), e) for d, e in zip(devices, expected, strict=True))


def test_moved_host_indices_are_recalled_until_changed():
    memo = call_memos.HostIndexMemo()
    host = torch.arange(10, 20)
    moved = host.to("meta")  # where SGLang's kernel backend puts them: not the CPU
    memo.remember(moved, host)
    assert memo.recall(moved) is host
    assert memo.recall(host.to("meta")) is None  # another tensor: nothing remembered
    host[0] = 5  # changed in place after the move: the copy on the device is stale
    assert memo.recall(moved) is None
    del moved  # SGLang dropped it: so does the memo
    assert len(memo) == 0


def test_move_indices_hook_remembers_only_what_it_moved_off_the_cpu(monkeypatch):
    memo = bench_adapter().host_indices
    host, device = torch.arange(8), torch.arange(8).to("meta")

    def to_meta(controller, host_indices, device_indices):
        return host_indices.to("meta"), device_indices

    moved, same_device = move_indices(to_meta, None, host, device)
    assert same_device is device and memo.recall(moved) is host
    kept, _ = move_indices(lambda c, h, d: (h, d), None, host, device)
    assert kept is host and memo.recall(kept) is None  # direct backend: nothing moved


def _reading_adapter(monkeypatch, reader: Any) -> Any:
    """The tests' adapter built under KVCORE_SGLANG_DMA_IN_PLACE=1, reading through ``reader``."""
    monkeypatch.setenv("KVCORE_SGLANG_DMA_IN_PLACE", "1")
    drop_own_adapter()
    adapter = bench_adapter()
    assert adapter.device_reads is not None
    monkeypatch.setattr(adapter, "device_reads", device_reads.DeviceIndexReads(reader))
    return adapter


def test_move_indices_hook_reads_paged_kernel_device_indices_back_only_under_the_setting(
    monkeypatch,
):
    started: list[torch.Tensor] = []

    def reader(device_indices: torch.Tensor) -> Any:
        started.append(device_indices)
        return torch.arange(device_indices.numel()), lambda: None

    assert bench_adapter().device_reads is None, "off by default: the indices stay unread"
    adapter = _reading_adapter(monkeypatch, reader)

    def controller(io_backend: str, page_size: int) -> Any:
        # MHA rows of 8 heads x 128 bf16: 2 KiB a token, so 128 KiB pages of 64 tokens.
        rows = torch.empty((2, 1, 256, 8, 128), dtype=torch.bfloat16, device="meta")
        pool = types.SimpleNamespace(page_size=page_size, layout="layer_first", kv_buffer=rows)
        return types.SimpleNamespace(mem_pool_host=pool, io_backend=io_backend)

    def move(controller, host_indices, device_indices):
        return host_indices.to("meta"), device_indices

    host = torch.arange(64)
    # Token rows, the direct backend and 32 KiB pages stay unread, as does a request the
    # ring takes (DMA_BELOW_TOKENS and more).
    for io_backend, page_size in [("kernel", 1), ("direct", 64), ("kernel", 16)]:
        device = torch.arange(64).to("meta")
        move_indices(move, controller(io_backend, page_size), host, device)
        assert adapter.device_reads.recall(device) is None
    large = torch.arange(device_reads.DMA_BELOW_TOKENS)
    move_indices(move, controller("kernel", 64), large, large.to("meta"))
    assert not started
    device = torch.arange(64).to("meta")
    moved, same_device = move_indices(move, controller("kernel", 64), host, device)
    assert same_device is device and started == [device]
    assert adapter.host_indices.recall(moved) is host
    read = adapter.device_reads.recall(device)
    assert read is not None and torch.equal(read, torch.arange(64))
    pool = pool_for("mha", "layer_first")
    found = adapter.call_indices(pool, transfers.MHA_POOL, moved, device, "kernel")
    assert isinstance(found, call_plans.CallIndices) and found.device_opaque
    assert found.device is device and found.device_read is read
    # Read from indices of another length (a stand-in gone wrong): planned around instead.
    other = torch.arange(32).to("meta")
    move_indices(move, controller("kernel", 64), torch.arange(32), other)
    monkeypatch.setattr(adapter.device_reads, "recall", lambda d: torch.arange(8))
    found = adapter.call_indices(pool, transfers.MHA_POOL, moved, device, "kernel")
    assert isinstance(found, call_plans.CallIndices) and found.device_read is None


def test_no_read_for_a_request_the_serve_rule_passes_or_the_ring_takes(monkeypatch):
    """A move does not say whether a load or a backup follows: the device indices are read
    only where the rule may serve either at that size, and below the size the layer ring
    takes instead (DMA_BELOW_TOKENS). The rule serves these pools from 4k, so only with it
    off is a request of 2k read."""
    pool = pool_for("mha", "layer_first")
    page_bytes = pool_rows.pool_row_bytes(pool) * pool.page_size
    # These pools' pages are small: the setting's threshold is lowered to them.
    monkeypatch.setenv("KVCORE_LONG_RUN_BYTES", str(page_bytes))
    started: list[int] = []

    def reader(device_indices: torch.Tensor) -> Any:
        started.append(device_indices.numel())
        return torch.zeros(device_indices.numel(), dtype=torch.int64), lambda: None

    controller = types.SimpleNamespace(mem_pool_host=pool, io_backend="kernel")
    for rule in ("1", "0"):
        monkeypatch.setenv("KVCORE_SERVE_RULE", rule)
        adapter = _reading_adapter(monkeypatch, reader)
        assert adapter.dma_page_bytes() == page_bytes
        for tokens in (2048, device_reads.DMA_BELOW_TOKENS):
            device = torch.arange(tokens).to("meta")
            move_indices(
                lambda c, h, d: (h.to("meta"), d), controller, torch.arange(tokens), device
            )
    assert started == [2048]


def test_a_failing_read_keeps_stocks_move_and_counts_once(monkeypatch):
    def reader(device_indices: torch.Tensor) -> Any:
        raise RuntimeError("injected read")

    adapter = _reading_adapter(monkeypatch, reader)
    rows = torch.empty((2, 1, 256, 8, 128), dtype=torch.bfloat16, device="meta")
    pool = types.SimpleNamespace(page_size=64, layout="layer_first", kv_buffer=rows)
    controller = types.SimpleNamespace(mem_pool_host=pool, io_backend="kernel")
    host, device = torch.arange(8), torch.arange(8).to("meta")
    before = fallbacks().get("internal_error:RuntimeError", 0)
    moved, same_device = move_indices(lambda c, h, d: (h.to("meta"), d), controller, host, device)
    assert moved.device.type == "meta" and same_device is device
    assert fallbacks().get("internal_error:RuntimeError", 0) == before + 1
    assert adapter.device_reads.recall(device) is None


def test_a_failure_in_the_move_hook_keeps_stocks_move_and_counts_once(monkeypatch):
    """kvcore's part of the move fails after stock's move ran: the moved indices come back
    as stock made them, and the failure is counted once, as one internal error."""
    memo = bench_adapter().host_indices

    def broken(pool: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(bench_adapter().bindings, "indices_moved", broken)
    host, device = torch.arange(8), torch.arange(8).to("meta")
    controller = types.SimpleNamespace(mem_pool_host=object())
    before = fallbacks().get("internal_error:RuntimeError", 0)
    moved, same_device = move_indices(lambda c, h, d: (h.to("meta"), d), controller, host, device)
    assert moved.device.type == "meta" and same_device is device
    assert fallbacks().get("internal_error:RuntimeError", 0) == before + 1
    assert memo.recall(moved) is None


def test_a_failure_finding_a_backups_indices_runs_stock_and_counts_once(
    transfer_hooks, small_mover, monkeypatch
):
    """kvcore fails before it has a plan for a backup (here its indices; on a GPU a device
    read's wait could): SGLang's own backup runs, once, and the failure is counted once."""
    transfer_hooks()

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(bench_adapter(), "call_indices", broken)
    gen = torch.Generator().manual_seed(31)
    with cpu_hicache():  # SGLang's direct copy, in torch, as the stock path here
        pool = pool_for("mha", "layer_first")
        parts = components("mha", pool)
        randomise(all_tensors(parts), gen)
        host_idx, device_idx = make_indices("mha", pool, "scattered", 64, gen)
        before = fallbacks().get("internal_error:RuntimeError", 0)
        pool.backup_from_device_all_layer(
            device_pool_of("mha", pool), host_idx, device_idx, "direct"
        )
    assert fallbacks().get("internal_error:RuntimeError", 0) == before + 1
    pairs = list(zip(*reference_slots("mha", pool, host_idx, device_idx), strict=True))
    for part in parts:
        for layer, device in enumerate(part.devices):
            for slot, row in pairs:
                copied = part.row(part.host.view(torch.uint8), layer, slot)
                assert torch.equal(copied, device.view(torch.uint8)[row])


def reload_every_layer(pool: Any, parts: list[Component], host_idx, device_idx) -> None:
    """An MHA pool's reload, layer by layer as SGLang calls it (the ``direct`` backend),
    every device buffer then checked against the rows the host slots hold."""
    pairs = list(zip(*reference_slots("mha", pool, host_idx, device_idx), strict=True))
    expected = as_bytes([device for part in parts for device in part.devices])
    for layer in range(LAYERS):
        for p, part in enumerate(parts):
            for slot, row in pairs:
                want = expected[p * LAYERS + layer]
                want[row] = part.row(part.host.view(torch.uint8), layer, slot)
        pool.load_to_device_per_layer(
            device_pool_of("mha", pool), host_idx, device_idx, layer, "direct"
        )
    devices = [device for part in parts for device in part.devices]
    for device, want in zip(devices, expected, strict=True):
        assert torch.equal(device.view(torch.uint8), want)


def test_a_reload_under_inference_mode_passes_whole_and_exact(
    use_mover, transfer_hooks, monkeypatch
):
    """SGLang can run under torch.inference_mode (SGLANG_ENABLE_TORCH_INFERENCE_MODE): its
    index tensors then have no version counter, so a kept plan could not see a write
    between layers. Every layer runs stock, the pass is counted once as its own reason
    (not as a failure inside kvcore), and the moved indices are not remembered."""
    transfer_hooks()
    use_mover(small_policy_mover())
    memo = bench_adapter().host_indices
    pool = pool_for("mha", "layer_first")
    parts = components("mha", pool)
    generator = torch.Generator().manual_seed(4)
    randomise(all_tensors(parts), generator)
    before = fallbacks()
    with cpu_hicache(), torch.inference_mode():  # stock's direct copy, in torch, here
        host_idx, device_idx = make_indices("mha", pool, "scattered", 64, generator)
        assert host_idx.is_inference()
        reload_every_layer(pool, parts, host_idx, device_idx)
        moved, _ = move_indices(lambda c, h, d: (h.clone(), d), None, host_idx, device_idx)
    new = {k: v - before.get(k, 0) for k, v in fallbacks().items() if v != before.get(k, 0)}
    assert new == {layer_loads.INFERENCE_INDICES: 1}
    assert len(memo) == 0 and moved is not host_idx


def shared_reloads(requests: int) -> tuple[dict[str, int], int]:
    """``requests`` whole reloads (every layer, new scattered indices each), bytes checked:
    the fallbacks counted and kvcore's transfers."""
    pool = pool_for("mha", "layer_first")
    parts = components("mha", pool)
    generator = torch.Generator().manual_seed(9)
    before, served_before = fallbacks(), sum(paths_taken().values())
    with cpu_hicache():  # stock's direct copy, in torch, here
        for _ in range(requests):
            randomise(all_tensors(parts), generator)
            host_idx, device_idx = make_indices("mha", pool, "scattered", 64, generator)
            reload_every_layer(pool, parts, host_idx, device_idx)
    new = {k: v - before.get(k, 0) for k, v in fallbacks().items() if v != before.get(k, 0)}
    return new, sum(paths_taken().values()) - served_before


def test_a_stock_share_passes_drawn_reloads_whole_and_counts_each_once(
    use_mover, transfer_hooks, monkeypatch
):
    transfer_hooks()
    use_mover(small_policy_mover())
    every = StockShare(1.0)
    monkeypatch.setattr(bench_adapter(), "stock_share", every)
    passed, served = shared_reloads(requests=3)
    # Each reload is one pass, its layers all stock's.
    assert passed == {STOCK_SHARE: 3} and served == 0
    half = StockShare(0.5)
    monkeypatch.setattr(bench_adapter(), "stock_share", half)
    passed, served = shared_reloads(requests=8)
    to_stock = passed.get(STOCK_SHARE, 0)
    assert set(passed) <= {STOCK_SHARE} and 0 < to_stock < 8
    # kvcore's reloads: one transfer a layer.
    assert served == (8 - to_stock) * LAYERS


def test_device_resident_indices_are_served_only_where_they_need_not_be_read():
    memo = call_memos.HostIndexMemo()
    host = torch.arange(64, 128)
    moved, device = host.to("meta"), torch.arange(64).to("meta")
    memo.remember(moved, host)
    pool = pool_for("mha", "layer_first")
    found = call_plans.call_indices(pool, transfers.MHA_POOL, moved, device, "kernel", memo)
    assert isinstance(found, call_plans.CallIndices)
    assert found.host is host and found.device is device and found.device_opaque
    unknown = torch.arange(64).to("meta")  # moved without the hook: no CPU copy to plan from
    assert (
        call_plans.call_indices(pool, transfers.MHA_POOL, unknown, device, "kernel", memo)
        == "sglang_indices_on_device"
    )
    direct = pool_for("mha", "page_first_direct")  # copies pages named by the device values
    assert (
        call_plans.call_indices(direct, transfers.MHA_POOL, host, device, "direct", memo)
        == "sglang_indices_on_device"
    )


def test_patched_methods_match_per_index_reference(transfer_hooks, small_mover):
    # One test over every served (pool, layout, io backend): applying the hooks is the slow
    # part, so it is done once.
    transfer_hooks()
    cases = [("contiguous", 1), ("contiguous", 100), ("scattered", 1), ("scattered", 150)]
    for kind, layout, io_backend in SERVED:
        for direction in ("load", "backup"):
            seen_before = paths_taken()
            for seed, (shape, n) in enumerate([*cases, ("merged", 200)]):
                check_served_call(kind, layout, io_backend, direction, shape, n, seed)
            seen = paths_taken()
            assert sum(seen.values()) > sum(seen_before.values()), (
                f"nothing went through the mover: {kind} {layout} {io_backend} {direction}"
            )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    served=st.sampled_from(SERVED),
    direction=st.sampled_from(["load", "backup"]),
    shape=st.sampled_from(["contiguous", "scattered", "merged"]),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**31 - 1),
    small=st.booleans(),
)
def test_random_calls_match_reference_on_every_path(
    use_mover, transfer_hooks, monkeypatch, served, direction, shape, n, seed, small
):
    transfer_hooks()  # idempotent: registers and wraps once
    use_mover(small_policy_mover() if small else Mover(metrics=METRICS))
    kind, layout, io_backend = served
    check_served_call(kind, layout, io_backend, direction, shape, n, seed)


def test_all_paths_are_exercised(transfer_hooks, small_mover):
    transfer_hooks()
    before = paths_taken()
    generator = torch.Generator().manual_seed(3)
    pool = pool_for("mha", "layer_first")
    cases = [
        (torch.arange(40, 140), torch.arange(200, 300)),  # one run both sides
        (torch.cat([torch.arange(0, 50), torch.arange(300, 350)]), torch.arange(1, 101)),
        (torch.arange(0, 100), torch.randperm(400, generator=generator)[:100] + 1),
        (torch.randperm(pool.size, generator=generator)[:100], torch.arange(1, 101)),
    ]
    for host_idx, device_idx in cases:
        pool.load_to_device_per_layer(None, host_idx, device_idx, 0, "kernel")
    taken = {p: c - before.get(p, 0) for p, c in paths_taken().items()}
    for path in ("single_copy", "batched_runs", "staged", "gather"):
        assert taken.get(path, 0) > 0, f"{path} not taken: {taken}"


def layered_cpu_kernels(calls: list[tuple[str, int]]) -> KernelSet:
    """The CPU kernels plus layered ops that log each call with its pair count."""

    def copy_runs_layers(pairs, runs):
        calls.append(("copy_runs_layers", len(pairs)))
        for src, dst in zip(pairs.src_words, pairs.dst_words, strict=True):
            REFERENCE.copy_runs(src, dst, runs)

    def gather_prepared(pairs, rows):
        calls.append(("gather_prepared", len(pairs)))
        REFERENCE.gather_prepared(pairs, rows)

    return dataclasses.replace(
        REFERENCE,
        copy_runs_layers=copy_runs_layers,
        gather_prepared=gather_prepared,
    )


@pytest.mark.parametrize(("kind", "pairs"), [("mha", 2), ("mla", 1)])
def test_the_pairs_of_a_call_move_in_one_submission(
    transfer_hooks, small_mover, swap_kernels, kind, pairs
):
    """A load's K and V (an MLA layer's one pair), a backup's every layer: one layered
    gather, the same bytes; a load's layer buffers are checked once and kept for the pool,
    its indices prepared once for the request."""
    transfer_hooks()
    calls: list[tuple[str, int]] = []
    swap_kernels("cpu", layered_cpu_kernels(calls))
    check_served_call(kind, "layer_first", "direct", "load", "scattered", 100, 5)
    assert calls == [("gather_prepared", pairs)]
    calls.clear()
    check_served_call(kind, "layer_first", "direct", "backup", "scattered", 100, 6)
    assert calls == [("gather_prepared", pairs * LAYERS)]


def test_pairs_one_submission_cannot_take_are_moved_one_by_one(
    transfer_hooks, small_mover, swap_kernels, monkeypatch
):
    transfer_hooks()
    calls: list[tuple[str, int]] = []
    swap_kernels("cpu", layered_cpu_kernels(calls))
    monkeypatch.setattr(
        "kvcore.planning.submissions.layers_mismatch", lambda plan, pairs: "a test says so"
    )
    before = paths_taken().get("gather", 0)
    check_served_call("mha", "layer_first", "direct", "backup", "scattered", 100, 7)
    assert calls == []  # no layered call: a gather per (layer, K or V) pair
    assert paths_taken()["gather"] - before == 2 * LAYERS


def test_layer_pairs_are_checked_once_per_pool_and_dropped_with_it():
    class Pool:
        pass

    memo = call_memos.LayerPairsMemo(per_pool=3)
    pool = Pool()
    host = torch.randint(0, 100, (4, 16, 8), dtype=torch.int16)
    device = [torch.zeros(16, 8, dtype=torch.int16) for _ in range(4)]
    first = memo.pairs(pool, list(host), device)
    assert memo.pairs(pool, list(host), device) is first  # fresh views, same buffers
    assert memo.pairs(pool, list(host[:, :8]), [d[:8] for d in device]) is not first
    assert memo.pairs(Pool(), list(host), device) is not first  # another pool
    for offset in range(3):  # past per_pool entries the pool's entries start over
        memo.pairs(pool, list(host[:, offset:]), [d[offset:] for d in device])
    assert memo.pairs(pool, list(host), device) is not first
    del pool
    gc.collect()
    assert len(memo._by_pool) == 0


def test_merged_load_is_split_into_runs_within_fixed_staging(
    use_mover, transfer_hooks, monkeypatch
):
    """Several loads merged into one call go through as runs; the staging buffer is
    allocated once at its configured size and reused, never grown, across chunks."""
    transfer_hooks()
    small_staging = 2048
    small_mover = small_policy_mover(small_staging)
    use_mover(small_mover)
    pool = pool_for("mla", "layer_first")
    parts = components("mla", pool)
    generator = torch.Generator().manual_seed(8)
    runs = [(0, 96), (320, 64), (640, 128)]  # three merged loads: 288 rows x 48 B
    host_idx = torch.cat([torch.arange(start, start + length) for start, length in runs])
    assert host_idx.numel() * 48 > 2 * small_staging  # several staging chunks
    device_sides = {
        "batched_runs": torch.cat([torch.arange(16, 112), torch.arange(160, 352)]),
        "staged": torch.randperm(500, generator=generator)[:288] + 1,
    }
    staging = small_mover.staging
    for path, device_idx in device_sides.items():
        randomise(all_tensors(parts), generator)
        before = paths_taken()
        for layer in range(LAYERS):
            want = parts[0].devices[layer].clone().view(torch.uint8)
            for slot, row in zip(host_idx.tolist(), device_idx.tolist(), strict=True):
                want[row] = parts[0].row(parts[0].host.view(torch.uint8), layer, slot)
            pool.load_to_device_per_layer(None, host_idx, device_idx, layer, "kernel")
            assert torch.equal(parts[0].devices[layer].view(torch.uint8), want)
        after = paths_taken()
        taken = {p: c - before.get(p, 0) for p, c in after.items() if c != before.get(p, 0)}
        assert taken == {path: LAYERS}
        # Allocated on first use (by the staged path), at its configured size.
        reserved = small_staging if path == "staged" else 0
        assert staging.bytes_reserved == reserved
    (buffer,) = staging._buffers.values()
    pool.load_to_device_per_layer(None, host_idx, device_sides["staged"], 0, "kernel")
    assert staging._buffers[torch.device("cpu")] is buffer
    assert staging.bytes_reserved == small_staging


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_layer_views_address_the_rows_sglang_own_views_do(layout):
    """kvcore's dense per-layer views and SGLang's own per-layer views (``data_refs``,
    strided for page_first) name the same memory for every slot."""
    from kvcore_sglang.host_layouts import block_rows

    for kind in ("mha", "mla"):
        pool = pool_for(kind, layout)
        buffer, refs = (
            (pool.k_buffer, pool.k_data_refs) if kind == "mha" else (pool.kv_buffer, pool.data_refs)
        )
        rows = block_rows(buffer, layout, pool.layer_num, pool.page_size, refs[0].shape[1:])
        assert not isinstance(rows, str)
        slots = torch.arange(pool.size)
        for layer, ref in enumerate(refs):
            view = rows.layer(layer)
            assert view.is_contiguous()
            row_of = rows.slot_map.rows_of(slots)
            for slot in (0, 1, pool.size // 2, pool.size - 1):
                assert view[row_of[slot]].data_ptr() == ref[slot].data_ptr()
            assert torch.equal(view[row_of].view(torch.uint8), ref[slots].view(torch.uint8))


def test_layer_the_pool_does_not_hold_is_a_no_op(transfer_hooks):
    transfer_hooks()
    for kind in POOL_CLASSES:
        pool = pool_for(kind, "layer_first")
        parts = components(kind, pool)
        randomise(all_tensors(parts), torch.Generator().manual_seed(5))
        snapshot = as_bytes(all_tensors(parts))
        before = (fallbacks(), paths_taken())
        host_idx, device_idx = torch.arange(64), torch.arange(64, 128)
        pool.load_to_device_per_layer(
            device_pool_of(kind, pool), host_idx, device_idx, LAYERS, "kernel"
        )
        after = as_bytes(all_tensors(parts))
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True))
        assert (fallbacks(), paths_taken()) == before


# --- calls that stay stock -----------------------------------------------------------------


class Recorder:
    """Stands in for the stock method: records each call, copies nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    return wide[..., : t.shape[-1]]


def _meta_indices(n: int) -> torch.Tensor:
    # Not on the CPU and impossible to read back: a read would raise.
    return torch.empty(n, dtype=torch.int64, device="meta")


FALLBACK_CASES: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "indices_on_device": (
        "sglang_indices_on_device",
        lambda pool: {"host_indices": _meta_indices(64)},
    ),
    "device_side_on_device": (
        "sglang_indices_on_device",
        lambda pool: {"device_indices": _meta_indices(64)},
    ),
    "io_backend": ("sglang_io_backend", lambda pool: {"io_backend": "kernel_ascend"}),
    "float_indices": ("sglang_index_dtype", lambda pool: {"host_indices": torch.ones(64)}),
    "out_of_range": (
        "sglang_invalid_indices",
        lambda pool: {"host_indices": torch.arange(64) + 100_000},
    ),
    "duplicate_destination": (
        "sglang_invalid_indices",
        lambda pool: {
            "host_indices": torch.zeros(128, dtype=torch.int64),
            "device_indices": torch.zeros(128, dtype=torch.int64),
        },
    ),
    "direct_on_page_first": ("sglang_layout_io_backend", lambda pool: {"layout": "page_first"}),
    "kernel_on_page_first_direct": (
        "sglang_layout_io_backend",
        lambda pool: {"layout": "page_first_direct", "io_backend": "kernel"},
    ),
    "page_head": ("sglang_layout_page_head", lambda pool: {"layout": "page_head"}),
}


def call_hook(kind: str, direction: str, pool: Any, **overrides: Any) -> Recorder:
    """Runs one transfer hook directly, with a Recorder as the stock method."""
    original = Recorder()
    args: dict[str, Any] = dict(
        host_indices=torch.arange(64), device_indices=torch.arange(64, 128), io_backend="direct"
    )
    args.update(overrides)
    device_pool = device_pool_of(kind, pool)
    target = f"{POOL_CLASSES[kind].__module__}.{POOL_CLASSES[kind].__qualname__}"
    indices = (args["host_indices"], args["device_indices"])
    if direction == "load":
        hook = adapter_hook(f"{target}.load_to_device_per_layer")
        hook(original, pool, device_pool, *indices, 1, args["io_backend"], is_draft=False)
        expected_args = (pool, device_pool, *indices, 1, args["io_backend"])
        expected_kwargs = {"is_draft": False}
    else:
        hook = adapter_hook(f"{target}.backup_from_device_all_layer")
        hook(original, pool, device_pool, *indices, args["io_backend"])
        expected_args = (pool, device_pool, *indices, args["io_backend"])
        expected_kwargs = {}
    assert len(original.calls) <= 1
    if original.calls:
        called_args, called_kwargs = original.calls[0]
        assert called_kwargs == expected_kwargs
        assert len(called_args) == len(expected_args)
        assert all(a is b for a, b in zip(called_args, expected_args, strict=True))
    return original


def assert_stock_once(kind, direction, pool, reason, **overrides) -> None:
    parts = components(kind, pool)
    randomise(all_tensors(parts), torch.Generator().manual_seed(11))
    snapshot = as_bytes(all_tensors(parts))
    before = fallbacks()
    original = call_hook(kind, direction, pool, **overrides)
    assert len(original.calls) == 1, "the stock method should run exactly once"
    after = fallbacks()
    assert after.get(reason, 0) == before.get(reason, 0) + 1, after
    assert sum(after.values()) == sum(before.values()) + 1
    current = as_bytes(all_tensors(parts))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, current, strict=True)), (
        "kvcore wrote before handing the call to stock"
    )


@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize(
    ("kind", "case"),
    [
        (kind, case)
        for kind in sorted(POOL_CLASSES)
        for case in sorted(FALLBACK_CASES)
        if case != "page_head" or kind == "mha"  # page_head is an MHA layout
    ],
)
def test_calls_kvcore_cannot_serve_run_stock_once_with_reason(kind, case, direction):
    reason, overrides = FALLBACK_CASES[case]
    extra = overrides(pool_for(kind, "layer_first"))
    layout = extra.pop("layout", "layer_first")
    assert_stock_once(kind, direction, pool_for(kind, layout), reason, **extra)


def test_page_first_direct_needs_whole_pages():
    # A page's worth of consecutive slots that does not start on a page boundary: stock
    # would copy the page the first index falls in, not these slots.
    pool = pool_for("mla", "page_first_direct")
    for direction in ("load", "backup"):
        assert_stock_once(
            "mla",
            direction,
            pool,
            "sglang_unpaged_indices",
            host_indices=torch.arange(1, 17),
            device_indices=torch.arange(16, 32),
        )


def test_a_kept_layer_still_checks_each_requests_indices(transfer_hooks):
    """Once a layer's buffers are kept, a request's first call takes them without a new
    job: the checks that depend on the request (whole pages here) still run."""
    transfer_hooks()
    pool = pool_for("mla", "page_first_direct")
    paged = {"host_indices": torch.arange(PAGE, 3 * PAGE), "device_indices": torch.arange(2 * PAGE)}
    served = call_hook("mla", "load", pool, **paged)
    assert not served.calls, "a paged request is kvcore's"
    assert (
        bench_adapter().pool_layers.get(pool, device_pool_of("mla", pool), (1, False)) is not None
    )
    assert_stock_once(
        "mla",
        "load",
        pool,
        "sglang_unpaged_indices",
        host_indices=torch.arange(1, PAGE + 1),
        device_indices=torch.arange(PAGE, 2 * PAGE),
    )


@pytest.mark.parametrize("direction", ["load", "backup"])
def test_dsa_calls_stock_runs(monkeypatch, direction):
    pool = pool_for("dsa", "layer_first")
    assert_stock_once(
        "dsa",
        direction,
        pool,
        "sglang_unaligned_indices",
        host_indices=torch.arange(8),
        device_indices=torch.arange(64, 72),
    )
    monkeypatch.setattr(pool, "indexer_page_stride_size", pool.indexer_page_stride_size - 4)
    assert_stock_once("dsa", direction, pool, "sglang_io_backend", io_backend="kernel")
    monkeypatch.undo()
    monkeypatch.setattr(pool, "_is_dummy", True)
    assert_stock_once("dsa", direction, pool, "sglang_dummy_pool")


def test_dsa_layer_sharded_backup_runs_stock(monkeypatch):
    pool = pool_for("dsa", "layer_first")
    monkeypatch.setattr(pool.device_pool, "layer_shard_enabled", True, raising=False)
    assert_stock_once("dsa", "backup", pool, "sglang_layer_shard")


@pytest.mark.parametrize("direction", ["load", "backup"])
def test_strided_device_rows_run_stock(monkeypatch, direction):
    pool = pool_for("mha", "layer_first")
    strided = tuple(_strided_like(t) for t in pool.device_v_buffers)
    monkeypatch.setattr(pool, "device_v_buffers", strided)
    # K would be served alone; the call is decided as a whole, so nothing is copied.
    assert_stock_once("mha", direction, pool, "strided_rows")


def test_dtype_mismatch_runs_stock(monkeypatch):
    pool = pool_for("mla", "layer_first")
    wider = tuple(t.to(torch.float32) for t in pool.device_kv_buffers)
    monkeypatch.setattr(pool, "device_kv_buffers", wider)
    assert_stock_once("mla", "backup", pool, "dtype_mismatch")


@pytest.mark.parametrize(
    ("attribute", "value", "reason"),
    [
        ("dcp_size", 2, "sglang_dcp"),
        pytest.param("_native_buffers", object(), "sglang_split_buffers", marks=ONLY_0_5_23),
        pytest.param("_layer_shard_enabled", True, "sglang_layer_shard", marks=ONLY_0_5_23),
    ],
)
def test_mla_pools_kvcore_does_not_serve_run_stock(monkeypatch, attribute, value, reason):
    pool = pool_for("mla", "layer_first")
    monkeypatch.setattr(pool, attribute, value)
    # Layer sharding changes only the backup; the other two change both methods.
    directions = ["backup"] if attribute == "_layer_shard_enabled" else ["load", "backup"]
    for direction in directions:
        assert_stock_once("mla", direction, pool, reason)


@ONLY_0_5_22
def test_mla_layer_sharded_backup_runs_stock_on_0_5_22(monkeypatch):
    # 0.5.22 backs a layer-sharded device pool up layer by layer (its own mapping of
    # draft layers included): left to stock. Loads of a sharded pool are served (below).
    pool = pool_for("mla", "layer_first")
    monkeypatch.setattr(pool.device_pool, "layer_shard_enabled", True, raising=False)
    assert_stock_once("mla", "backup", pool, "sglang_layer_shard")


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_source_no_release_was_written_for_runs_stock(monkeypatch, kind):
    pool = pool_for(kind, "layer_first")
    for direction, method in (("load", METHODS[0]), ("backup", METHODS[1])):
        target = f"{POOL_CLASSES[kind].__module__}.{POOL_CLASSES[kind].__qualname__}.{method}"
        recorded = guard.FINGERPRINTS
        unknown = {r: {t: f for t, f in fps.items() if t != target} for r, fps in recorded.items()}
        monkeypatch.setattr(guard, "FINGERPRINTS", unknown)
        assert_stock_once(kind, direction, pool, "sglang_source_unknown")
        monkeypatch.undo()


@pytest.mark.parametrize("kind", sorted(POOL_CLASSES))
def test_subclass_pools_run_stock(monkeypatch, kind):
    pool = pool_for(kind, "layer_first")

    class OwnData(POOL_CLASSES[kind]):  # type: ignore[misc, valid-type]
        pass

    monkeypatch.setattr(pool, "__class__", OwnData)
    for direction in ("load", "backup"):
        assert_stock_once(kind, direction, pool, "sglang_pool_class")


def test_patched_methods_hand_unserved_calls_to_stock(transfer_hooks):
    # Through the real wrappers: SGLang's stock op needs CUDA, so reaching it fails here.
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    before = fallbacks().get("sglang_io_backend", 0)
    with pytest.raises(ValueError, match="Unsupported IO backend"):
        pool.load_to_device_per_layer(None, torch.arange(4), torch.arange(1, 5), 0, "bogus")
    assert fallbacks().get("sglang_io_backend", 0) == before + 1


# --- guard and plugin ----------------------------------------------------------------------

ALL_TRANSFER_TARGETS = {t for group in guard.TRANSFER_GROUPS.values() for t in group}


def test_guard_covers_the_transfer_targets():
    result = guard.check_targets(VERSION, guard.TRANSFER_GROUPS)
    assert result.skipped == ()
    assert (
        set(result.patchable) == {*transfers.TARGETS, *pool_warm_up.TARGETS} == ALL_TRANSFER_TARGETS
    )
    (other,) = set(RELEASES) - {VERSION}
    across = guard.check_targets(other, guard.TRANSFER_GROUPS)
    # The releases share their DSA transfers and move_indices, not their MHA and MLA ones
    # (transfers and constructors).
    assert set(across.patchable) == {*guard.DSA_TRANSFER_TARGETS, *guard.INDEX_MEMO_TARGETS}
    assert {s.target for s in across.skipped} == {*guard.TRANSFER_TARGETS, *guard.WARM_UP_TARGETS}
    assert all(s.reason.startswith("source changed") for s in across.skipped)


@pytest.mark.parametrize(
    ("pool_class", "by_release"),
    [
        (transfers.MHA_POOL, pool_jobs.MHA_JOBS),
        (transfers.MLA_POOL, pool_jobs.MLA_JOBS),
        (transfers.DSA_POOL, pool_jobs.DSA_JOBS),
    ],
)
def test_hooks_plan_with_the_installed_release_builders(pool_class, by_release):
    assert set(by_release) == set(RELEASES)
    for method in METHODS:
        found = release_jobs.ReleaseJobs().jobs_for(f"{pool_class}.{method}", by_release)
        assert found == by_release[VERSION]


def test_the_builders_of_a_target_are_looked_up_again_only_for_other_records(monkeypatch):
    """Every request's first call asks for its builders: found once per target, and again
    where the recorded fingerprints or the builders asked about are others."""
    target = f"{transfers.MHA_POOL}.{METHODS[0]}"
    jobs = release_jobs.ReleaseJobs()
    found = jobs.jobs_for(target, pool_jobs.MHA_JOBS)
    assert found is pool_jobs.MHA_JOBS[VERSION]
    recorded = guard.FINGERPRINTS
    unknown = {r: {t: f for t, f in fps.items() if t != target} for r, fps in recorded.items()}
    monkeypatch.setattr(guard, "FINGERPRINTS", unknown)
    assert jobs.jobs_for(target, pool_jobs.MHA_JOBS) is None
    monkeypatch.undo()
    assert jobs.jobs_for(target, pool_jobs.MHA_JOBS) is found
    other = {VERSION: pool_jobs.MLA_JOBS[VERSION]}
    assert jobs.jobs_for(target, other) is other[VERSION]
    assert jobs.jobs_for(target, pool_jobs.MHA_JOBS) is found


def test_plugin_registers_transfer_hooks_over_stock(transfer_hooks):
    status = transfer_hooks()
    assert set(status.patched_targets) >= ALL_TRANSFER_TARGETS
    assert set(guard.ALLOCATOR_TARGETS) <= set(status.patched_targets)
    for (cls, name), function in STOCK.items():
        assert vars(cls)[name].__wrapped__ is function


def test_entry_point_with_transfers_off_leaves_them_stock(sglang_hooks, monkeypatch):
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")
    for (cls, name), function in STOCK.items():
        monkeypatch.setattr(cls, name, function)
    status = sglang_hooks()
    assert not ALL_TRANSFER_TARGETS & set(status.patched_targets)
    assert all(vars(cls)[name] is function for (cls, name), function in STOCK.items())


def test_entry_point_hooks_transfers_by_default(sglang_hooks, monkeypatch):
    monkeypatch.delenv("KVCORE_TRANSFERS", raising=False)
    for (cls, name), function in STOCK.items():
        monkeypatch.setattr(cls, name, function)
    status = sglang_hooks()
    assert set(status.patched_targets) >= ALL_TRANSFER_TARGETS
    assert all(vars(cls)[name] is not function for (cls, name), function in STOCK.items())


# The functions only one transfer group depends on (the registry is every group's).
OWN_DEPENDENCIES = {
    group: [
        t
        for t in guard.DEPENDENCIES[group]
        if not any(t in deps for other, deps in guard.DEPENDENCIES.items() if other != group)
    ]
    for group in guard.TRANSFER_GROUPS
}


@pytest.mark.parametrize(
    ("group", "dependency"),
    [(group, deps[0]) for group, deps in sorted(OWN_DEPENDENCIES.items()) if deps],
)
def test_changed_dependency_leaves_its_transfer_group_stock(
    transfer_hooks, monkeypatch, group, dependency
):
    monkeypatch.setitem(
        guard.FINGERPRINTS, VERSION, {**guard.FINGERPRINTS[VERSION], dependency: "0" * 64}
    )
    status = transfer_hooks()
    targets = set(guard.TRANSFER_GROUPS[group])
    assert not targets & set(status.patched_targets)
    assert ALL_TRANSFER_TARGETS - targets <= set(status.patched_targets)
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert all(f"whose target {dependency} changed" in skipped[t] for t in targets)


@pytest.mark.parametrize("group", sorted(guard.TRANSFER_GROUPS))
def test_changed_fingerprint_leaves_its_transfer_group_stock(
    transfer_hooks, monkeypatch, caplog, group
):
    targets = guard.TRANSFER_GROUPS[group]
    changed = targets[-1]
    monkeypatch.setitem(
        guard.FINGERPRINTS, VERSION, {**guard.FINGERPRINTS[VERSION], changed: "0" * 64}
    )
    caplog.set_level(logging.WARNING)
    status = transfer_hooks()
    assert not set(targets) & set(status.patched_targets)
    assert ALL_TRANSFER_TARGETS - set(targets) <= set(status.patched_targets)
    assert set(guard.ALLOCATOR_TARGETS) <= set(status.patched_targets)
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert skipped[changed].startswith("source changed")
    assert set(targets) <= set(skipped)
    for (cls, name), function in STOCK.items():
        target = f"{cls.__module__}.{cls.__qualname__}.{name}"
        patched = vars(cls)[name] is not function
        assert patched == (target not in targets)
    assert any(changed in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_transfers_setting_turns_the_hooks_on(sglang_hooks, monkeypatch):
    for (cls, name), function in STOCK.items():
        monkeypatch.setattr(cls, name, function)
    monkeypatch.setenv("KVCORE_TRANSFERS", "1")
    status = sglang_hooks()
    assert set(status.patched_targets) >= ALL_TRANSFER_TARGETS
    for (cls, name), function in STOCK.items():
        assert vars(cls)[name].__wrapped__ is function


# --- one plan per reload ---------------------------------------------------------------------


def _counting_planners(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("plan", "plan_for", "plan_device_indexed", "plan_device_indexed_for"):
        real = getattr(call_plans, name)

        def counted(*args: Any, _real=real, _name=name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(call_plans, name, counted)
    return calls


def _reload_expected(
    kind: str, pool: Any, host_idx, device_idx, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pool's device layers, its buffers randomised by ``seed``, and the bytes each
    must hold once every layer is reloaded."""
    parts = components(kind, pool)
    randomise(all_tensors(parts), torch.Generator().manual_seed(seed))
    pairs = list(zip(*reference_slots(kind, pool, host_idx, device_idx), strict=True))
    targets = [device for part in parts for device in part.devices]
    expected = as_bytes(targets)
    for p, part in enumerate(parts):
        for layer in range(LAYERS):
            for slot, row in pairs:
                expected[p * LAYERS + layer][row] = part.row(
                    part.host.view(torch.uint8), layer, slot
                )
    return targets, expected


def _load_every_layer_and_check(kind: str, pool: Any, host_idx, device_idx, io_backend) -> None:
    targets, expected = _reload_expected(kind, pool, host_idx, device_idx, int(host_idx[0]))
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(
            device_pool_of(kind, pool), host_idx, device_idx, layer, io_backend
        )
    for target, want in zip(targets, expected, strict=True):
        assert torch.equal(target.view(torch.uint8), want)


def test_interleaved_pools_keep_their_own_requests_and_layers(
    transfer_hooks, small_mover, monkeypatch
):
    """SGLang interleaves pools layer by layer (a model's KV pool and its indexer pool):
    each pool's request, plan and kept layers serve that pool alone, even where both get
    the very same index tensors."""
    transfer_hooks()
    answered = _spy_later_layers(monkeypatch)
    pools = [pool_for("mha", "layer_first"), mha_host(TOKENS, PAGE, layers=LAYERS, heads=2)]
    gen = torch.Generator().manual_seed(23)
    before = fallbacks()
    for request in range(3):  # the later requests: layers kept, served on the fast path
        host_idx, device_idx = make_indices("mha", pools[0], "scattered", 120, gen)
        reloads = [
            _reload_expected("mha", pool, host_idx, device_idx, 10 * request + p)
            for p, pool in enumerate(pools)
        ]
        for layer in range(LAYERS):
            for pool in pools:
                pool.load_to_device_per_layer(
                    device_pool_of("mha", pool), host_idx, device_idx, layer, "kernel"
                )
        for targets, expected in reloads:
            for target, want in zip(targets, expected, strict=True):
                assert torch.equal(target.view(torch.uint8), want)
    # A request's first layer is not asked. Each pool's first request meets layers 1..;
    # later ones serve them fast.
    later = [True, True] * (LAYERS - 1)
    assert answered == [False] * 2 * (LAYERS - 1) + 2 * later, answered
    assert fallbacks() == before


@pytest.mark.parametrize(("kind", "layout", "io_backend"), SERVED)
def test_a_layer_by_layer_reload_plans_once_and_replans_when_the_indices_change(
    transfer_hooks, small_mover, monkeypatch, kind, layout, io_backend
):
    transfer_hooks()
    calls = _counting_planners(monkeypatch)
    pool = pool_for(kind, layout)
    host_idx, device_idx = make_indices(
        kind, pool, "scattered", 150, torch.Generator().manual_seed(5)
    )
    before = fallbacks()

    _load_every_layer_and_check(kind, pool, host_idx, device_idx, io_backend)
    assert len(calls) == 1, calls

    # Changed in place (same tensor, new version): planned again, and the new rows copied.
    page = pool.page_size if kind == "dsa" or layout == "page_first_direct" else 1
    host_idx.copy_(host_idx.roll(page))
    _load_every_layer_and_check(kind, pool, host_idx, device_idx, io_backend)
    assert len(calls) == 2, calls

    # Other index tensors with equal values: planned again (the memo keys on identity).
    _load_every_layer_and_check(kind, pool, host_idx.clone(), device_idx.clone(), io_backend)
    assert len(calls) == 3, calls
    assert fallbacks() == before


def test_a_memoised_plan_follows_the_mover_policy(use_mover, transfer_hooks, monkeypatch):
    transfer_hooks()
    calls = _counting_planners(monkeypatch)
    pool = pool_for("mha", "layer_first")
    host_idx, device_idx = make_indices(
        "mha", pool, "scattered", 150, torch.Generator().manual_seed(6)
    )
    for policy in (SMALL_POLICY, PathPolicy()):
        use_mover(Mover(policy, metrics=METRICS))
        _load_every_layer_and_check("mha", pool, host_idx, device_idx, "kernel")
    assert len(calls) == 2, calls


def _spy_later_layers(monkeypatch) -> list[bool]:
    """What each load's fast path (a later layer of a prepared request) answered."""
    answered: list[bool] = []
    real = transfers.later_layer_served

    def spy(*args: Any) -> bool:
        answered.append(real(*args))
        return answered[-1]

    monkeypatch.setattr(transfers, "later_layer_served", spy)
    return answered


@pytest.mark.parametrize(("kind", "layout", "io_backend"), SERVED)
def test_later_layers_of_a_request_take_one_launch_each(
    transfer_hooks, small_mover, monkeypatch, kind, layout, io_backend
):
    """Once a pool's layers have been seen, every layer after a request's first is served
    by the fast path (no planning, no lookup of the pool's jobs), with the same bytes."""
    transfer_hooks()
    answered = _spy_later_layers(monkeypatch)
    pool = pool_for(kind, layout)
    gen = torch.Generator().manual_seed(21)
    for _ in range(3):
        host_idx, device_idx = make_indices(kind, pool, "scattered", 120, gen)
        _load_every_layer_and_check(kind, pool, host_idx, device_idx, io_backend)
    # A request's first layer is new, so the fast path is not asked. Request 1 meets layers
    # 1.. for the first time; requests 2 and 3 serve them fast.
    first_sight = [False] * (LAYERS - 1)
    assert answered == first_sight + 2 * [True] * (LAYERS - 1), answered


def test_a_failure_on_the_fast_path_runs_that_layer_stock_and_passes_the_rest(
    transfer_hooks, small_mover, monkeypatch
):
    transfer_hooks()
    answered = _spy_later_layers(monkeypatch)
    gen = torch.Generator().manual_seed(22)
    with cpu_hicache():  # SGLang's direct copy, in torch, as the stock path here
        pool = pool_for("mha", "layer_first")
        host_idx, device_idx = make_indices("mha", pool, "scattered", 120, gen)
        _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
        host_idx, device_idx = make_indices("mha", pool, "scattered", 120, gen)
        before = fallbacks().get("internal_error:RuntimeError", 0)
        calls = 0
        real = Mover.execute_prepared

        def broken_once(self, prepared, pairs):
            nonlocal calls
            calls += 1
            if calls == 2:  # layer 1: the fast path
                raise RuntimeError("injected")
            real(self, prepared, pairs)

        monkeypatch.setattr(Mover, "execute_prepared", broken_once)
        # Layer 0 is kvcore's, layer 1 fails inside kvcore and runs stock, layer 2 passes:
        # every layer lands byte for byte.
        _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
    assert fallbacks().get("internal_error:RuntimeError", 0) == before + 1
    assert calls == 2
    # Request 1's layers 1 and 2 (first sight), request 2's layer 1 (it fails); request 2's
    # layer 2 passes without asking.
    assert answered == [False, False, False], answered


# --- 0.5.22's layer mapping: MTP draft layers and layer sharding ------------------------------


def _device_0_5_22(kind: str, layers: int) -> Any:
    if kind == "mha":
        return mha_device(TOKENS, PAGE, layers=layers, heads=2)
    return mla_device(TOKENS, PAGE, layers=layers)


def _host_0_5_22(kind: str, device: Any, layout: str, **extra: Any) -> Any:
    build = mha_host_pool if kind == "mha" else mla_host_pool
    return build(
        device,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        **extra,
    )


def _check_load(kind, pool, device_pool, layer_id, host_layer, io_backend, seed, *, is_draft):
    """One load through the hooks: device layer ``layer_id`` of each component (its index in
    ``device_*_buffers``) receives host layer ``host_layer``; nothing else is written."""
    parts = components(kind, pool)
    generator = torch.Generator().manual_seed(seed)
    randomise(all_tensors(parts), generator)
    host_idx, device_idx = make_indices(kind, pool, "scattered", 150, generator)
    expected = as_bytes(all_tensors(parts))
    at = 0
    for part in parts:
        want = expected[at + 1 + layer_id]
        for slot, row in zip(host_idx.tolist(), device_idx.tolist(), strict=True):
            want[row] = part.row(part.host.view(torch.uint8), host_layer, slot)
        at += 1 + len(part.devices)
    before = (fallbacks(), paths_taken())
    pool.load_to_device_per_layer(
        device_pool, host_idx, device_idx, layer_id, io_backend, is_draft=is_draft
    )
    after = as_bytes(all_tensors(parts))
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))
    assert fallbacks() == before[0]
    assert sum(paths_taken().values()) > sum(before[1].values()), "not served"


@ONLY_0_5_22
@pytest.mark.parametrize(
    ("layout", "io_backend"),
    [(layout, backend) for layout, backends in LAYOUT_BACKENDS.items() for backend in backends],
)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_0_5_22_draft_layers_follow_the_target_layers(
    transfer_hooks, small_mover, kind, layout, io_backend
):
    """An MTP draft pool's layer sits after the target's, on the host and in
    ``device_*_buffers``: SGLang loads it with ``is_draft`` and the draft's device pool,
    and backs it up with the target layers."""
    transfer_hooks()
    target, draft = _device_0_5_22(kind, LAYERS), _device_0_5_22(kind, 1)
    pool = _host_0_5_22(kind, target, layout, mtp_draft_device_pools=(draft,))
    assert pool.layer_num == LAYERS + 1
    for seed, layer in enumerate(range(LAYERS + 1)):
        is_draft = layer == LAYERS
        device_pool = draft if is_draft else target
        _check_load(kind, pool, device_pool, layer, layer, io_backend, seed, is_draft=is_draft)
    for seed in range(2):
        before = fallbacks()
        parts = components(kind, pool)
        assert all(len(part.devices) == LAYERS + 1 for part in parts)
        generator = torch.Generator().manual_seed(10 + seed)
        randomise(all_tensors(parts), generator)
        host_idx, device_idx = make_indices(kind, pool, "scattered", 150, generator)
        expected = as_bytes([part.host for part in parts])
        for want, part in zip(expected, parts, strict=True):
            for layer, device in enumerate(part.devices):
                for slot, row in zip(host_idx.tolist(), device_idx.tolist(), strict=True):
                    part.row(want, layer, slot).copy_(device.view(torch.uint8)[row])
        pool.backup_from_device_all_layer(target, host_idx, device_idx, io_backend)
        got = [part.host.view(torch.uint8) for part in parts]
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert fallbacks() == before


@ONLY_0_5_22
@pytest.mark.parametrize(
    ("layout", "io_backend"),
    [(layout, backend) for layout, backends in LAYOUT_BACKENDS.items() for backend in backends],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_0_5_22_layer_sharded_loads_map_owned_layers_to_host_layers(
    transfer_hooks, small_mover, monkeypatch, rank, layout, io_backend
):
    """A layer-sharded MLA device pool (a CP rank of a layer-split DSA model) keeps its
    ``kv_buffer`` list index-aligned; the host pool holds only the owned layers, first
    owned layer first. Loads of owned layers are served; the others copy nothing."""
    from sglang.srt.layers.cp.utils import get_layer_shard_range

    transfer_hooks()
    shards = 2
    device = _device_0_5_22("mla", LAYERS)
    owned = get_layer_shard_range(rank, shards, LAYERS)
    monkeypatch.setattr(device, "layer_shard_enabled", True, raising=False)
    monkeypatch.setattr(device, "layer_shard_size", shards, raising=False)
    monkeypatch.setattr(device, "_owned_local_layer_range", lambda: owned, raising=False)
    pool = _host_0_5_22("mla", device, layout)
    assert pool.layer_num == -(-LAYERS // shards)
    for layer in range(LAYERS):
        if owned[0] <= layer < owned[1]:
            _check_load(
                "mla", pool, device, layer, layer - owned[0], io_backend, layer, is_draft=False
            )
            continue
        parts = components("mla", pool)
        snapshot = as_bytes(all_tensors(parts))
        before = (fallbacks(), paths_taken())
        host_idx, device_idx = torch.arange(64), torch.arange(64, 128)
        pool.load_to_device_per_layer(device, host_idx, device_idx, layer, io_backend)
        after = as_bytes(all_tensors(parts))
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True))
        assert (fallbacks(), paths_taken()) == before


def test_a_kept_request_holds_neither_the_pool_nor_its_device_pool():
    import gc
    import weakref

    from kvcore.planning.path_policy import PathPolicy

    class Pool:  # stands in for a host pool SGLang drops (pinned buffers and all)
        pass

    requests = load_requests.LoadRequests()
    policy = PathPolicy()
    pool, device_pool = Pool(), Pool()
    host_idx, device_idx = torch.arange(4, 20), torch.arange(30, 46)
    kept = requests.start(pool, device_pool, host_idx, device_idx, "direct", False, policy)
    assert requests.latest(pool, device_pool) is kept
    assert kept.matches(pool, device_pool, host_idx, device_idx, "direct", False, policy)
    # Any other tensor, version, backend, draft flag or policy is a new request.
    others = [
        (host_idx.clone(), device_idx, "direct", False, policy),
        (host_idx, device_idx, "kernel", False, policy),
        (host_idx, device_idx, "direct", True, policy),
        (host_idx, device_idx, "direct", False, PathPolicy()),
    ]
    for other in others:
        assert not kept.matches(pool, device_pool, *other)
    host_idx.add_(1)
    assert not kept.matches(pool, device_pool, host_idx, device_idx, "direct", False, policy)

    alive = [weakref.ref(x) for x in (pool, device_pool)]
    del pool, device_pool, kept
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


# --- the warm-up when SGLang builds a host pool ----------------------------------------------


@pytest.fixture
def fresh_warm_up(monkeypatch) -> list[tuple[Any, int]]:
    """Every row size is warmed anew; the warm-ups run are recorded (device, row bytes)."""
    bench_adapter().warmed.clear()
    ran: list[tuple[Any, int]] = []
    real = pool_warm_up.warm_up

    def recorded(mover: Mover, device: Any, row_bytes: Any) -> Any:
        sizes = list(row_bytes)
        ran.extend((device, size) for size in sizes)
        return real(mover, device, sizes)

    monkeypatch.setattr(pool_warm_up, "warm_up", recorded)
    yield ran


def test_building_a_host_pool_warms_its_rows_once(transfer_hooks, small_mover, fresh_warm_up):
    transfer_hooks()
    before = METRICS.snapshot()["fallbacks"]
    mha = mha_host(TOKENS, PAGE, "layer_first", layers=LAYERS, heads=2)
    mha_host(TOKENS, PAGE, "page_first", layers=LAYERS, heads=2)  # same rows: warmed already
    mla = mla_host(TOKENS, PAGE, "layer_first", layers=LAYERS)
    mha_row, mla_row = (
        p.kv_buffer.shape[-2] * p.kv_buffer.shape[-1] * p.kv_buffer.element_size()
        for p in (mha, mla)
    )
    assert fresh_warm_up == [(torch.device("cpu"), mha_row), (torch.device("cpu"), mla_row)]
    assert METRICS.snapshot()["fallbacks"] == before  # warm-up copies are not counted
    for pool in (mha, mla):  # trusted: SGLang's calls still reach kvcore's hooks
        assert not {"load_to_device_per_layer", "backup_from_device_all_layer"} & set(vars(pool))


@pytest.mark.parametrize("outcome", ["wrong_bytes", "failed"])
def test_a_pool_whose_warm_up_went_wrong_runs_sglangs_own_copies(
    transfer_hooks, small_mover, fresh_warm_up, monkeypatch, outcome
):
    transfer_hooks()

    def untrustworthy(mover: Mover, device: Any, row_bytes: Any) -> Any:
        if outcome == "failed":
            raise RuntimeError("a kernel did not compile")
        return WarmUp(wrong=["h2d/gather/512B"])

    monkeypatch.setattr(pool_warm_up, "warm_up", untrustworthy)
    before = METRICS.snapshot()["fallbacks"].get(f"warm_up_{outcome}", 0)
    pool = mha_host(TOKENS, PAGE, "layer_first", layers=LAYERS, heads=2)
    for name in METHODS:
        bound = getattr(pool, name)
        assert bound.__func__ is STOCK[(MHATokenToKVPoolHost, name)]
    again = mha_host(TOKENS, PAGE, "layer_first", layers=LAYERS, heads=2)  # remembered
    assert getattr(again, METHODS[0]).__func__ is STOCK[(MHATokenToKVPoolHost, METHODS[0])]
    assert METRICS.snapshot()["fallbacks"][f"warm_up_{outcome}"] == before + 1
