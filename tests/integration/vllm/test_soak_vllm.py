"""The vLLM soak (``python -m benchmarks.soak --engine vllm``) on the CPU: store and load
jobs in flight at once through kvcore's handlers, chunks from kvcore's manager; every load
checked, nothing left behind, and a load with one wrong byte caught."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch

from benchmarks import soak
from benchmarks.vllm.soak import PROFILES
from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.plans import TransferPlan
from tests.support.mover_writes import executed_into

pytestmark = pytest.mark.vllm

LAYOUTS = [model.name for model in PROFILES["cpu"].layouts]


def _soak(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "soak.json"
    argv = ["--engine", "vllm", "--seed", "5", "--device", "cpu", "--quiet", "--json", str(out)]
    status = soak.main([*argv, *extra])
    return status, json.loads(out.read_text())


def test_a_short_soak_checks_every_load_and_ends_at_its_baseline(tmp_path):
    status, doc = _soak(tmp_path, "--seconds", "3")
    assert doc["errors"] == []
    assert status == 0 and doc["ok"]
    assert doc["mismatched_bytes"] == doc["stray_bytes"] == doc["leaks"] == 0
    phases = doc["phases"]
    assert {(p["layout"], p["serve_rule"]) for p in phases} == {
        (layout, rule) for layout in LAYOUTS for rule in (False, True)
    }
    assert all(p["loads"] >= 1 and p["backups"] >= 1 for p in phases)
    assert doc["reloads_checked"] == doc["calls"]["loads"] > 0
    # Rules off, kvcore copies every job itself; on, the small ones stay with vLLM's.
    assert all(not p["jobs_left_to_stock"] for p in phases if not p["serve_rule"])
    assert any(p["jobs_left_to_stock"] for p in phases if p["serve_rule"])
    items = {item["name"]: item for item in doc["accounting"]["items"]}
    for layout in LAYOUTS:
        assert items[f"{layout} manager free chunks"]["ok"]
        assert items[f"{layout} whole pool allocatable as one run"]["end"] is True
        for rule in ("off", "on"):
            for handler in ("store", "load"):
                item = items[f"{layout} rules {rule} {handler} kvcore_events_outstanding"]
                assert item["end"] == 0
    for name in ("staging_bytes_reserved", "staging_leases_held", "mover_prepared_plans"):
        assert items[name]["ok"], items[name]


def _flip_first_load(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One byte of the first host-to-device copy into a KV tensor flipped after it lands."""
    flipped: list[int] = []

    def flip(plan: TransferPlan, dst: torch.Tensor) -> None:
        if flipped or plan.direction is not Direction.H2D or dst.dtype == torch.uint8:
            return
        dst[int(plan.dst_idx[0])].reshape(-1).view(torch.uint8)[3] ^= 0x10
        flipped.append(int(plan.dst_idx[0]))

    def wrap(original: Callable[..., None], pick: Callable[..., torch.Tensor]) -> Any:
        def wrapped(self: Mover, plan: TransferPlan, *args: Any, **kwargs: Any) -> None:
            original(self, plan, *args, **kwargs)
            flip(plan, pick(plan, *args))

        return wrapped

    monkeypatch.setattr(Mover, "execute", wrap(Mover.execute, executed_into))
    return flipped


def test_a_load_with_one_wrong_byte_is_reported(tmp_path, monkeypatch):
    flipped = _flip_first_load(monkeypatch)
    status, doc = _soak(tmp_path, "--seconds", "1", "--pools", LAYOUTS[0])
    assert flipped, "no load reached kvcore's mover"
    assert status == 1 and not doc["ok"]
    assert doc["mismatched_bytes"] == 1 and doc["mismatches"] == 1
    assert doc["stray_bytes"] == 0 and doc["leaks"] == 0
    assert any("1 bytes differ from what was stored" in e for e in doc["errors"])
