"""The SGLang guard fingerprints every SGLang function the adapter calls or overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcore_sglang
from kvcore.fingerprint import package_root
from kvcore_sglang import guard
from tests.support.stock_uses import EngineSource, StockUse, stock_uses

pytestmark = pytest.mark.sglang

# Calls matched by name whose receiver is one of kvcore's objects, never SGLang's.
NOT_STOCK = {
    "sglang.srt.managers.cache_controller.HiCacheController.load": "transfers' jobs.load",
}
GROUPS = guard.EVERY_GROUP


def adapter_uses() -> list[StockUse]:
    package = Path(kvcore_sglang.__file__).parent
    # Every adapter module runs in SGLang's processes, so every one is read; the benches and
    # their scaffolding, run by hand, live in benchmarks.sglang.
    sources = {
        f"kvcore_sglang.{path.stem}": path.read_text(encoding="utf-8")
        for path in sorted(package.glob("*.py"))
    }
    classes = {target.rpartition(".")[0] for target in guard.recorded_targets(GROUPS)}
    return stock_uses(sources, EngineSource(package_root("sglang"), "sglang"), classes)


def test_every_sglang_function_the_adapter_uses_is_checked_with_a_group():
    uses = adapter_uses()
    checked = set(guard.recorded_targets(GROUPS))
    missing = sorted(
        f"{u.target} ({u.site}: {u.how})"
        for u in uses
        if u.target not in checked and u.target not in NOT_STOCK
    )
    assert missing == []
    # Each exclusion still matches a call, so none outlives the call it was written for.
    assert set(NOT_STOCK) <= {u.target for u in uses}
