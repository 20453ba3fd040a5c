"""The vLLM guard fingerprints every vLLM function the adapter calls or overrides."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import kvcore_vllm
from kvcore.engine_status import release_of
from kvcore.fingerprint import package_root
from kvcore_vllm import guard
from kvcore_vllm.releases import installed_shape
from tests.support.stock_uses import EngineSource, StockUse, stock_uses

pytestmark = pytest.mark.vllm

# Calls matched by name whose receiver is one of kvcore's objects, never vLLM's.
NOT_STOCK = {
    "vllm.v1.kv_offload.base.OffloadingManager.shutdown": (
        "transfers' self._stock.shutdown() is the stock handler's, not a manager's"
    ),
    "vllm.v1.kv_offload.cpu.shared_offload_region.SharedOffloadRegion.cleanup": (
        "spec's region.cleanup() gives back kvcore's ExactHostRegion, not vLLM's region"
    ),
}


def adapter_uses() -> list[StockUse]:
    package = Path(kvcore_vllm.__file__).parent
    # Every adapter module runs in vLLM's processes, so every one is read; the benches, run
    # by hand, live in benchmarks.vllm.
    sources = {
        f"kvcore_vllm.{path.stem}": path.read_text(encoding="utf-8")
        for path in sorted(package.glob("*.py"))
    }
    classes = {t.name.rpartition(".")[0] for t in guard.TARGETS if "." in t.qualname}
    return stock_uses(sources, EngineSource(package_root("vllm"), "vllm"), classes)


def test_every_vllm_function_the_adapter_uses_is_a_target():
    uses = adapter_uses()
    targets = {t.name for t in guard.TARGETS}
    missing = sorted(
        f"{u.target} ({u.site}: {u.how})"
        for u in uses
        if u.target not in targets and u.target not in NOT_STOCK
    )
    assert missing == []
    # Each exclusion still matches a call, so none outlives the call it was written for.
    assert set(NOT_STOCK) <= {u.target for u in uses}


def test_overridden_targets_are_the_methods_kvcore_overrides():
    # Constructors are extended through super(), not replaced.
    overridden = {
        u.target
        for u in adapter_uses()
        if u.how == "overrides" and not u.target.endswith("__init__")
    }
    from kvcore_vllm.manager import POOL_METHODS, KVCoreCPUOffloadingManager

    release = release_of(importlib.metadata.version("vllm"))
    shape = installed_shape()
    # The pool methods are written under 0.33's names; a release that names them otherwise
    # gets them bound under its names at import, which reading the source cannot see.
    manager = "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager"
    renamed = {m: shape.name(m) for m in POOL_METHODS if shape.name(m) != m}
    for current, there in renamed.items():
        assert getattr(KVCoreCPUOffloadingManager, there) is getattr(
            KVCoreCPUOffloadingManager, current
        )
    bound = {f"{manager}.{there}" for there in renamed.values()}
    assert overridden | bound == {t.name for t in guard.targets_for(release) if t.overridden}
