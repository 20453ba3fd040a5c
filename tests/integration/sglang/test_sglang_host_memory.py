"""SGLang's default host allocation through kvcore's hook (kvcore_sglang.host_memory), on CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed")
pytestmark = pytest.mark.sglang

from sglang.srt.mem_cache.pool_host import common  # noqa: E402
from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator  # noqa: E402
from sglang_pools import mha_host, mla_host  # noqa: E402

from kvcore import host_mapping  # noqa: E402
from kvcore.metrics import METRICS  # noqa: E402
from kvcore_sglang import guard, host_memory, host_memory_choice  # noqa: E402
from tests.support.resident import resident_pages  # noqa: E402

DIMS = (2, 3, 37, 4, 16)  # not a whole number of pages: the mapping is exactly its bytes


def _mapping_line(address: int) -> str:
    """The /proc/self/maps line of the mapping that holds ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if start <= address < end:
            return line
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def mapped_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The dims of every buffer kvcore's mapping made during the test."""
    calls: list[tuple[int, ...]] = []
    made = host_memory.mapped_pool_tensor

    def counted(dims: tuple[int, ...], dtype: torch.dtype, **kwargs: Any) -> torch.Tensor:
        calls.append(tuple(dims))
        return made(dims, dtype, **kwargs)

    monkeypatch.setattr(host_memory, "mapped_pool_tensor", counted)
    return calls


@pytest.fixture
def hooked(sglang_hooks: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plugin's hooks applied with the host pool on and the transfers off."""
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")
    monkeypatch.delenv("KVCORE_HOST_POOL", raising=False)
    for name in host_memory_choice.SGLANG_CHOICES:
        monkeypatch.delenv(name, raising=False)
    yield sglang_hooks()


def test_the_default_allocation_is_kvcores_mapping_as_stock_makes_it(hooked, mapped_calls):
    assert guard.HOST_MEMORY_TARGET in hooked.patched_targets
    allocator = HostTensorAllocator()
    tensor = allocator.allocate(DIMS, dtype=torch.bfloat16, device="cpu")
    stock = common.alloc_mmap(DIMS, torch.bfloat16)
    assert mapped_calls == [DIMS]
    assert tensor.shape == stock.shape and tensor.dtype == stock.dtype
    assert (allocator.dims, allocator.dtype) == (DIMS, torch.bfloat16)
    assert torch.equal(tensor, stock) and not tensor.any()
    # The same kind of mapping as SGLang's: shared, anonymous, read-write.
    for made in (tensor, stock):
        perms = _mapping_line(made.data_ptr()).split()[1]
        assert perms == "rw-s", perms
    resident, pages = resident_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    assert resident == pages
    # It holds what is written, as any host pool buffer must.
    data = torch.randn(DIMS, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    tensor.copy_(data)
    assert torch.equal(tensor, data)


def test_a_large_buffer_is_spread_over_several_files(hooked, mapped_calls, monkeypatch):
    # Pools of 2 GiB and more: here a few pages stand in, the count forced to three.
    monkeypatch.setattr(host_mapping, "segment_count", lambda nbytes: 3)
    tensor = HostTensorAllocator().allocate(DIMS, dtype=torch.bfloat16, device="cpu")
    nbytes = tensor.numel() * tensor.element_size()
    maps = Path("/proc/self/maps").read_text()
    assert maps.count("kvcore-host-pool") >= 3
    assert _mapping_line(tensor.data_ptr()).split()[1] == "rw-s"
    resident, pages = resident_pages(tensor.data_ptr(), nbytes)
    assert not tensor.any() and resident == pages
    data = torch.randn(DIMS, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    tensor.copy_(data)
    assert torch.equal(tensor, data)


def test_sglangs_pools_are_built_on_kvcores_mapping_and_hold_their_rows(hooked, mapped_calls):
    mha = mha_host(64, 16)
    mla = mla_host(64, 16)
    buffers = [mha.kv_buffer, mla.kv_buffer]
    assert [tuple(b.shape) for b in buffers] == mapped_calls
    for buffer in buffers:
        rows = torch.randn(buffer.shape, generator=torch.Generator().manual_seed(3))
        buffer.copy_(rows.to(buffer.dtype))
        assert torch.equal(buffer, rows.to(buffer.dtype))


class _BackendAllocator(HostTensorAllocator):
    """A storage backend's allocator that keeps the default allocation."""


@pytest.mark.parametrize(
    "case",
    ["subclass", "device", "SGLANG_HUGEPAGE_SIZE", "SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS"],
)
def test_sglangs_own_allocation_where_it_is_not_the_default_one(
    hooked, mapped_calls, monkeypatch, case
):
    allocator: HostTensorAllocator = HostTensorAllocator()
    device = "cpu"
    if case == "subclass":
        allocator = _BackendAllocator()
    elif case == "device":
        device = "cuda"
    else:
        # Values SGLang takes as its own path; the hugepage one falls back to plain pages
        # here, with one logged line, as it does on a host without hugepages.
        monkeypatch.setenv(case, "2MB" if case == "SGLANG_HUGEPAGE_SIZE" else "2")
    if case == "device":
        with pytest.raises(AssertionError, match="only supports CPU"):
            allocator.allocate(DIMS, dtype=torch.float16, device=device)
    else:
        tensor = allocator.allocate(DIMS, dtype=torch.float16, device=device)
        assert tensor.shape == DIMS and not tensor.any()
    assert mapped_calls == []


def test_a_failed_mapping_leaves_the_allocation_to_sglang_counted(hooked, monkeypatch):
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory, "faulted_memory", refused)
    before = METRICS.snapshot()["fallbacks"].get("host_pool_stock:OSError", 0)
    tensor = HostTensorAllocator().allocate(DIMS, dtype=torch.float32, device="cpu")
    assert tensor.shape == DIMS and not tensor.any()
    assert METRICS.snapshot()["fallbacks"]["host_pool_stock:OSError"] == before + 1


def test_kvcore_host_pool_off_leaves_the_allocation_unhooked(sglang_hooks, monkeypatch):
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")
    monkeypatch.setenv("KVCORE_HOST_POOL", "0")
    original = vars(HostTensorAllocator)["allocate"]
    status = sglang_hooks()
    assert guard.HOST_MEMORY_TARGET not in status.patched_targets
    assert vars(HostTensorAllocator)["allocate"] is original


def test_doctor_names_the_host_pool_group_and_its_switch(monkeypatch):
    import kvcore_sglang

    monkeypatch.setenv("KVCORE_ENABLE", "sglang")
    monkeypatch.setenv("KVCORE_HOST_POOL", "0")
    found = kvcore_sglang.status()
    assert found.settings["host_pool"] is False
    assert found.groups_off[guard.HOST_MEMORY_GROUP] == "KVCORE_HOST_POOL=0"
    assert guard.HOST_MEMORY_TARGET not in found.would_patch
    monkeypatch.setenv("KVCORE_HOST_POOL", "1")
    found = kvcore_sglang.status()
    assert found.settings["host_pool"] is True
    assert guard.HOST_MEMORY_TARGET in found.would_patch


def test_a_patched_source_hooks_the_allocation_under_kvcore_host_pool(
    hooks_recorded_apart, monkeypatch, mapped_calls
):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvcore_sglang import patched

    stock = vars(HostTensorAllocator)["allocate"]
    saved = set(HookRegistry._patched)
    HookRegistry._patched.clear()  # a patched lane's import claimed the targets already
    try:
        monkeypatch.delenv("KVCORE_ENABLE", raising=False)
        monkeypatch.setenv("KVCORE_HOST_POOL", "0")
        assert patched.hook(guard.HOST_MEMORY_TARGET, stock) is stock
        monkeypatch.setenv("KVCORE_HOST_POOL", "1")
        hooked = patched.hook(guard.HOST_MEMORY_TARGET, stock)
        assert getattr(hooked, patched.PATCH_MARK) == guard.HOST_MEMORY_TARGET
        assert guard.HOST_MEMORY_TARGET in HookRegistry._patched
        tensor = hooked(HostTensorAllocator(), DIMS, dtype=torch.bfloat16, device="cpu")
        assert mapped_calls == [DIMS] and tensor.shape == DIMS and not tensor.any()
    finally:
        HookRegistry._patched.clear()
        HookRegistry._patched.update(saved)


@pytest.mark.parametrize(
    ("environ", "choice"),
    [
        ({}, None),
        ({"SGLANG_HUGEPAGE_SIZE": " "}, None),
        ({"SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS": "0"}, None),
        ({"SGLANG_HUGEPAGE_SIZE": "1GB"}, "SGLANG_HUGEPAGE_SIZE"),
        (
            {"SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS": "8"},
            "SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS",
        ),
    ],
)
def test_sglangs_own_settings_that_keep_its_allocation(environ, choice):
    assert host_memory_choice.sglang_choice(environ) == choice
