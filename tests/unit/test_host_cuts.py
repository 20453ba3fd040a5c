"""Host runs cut where one host registration ends and the next begins (a pool pinned in
steps): kvcore.runs.cut_runs and the device-indexed plans that take ``host_cuts``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.direction import Direction
from kvcore.kernels import reference
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.run_pieces import cut_runs
from kvcore.runs import Runs, find_runs

ROW = (1, 576)  # 1152 B, as MLA's token rows
# Staging of 40 rows, so that a 64-row request is staged in two chunks.
POLICY = PathPolicy(staging_bytes=40 * 1152, long_run_bytes=4 << 10)


def _rows(runs: Runs) -> list[int]:
    return [row for start, length in runs.as_list() for row in range(start, start + length)]


def _crosses(start: int, length: int, cuts: np.ndarray) -> bool:
    return bool(((cuts > start) & (cuts < start + length)).any())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 200), max_size=40),
    st.lists(st.integers(0, 220), max_size=12, unique=True),
)
def test_cut_runs_keeps_every_row_in_order_and_no_piece_spans_a_cut(values, cuts):
    runs = find_runs(torch.tensor(values, dtype=torch.int64))
    ends = np.array(sorted(cuts), dtype=np.int64)
    cut = cut_runs(runs, ends)
    assert _rows(cut) == _rows(runs) == values
    assert all(length > 0 for _, length in cut.as_list())
    assert not any(_crosses(start, length, ends) for start, length in cut.as_list())
    # Only runs that span a cut are cut, each into one piece more per cut inside it.
    spanned = sum(int(((ends > s) & (ends < s + n)).sum()) for s, n in runs.as_list())
    assert cut.count == runs.count + spanned
    if not spanned:
        assert cut is runs


def test_cuts_at_a_runs_ends_leave_it_whole():
    runs = Runs(torch.tensor([0, 100]), torch.tensor([50, 20]))
    assert cut_runs(runs, np.array([0, 50, 100, 120])) is runs
    assert cut_runs(runs, np.array([49, 101])).as_list() == [(0, 49), (49, 1), (100, 1), (101, 19)]


def _case(direction: Direction, host_idx: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (128, *ROW), dtype=torch.uint8, generator=gen)
    device = torch.randint(0, 256, (128, *ROW), dtype=torch.uint8, generator=gen)
    device_idx = torch.randperm(128, generator=gen)[: host_idx.numel()]
    if direction is Direction.H2D:
        return host, device, host_idx, device_idx
    return device, host, device_idx, host_idx


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H], ids=lambda d: d.name)
@pytest.mark.parametrize("cuts", [[40], [20, 50, 70]], ids=["one-cut", "three-cuts"])
def test_a_staged_plan_copies_no_host_run_across_a_cut(monkeypatch, direction, cuts):
    """One host run over slots 10-73: staged in pieces that each stay on one side of every
    cut, every byte where stock's copy puts it, untouched rows and the source unchanged."""
    ends = np.array(cuts, dtype=np.int64)
    copied: list[tuple[int, int]] = []
    listed = reference.listed_runs_to_staging

    def recording(host_words, host_runs, staging, *, into_staging):
        runs = list(host_runs)
        copied.extend(runs)
        listed(host_words, runs, staging, into_staging=into_staging)

    monkeypatch.setattr(reference, "listed_runs_to_staging", recording)
    src, dst, src_idx, dst_idx = _case(direction, torch.arange(10, 74), 5)
    chosen = plan_device_indexed(
        src, dst, src_idx, dst_idx, direction=direction, policy=POLICY, host_cuts=ends
    )
    assert chosen.path is TransferPath.STAGED
    assert chosen.host_runs.count == 1 + len(cuts)
    expected = dst.clone()
    expected[dst_idx] = src[src_idx]
    src_before = src.clone()
    Mover(POLICY).execute(chosen)
    assert torch.equal(dst, expected) and torch.equal(src, src_before)
    assert sum(length for _, length in copied) == 64
    assert not any(_crosses(start, length, ends) for start, length in copied)
    uncut = plan_device_indexed(src, dst, src_idx, dst_idx, direction=direction, policy=POLICY)
    assert uncut.host_runs.count == 1


def test_cuts_never_turn_a_gather_into_dma():
    """Scattered host slots take the gather, which reads by address and crosses nothing."""
    gen = torch.Generator().manual_seed(2)
    host_idx = torch.randperm(128, generator=gen)[:32]
    src, dst, src_idx, dst_idx = _case(Direction.H2D, host_idx, 7)
    chosen = plan_device_indexed(
        src,
        dst,
        src_idx,
        dst_idx,
        direction=Direction.H2D,
        policy=POLICY,
        host_cuts=np.array([64]),
    )
    assert chosen.path is TransferPath.GATHER
