"""What the SGLang soak's end accounting reads: kvcore's state and caches, each pool's slots.

:func:`state` is kvcore's mover, the memory in use and the sizes of what kvcore's SGLang
adapter keeps between calls, taken before the traffic and after it; :func:`slot_state` and
:func:`slot_accounting` compare a pool's slot state at its end with the state it was built
with.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.soak_report import Accounting
from benchmarks.soak_state import memory_state, mover_state
from kvcore.mover import Mover


def index_caches() -> tuple[dict[str, Any], dict[str, str]]:
    """Sizes of what kvcore's SGLang adapter keeps between calls."""
    from benchmarks.sglang.hook_adapter import bench_adapter

    adapter = bench_adapter()
    values: dict[str, Any] = {
        "host_index_memo": len(adapter.host_indices),
        "bypassed_pools": len(adapter.bindings.bypassed),
        "passing_reload_pools": len(adapter.bindings.passing),
    }
    reads = {
        "host_index_memo": "public",
        "bypassed_pools": "public",
        "passing_reload_pools": "public",
    }
    for name, memo in (
        ("pool_layers", adapter.pool_layers),
        ("layer_pairs", adapter.layer_pairs),
    ):
        by_pool = getattr(memo, "_by_pool", None)
        values[name] = None if by_pool is None else len(by_pool)
        reads[name] = "private"
    return values, reads


def state(mover: Mover, device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    values, reads = {}, {}
    for part in (mover_state(mover, device), memory_state(device), index_caches()):
        values.update(part[0])
        reads.update(part[1])
    return values, reads


def slot_state(pool: Any) -> dict[str, Any]:
    """The pool's slot state as SGLang and kvcore's allocator report it."""
    from kvcore_sglang import host_slots

    allocator = host_slots.slots_of(pool)
    return {
        "host slots free": pool.available_size(),
        "slot_used flags set": int(torch.as_tensor(pool.slot_used).sum()),
        "kvcore allocator free runs": None
        if allocator is None
        else [list(run) for run in allocator.free_runs_snapshot()],
    }


def slot_accounting(pool: Any, accounting: Accounting, built: dict[str, Any], where: str) -> None:
    """The pool's slot state against the state it was built with, and the whole pool
    allocatable as one ascending run through ``pool.alloc``."""
    end = slot_state(pool)
    for name, before in built.items():
        if before is None:
            accounting.skip(f"{where} {name}", "the pool runs SGLang's own allocator")
        else:
            accounting.exact(f"{where} {name}", before, end[name], "public")
    capacity = built["host slots free"]
    whole = pool.alloc(capacity)
    one_run = whole is not None and bool(torch.equal(whole, torch.arange(capacity)))
    accounting.exact(f"{where} whole pool allocatable as one run", True, one_run, "public")
    if whole is not None:
        pool.free(whole)
