"""HostKVCache's allocator through kvcore against SGLang's own, on real SGLang host pools."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import (
    HiSparseMHATokenToKVPoolHost,
    MHATokenToKVPoolHost,
)
from sglang_pools import BUILDERS, mha_host

from kvcore.churn import make_trace, replay
from kvcore.runs import find_runs
from kvcore_sglang import host_slots

pytestmark = pytest.mark.sglang

PAGE = 16


def stock_and_patched(sglang_hooks, build):
    """The same pool twice: built before the hooks (stock) and after them (kvcore)."""
    stock = build()
    sglang_hooks()
    patched = build()
    assert host_slots.slots_of(stock) is None
    assert host_slots.slots_of(patched) is not None
    return stock, patched


def test_churn_matches_stock_step_by_step_and_is_contiguous(sglang_hooks):
    stock, patched = stock_and_patched(sglang_hooks, lambda: mha_host(8192, 1))
    trace = make_trace(stock.size, mixed_ops=3000, max_occupancy=0.75, seed=1)
    live: dict[int, torch.Tensor] = {}

    def no_slot_twice(step, pool):
        # Every allocation still live is disjoint from the others and in range.
        if step % 500 == 0 and live:
            held = torch.cat(list(live.values()))
            assert held.unique().numel() == held.numel()

    stock_result = replay(trace, stock)
    patched_result = replay(trace, patched, after_each=no_slot_twice)

    assert not all(stock_result.outcomes), "the trace should contain refused allocations"
    assert patched_result.outcomes == stock_result.outcomes
    assert patched_result.available == stock_result.available
    assert patched_result.one_run_fraction >= 0.95
    assert patched_result.one_run_fraction > stock_result.one_run_fraction + 0.3


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_every_served_pool_kind_matches_stock(sglang_hooks, kind):
    page = 64 if kind == "dsa" else PAGE
    stock, patched = stock_and_patched(sglang_hooks, lambda: BUILDERS[kind](2048, page))
    assert type(stock) is type(patched)
    trace = make_trace(stock.size, page_size=page, mixed_ops=400, seed=7)
    stock_result = replay(trace, stock)
    patched_result = replay(trace, patched)
    assert patched_result.outcomes == stock_result.outcomes
    assert patched_result.available == stock_result.available
    assert patched_result.one_run_fraction >= stock_result.one_run_fraction


def test_alloc_contract(sglang_hooks):
    sglang_hooks()
    pool = mha_host(1024, PAGE)
    size = pool.size
    with pytest.raises(AssertionError, match="multiple of the page size"):
        pool.alloc(PAGE + 1)
    assert pool.available_size() == size
    assert pool.alloc(size + PAGE) is None
    assert pool.available_size() == size
    first = pool.alloc(3 * PAGE)
    assert first.dtype == torch.int64 and first.device.type == "cpu"
    assert first.tolist() == list(range(3 * PAGE))
    assert pool.available_size() == size - 3 * PAGE
    assert pool.alloc(size - 2 * PAGE) is None
    rest = pool.alloc(size - 3 * PAGE)
    assert rest is not None and pool.available_size() == 0
    assert pool.alloc(PAGE) is None
    assert pool.alloc(0).numel() == 0
    everything = torch.cat([first, rest]).sort().values
    assert torch.equal(everything, torch.arange(size))


def test_free_contract_and_messages_match_stock(sglang_hooks):
    stock, patched = stock_and_patched(sglang_hooks, lambda: mha_host(1024, PAGE))
    messages = []
    for pool in (stock, patched):
        slots = pool.alloc(4 * PAGE)
        assert pool.free(slots[PAGE : 2 * PAGE]) == PAGE
        assert pool.free(torch.empty(0, dtype=torch.int64)) == 0
        with pytest.raises(AssertionError, match="Double-free detected") as caught:
            pool.free(slots[: 2 * PAGE])
        messages.append(str(caught.value))
        # The refused free changed nothing.
        assert pool.available_size() == pool.size - 3 * PAGE
        assert pool.free(slots[:PAGE]) == PAGE
    assert messages[0] == messages[1]
    assert str(list(range(PAGE, 2 * PAGE))) in messages[1]


def test_freed_slots_come_back_as_one_run(sglang_hooks):
    sglang_hooks()
    pool = mha_host(1024, PAGE)
    pages = [pool.alloc(PAGE) for _ in range(8)]
    for index in (1, 3, 2):
        pool.free(pages[index])
    again = pool.alloc(3 * PAGE)
    assert find_runs(again).count == 1
    assert again.tolist() == list(range(PAGE, 4 * PAGE))


def test_clear_frees_everything(sglang_hooks):
    sglang_hooks()
    pool = mha_host(1024, PAGE)
    slots = pool.alloc(8 * PAGE)
    pool.clear()
    assert pool.available_size() == pool.size
    with pytest.raises(AssertionError, match="Double-free detected"):
        pool.free(slots)
    assert pool.alloc(pool.size) is not None


def test_alloc_and_free_hold_the_pool_lock(sglang_hooks):
    sglang_hooks()
    pool = mha_host(1024, PAGE)
    slots = pool.alloc(PAGE)
    done = []
    calls = [lambda: done.append(pool.alloc(PAGE)), lambda: done.append(pool.free(slots))]
    for call in calls:
        with pool.lock:
            worker = threading.Thread(target=call)
            worker.start()
            worker.join(timeout=0.2)
            assert worker.is_alive(), "the call ran while another thread held pool.lock"
        worker.join(timeout=5)
        assert not worker.is_alive()
    assert len(done) == 2 and done[1] == PAGE


def test_served_and_stock_pool_classes(monkeypatch):
    assert host_slots.is_served(MHATokenToKVPoolHost)
    assert not host_slots.is_served(HiSparseMHATokenToKVPoolHost)
    assert not host_slots.is_served(MambaPoolHost)

    class OwnAlloc(MHATokenToKVPoolHost):
        def alloc(self, need_size):
            return None

    name = f"{OwnAlloc.__module__}.{OwnAlloc.__qualname__}"
    monkeypatch.setattr(host_slots, "SERVED_POOLS", host_slots.SERVED_POOLS | {name})
    assert not host_slots.is_served(OwnAlloc), "a class overriding alloc must stay stock"
    assert host_slots._defining_class(OwnAlloc, "free") is HostKVCache
