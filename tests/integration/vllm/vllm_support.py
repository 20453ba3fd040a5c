"""Helpers for the vLLM tests: a small offloading config, and a churn driver.

The driver runs vLLM's stock CPU offloading manager and kvcore's through the same churn.

Each request looks up a prefix of one of a few shared documents, loads the hit prefix,
stores the rest, and completes its loads and stores later, some stores failing. Both
managers see the same calls in the same order; every answer they give that vLLM can
observe is compared, and the chunk ids each one hands out are checked for exclusivity.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.releases import installed_shape

SHAPE = installed_shape()
"""The installed release's names (kvcore_vllm.releases): tests spell 0.33's through it."""


def name(current: str) -> str:
    """The installed release's name for what vLLM 0.33 calls ``current``."""
    return SHAPE.name(current)


SHARED_REGION_ONLY = pytest.mark.skipif(
    SHAPE.worker_pins_each_tensor,
    reason="this vLLM's worker pins each KV tensor; it maps no shared region (0.25.1)",
)
"""For tests of vLLM's shared CPU-tier region (0.32 and later)."""


def shared_region(chunks: int, chunk_bytes: int) -> Any:
    """One worker's shared region of ``chunks`` rows of ``chunk_bytes``, by vLLM's own class,
    as its spec builds it on a GPU (a fresh engine id: its files are its own)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    return SharedOffloadRegion(
        engine_id=f"kvcore-test-{uuid.uuid4().hex}",
        num_chunks=chunks,
        rank=0,
        kv_bytes_per_chunk=chunk_bytes,
        cpu_page_size=chunk_bytes,
        barrier=None,
    )


def second_workers_region(chunks: int, slot_bytes: int) -> Any:
    """The region of the second of two workers, by vLLM's own class: each row holds the two
    workers' slots of ``slot_bytes`` (a fresh engine id: its files are its own)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    return SharedOffloadRegion(
        engine_id=f"kvcore-test-{uuid.uuid4().hex}",
        num_chunks=chunks,
        rank=1,
        kv_bytes_per_chunk=2 * slot_bytes,
        cpu_page_size=slot_bytes,
        barrier=None,
    )


def spec_args(extra: dict[str, Any]) -> tuple[Any, ...]:
    """What a spec's constructor takes on the installed release, for the setup of
    :func:`offloading_config`; vLLM 0.25 takes its engine and KV cache configs, of which
    stand-ins carry only the fields its spec reads."""
    try:
        import vllm.v1.kv_offload.config  # noqa: F401
    except ModuleNotFoundError:
        return _engine_configs(extra)
    return (offloading_config(extra),)


def spec_selection(extra: dict[str, Any]) -> Any:
    """What the spec factory's get_spec_cls reads ``extra`` from on the installed release:
    the extra config itself, or (vLLM 0.25) an engine config that holds it."""
    args = spec_args(extra)
    return extra if len(args) == 1 else args[0]


def _engine_configs(extra: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM 0.25's (VllmConfig, KVCacheConfig) for one worker, one group of 16-token
    blocks, 2 blocks an offloaded block, 4 KiB a block (1 GiB of GPU blocks)."""
    parallel = SimpleNamespace(
        world_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"block_size": 32, **extra}),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=True),
        parallel_config=parallel,
        cache_config=SimpleNamespace(block_size=16),
    )
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))
    num_blocks = 1 << 18
    kv_cache_config = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[SimpleNamespace(size=4096 * num_blocks, block_stride=0)],
        kv_cache_groups=[group],
    )
    return vllm_config, kv_cache_config


def offloading_config(extra: dict[str, Any]) -> Any:
    """One worker, one group of 16-token blocks, 2 blocks a chunk, 4 KiB a block
    (vLLM 0.32 on)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id="e0",
        model=OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


@dataclass
class Contiguity:
    """How the chunk ids of multi-chunk stores were laid out."""

    stores: int = 0
    one_run: int = 0
    runs: int = 0

    def add(self, ids: np.ndarray) -> None:
        if len(ids) < 2:
            return
        self.stores += 1
        breaks = int(np.count_nonzero(np.diff(ids.astype(np.int64)) != 1))
        self.runs += breaks + 1
        self.one_run += breaks == 0

    @property
    def one_run_share(self) -> float:
        return self.one_run / self.stores if self.stores else 1.0


@dataclass
class ChurnResult:
    stock: Contiguity = field(default_factory=Contiguity)
    kvcore: Contiguity = field(default_factory=Contiguity)
    stores: int = 0
    refused: int = 0
    evicted: int = 0
    failed_stores: int = 0


@dataclass
class _Pending:
    loads: list[list[bytes]] = field(default_factory=list)
    stores: list[list[bytes]] = field(default_factory=list)


class _Side:
    """One manager with the chunk ids it holds, as the test sees them."""

    def __init__(self, manager: CPUOffloadingManager) -> None:
        self.manager = manager
        self.contiguity = Contiguity()

    def live_ids(self, keys: set[bytes]) -> list[int]:
        ids = []
        for key in keys:
            chunk = self.manager._policy.get(key)
            assert chunk is not None, key
            ids.append(getattr(chunk, name("chunk_id")))
        return ids


def run_churn(
    seed: int,
    *,
    policy: str = "lru",
    num_chunks: int = 256,
    requests: int = 400,
    documents: int = 12,
    max_request_chunks: int = 40,
    fail_rate: float = 0.1,
    reset_rate: float = 0.0,
) -> ChurnResult:
    rng = random.Random(seed)
    stock = _Side(CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True))
    ours = _Side(KVCoreCPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True))
    sides = (stock, ours)
    result = ChurnResult(stock=stock.contiguity, kvcore=ours.contiguity)
    live: set[bytes] = set()
    in_flight: list[tuple[str, list[bytes], list[ReqContext]]] = []
    finished_pending: list[list[ReqContext]] = []

    for number in range(requests):
        if reset_rate and rng.random() < reset_rate:
            _drain(rng, in_flight, sides, live, result, fail_rate, everything=True)
            for side in sides:
                side.manager.reset_cache()
            live.clear()
            in_flight.clear()
            finished_pending.clear()
        doc = rng.randrange(documents)
        length = rng.randint(1, max_request_chunks)
        keys = [make_offload_key(f"d{doc}b{i}".encode(), 0) for i in range(length)]
        contexts = [ReqContext(req_id=f"r{number}") for _ in sides]
        for ctx in contexts:
            # vLLM 0.25's contexts hold no key positions.
            for position, key in enumerate(keys):
                if hasattr(ctx, "set_offload_key_position"):
                    ctx.set_offload_key_position(key, (position + 1) * 16)
        for side, ctx in zip(sides, contexts, strict=True):
            side.manager.on_new_request(ctx)

        lookups = [
            [side.manager.lookup(key, ctx) for key in keys]
            for side, ctx in zip(sides, contexts, strict=True)
        ]
        assert lookups[0] == lookups[1]
        hits = 0
        while hits < length and lookups[0][hits] == LookupResult.HIT:
            hits += 1
        if hits:
            loaded = keys[:hits]
            for side, ctx in zip(sides, contexts, strict=True):
                side.manager.prepare_load(loaded, ctx)
                # 0.34 has no touch: its policies learn of reuse when the request ends.
                if hasattr(side.manager, "touch"):
                    side.manager.touch(loaded, ctx)
            in_flight.append(("load", loaded, contexts))

        to_store = [k for k, r in zip(keys, lookups[0], strict=True) if r == LookupResult.MISS]
        if to_store:
            outputs = [
                side.manager.prepare_store(to_store, ctx)
                for side, ctx in zip(sides, contexts, strict=True)
            ]
            _compare_store_outputs(outputs)
            if outputs[0] is None:
                result.refused += 1
            else:
                result.stores += 1
                result.evicted += len(outputs[0].evicted_keys)
                live.difference_update(outputs[0].evicted_keys)
                live.update(outputs[0].keys_to_store)
                for side, output in zip(sides, outputs, strict=True):
                    side.contiguity.add(output.store_spec.block_ids)
                if outputs[0].keys_to_store:
                    in_flight.append(("store", list(outputs[0].keys_to_store), contexts))
        finished_pending.append(contexts)

        _drain(rng, in_flight, sides, live, result, fail_rate, everything=False)
        while len(finished_pending) > 4:
            for side, ctx in zip(sides, finished_pending.pop(0), strict=True):
                side.manager.on_request_finished(ctx)
        _compare_state(sides, live)

    _drain(rng, in_flight, sides, live, result, fail_rate, everything=True)
    _compare_state(sides, live)
    return result


def _drain(
    rng: random.Random,
    in_flight: list[tuple[str, list[bytes], list[ReqContext]]],
    sides: tuple[_Side, _Side],
    live: set[bytes],
    result: ChurnResult,
    fail_rate: float,
    *,
    everything: bool,
) -> None:
    """Complete some (or all) transfers in flight, in random order."""
    rng.shuffle(in_flight)
    keep = 0 if everything else rng.randint(0, min(3, len(in_flight)))
    while len(in_flight) > keep:
        kind, keys, contexts = in_flight.pop()
        if kind == "load":
            for side, ctx in zip(sides, contexts, strict=True):
                side.manager.complete_load(keys, ctx)
            continue
        success = rng.random() >= fail_rate
        for side, ctx in zip(sides, contexts, strict=True):
            side.manager.complete_store(keys, ctx, success=success)
        if not success:
            result.failed_stores += 1
            live.difference_update(keys)


def _compare_store_outputs(outputs: list[Any]) -> None:
    stock, ours = outputs
    assert (stock is None) == (ours is None)
    if stock is None:
        return
    assert stock.keys_to_store == ours.keys_to_store
    assert stock.evicted_keys == ours.evicted_keys


def _compare_state(sides: tuple[_Side, _Side], live: set[bytes]) -> None:
    stock, ours = sides
    events = [list(side.manager.take_events()) for side in sides]
    assert events[0] == events[1]
    stats = [side.manager.get_stats().data for side in sides]
    assert stats[0] == stats[1]
    free = name("_get_num_free_chunks")
    assert getattr(stock.manager, free)() == getattr(ours.manager, free)()
    for side in sides:
        ids = side.live_ids(live)
        assert len(set(ids)) == len(ids), "a chunk id is held by two keys"
        assert all(0 <= i < getattr(side.manager, name("_num_chunks")) for i in ids)
    # kvcore's allocator holds exactly the live chunks, and frees exactly the rest.
    allocator = ours.manager._allocator
    held = set(np.flatnonzero(allocator.page_used.numpy()).tolist())
    released = set(ours.manager._released)
    live_ids = set(ours.live_ids(live))
    assert len(released) == len(ours.manager._released), "a chunk id was freed twice"
    assert live_ids.isdisjoint(released)
    assert held == live_ids | released
    assert allocator.available_size() + len(held) == getattr(ours.manager, name("_num_chunks"))
