"""The SGLang soak (``python -m benchmarks.soak --engine sglang``) on the CPU: a short run
through every pool kind, layout, page size and rule setting checks every reload and leaks
nothing, and a reload with one wrong byte is caught."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

import torch

from benchmarks import soak
from benchmarks.sglang.soak import KINDS, LAYOUTS, PAGES
from benchmarks.sglang.soak_pool import pool_name
from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.plans import TransferPlan
from tests.support.mover_writes import executed_into

pytestmark = pytest.mark.sglang

ONE_POOL = "mla/layer_first/p64"


def _soak(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "soak.json"
    argv = ["--engine", "sglang", "--seed", "3", "--device", "cpu", "--quiet", "--json", str(out)]
    status = soak.main([*argv, *extra])
    return status, json.loads(out.read_text())


def test_a_short_soak_checks_every_reload_and_ends_at_its_baseline(tmp_path):
    status, doc = _soak(tmp_path, "--seconds", "3")
    assert doc["errors"] == []
    assert status == 0 and doc["ok"]
    assert doc["mismatched_bytes"] == doc["stray_bytes"] == doc["leaks"] == 0
    phases = doc["phases"]
    every_pool = {pool_name(k, lay, p) for k in KINDS for lay in LAYOUTS for p in PAGES}
    assert {(p["pool"], p["serve_rule"]) for p in phases} == {
        (pool, rule) for pool in every_pool for rule in (False, True)
    }
    assert all(p["loads"] >= 1 and p["backups"] >= 1 for p in phases)
    calls = doc["calls"]
    # Every reload was compared, and every backup was read back by one.
    assert doc["reloads_checked"] == calls["loads"] > 0
    assert doc["backups_verified"] == calls["backups"] > 0
    assert calls["load_calls"] >= 2 * calls["loads"]  # layer by layer
    assert doc["checkpoints"] >= 3 * len(every_pool)
    # Rule off: kvcore moved the copies itself; rule on: SGLang's copies ran (its loads).
    off = [p for p in phases if not p["serve_rule"]]
    assert all(p["kvcore"]["paths"] for p in off)
    on = [p for p in phases if p["serve_rule"]]
    assert all(p["kvcore"]["fallbacks"] for p in on)
    items = {item["name"]: item for item in doc["accounting"]["items"]}
    for name in (
        "load_requests",
        "host_index_memo",
        "bypassed_pools",
        "pool_layers",
        "layer_pairs",
        "staging_bytes_reserved",
        "staging_leases_held",
        "mover_prepared_plans",
    ):
        assert items[name]["ok"], items[name]
    for pool in every_pool:
        slots = items[f"{pool} host slots free"]
        assert slots["end"] == slots["baseline"] > 0
        assert items[f"{pool} whole pool allocatable as one run"]["end"] is True
    assert "events" in doc["accounting"]["not_checked"]


def _flip_first_load(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One byte of the first host-to-device copy into a model's buffer flipped after it
    lands (not the settle copies, which are bytes): what a broken copy leaves."""
    flipped: list[int] = []

    def flip(plan: TransferPlan, dst: torch.Tensor) -> None:
        if flipped or plan.direction is not Direction.H2D or dst.dtype == torch.uint8:
            return
        row = dst[int(plan.dst_idx[0])]
        row.reshape(-1).view(torch.uint8)[3] ^= 0x10
        flipped.append(int(plan.dst_idx[0]))

    def wrap(
        original: Callable[..., None],
        pick: Callable[..., torch.Tensor],
        plan_of: Callable[[Any], TransferPlan] = lambda plan: plan,
    ) -> Any:
        def wrapped(self: Mover, work: Any, *args: Any, **kwargs: Any) -> None:
            original(self, work, *args, **kwargs)
            flip(plan_of(work), pick(work, *args))

        return wrapped

    monkeypatch.setattr(Mover, "execute", wrap(Mover.execute, executed_into))
    # A prepared request's layers (gathered or staged) come through here.
    monkeypatch.setattr(
        Mover,
        "execute_prepared",
        wrap(Mover.execute_prepared, lambda _, pairs: pairs.dsts[0], lambda done: done.plan),
    )
    return flipped


def test_a_reload_with_one_wrong_byte_is_reported(tmp_path, monkeypatch):
    flipped = _flip_first_load(monkeypatch)
    status, doc = _soak(tmp_path, "--seconds", "1", "--pools", ONE_POOL)
    assert flipped, "no load reached kvcore's mover"
    assert status == 1 and not doc["ok"]
    assert doc["mismatched_bytes"] == 1 and doc["mismatches"] == 1
    assert doc["stray_bytes"] == 0 and doc["leaks"] == 0
    assert any("1 bytes differ from what was backed up" in e for e in doc["errors"])


def test_an_unknown_pool_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no pool is named"):
        _soak(tmp_path, "--seconds", "1", "--pools", "mha/page_first_direct/p64")
