"""A page-in staged by region begun before it is planned (``Mover.begin_region_load``,
``RegionStaging.begin``), on the CPU's reference kernels: finished by the plan's execution
it copies what a page-in staged after planning copies; closed unfinished, or handed a plan
of other rows, it writes nothing of its own, and the staging buffer is free again."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_region_staging import BLOCKS, POISON, ROW_BYTES, TENSORS, Region, _assert_copied

from kvcore.direction import Direction
from kvcore.kernels import REFERENCE
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.plans import plan

CPU = torch.device("cpu")


ON = PathPolicy(begin_region_loads=True)


def _mover(policy: PathPolicy = ON) -> Mover:
    return Mover(policy, metrics=Metrics())


def _poisoned(region: Region) -> None:
    for dst in region.dsts:
        dst.fill_(POISON)


def _staging_free(mover: Mover) -> bool:
    return not mover.staging._lock_for(CPU).locked()


def _paths(mover: Mover) -> list[str]:
    assert mover.metrics is not None
    return [row["path"] for row in mover.metrics.snapshot()["transfers"]]


@pytest.mark.parametrize("seed", range(40))
def test_a_begun_load_finished_by_its_plan_copies_every_pair_exactly(seed):
    rnd = random.Random(seed)
    spacing = rnd.randint(1, 4)
    region = Region(spacing, TENSORS * spacing + rnd.choice((0, 0, 1, 5)), chunks=40, seed=seed)
    srcs = region.srcs(rnd.sample(range(TENSORS), TENSORS))
    pairs = layer_pairs(srcs, region.dsts)
    spans = rnd.randint(1, 15)
    mover = _mover(replace(ON, staging_bytes=spans * TENSORS * spacing * ROW_BYTES))
    host_before = region.host.clone()
    for _ in range(2):
        _poisoned(region)
        count = rnd.randint(2, BLOCKS)
        src_idx, dst_idx = region.rows(
            rnd.sample(range(40), count), rnd.sample(range(BLOCKS), count)
        )
        begun = mover.begin_region_load(src_idx, dst_idx, pairs)
        assert begun is not None
        chosen = plan(srcs[0], region.dsts[0], src_idx, dst_idx, direction=Direction.H2D)
        mover.execute(chosen, pairs, begun=begun)
        _assert_copied(region, srcs, src_idx, dst_idx)
        assert _staging_free(mover)
    assert torch.equal(region.host, host_before)
    assert _paths(mover) == ["staged"]


def test_a_begun_load_closed_unfinished_writes_nothing_and_frees_the_staging():
    region = Region(spacing=2, period=7, chunks=30)
    pairs = layer_pairs(region.srcs([0, 1, 2]), region.dsts)
    _poisoned(region)
    mover = _mover()
    src_idx, dst_idx = region.rows([3, 9, 4, 20], [0, 5, 2, 7])
    begun = mover.begin_region_load(src_idx, dst_idx, pairs)
    assert begun is not None and not _staging_free(mover)
    begun.close()
    begun.close()  # a second close does nothing
    assert _staging_free(mover)
    assert all(bool((dst == POISON).all()) for dst in region.dsts)


@pytest.mark.parametrize("rewritten", ["new_tensors", "sources_in_place", "destinations_in_place"])
def test_a_begun_load_handed_a_plan_of_other_rows_copies_the_plans_rows(swap_kernels, rewritten):
    """Other rows than the begun load's, in new tensors or in the same ones rewritten in place
    since: the plan's rows are copied, and nothing else written. The kernel set's upload of
    the scatter rows is a copy, as on a GPU (the reference set's would alias them)."""
    swap_kernels(
        "cpu",
        replace(
            REFERENCE,
            upload_rows=lambda indices, device: tuple(index.clone() for index in indices),
        ),
    )
    region = Region(spacing=2, period=7, chunks=30)
    srcs = region.srcs([2, 0, 1])
    pairs = layer_pairs(srcs, region.dsts)
    _poisoned(region)
    mover = _mover()
    src_idx, dst_idx = region.rows([3, 9, 4], [0, 5, 2])
    begun = mover.begin_region_load(src_idx, dst_idx, pairs)
    assert begun is not None
    other_src, other_dst = region.rows([12, 1, 7], [8, 1, 4])
    if rewritten == "new_tensors":
        src_idx, dst_idx = other_src, other_dst
    elif rewritten == "sources_in_place":
        src_idx.copy_(other_src)
    else:
        dst_idx.copy_(other_dst)
    chosen = plan(srcs[0], region.dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    mover.execute(chosen, pairs, begun=begun)
    _assert_copied(region, srcs, src_idx, dst_idx)
    assert _staging_free(mover) and _paths(mover) == ["staged"]


@pytest.mark.parametrize(
    ("rows", "begins"),
    [
        (lambda region: region.rows([3, 9], [0, 5]), True),
        (lambda region: tuple(idx[1:] for idx in region.rows([3, 9], [0, 5])), False),
        (lambda region: region.rows([3, 29], [0, 5]), False),
        (lambda region: region.rows([3], [0]), False),
        (lambda region: tuple(idx.int() for idx in region.rows([3, 9], [0, 5])), False),
        (lambda region: (region.rows([3, 9], [0, 5])[0], region.rows([3], [0])[1]), False),
    ],
    ids=["whole_pages", "partial_page", "past_the_region", "one_page", "int32", "unequal"],
)
def test_only_loads_surely_staged_by_region_are_begun(rows, begins):
    """Whole pages are; a partial page is not, nor a span running past the region (its last
    chunk row cut short), nor one page (a single copy, no gather), nor int32 rows, nor
    sides of unequal lengths."""
    region = Region(spacing=2, period=7, chunks=30)
    region.host = region.host[: 29 * 7 + 3]
    pairs = layer_pairs(region.srcs([0, 1, 2]), region.dsts)
    begun = _mover().begin_region_load(*rows(region), pairs)
    assert (begun is not None) == begins
    if begun is not None:
        begun.close()


@pytest.mark.parametrize(
    "policy",
    [
        PathPolicy(),  # the setting's default
        replace(ON, stage_regions="off"),
        replace(ON, long_run_bytes=1),  # pages long enough for one DMA each: not a gather
        replace(ON, staging_bytes=TENSORS * 2 * ROW_BYTES - 1),  # no span fits
    ],
    ids=["default", "off", "dma_pages", "no_span_fits"],
)
def test_no_load_is_begun_where_the_plan_is_not_staged_by_region(policy):
    region = Region(spacing=2, period=7, chunks=30)
    pairs = layer_pairs(region.srcs([0, 1, 2]), region.dsts)
    assert _mover(policy).begin_region_load(*region.rows([3, 9, 4], [0, 5, 2]), pairs) is None


def test_no_load_is_begun_over_sources_that_are_no_region():
    region = Region(spacing=2, period=7, chunks=30)
    pairs = layer_pairs([region.host.clone() for _ in range(TENSORS)], region.dsts)
    assert _mover().begin_region_load(*region.rows([3, 9], [0, 5]), pairs) is None
