"""HostKVCache's allocator through kvcore against SGLang's own, on real SGLang host pools."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

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

from kvcore.bench.churn import make_trace, replay
from kvcore.runs import find_runs
from kvcore_sglang import host_slots

pytestmark = pytest.mark.sglang

PAGE = 16
STATE_STEPS = 300


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


def assert_public_state(
    stock: HostKVCache, served: HostKVCache, held: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Each pool's stock public state says exactly what it holds for the trace."""
    size = stock.logical_size
    assert served.logical_size == size
    assert served.available_size() == stock.available_size()
    for pool, slots in ((stock, [a for a, _ in held]), (served, [b for _, b in held])):
        held_mask = torch.zeros(size, dtype=torch.bool)
        if slots:
            held_mask[torch.cat(slots)] = True
        free = torch.cat([pool.free_slots, *pool.release_slots])
        assert pool.free_slots.dtype == free.dtype == torch.int64
        assert len(pool.free_slots) + pool.num_release_slots == len(free) == pool.available_size()
        free_mask = torch.zeros(size, dtype=torch.bool)
        free_mask[free] = True
        assert int(free_mask.sum()) == len(free), "a slot is listed free twice"
        assert torch.equal(free_mask, ~held_mask)
        assert torch.equal(pool.slot_used, held_mask)
    assert served.mem_state.device == stock.mem_state.device
    assert served.mem_state.dtype == stock.mem_state.dtype
    assert torch.equal(served.mem_state, stock.mem_state)


@pytest.mark.parametrize(
    ("kind", "page"),
    [(kind, 64 if kind == "dsa" else PAGE) for kind in sorted(BUILDERS)] + [("mha", 1)],
)
def test_public_state_matches_stock_after_every_step(sglang_hooks, kind, page):
    """One seeded trace of allocs (some refused), frees of random pages of live
    allocations and clears, through a stock pool and a served one, checking
    ``available_size``, ``free_slots`` + ``release_slots``, ``num_release_slots``,
    ``slot_used`` and ``mem_state`` after every step.

    The two pools hand out different slots in a different order on purpose (kvcore
    contiguous runs, stock the head of its free list), so the free slots are compared
    as sets: each pool's with the complement of the slots it holds for the trace,
    and ``slot_used`` with those slots; across the pools the counts must be equal.
    """
    stock, served = stock_and_patched(sglang_hooks, lambda: BUILDERS[kind](1024, page))
    pages = stock.logical_size // page
    rng = random.Random(f"{kind}-{page}")
    # Per live allocation: the stock pool's slots and the served pool's.
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    cleared = refused = 0
    for _ in range(STATE_STEPS):
        roll = rng.random()
        if roll < 0.03:
            stock.clear()
            served.clear()
            held.clear()
            cleared += 1
        elif roll < 0.55 or not held:
            need = page * rng.randint(0, pages // 3)
            a, b = stock.alloc(need), served.alloc(need)
            assert (a is None) == (b is None)
            if a is None:
                refused += 1
            elif need:
                assert len(a) == len(b) == need
                held.append((a, b))
        else:
            a, b = held.pop(rng.randrange(len(held)))
            order = list(range(len(a) // page))
            rng.shuffle(order)
            cut = rng.randint(1, len(order))

            def pages_of(slots: torch.Tensor, chosen: list[int]) -> torch.Tensor:
                return torch.cat([slots[p * page : (p + 1) * page] for p in chosen])

            freed = order[:cut]
            assert stock.free(pages_of(a, freed)) == served.free(pages_of(b, freed)) == cut * page
            if cut < len(order):
                kept = order[cut:]
                held.append((pages_of(a, kept), pages_of(b, kept)))
        assert_public_state(stock, served, held)
    assert cleared and refused, "the trace should clear the pools and refuse allocations"


ERROR_CASES: dict[str, Callable[[HostKVCache, torch.Tensor], object]] = {
    "unaligned alloc": lambda pool, slots: pool.alloc(PAGE + 1),
    "double free": lambda pool, slots: pool.free(slots[: 2 * PAGE]),
    "free never allocated": lambda pool, slots: pool.free(torch.tensor([pool.size - 1])),
    "free past the end": lambda pool, slots: pool.free(torch.tensor([pool.size + 3])),
    "free before the start": lambda pool, slots: pool.free(torch.tensor([-pool.size - 1])),
    "free float slots": lambda pool, slots: pool.free(slots[PAGE:].float()),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_errors_match_stock(sglang_hooks, case):
    stock, served = stock_and_patched(sglang_hooks, lambda: mha_host(1024, PAGE))
    errors = []
    for pool in (stock, served):
        slots = pool.alloc(4 * PAGE)
        assert pool.free(slots[:PAGE]) == PAGE
        used = pool.slot_used.clone()
        with pytest.raises(Exception) as caught:
            ERROR_CASES[case](pool, slots)
        errors.append((type(caught.value), str(caught.value)))
        # The refused call changed nothing.
        assert pool.available_size() == pool.size - 3 * PAGE
        assert torch.equal(pool.slot_used, used)
    assert errors[0] == errors[1]


@pytest.mark.parametrize("flagged_in", ["slot_used", "allocator"])
def test_double_alloc_matches_stock(sglang_hooks, flagged_in):
    """Pages 2 and 5 flagged allocated behind the free list's back: in ``slot_used``
    on both pools, or in kvcore's own used map on the served one. Allocating the whole
    pool hands them out again; both raise stock's assertion, naming the same slots."""
    stock, served = stock_and_patched(sglang_hooks, lambda: mha_host(1024, PAGE))
    flagged = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (2, 5)])
    stock.slot_used[flagged] = True
    if flagged_in == "slot_used":
        served.slot_used[flagged] = True
    else:
        host_slots.slots_of(served).page_used[[2, 5]] = True
    errors = []
    for pool in (stock, served):
        used = pool.slot_used.clone()
        with pytest.raises(AssertionError) as caught:
            pool.alloc(pool.size)
        errors.append(str(caught.value))
        # As stock: the slots picked have left the free list, slot_used is unchanged.
        assert pool.available_size() == 0
        assert len(pool.free_slots) + pool.num_release_slots == 0
        assert torch.equal(pool.slot_used, used)
    assert errors[0] == errors[1]
    assert errors[1] == f"Double-alloc detected: slots already allocated: {flagged.tolist()}."


@pytest.mark.parametrize(
    ("make_slots", "match"),
    [
        (lambda slots: torch.cat([slots[:PAGE], slots[:PAGE]]), "listed more than once"),
        (lambda slots: slots[: PAGE // 2], "not whole pages"),
    ],
    ids=["a page twice", "half a page"],
)
def test_frees_stock_would_corrupt_its_free_list_with_are_refused(sglang_hooks, make_slots, match):
    """Stock takes these and lists slots free twice, or splits a page; the served pool
    refuses them with the allocator's ValueError and changes nothing."""
    sglang_hooks()
    pool = mha_host(1024, PAGE)
    slots = pool.alloc(4 * PAGE)
    used = pool.slot_used.clone()
    free = set(pool.free_slots.tolist())
    with pytest.raises(ValueError, match=match):
        pool.free(make_slots(slots))
    assert pool.available_size() == pool.size - 4 * PAGE
    assert torch.equal(pool.slot_used, used)
    assert set(pool.free_slots.tolist()) == free
