"""kvcore.warm_up: every path once on scratch rows, bytes checked, engine counters untouched."""

from __future__ import annotations

import dataclasses

import torch

from kvcore.kernels import KernelSet, kernels_for
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import PathPolicy
from kvcore.warm_up import PATHS, warm_up

CPU = torch.device("cpu")


class BrokenMover(Mover):
    """A mover whose copy of runs flips a byte of what it wrote, or raises."""

    def __init__(self, *, raises: bool = False) -> None:
        super().__init__(PathPolicy(), metrics=Metrics())
        self.raises = raises

    def kernels(self, device: torch.device) -> KernelSet:
        base = kernels_for(device)

        def copy_runs(src, dst, runs):
            if self.raises:
                raise RuntimeError("PassManager::run failed")
            base.copy_runs(src, dst, runs)
            start = int(runs.dst_starts[0])
            dst[start].bitwise_not_()

        # Without the op over several pairs, the mover runs this one for each pair.
        return dataclasses.replace(base, copy_runs=copy_runs, copy_runs_layers=None)


def test_every_path_both_directions_one_pair_and_layers_per_row_size():
    mover = Mover(PathPolicy(), metrics=Metrics())
    result = warm_up(mover, CPU, [48, 4096, 48])
    assert result.trustworthy and result.failed == {} and result.wrong == []
    assert len(result.warmed) == 2 * 2 * len(PATHS) * 2
    assert "h2d/staged/4096B/layers" in result.warmed and "d2h/gather/48B" in result.warmed
    # Warm-up copies are not the engine's: its counters stay as they were.
    assert mover.metrics is not None and mover.metrics.snapshot()["transfers"] == []


def test_a_path_that_moves_a_wrong_byte_makes_the_mover_untrustworthy():
    result = warm_up(BrokenMover(), CPU, [4096])
    assert not result.trustworthy
    # Runs paths copy through copy_runs; the others never call it.
    assert {name.split("/")[1] for name in result.wrong} == {"single_copy", "batched_runs"}
    assert not any("staged" in name or "gather" in name for name in result.wrong)


def test_a_path_that_raises_is_named_and_the_others_still_run():
    result = warm_up(BrokenMover(raises=True), CPU, [64])
    assert result.trustworthy and result.wrong == []
    assert {name.split("/")[1] for name in result.failed} == {"single_copy", "batched_runs"}
    assert all("PassManager::run failed" in why for why in result.failed.values())
    assert len(result.warmed) == 2 * 2 * 2
