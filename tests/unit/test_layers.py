"""LayerPairs and Mover.execute over them: every pair of a transfer moved with one plan.

On a CPU the reference kernels have no layered ops, so the mover issues each pair in
turn; a kernel set with layered ops gets one call per transfer. The CUDA set's batched
run copy is checked here for its address arithmetic, with the driver call replaced by
memmoves on host memory.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.direction import Direction
from kvcore.kernels import REFERENCE, KernelSet, run_copies
from kvcore.kernels.batch_copy import BatchCopyError
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import plan
from kvcore.planning.submissions import layers_mismatch, submissions
from kvcore.runs import find_runs

H2D, D2H = Direction.H2D, Direction.D2H
PATHS = [
    TransferPath.SINGLE_COPY,
    TransferPath.BATCHED_RUNS,
    TransferPath.STAGED,
    TransferPath.GATHER,
]
POLICY = PathPolicy(staging_bytes=24 * 1152, long_run_bytes=4096)
LAYERS, CHUNK_ROWS, CHUNKS, SHAPE = 3, 8, 6, (1, 576)
# View l of a shared region starts l chunks in; its rows c * LAYERS * CHUNK_ROWS + j
# (j < CHUNK_ROWS) are chunk c's rows of layer l, which no other view reaches.
VIEW_ROWS = (CHUNKS - 1) * LAYERS * CHUNK_ROWS + CHUNK_ROWS
SLOTS = torch.tensor(
    [c * LAYERS * CHUNK_ROWS + j for c in range(CHUNKS) for j in range(CHUNK_ROWS)]
)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    count = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def side(shared: bool, gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The memory of one side and its ``LAYERS`` row views (see :func:`views_of`)."""
    rows = CHUNKS * LAYERS * CHUNK_ROWS if shared else LAYERS * VIEW_ROWS
    memory = random_bytes((rows, *SHAPE), torch.bfloat16, gen)
    return memory, views_of(memory, shared)


def views_of(memory: torch.Tensor, shared: bool) -> list[torch.Tensor]:
    """Shared: views that interleave the layers chunk by chunk (vLLM's shared host region,
    as kvcore_vllm's page rows see it). Otherwise each layer has rows of its own."""
    step = CHUNK_ROWS if shared else VIEW_ROWS
    return [memory[layer * step : layer * step + VIEW_ROWS] for layer in range(LAYERS)]


def indices(
    path: TransferPath, direction: Direction, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination rows (among SLOTS) whose runs lead the planner to ``path``."""
    if path is TransferPath.SINGLE_COPY:
        return SLOTS[:4], SLOTS[8:12]
    if path is TransferPath.BATCHED_RUNS:
        return torch.cat([SLOTS[:8], SLOTS[16:24]]), torch.cat([SLOTS[8:16], SLOTS[32:40]])
    shuffled = SLOTS[torch.randperm(len(SLOTS), generator=gen)][:16]
    if path is TransferPath.STAGED:
        # Two runs of 8 rows on the host side, scattered rows on the device side.
        return (SLOTS[:16], shuffled) if direction is H2D else (shuffled, SLOTS[:16])
    return shuffled, SLOTS[torch.randperm(len(SLOTS), generator=gen)][:16]


def expected_after(
    srcs: list[torch.Tensor],
    dst_memory: torch.Tensor,
    shared: bool,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
) -> torch.Tensor:
    """The destination memory after a per-index copy of each pair in turn."""
    expected = dst_memory.clone()
    for src, dst in zip(srcs, views_of(expected, shared), strict=True):
        for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
            dst[d] = src[s]
    return expected


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("direction", [H2D, D2H], ids=lambda d: d.value)
@pytest.mark.parametrize("shared_host", [False, True], ids=["own_tensors", "shared_host"])
def test_every_pair_moves_like_a_per_index_copy(path, direction, shared_host):
    gen = torch.Generator().manual_seed(3)
    host_memory, host = side(shared_host, gen)
    device_memory, device = side(False, gen)
    srcs, dsts = (host, device) if direction is H2D else (device, host)
    src_memory, dst_memory = (
        (host_memory, device_memory) if direction is H2D else (device_memory, host_memory)
    )
    dst_shared = shared_host and direction is D2H
    src_idx, dst_idx = indices(path, direction, gen)
    src_before = src_memory.clone()
    expected = expected_after(srcs, dst_memory, dst_shared, src_idx, dst_idx)
    chosen = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=direction, policy=POLICY)
    assert chosen.path is path
    Mover(POLICY).execute(chosen, layer_pairs(srcs, dsts))
    # Untouched rows keep their random bytes; copied rows hold their source rows.
    assert same_bytes(dst_memory, expected)
    assert same_bytes(src_memory, src_before)


def test_a_stock_path_runs_in_place_of_a_plan_over_its_own_buffers_only():
    gen = torch.Generator().manual_seed(4)
    _, host = side(False, gen)
    device_memory, device = side(False, gen)
    before = device_memory.clone()
    src_idx, dst_idx = indices(PATHS[0], H2D, gen)
    chosen = plan(host[0], device[0], src_idx, dst_idx, direction=H2D, policy=POLICY)
    calls: list[int] = []
    with pytest.raises(ValueError, match="own buffers only"):
        Mover(POLICY).execute(chosen, layer_pairs(host, device), stock=lambda: calls.append(1))
    assert calls == [] and same_bytes(device_memory, before)


@settings(max_examples=80, deadline=None)
@given(
    direction=st.sampled_from([H2D, D2H]),
    shared_host=st.booleans(),
    count=st.integers(0, len(SLOTS)),
    seed=st.integers(0, 2**31 - 1),
    staging_rows=st.integers(1, 40),
)
def test_random_layered_transfers_match_per_pair_copies(
    direction, shared_host, count, seed, staging_rows
):
    gen = torch.Generator().manual_seed(seed)
    host_memory, host = side(shared_host, gen)
    device_memory, device = side(False, gen)
    srcs, dsts = (host, device) if direction is H2D else (device, host)
    dst_memory = device_memory if direction is H2D else host_memory
    src_memory = host_memory if direction is H2D else device_memory
    # Sources may repeat, destinations may not; runs, scattered rows or a mix of both.
    src_idx = SLOTS[torch.randint(0, len(SLOTS), (count,), generator=gen)]
    if seed % 2:
        src_idx = SLOTS[:count]
    dst_idx = SLOTS[torch.randperm(len(SLOTS), generator=gen)[:count]]
    if seed % 3 == 0:
        dst_idx = SLOTS[len(SLOTS) - count :]
    src_before = src_memory.clone()
    expected = expected_after(srcs, dst_memory, shared_host and direction is D2H, src_idx, dst_idx)
    policy = PathPolicy(staging_bytes=staging_rows * 1152, long_run_bytes=2048)
    chosen = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=direction, policy=policy)
    Mover(policy).execute(chosen, layer_pairs(srcs, dsts))
    assert same_bytes(dst_memory, expected)
    assert same_bytes(src_memory, src_before)


def layered_kernels(calls: list[str]) -> KernelSet:
    def copy_runs_layers(pairs, runs):
        calls.append(f"copy_runs_layers x{len(pairs)}")
        for src, dst in zip(pairs.src_words, pairs.dst_words, strict=True):
            REFERENCE.copy_runs(src, dst, runs)

    def gather_prepared(pairs, rows):
        calls.append(f"gather_prepared x{len(pairs)}")
        REFERENCE.gather_prepared(pairs, rows)

    def stage_in(*args):
        calls.append("stage_in")
        REFERENCE.stage_in(*args)

    return KernelSet(
        "layered",
        REFERENCE.copy_runs,
        REFERENCE.prepare_gather,
        stage_in,
        REFERENCE.stage_out,
        copy_runs_layers=copy_runs_layers,
        prepare_rows=REFERENCE.prepare_rows,
        gather_prepared=gather_prepared,
    )


@pytest.mark.parametrize(
    ("path", "calls"),
    [
        (TransferPath.SINGLE_COPY, ["copy_runs_layers x3"]),
        (TransferPath.BATCHED_RUNS, ["copy_runs_layers x3"]),
        (TransferPath.GATHER, ["gather_prepared x3"]),
        # No layered staging: each pair is staged in turn, in one piece of 12 rows.
        (TransferPath.STAGED, ["stage_in"] * 3),
    ],
    ids=lambda v: v.value if isinstance(v, TransferPath) else None,
)
def test_layered_kernel_ops_take_every_pair_in_one_call(swap_kernels, path, calls):
    issued: list[str] = []
    swap_kernels("cpu", layered_kernels(issued))
    gen = torch.Generator().manual_seed(4)
    _, host = side(True, gen)
    device_memory, device = side(False, gen)
    src_idx, dst_idx = indices(path, H2D, gen)
    expected = expected_after(host, device_memory, False, src_idx, dst_idx)
    chosen = plan(host[0], device[0], src_idx, dst_idx, direction=H2D, policy=POLICY)
    Mover(POLICY).execute(chosen, layer_pairs(host, device))
    assert issued == calls
    assert same_bytes(device_memory, expected)


def test_pairs_kvcore_cannot_move_carry_the_stock_reason():
    gen = torch.Generator().manual_seed(5)
    rows = [random_bytes((8, 64), torch.float16, gen) for _ in range(4)]
    assert layer_pairs(rows[:2], rows[2:]).reason is None
    assert layer_pairs(rows[:2], [rows[2], rows[3].view(torch.int16)]).reason == "dtype_mismatch"
    wider = random_bytes((8, 128), torch.float16, gen)
    assert layer_pairs([rows[0], wider], [rows[2], wider.clone()]).reason == "row_shape_mismatch"
    strided = random_bytes((8, 128), torch.float16, gen)[:, :64]
    assert layer_pairs([rows[0], strided], rows[2:]).reason == "strided_rows"
    assert layer_pairs([rows[0]], [rows[0]]).reason == "overlapping_buffers"


def test_pairs_are_one_word_type_wide_enough_for_all():
    gen = torch.Generator().manual_seed(6)
    aligned = [random_bytes((8, 64), torch.int64, gen).view(torch.uint8) for _ in range(3)]
    # A byte view one byte into its buffer: no word wider than a byte fits its address.
    odd = random_bytes((8 * 512 + 1,), torch.uint8, gen)[1:].view(8, 512)
    wide = layer_pairs(aligned[:2], [aligned[2], aligned[2].clone()])
    assert wide.reason is None and wide.word_bytes == 8
    narrow = layer_pairs([aligned[0], odd], [aligned[1], aligned[2]])
    assert narrow.reason is None and narrow.word_bytes == 1
    assert {t.dtype for t in (*narrow.src_words, *narrow.dst_words)} == {torch.uint8}


def test_malformed_pairs_raise():
    rows = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="as many sources"):
        layer_pairs([], [])
    with pytest.raises(ValueError, match="as many sources"):
        layer_pairs([rows, rows.clone()], [rows.clone()])
    with pytest.raises(ValueError, match="several devices"):
        layer_pairs([rows, torch.zeros(4, 8, device="meta")], [rows.clone(), rows.clone()])
    with pytest.raises(ValueError, match="scalar"):
        layer_pairs([torch.tensor(1.0)], [torch.tensor(2.0)])


def test_plans_that_do_not_fit_the_pairs_are_refused_before_any_copy():
    gen = torch.Generator().manual_seed(7)
    long_src = random_bytes((30, 16), torch.int32, gen)
    short_src = random_bytes((10, 16), torch.int32, gen)
    dsts = [random_bytes((30, 16), torch.int32, gen) for _ in range(2)]
    before = [d.clone() for d in dsts]
    reaching = plan(long_src, dsts[0], torch.tensor([25, 3]), torch.tensor([0, 1]), direction=H2D)
    pairs = layer_pairs([long_src, short_src], dsts)
    assert "shortest pair has 10" in layers_mismatch(reaching, pairs)
    with pytest.raises(ValueError, match="shortest pair"):
        Mover().execute(reaching, pairs)
    forced = plan(
        long_src,
        dsts[0],
        torch.tensor([1]),
        torch.tensor([0]),
        direction=H2D,
        force=TransferPath.FALLBACK,
    )
    with pytest.raises(ValueError, match="falls back"):
        Mover().execute(forced, pairs)
    wide = plan(
        random_bytes((30, 32), torch.int32, gen),
        random_bytes((30, 32), torch.int32, gen),
        torch.tensor([1]),
        torch.tensor([0]),
        direction=H2D,
    )
    with pytest.raises(ValueError, match="rows of 128 B"):
        Mover().execute(wide, pairs)
    mixed = layer_pairs([long_src, long_src.view(torch.float32)], dsts)
    with pytest.raises(ValueError, match="dtype_mismatch"):
        Mover().execute(wide, mixed)
    for got, want in zip(dsts, before, strict=True):
        assert torch.equal(got, want)


def test_metrics_count_the_bytes_of_every_pair():
    gen = torch.Generator().manual_seed(8)
    srcs = [random_bytes((20, 64), torch.uint8, gen) for _ in range(4)]
    dsts = [random_bytes((20, 64), torch.uint8, gen) for _ in range(4)]
    metrics = Metrics()
    chosen = plan(srcs[0], dsts[0], torch.arange(5), torch.arange(5, 10), direction=D2H)
    Mover(metrics=metrics).execute(chosen, layer_pairs(srcs, dsts))
    (recorded,) = metrics.snapshot()["transfers"]
    assert (recorded["path"], recorded["count"], recorded["bytes"]) == (
        "single_copy",
        1,
        4 * 5 * 64,
    )


def memmove_batches(log: list[tuple[int, bool]]):
    def copy(dsts, srcs, sizes, device, *, host_pinned, stream=None):
        log.append((len(sizes), host_pinned))
        for target, source, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(target, source, size)

    return copy


@pytest.mark.parametrize("shared_host", [False, True], ids=["own_tensors", "shared_host"])
def test_cuda_batched_runs_address_every_pair(monkeypatch, shared_host):
    log: list[tuple[int, bool]] = []
    monkeypatch.setattr(run_copies, "copy_pointers_batched", memmove_batches(log))
    gen = torch.Generator().manual_seed(9)
    _, host = side(shared_host, gen)
    device_memory, device = side(False, gen)
    src_idx = torch.cat([SLOTS[0:4], SLOTS[9:15], SLOTS[30:33]])
    dst_idx = torch.cat([SLOTS[40:44], SLOTS[0:6], SLOTS[20:23]])
    chosen = plan(
        host[0], device[0], src_idx, dst_idx, direction=H2D, force=TransferPath.BATCHED_RUNS
    )
    expected = expected_after(host, device_memory, False, src_idx, dst_idx)
    assert run_copies.copy_runs_layers(layer_pairs(host, device), chosen.runs) is None
    assert same_bytes(device_memory, expected)
    # One submission of every run of every pair; CPU memory is not pinned.
    assert log == [(chosen.runs.count * LAYERS, False)]


@pytest.mark.parametrize("direction", [H2D, D2H])
@pytest.mark.parametrize("shared_host", [False, True], ids=["own_tensors", "shared_host"])
def test_cuda_batched_runs_walk_an_interleaved_host_region_in_address_order(
    monkeypatch, direction, shared_host
):
    """Views interleaved in one host region go run by run, each run's pages of every layer
    in address order; a layer's own host tensor goes layer by layer, as before."""
    host_addresses: list[int] = []
    copy = memmove_batches([])

    def logged(dsts, srcs, sizes, device, **kwargs):
        host_addresses.extend((srcs if direction is H2D else dsts).tolist())
        copy(dsts, srcs, sizes, device, **kwargs)

    monkeypatch.setattr(run_copies, "copy_pointers_batched", logged)
    gen = torch.Generator().manual_seed(12)
    host_memory, host = side(shared_host, gen)
    device_memory, device = side(False, gen)
    host_idx = torch.cat([SLOTS[8:12], SLOTS[16:24], SLOTS[0:3]])
    device_idx = torch.cat([SLOTS[40:44], SLOTS[0:8], SLOTS[20:23]])
    if direction is H2D:
        srcs, dsts, src_idx, dst_idx = host, device, host_idx, device_idx
        written, untouched, shared_dst = device_memory, host_memory, False
    else:
        srcs, dsts, src_idx, dst_idx = device, host, device_idx, host_idx
        written, untouched, shared_dst = host_memory, device_memory, shared_host
    source_before = untouched.clone()
    expected = expected_after(srcs, written, shared_dst, src_idx, dst_idx)
    # The pairs in reverse: the host's address order is then not the pairs' order.
    srcs, dsts = srcs[::-1], dsts[::-1]
    chosen = plan(
        srcs[0], dsts[0], src_idx, dst_idx, direction=direction, force=TransferPath.BATCHED_RUNS
    )
    assert run_copies.copy_runs_layers(layer_pairs(srcs, dsts), chosen.runs) is None
    assert same_bytes(written, expected)
    assert same_bytes(untouched, source_before)
    runs = chosen.runs.count
    by_run = np.array(host_addresses).reshape(runs, LAYERS)
    by_layer = np.array(host_addresses).reshape(LAYERS, runs)
    if shared_host:
        assert (np.diff(by_run, axis=1) > 0).all()
    else:
        view_bytes = VIEW_ROWS * host_memory[0].numel() * host_memory.element_size()
        views = (by_layer - host_memory.data_ptr()) // view_bytes
        assert views.tolist() == [[layer] * runs for layer in reversed(range(LAYERS))]


def test_the_run_order_holds_against_the_json_it_cites():
    """Paired request by request on one H100, alone and beside decode and prefill forwards:
    MHA's 32 KiB pages copied run by run (block-major) went faster than pair by pair in every
    cell, the paired interval above 1, the forward within 1% of its time alone; through
    vLLM's handler, loads of 32k tokens took at most 1.12x the link run by run."""
    root = Path(__file__).resolve().parents[2]
    probe, handler = (json.loads((root / f).read_text()) for f in run_copies.RUN_ORDER_EVIDENCE)
    assert len(probe["cells"]) == 6
    for cell in probe["cells"]:
        block_major = cell["variants"]["block-major"]
        assert cell["identical"] and block_major["speed_over_layer_major"][1] > 1, cell
        assert block_major.get("forward_over_alone", 1.0) <= 1.01, cell
    for name in ("run-by-run", "run-by-run-again"):
        loads = [
            row
            for row in handler["runs"][name]["rows"]
            if row["case"].endswith("/load") and row["tokens"] == 32768
        ]
        assert len(loads) == 4 and all(row["identical"] for row in loads)
        assert all(row["kvcore_ms"] <= 1.12 * row["link_ms"] for row in loads), name


def test_cuda_batched_runs_refused_go_run_by_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise BatchCopyError("pageable host memory")

    monkeypatch.setattr(run_copies, "copy_pointers_batched", refuse)
    gen = torch.Generator().manual_seed(10)
    host_memory, host = side(True, gen)
    _, device = side(False, gen)
    src_idx = torch.cat([SLOTS[0:3], SLOTS[6:8], SLOTS[20:23]])
    dst_idx = torch.cat([SLOTS[9:12], SLOTS[30:32], SLOTS[3:6]])
    chosen = plan(
        device[0], host[0], src_idx, dst_idx, direction=D2H, force=TransferPath.BATCHED_RUNS
    )
    expected = expected_after(device, host_memory, True, src_idx, dst_idx)
    reason = run_copies.copy_runs_layers(layer_pairs(device, host), chosen.runs)
    assert reason == "batch_copy_refused:pageable host memory"
    assert same_bytes(host_memory, expected)


def test_submissions_take_every_pair_at_once_where_they_can():
    gen = torch.Generator().manual_seed(12)
    srcs = [random_bytes((20, 64), torch.uint8, gen) for _ in range(3)]
    dsts = [random_bytes((20, 64), torch.uint8, gen) for _ in range(3)]
    first = plan(srcs[0], dsts[0], torch.arange(4), torch.arange(4, 8), direction=H2D)
    buffers = list(zip(srcs, dsts, strict=True))
    (one,) = submissions(first, buffers, layer_pairs(srcs, dsts))
    assert one.plan is first and one.pairs is not None and len(one.pairs) == 3
    each = submissions(first, buffers, None)
    assert len(each) == 3 and all(s.pairs is None for s in each)
    assert all(
        s.plan.src is src and s.plan.dst is dst for s, (src, dst) in zip(each, buffers, strict=True)
    )
    # The pair the plan was made for keeps it; the others get it rebound.
    assert each[0].plan is first and all(s.plan is not first for s in each[1:])
    mixed = [*buffers[:2], (srcs[2].view(torch.int8), dsts[2])]
    assert submissions(first, mixed, layer_pairs(*zip(*mixed, strict=True))) == "dtype_mismatch"


# Destinations that share memory: one submission must never write a byte twice.


@pytest.mark.parametrize("direction", [H2D, D2H], ids=lambda d: d.value)
def test_pairs_writing_one_destination_twice_are_refused(direction):
    gen = torch.Generator().manual_seed(13)
    srcs = [random_bytes((20, 64), torch.int16, gen) for _ in range(2)]
    dst = random_bytes((20, 64), torch.int16, gen)
    pairs = layer_pairs(srcs, [dst, dst])
    assert pairs.reason == "overlapping_buffers"
    src_idx, dst_idx = torch.tensor([3, 9, 4, 15]), torch.tensor([0, 7, 19, 2])
    first = plan(srcs[0], dst, src_idx, dst_idx, direction=direction)
    before = dst.clone()
    with pytest.raises(ValueError, match="overlapping_buffers"):
        Mover().execute(first, pairs)
    assert torch.equal(dst, before)
    # Pair by pair instead, in order: the engine's own result.
    work = submissions(first, [(srcs[0], dst), (srcs[1], dst)], pairs)
    assert isinstance(work, list) and [s.pairs for s in work] == [None, None]
    for each in work:
        Mover().execute(each.plan, each.pairs)
    expected = before.clone()
    expected[dst_idx] = srcs[1][src_idx]  # the last pair's write wins, as in stock's loop
    assert torch.equal(dst, expected)


def test_pairs_whose_memory_meets_whatever_the_rows_are_refused():
    gen = torch.Generator().manual_seed(14)
    own = [random_bytes((20, 64), torch.uint8, gen) for _ in range(2)]
    memory = random_bytes((41 * 64,), torch.uint8, gen)
    # Two destinations half a row apart: every row of one meets two rows of the other.
    halfway = [memory[:1280].view(20, 64), memory[32 : 32 + 1280].view(20, 64)]
    assert layer_pairs(own, halfway).reason == "overlapping_buffers"
    # One pair's destination is another pair's source.
    assert layer_pairs([own[0], own[1]], [own[1].clone(), own[0]]).reason == "overlapping_buffers"
    # Sources may share memory: they are only read.
    assert layer_pairs([own[0], own[0]], [halfway[0], own[1]]).reason is None
    assert layer_pairs([own[0], own[0]], [own[1], own[1].clone()]).shared_dsts == ()


def test_shared_destinations_take_plans_whose_rows_stay_apart():
    gen = torch.Generator().manual_seed(15)
    host_memory, host = side(True, gen)
    _, device = side(False, gen)
    pairs = layer_pairs(device, host)
    (offsets,) = pairs.shared_dsts
    assert offsets.tolist() == [0, CHUNK_ROWS, 2 * CHUNK_ROWS]
    apart = plan(device[0], host[0], SLOTS[:12], SLOTS[12:24], direction=D2H)
    assert layers_mismatch(apart, pairs) is None
    # Row CHUNK_ROWS of the first view is row 0 of the second.
    meeting = plan(device[0], host[0], SLOTS[:2], torch.tensor([0, CHUNK_ROWS]), direction=D2H)
    before = host_memory.clone()
    with pytest.raises(ValueError, match="write a byte twice"):
        Mover().execute(meeting, pairs)
    assert same_bytes(host_memory, before)
    work = submissions(meeting, list(zip(device, host, strict=True)), pairs)
    assert isinstance(work, list) and len(work) == LAYERS
    # Destination rows on the device, never read, cannot be checked against shared memory.
    unread = plan_device_indexed(
        host[0], host[1].clone(), SLOTS[:4], torch.arange(4), direction=H2D
    )
    shared_device = layer_pairs([h.clone() for h in host], host)
    with pytest.raises(ValueError, match="unread"):
        Mover().execute(unread, shared_device)


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    rows=st.sets(st.integers(0, 59), max_size=24),
)
def test_rows_collide_exactly_where_two_destinations_write_one_row(gaps, rows):
    memory = torch.zeros(200, 4, dtype=torch.int32)
    offsets = np.cumsum([0, *gaps])
    views = [memory[o : o + 60] for o in offsets.tolist()]
    pairs = layer_pairs([torch.ones(60, 4, dtype=torch.int32)] * len(views), views)
    assert pairs.reason is None and pairs.shared_dsts[0].tolist() == offsets.tolist()
    written = torch.tensor(sorted(rows), dtype=torch.int64)
    shuffled = written[torch.randperm(len(written), generator=torch.Generator().manual_seed(0))]
    memory_rows = [o + r for o in offsets.tolist() for r in rows]
    collide = len(set(memory_rows)) != len(memory_rows)
    assert pairs.rows_collide(find_runs(shuffled)) is collide
