"""Page-ins over one host region's evenly spaced views, staged by whole spans
(kvcore/region_staging.py, ``PathPolicy.stage_regions``), on the CPU's reference kernels:
vLLM's shared CPU tier, where a chunk row holds every tensor's pages side by side."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcore import kernels, region_staging
from kvcore.direction import Direction
from kvcore.kernels import REFERENCE
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import plan

TENSORS, WORDS, BLOCKS = 3, 16, 12
POISON = -7
ROW_BYTES = WORDS * 8
GATHER = TransferPath.GATHER


class Region:
    """``chunks`` chunk rows of ``period`` rows; tensor t's page of chunk c is the
    ``spacing`` rows from ``c * period + t * spacing`` (padding past ``TENSORS * spacing``)."""

    def __init__(self, spacing: int, period: int, chunks: int = 12, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.spacing, self.period = spacing, period
        self.host = torch.randint(-(2**62), 2**62, (chunks * period, WORDS), generator=gen)
        self.dsts = [
            torch.full((BLOCKS * spacing, WORDS), POISON, dtype=torch.int64) for _ in range(TENSORS)
        ]

    def srcs(self, order: list[int]) -> list[torch.Tensor]:
        return [self.host[t * self.spacing :] for t in order]

    def rows(self, chunks: list[int], blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A job's source and destination rows: whole pages of the chunks into the blocks."""
        each = torch.arange(self.spacing)
        src = (torch.tensor(chunks)[:, None] * self.period + each).reshape(-1)
        dst = (torch.tensor(blocks)[:, None] * self.spacing + each).reshape(-1)
        return src, dst


def _load(
    region: Region,
    order: list[int],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    policy: PathPolicy,
    path: TransferPath = TransferPath.GATHER,
) -> list[str]:
    """The load through a mover of ``policy``; checks every byte and returns the paths taken."""
    for dst in region.dsts:
        dst.fill_(POISON)
    srcs = region.srcs(order)
    pairs = layer_pairs(srcs, region.dsts)
    host_before = region.host.clone()
    mover = Mover(policy, metrics=Metrics())
    chosen = plan(srcs[0], region.dsts[0], src_idx, dst_idx, direction=Direction.H2D, force=path)
    mover.execute(chosen, pairs)
    _assert_copied(region, srcs, src_idx, dst_idx)
    assert torch.equal(region.host, host_before)
    assert mover.metrics is not None
    return [row["path"] for row in mover.metrics.snapshot()["transfers"]]


def _assert_copied(
    region: Region, srcs: list[torch.Tensor], src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Every pair's rows copied exactly, every other destination row still poisoned."""
    untouched = torch.ones(BLOCKS * region.spacing, dtype=torch.bool)
    untouched[dst_idx] = False
    for src, dst in zip(srcs, region.dsts, strict=True):
        assert torch.equal(dst[dst_idx], src[src_idx])
        assert bool((dst[untouched] == POISON).all())


def test_evenly_spaced_views_of_one_host_region_are_a_source_region():
    region = Region(spacing=2, period=7)
    pairs = layer_pairs(region.srcs([2, 0, 1]), region.dsts)
    assert pairs.src_region is not None
    assert pairs.src_region.offsets == (4, 0, 2)
    assert pairs.src_region.spacing == 2
    assert pairs.src_region.base == 1
    assert pairs.src_region.rows == region.host.shape[0]


@pytest.mark.parametrize(
    "srcs",
    [
        lambda host: [host[0:], host[1:], host[3:]],  # uneven spacing
        lambda host: [host[0:], host[2:], host[2:]],  # one view twice
        lambda host: [host.clone(), host.clone(), host.clone()],  # tensors of their own
    ],
    ids=["uneven", "repeated", "separate"],
)
def test_other_sources_are_no_source_region(srcs):
    region = Region(spacing=1, period=3)
    assert layer_pairs(srcs(region.host), region.dsts).src_region is None


@pytest.mark.parametrize(("spacing", "period"), [(1, 3), (2, 6), (3, 11)], ids=str)
@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]], ids=str)
@pytest.mark.parametrize("spans_staged", [100, 2, 1])
def test_a_load_staged_by_region_copies_every_pair_exactly(spacing, period, order, spans_staged):
    """Whole pages of adjacent and scattered chunks, chunk rows with and without padding,
    pairs in any order, a staging buffer holding the whole load or one span at a time."""
    region = Region(spacing, period)
    src_idx, dst_idx = region.rows([2, 3, 4, 7, 9], [5, 0, 11, 3, 8])
    staging = spans_staged * TENSORS * spacing * ROW_BYTES
    policy = PathPolicy(stage_regions="all", staging_bytes=staging)
    assert _load(region, order, src_idx, dst_idx, policy) == ["staged"]


@pytest.mark.parametrize("padding", [0, 1], ids=["dense_rows", "padded_rows"])
def test_adjacent_chunks_go_in_one_dma_and_a_gap_starts_another(swap_kernels, monkeypatch, padding):
    """Chunk rows side by side, or a padding row apart (copied along with them), are one
    DMA; a chunk further on starts the next."""
    runs: list[int] = []

    def copy_runs(src, dst, paired):
        runs.append(paired.count)
        return REFERENCE.copy_runs(src, dst, paired)

    swap_kernels("cpu", dataclasses.replace(REFERENCE, copy_runs=copy_runs))
    monkeypatch.setattr(region_staging, "_MAX_GAP_PART", 1)
    region = Region(spacing=1, period=TENSORS + padding)
    src_idx, dst_idx = region.rows([2, 3, 4, 7, 8], [1, 2, 3, 4, 5])
    assert _load(region, [0, 1, 2], src_idx, dst_idx, PathPolicy(stage_regions="all")) == ["staged"]
    assert runs == [2]


@pytest.mark.parametrize(
    ("starts", "capacity_rows", "stride"),
    [
        ([0, 10, 20, 40, 55], 1000, 10),  # dense rows: spans side by side
        ([0, 11, 22, 33, 50, 62], 1000, 11),  # one padding row after each span: the usual gap
        ([0, 12, 24, 35, 46, 57], 1000, 11),  # the most common gap wins
        ([0, 12, 30], 1000, 10),  # gaps longer than an eighth of a span: copied apart
        ([30, 19, 8], 1000, 10),  # spans in falling order: no gap to copy along
        ([0, 11, 22], 10, 10),  # a stride the staging buffer cannot hold once
    ],
)
def test_spans_a_padding_apart_take_their_gap_in_staging(starts, capacity_rows, stride):
    span_stride = region_staging.span_stride
    assert span_stride(np.array(starts, dtype=np.int64), 10, capacity_rows) == stride


@pytest.mark.parametrize(
    ("per_lease", "spans", "span_bytes", "layout"),
    [
        (64, 1000, 1 << 20, (8, 8)),  # a long page-in: eight slots of 8 MiB, reused
        (64, 20, 1 << 20, (8, 4)),  # shorter: pieces of at least 4 MiB
        (64, 8, 1 << 20, (8, 4)),
        (64, 40, 64 << 10, (8, 8)),  # small spans: at most what a slot holds
        (64, 3, 64 << 10, (8, 8)),  # fewer spans than slots: one piece
        (64, 10, 24 << 20, (8, 1)),  # spans over 8 MiB: one a piece
        (2, 40, 1 << 20, (2, 1)),  # a lease of two spans: two slots of one
        (1, 40, 1 << 20, (1, 1)),
    ],
)
def test_the_lease_is_cut_into_ring_slots(per_lease, spans, span_bytes, layout):
    slots, per_slot = region_staging.ring_slots(per_lease, spans, span_bytes)
    assert (slots, per_slot) == layout
    assert slots * per_slot <= per_lease


@pytest.mark.parametrize("spans_staged", [100, 7, 2])
def test_pieces_through_the_ring_slots_copy_every_pair_exactly(
    swap_kernels, monkeypatch, spans_staged
):
    """One span a piece: every slot filled and drained in turn, and filled again."""
    monkeypatch.setattr(region_staging, "_MIN_PIECE_BYTES", 1)
    runs: list[tuple[list[int], list[int]]] = []

    def copy_runs(src, dst, paired):
        runs.append((paired.dst_starts.tolist(), paired.offsets.tolist()))
        return REFERENCE.copy_runs(src, dst, paired)

    swap_kernels("cpu", dataclasses.replace(REFERENCE, copy_runs=copy_runs))
    region = Region(spacing=2, period=7, chunks=30)
    chunks = [2, 3, 4, 7, 9, 10, 11, 12, 20, 21, 25, 28]
    src_idx, dst_idx = region.rows(chunks, list(range(BLOCKS)))
    staging = spans_staged * TENSORS * 2 * ROW_BYTES
    policy = PathPolicy(stage_regions="all", staging_bytes=staging)
    assert _load(region, [1, 2, 0], src_idx, dst_idx, policy) == ["staged"]
    slots, per_slot = region_staging.ring_slots(spans_staged, len(chunks), 1)
    span_rows = TENSORS * 2
    pieces = -(-len(chunks) // per_slot)
    assert len(runs) == pieces
    for piece, (dst_starts, offsets) in enumerate(runs):
        assert dst_starts[0] == piece % slots * per_slot * span_rows
        assert offsets[0] == 0


@pytest.mark.parametrize("ranged", [True, False], ids=["gather_range", "sliced"])
@pytest.mark.parametrize("uploads", [True, False])
def test_a_page_in_uploads_its_rows_once_its_first_dma_is_queued(
    swap_kernels, monkeypatch, uploads, ranged
):
    """Every piece scatters entries of one upload of the job's rows, made once the first
    piece's DMA is queued (only the scatters read them): prepared once and read by range
    where the kernel set has ``gather_range``, else each piece's slice prepared; a kernel
    set without ``upload_rows`` is handed the host rows, and copies the same bytes."""
    monkeypatch.setattr(region_staging, "_MIN_PIECE_BYTES", 1)
    uploaded: list[int] = []
    handed: list[torch.Tensor] = []
    ranges: list[tuple[int, int]] = []
    order: list[str] = []

    def upload_rows(indices, device):
        uploaded.append(len(indices))
        order.append("upload")
        return tuple(index.clone() for index in indices)

    def copy_runs(src, dst, paired):
        order.append("dma")
        return REFERENCE.copy_runs(src, dst, paired)

    def prepare_rows(src_idx, dst_idx, device):
        handed.append(dst_idx)
        return REFERENCE.prepare_rows(src_idx, dst_idx, device)

    def gather_range(pairs, rows, begin, end):
        ranges.append((begin, end))
        return REFERENCE.gather_range(pairs, rows, begin, end)

    kernels = dataclasses.replace(
        REFERENCE,
        prepare_rows=prepare_rows,
        gather_range=gather_range if ranged else None,
        upload_rows=upload_rows if uploads else None,
        copy_runs=copy_runs,
    )
    swap_kernels("cpu", kernels)
    region = Region(spacing=2, period=7, chunks=30)
    chunks = [2, 3, 4, 7, 9, 10, 11, 12, 20, 21, 25, 28]
    src_idx, dst_idx = region.rows(chunks, list(range(BLOCKS)))
    policy = PathPolicy(stage_regions="all", staging_bytes=3 * TENSORS * 2 * ROW_BYTES)
    assert _load(region, [1, 2, 0], src_idx, dst_idx, policy) == ["staged"]
    assert uploaded == ([2] if uploads else [])
    assert order[:2] == (["dma", "upload"] if uploads else ["dma", "dma"])
    # One span a piece here: each piece is one chunk's two rows.
    assert len(handed) == (1 if ranged else len(chunks))
    assert ranges == ([(2 * i, 2 * i + 2) for i in range(len(chunks))] if ranged else [])
    assert torch.equal(torch.cat(handed), dst_idx)
    shares_upload = [
        rows.untyped_storage().data_ptr() == dst_idx.untyped_storage().data_ptr() for rows in handed
    ]
    assert not any(shares_upload) if uploads else all(shares_upload)


@pytest.mark.parametrize(
    ("stage_regions", "in_place_of_gather", "in_place_of_dma"),
    [
        ("gather", "staged", "batched_runs"),
        ("all", "staged", "staged"),
        ("off", "gather", "batched_runs"),
    ],
)
def test_the_setting_names_the_paths_it_takes_the_place_of(
    stage_regions, in_place_of_gather, in_place_of_dma
):
    region = Region(spacing=2, period=6)
    src_idx, dst_idx = region.rows([2, 3], [0, 1])
    policy = PathPolicy(stage_regions=stage_regions)
    assert _load(region, [0, 1, 2], src_idx, dst_idx, policy) == [in_place_of_gather]
    dma = TransferPath.BATCHED_RUNS
    assert _load(region, [0, 1, 2], src_idx, dst_idx, policy, dma) == [in_place_of_dma]


def test_the_gathers_place_is_the_default_and_a_wrong_name_is_refused():
    assert PathPolicy().stage_regions == "gather"
    with pytest.raises(ValueError, match="one of off, gather, all"):
        PathPolicy(stage_regions="on")


def test_it_takes_only_page_ins_of_whole_pages_whose_span_fits():
    region = Region(spacing=2, period=6)
    src_idx, dst_idx = region.rows([2, 3], [0, 1])
    on = PathPolicy(stage_regions="all")
    # Half of each page: the rows of every pair do not fill one span.
    assert _load(region, [0, 1, 2], src_idx[::2], dst_idx[::2], on) == ["gather"]
    # A span larger than the staging buffer.
    tight = PathPolicy(stage_regions="all", staging_bytes=TENSORS * 2 * ROW_BYTES - 1)
    assert _load(region, [0, 1, 2], src_idx, dst_idx, tight) == ["gather"]


class _MemmoveRing:
    """An address ring whose pieces are copied on the host as they are filled (by
    ``ctypes.memmove``, at the addresses the page-in hands it): its address arithmetic is
    then checked byte for byte."""

    def __init__(self) -> None:
        self.copies = 0

    def fill(self, slot: int, reused: bool, copies: list[tuple[int, int, int]]) -> None:
        for dst, src, nbytes in copies:
            ctypes.memmove(dst, src, nbytes)
            self.copies += 1

    @contextlib.contextmanager
    def draining(self, slot: int, refilled: bool):
        yield


@pytest.mark.parametrize("by_address", [False, True], ids=["torch_ring", "address_ring"])
@pytest.mark.parametrize("seed", range(60))
def test_random_loads_through_the_ring_copy_every_pair_exactly(monkeypatch, seed, by_address):
    """Random spacings, paddings, pair orders, staging sizes and chunk sets, one piece of a
    span or more a slot, two loads in turn through one mover (its kept views and slots
    reused): every copied row exact, every other row untouched, the region unchanged; with
    the pieces copied by address too (:class:`_MemmoveRing`)."""
    ring = _MemmoveRing()
    if by_address:
        opened = dataclasses.replace(
            REFERENCE, open_address_ring=lambda device, slots: contextlib.nullcontext(ring)
        )
        monkeypatch.setitem(kernels._BY_DEVICE_TYPE, "cpu", opened)
    rnd = random.Random(seed)
    monkeypatch.setattr(region_staging, "_MIN_PIECE_BYTES", rnd.choice((1, 3 * ROW_BYTES, 1 << 20)))
    monkeypatch.setattr(region_staging, "_MAX_GAP_PART", rnd.choice((1, 8)))
    spacing = rnd.randint(1, 4)
    region = Region(spacing, TENSORS * spacing + rnd.choice((0, 0, 1, 5)), chunks=40, seed=seed)
    order = rnd.sample(range(TENSORS), TENSORS)
    srcs = region.srcs(order)
    pairs = layer_pairs(srcs, region.dsts)
    spans = rnd.randint(1, 15)
    mover = Mover(
        PathPolicy(stage_regions="gather", staging_bytes=spans * TENSORS * spacing * ROW_BYTES),
        metrics=Metrics(),
    )
    host_before = region.host.clone()
    for _ in range(2):
        for dst in region.dsts:
            dst.fill_(POISON)
        count = rnd.randint(1, BLOCKS)
        src_idx, dst_idx = region.rows(
            rnd.sample(range(40), count), rnd.sample(range(BLOCKS), count)
        )
        chosen = plan(
            srcs[0], region.dsts[0], src_idx, dst_idx, direction=Direction.H2D, force=GATHER
        )
        mover.execute(chosen, pairs)
        _assert_copied(region, srcs, src_idx, dst_idx)
    assert torch.equal(region.host, host_before)
    assert mover.metrics is not None
    assert {row["path"] for row in mover.metrics.snapshot()["transfers"]} == {"staged"}
    assert (ring.copies > 0) == by_address


def test_the_slot_count_holds_against_the_json_it_cites():
    """On one machine: eight slots loaded MLA beside a prefill at least 4% sooner than four
    (8k and 32k tokens), the other cells within 3%, the other batch's forward within 1% of
    its time alone; sixteen slots brought no more."""
    assert region_staging.RING_SLOTS == 8
    runs = _piece_runs(region_staging.SLOT_EVIDENCE)
    four = [row for row in runs["4-slots"] if row["tokens"] >= 8192]
    eight, sixteen = runs["8-slots"], runs["16-slots"]
    assert len(four) == len(eight) == len(sixteen) == 8
    for base, row, more in zip(four, eight, sixteen, strict=True):
        cell = (row["tokens"], row["compute"])
        assert cell == (base["tokens"], base["compute"]) == (more["tokens"], more["compute"])
        assert row["identical"] and row["kvcore_paths"] == ["staged"]
        if row["compute"] == "prefill-4096":
            assert row["kvcore_ms"] <= 0.96 * base["kvcore_ms"], cell
        else:
            assert row["kvcore_ms"] <= 1.03 * base["kvcore_ms"], cell
        assert more["kvcore_ms"] >= 0.98 * row["kvcore_ms"], cell
        if row["situation"] == "independent":
            assert row["forward_with_kvcore_ms"] <= 1.01 * row["forward_alone_ms"], cell


def _piece_runs(evidence: str = region_staging.PIECE_EVIDENCE) -> dict[str, list[dict]]:
    root = Path(__file__).resolve().parents[2]
    runs = json.loads((root / evidence).read_text())["runs"]
    return {
        name: [row for row in run["rows"] if "mla-18KiB" in row["case"]]
        for name, run in runs.items()
    }


def test_the_piece_cap_holds_against_the_json_it_cites():
    """On one machine, two rounds, pieces of at most 16 MiB against 8 (by address, loads at
    the top priority): in every cell the load no longer than 1.01x, the submissions' hold on
    the host at most 0.75x, the other batch's forward done no later after the request's start
    and its own time within 7.5% of its time alone; beside the prefill the load at most 0.9x."""
    assert region_staging._MAX_PIECE_BYTES == 16 << 20
    runs = _piece_runs()
    for round_ in (1, 2):
        capped, before = runs[f"cap16-{round_}"], runs[f"default-{round_}"]
        assert len(capped) == len(before) == 8
        for cap, old in zip(capped, before, strict=True):
            assert (cap["tokens"], cap["compute"]) == (old["tokens"], old["compute"])
            assert cap["identical"] and cap["kvcore_paths"] == ["staged"]
            assert cap["kvcore_ms"] <= 1.01 * old["kvcore_ms"], cap
            host = cap["submit_host_ms"]["kvcore"]
            assert host <= 0.75 * old["submit_host_ms"]["kvcore"], cap
            if cap["compute"] == "prefill-4096":
                assert cap["kvcore_ms"] <= 0.9 * old["kvcore_ms"], cap
            if cap["situation"] == "independent":
                assert cap["forward_done_ms"]["kvcore"] <= old["forward_done_ms"]["kvcore"], cap
                assert cap["forward_with_kvcore_ms"] <= 1.075 * cap["forward_alone_ms"], cap
