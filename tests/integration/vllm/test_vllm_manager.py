"""kvcore's CPU offloading manager and spec against vLLM's own, on real vLLM classes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_support import SHAPE, Contiguity, run_churn, spec_args

from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.spec import KVCoreCPUOffloadingSpec

pytestmark = pytest.mark.vllm


def _keys(name: str, count: int) -> list[bytes]:
    return [make_offload_key(f"{name}{i}".encode(), 0) for i in range(count)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_churn_beside_stock_same_answers_and_fewer_runs(policy):
    stock, ours = Contiguity(), Contiguity()
    refused = evicted = failed = 0
    for seed in range(3):
        result = run_churn(seed, policy=policy, num_chunks=64, max_request_chunks=40, requests=300)
        for total, part in ((stock, result.stock), (ours, result.kvcore)):
            total.stores += part.stores
            total.one_run += part.one_run
            total.runs += part.runs
        refused += result.refused
        evicted += result.evicted
        failed += result.failed_stores
    # The workload reaches every branch: refused stores, evictions, failed stores.
    assert refused > 0 and evicted > 1000 and failed > 0
    assert stock.stores == ours.stores > 300
    assert ours.one_run_share > stock.one_run_share + 0.08
    assert ours.runs < 0.5 * stock.runs


def test_larger_pool_churn_is_more_contiguous():
    result = run_churn(0, num_chunks=256, requests=300, max_request_chunks=40)
    assert result.evicted > 1000
    assert result.kvcore.one_run_share > result.stock.one_run_share
    assert result.kvcore.runs < 0.75 * result.stock.runs


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    policy=st.sampled_from(["lru", "arc"]),
    num_chunks=st.integers(8, 96),
    max_request_chunks=st.integers(1, 48),
    fail_rate=st.sampled_from([0.0, 0.2, 0.6]),
    reset_rate=st.sampled_from([0.0, 0.05]),
)
def test_churn_answers_match_stock(
    seed, policy, num_chunks, max_request_chunks, fail_rate, reset_rate
):
    run_churn(
        seed,
        policy=policy,
        num_chunks=num_chunks,
        requests=60,
        documents=6,
        max_request_chunks=max_request_chunks,
        fail_rate=fail_rate,
        reset_rate=reset_rate,
    )


def test_fresh_pool_hands_each_store_one_ascending_run():
    manager = KVCoreCPUOffloadingManager(100, enable_events=True)
    expected_start = 0
    for number, size in enumerate([7, 1, 30, 12, 50]):
        ctx = ReqContext(req_id=f"r{number}")
        manager.on_new_request(ctx)
        output = manager.prepare_store(_keys(f"q{number}-", size), ctx)
        assert output is not None and output.evicted_keys == []
        ids = output.store_spec.block_ids
        assert ids.tolist() == list(range(expected_start, expected_start + size))
        expected_start += size
        manager.complete_store(output.keys_to_store, ctx)
    assert manager.allocator_stats.one_run_fraction == 1.0
    assert manager._get_num_free_chunks() == 0


def test_evicted_neighbours_merge_into_one_run():
    manager = KVCoreCPUOffloadingManager(12)
    for name in ("a", "b", "c"):
        ctx = ReqContext(req_id=name)
        output = manager.prepare_store(_keys(name, 4), ctx)
        manager.complete_store(output.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    ctx = ReqContext(req_id="d")
    output = manager.prepare_store(_keys("d", 8), ctx)
    # LRU evicts a and b, whose chunks 0-3 and 4-7 come back as one run of 8.
    assert sorted(output.evicted_keys) == sorted(_keys("a", 4) + _keys("b", 4))
    assert output.store_spec.block_ids.tolist() == list(range(8))


def test_failed_store_returns_its_chunks():
    manager = KVCoreCPUOffloadingManager(10)
    ctx = ReqContext(req_id="r")
    output = manager.prepare_store(_keys("x", 6), ctx)
    manager.complete_store(output.keys_to_store, ctx, success=False)
    assert manager._get_num_free_chunks() == 10
    output = manager.prepare_store(_keys("y", 10), ReqContext(req_id="s"))
    assert output.store_spec.block_ids.tolist() == list(range(10))
    assert manager._allocator.page_used.numpy().all()


def test_reset_cache_frees_every_chunk():
    managers = [CPUOffloadingManager(16), KVCoreCPUOffloadingManager(16)]
    for manager in managers:
        ctx = ReqContext(req_id="r")
        output = manager.prepare_store(_keys("x", 9), ctx)
        manager.complete_store(output.keys_to_store[:4], ctx, success=False)
        manager.reset_cache()
        assert getattr(manager, SHAPE.name("_get_num_free_chunks"))() == 16
        output = manager.prepare_store(_keys("x", 16), ReqContext(req_id="s"))
        assert output.store_spec.block_ids.tolist() == list(range(16))
    stock, ours = managers
    assert ours._allocator.page_used.numpy().all()
    assert ours.get_stats().data == stock.get_stats().data


def test_chunks_freed_onto_stocks_free_list_return_to_the_pool():
    """A subclass may free chunks onto stock's free list itself (vLLM 0.34's tiering manager
    releases its deferred writes so): kvcore's pool takes them back, counted as stock counts
    them."""
    managers = [CPUOffloadingManager(8), KVCoreCPUOffloadingManager(8)]
    handed_out = []
    for manager in managers:
        ctx = ReqContext(req_id="r")
        output = manager.prepare_store(_keys("x", 6), ctx)
        manager.complete_store(output.keys_to_store, ctx)
        manager._free_list += [4, 5]
        assert getattr(manager, SHAPE.name("_get_num_free_chunks"))() == 4
        handed_out.append(manager.get_stats().data)
        output = manager.prepare_store(_keys("y", 4), ReqContext(req_id="s"))
        assert output is not None and output.evicted_keys == []
        assert sorted(output.store_spec.block_ids.tolist()) == [4, 5, 6, 7]
        assert getattr(manager, SHAPE.name("_get_num_free_chunks"))() == 0
    assert handed_out[0] == handed_out[1]
    assert managers[1]._allocator.page_used.numpy().all()


@pytest.mark.parametrize(
    "extra",
    [
        {"cpu_bytes_to_use": 1 << 20},
        {
            "cpu_bytes_to_use": 3 << 20,
            "eviction_policy": "arc",
            "store_threshold": 2,
            "max_tracker_size": 10,
        },
    ],
)
def test_spec_builds_the_stock_manager_settings(extra):
    ours = KVCoreCPUOffloadingSpec(*spec_args(extra)).get_manager()
    stock = CPUOffloadingSpec(*spec_args(extra)).get_manager()
    assert isinstance(ours, KVCoreCPUOffloadingManager)
    assert type(stock) is not type(ours)
    pool_size = getattr(stock, SHAPE.name("_num_chunks"))
    assert getattr(ours, SHAPE.name("_num_chunks")) == pool_size > 0
    assert ours._allocator.size == pool_size
    assert type(ours._policy) is type(stock._policy)
    assert ours.store_threshold == stock.store_threshold
    assert ours.max_tracker_size == stock.max_tracker_size
    assert (ours.events is None) == (stock.events is None)
    assert (ours.counts is None) == (stock.counts is None)
    if hasattr(stock, "config_info"):  # vLLM 0.33 on
        assert list(ours.config_info()) == list(stock.config_info())
    assert ours.get_stats().data == stock.get_stats().data


def test_allocation_is_exact_under_random_sizes():
    rng = np.random.default_rng(7)
    manager = KVCoreCPUOffloadingManager(50)
    for number in range(200):
        size = int(rng.integers(1, 51))
        ctx = ReqContext(req_id=f"r{number}")
        output = manager.prepare_store(_keys(f"k{number}-", size), ctx)
        assert output is not None
        ids = output.store_spec.block_ids
        assert len(set(ids.tolist())) == size and ids.min() >= 0 and ids.max() < 50
        manager.complete_store(output.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        live = len(getattr(manager._policy, SHAPE.name("chunks")))
        held = int(manager._allocator.page_used.numpy().sum())
        assert held == live + len(manager._released)
        assert getattr(manager, SHAPE.name("_num_allocated_chunks")) == live
        assert getattr(manager, SHAPE.name("_get_num_free_chunks"))() == 50 - live
