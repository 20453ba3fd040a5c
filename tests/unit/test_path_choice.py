"""kvcore.planning.path_choice, and the planner's gather decided from the host rows alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.direction import Direction
from kvcore.planning.path_choice import choose_path, rules_out_dma
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import plan
from kvcore.runs import find_paired_runs, find_runs, segment_transfer

POLICY = PathPolicy()


@settings(max_examples=400, deadline=None)
@given(
    host=st.integers(1, 600),
    extra=st.integers(0, 600),
    nbytes=st.integers(0, 1 << 30),
    staging=st.sampled_from([1 << 10, 1 << 20, 64 << 20]),
)
def test_host_runs_that_rule_out_dma_leave_the_gather_whatever_the_other_side(
    host, extra, nbytes, staging
):
    policy = PathPolicy(staging_bytes=staging)
    # Both sides' runs are at least the host side's.
    paired = host + extra
    if rules_out_dma(host, nbytes, policy):
        assert choose_path(paired, host, nbytes, policy) is TransferPath.GATHER


@settings(max_examples=400, deadline=None)
@given(
    host=st.integers(0, 600),
    nbytes=st.integers(0, 1 << 30),
    staging=st.sampled_from([1 << 10, 1 << 20, 64 << 20]),
    max_dma_runs=st.sampled_from([1, 16, 300]),
)
def test_host_runs_that_leave_dma_open_have_a_paired_count_that_takes_it(
    host, nbytes, staging, max_dma_runs
):
    policy = PathPolicy(staging_bytes=staging, max_dma_runs=max_dma_runs)
    # Exact, not only safe: where the host rows do not rule DMA out, paired runs as few as
    # the host's (a device side that breaks nowhere else) take a DMA path.
    if not rules_out_dma(host, nbytes, policy):
        assert choose_path(max(host, 1), host, nbytes, policy) is not TransferPath.GATHER


def _scattered(rows: int, size: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(size, generator=gen)[:rows]


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
@pytest.mark.parametrize("rows", [17, 300, 5000])
def test_a_gather_decided_from_the_host_rows_matches_the_full_segmentation(direction, rows):
    gen = torch.Generator().manual_seed(rows)
    host = torch.randint(0, 256, (8192, 64), dtype=torch.uint8, generator=gen)
    device = torch.randint(0, 256, (9000, 64), dtype=torch.uint8, generator=gen)
    host_idx, device_idx = _scattered(rows, 8192, gen), _scattered(rows, 9000, gen)
    page_in = direction is Direction.H2D
    src, dst = (host, device) if page_in else (device, host)
    src_idx, dst_idx = (host_idx, device_idx) if page_in else (device_idx, host_idx)
    chosen = plan(src, dst, src_idx, dst_idx, direction=direction)
    full = segment_transfer(src_idx, dst_idx, src.shape[0], dst.shape[0], host_is_src=page_in)
    assert chosen.path is TransferPath.GATHER
    assert chosen.paired_runs_found is None and chosen.host_runs_found is None
    assert (chosen.src_span, chosen.dst_span) == (full.src_span, full.dst_span)
    # Found when asked for, equal to what segmenting both sides finds.
    expected = find_paired_runs(src_idx, dst_idx)
    for mine, theirs in zip(
        (chosen.runs.src_starts, chosen.runs.dst_starts, chosen.runs.lengths),
        (expected.src_starts, expected.dst_starts, expected.lengths),
        strict=True,
    ):
        assert torch.equal(mine, theirs)
    assert torch.equal(chosen.host_runs.starts, find_runs(host_idx).starts)
    assert chosen.paired_runs_found is chosen.runs


def test_few_short_host_runs_decide_the_gather_without_segmenting():
    gen = torch.Generator().manual_seed(4)
    host = torch.randint(0, 256, (4096, 64), dtype=torch.uint8, generator=gen)
    device = torch.zeros((4096, 64), dtype=torch.uint8)
    # Eight host pages of 64 rows of 64 B: too short for DMA at line rate, so the gather.
    host_idx = torch.cat([torch.arange(s, s + 64) for s in range(0, 4096, 512)])
    device_idx = _scattered(512, 4096, gen)
    chosen = plan(host, device, host_idx, device_idx, direction=Direction.H2D)
    assert chosen.path is TransferPath.GATHER
    assert chosen.paired_runs_found is None and chosen.host_runs_found is None
    assert chosen.host_runs.count == 8
    assert (chosen.src_span, chosen.dst_span) == (3584 + 64, int(device_idx.max()) + 1)


def test_few_host_runs_still_segment_both_sides():
    gen = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (4096, 1024), dtype=torch.uint8, generator=gen)
    device = torch.zeros((4096, 1024), dtype=torch.uint8)
    # Four host runs of 256 rows of 1 KiB, long enough for DMA: staging stays open, so
    # both sides are segmented.
    host_idx = torch.cat([torch.arange(s, s + 256) for s in (0, 1024, 2048, 3072)])
    chosen = plan(host, device, host_idx, _scattered(1024, 4096, gen), direction=Direction.H2D)
    assert chosen.paired_runs_found is not None and chosen.host_runs_found is not None
    assert chosen.host_runs.count == 4


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
@pytest.mark.parametrize("side", ["src_idx", "dst_idx"])
def test_the_host_decided_gather_checks_both_sides_bounds(direction, side):
    gen = torch.Generator().manual_seed(5)
    host = torch.zeros((1000, 8), dtype=torch.uint8)
    device = torch.zeros((900, 8), dtype=torch.uint8)
    src, dst = (host, device) if direction is Direction.H2D else (device, host)
    src_idx, dst_idx = _scattered(400, src.shape[0], gen), _scattered(400, dst.shape[0], gen)
    bad = {"src_idx": src_idx, "dst_idx": dst_idx}[side]
    bad[123] = {"src_idx": src, "dst_idx": dst}[side].shape[0]
    before = dst.clone()
    with pytest.raises(ValueError, match=side):
        plan(src, dst, src_idx, dst_idx, direction=direction)
    bad[123] = -1
    with pytest.raises(ValueError, match=side):
        plan(src, dst, src_idx, dst_idx, direction=direction)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_the_host_decided_gather_refuses_duplicate_destinations(direction):
    gen = torch.Generator().manual_seed(6)
    host = torch.zeros((1000, 8), dtype=torch.uint8)
    device = torch.zeros((1000, 8), dtype=torch.uint8)
    src_idx, dst_idx = _scattered(400, 1000, gen), _scattered(400, 1000, gen)
    dst_idx[7] = dst_idx[300]
    src, dst = (host, device) if direction is Direction.H2D else (device, host)
    with pytest.raises(ValueError, match="duplicate"):
        plan(src, dst, src_idx, dst_idx, direction=direction)
