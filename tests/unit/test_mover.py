"""Mover: every path byte-identical to a per-index loop; path choice; bad input; metrics."""

from __future__ import annotations

import dataclasses
import gc
import math
import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.direction import Direction
from kvcore.kernels import REFERENCE, KernelSet
from kvcore.kernels.reference import buffer_rows
from kvcore.metrics import METRICS, Metrics
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed, plan_device_indexed_for
from kvcore.planning.host_run import one_host_run
from kvcore.planning.path_policy import FALLBACK_REASONS, PathPolicy, TransferPath
from kvcore.planning.plans import TransferPlan, plan, plan_for
from kvcore.planning.transfer_sides import check_sides
from kvcore.runs import find_runs
from kvcore.staging import StagingBuffers

H2D, D2H = Direction.H2D, Direction.D2H
SINGLE, STAGED, BATCHED, GATHER, FALLBACK = (
    TransferPath.SINGLE_COPY,
    TransferPath.STAGED,
    TransferPath.BATCHED_RUNS,
    TransferPath.GATHER,
    TransferPath.FALLBACK,
)
POISON = 0xA5
FP8 = [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []
DTYPES = [torch.bfloat16, torch.float16, torch.uint8, torch.int8, *FP8]
ROWS = {
    "mha_4k": (2, 8, 128),
    "mla_576": (1, 576),
    "dsa_page": (64 * 132,),
    "odd_3": (3,),
}
# NaNs with payloads and sign bits: a copy through float registers could canonicalise them.
NAN_PATTERNS: dict[torch.dtype, tuple[torch.dtype, list[int]]] = {
    torch.bfloat16: (torch.int16, [0x7FC1, -0x007F, 0x7F81]),
    torch.float16: (torch.int16, [0x7E01, -0x03FF, 0x7C01]),
    **{dtype: (torch.uint8, [0x7F, 0xFF]) for dtype in FP8},
}
SRC_ROWS, DST_ROWS = 48, 40


def ident(value: object) -> str:
    return str(getattr(value, "value", value))


SMALL_POLICY = PathPolicy(staging_bytes=64 << 10, long_run_bytes=16 << 10)


def random_rows(rows: int, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    size = rows * math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    if dtype in NAN_PATTERNS:
        word_dtype, patterns = NAN_PATTERNS[dtype]
        words = data.view(word_dtype)
        for i, pattern in enumerate(patterns):
            words[i :: 5 * len(patterns)] = pattern
    return data.view(dtype).view(rows, *shape)


def poisoned_rows(rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    size = rows * math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.full((size,), POISON, dtype=torch.uint8).view(dtype).view(rows, *shape)


def row_bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def loop_reference(src, dst, src_idx, dst_idx) -> torch.Tensor:
    """The plain per-index copy, on bytes."""
    out = row_bytes_of(dst).clone()
    src_bytes = row_bytes_of(src)
    for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
        out[d] = src_bytes[s]
    return out


def check_transfer(mover, src, dst, src_idx, dst_idx, direction, **kwargs):
    """Run one transfer and assert the bytes; returns the plan."""
    expected = loop_reference(src, dst, src_idx, dst_idx)
    src_before = row_bytes_of(src).clone()
    dst_poisoned = bool((row_bytes_of(dst) == POISON).all())
    done = mover.transfer(src, dst, src_idx, dst_idx, direction=direction, **kwargs)
    assert torch.equal(row_bytes_of(dst), expected)
    assert torch.equal(row_bytes_of(src), src_before)
    if dst_poisoned:
        keep = torch.ones(dst.shape[0], dtype=torch.bool)
        keep[dst_idx] = False
        assert bool((row_bytes_of(dst)[keep] == POISON).all())
    return done


def fixed_layouts(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    def perm(n: int, pool: int) -> torch.Tensor:
        return torch.randperm(pool, generator=gen)[:n]

    return {
        "empty": (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)),
        "one_run": (torch.arange(10, 34), torch.arange(5, 29)),
        "src_run_dst_scattered": (torch.arange(0, 24), perm(24, DST_ROWS)),
        "src_scattered_dst_run": (perm(24, SRC_ROWS), torch.arange(16, 40)),
        "paired_runs": (
            torch.cat([torch.arange(0, 8), torch.arange(20, 28), torch.arange(36, 44)]),
            torch.cat([torch.arange(30, 38), torch.arange(0, 8), torch.arange(12, 20)]),
        ),
        "scattered": (perm(24, SRC_ROWS), perm(24, DST_ROWS)),
        "repeated_src": (torch.randint(0, 6, (24,), generator=gen), perm(24, DST_ROWS)),
    }


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=ident)
@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
@pytest.mark.parametrize("path", [SINGLE, STAGED, BATCHED, GATHER, FALLBACK], ids=ident)
def test_forced_path_is_byte_identical(path, direction, dtype, row):
    gen = torch.Generator().manual_seed(hash((path.value, direction.value, str(dtype))) % 2**31)
    mover = Mover(SMALL_POLICY)
    src = random_rows(SRC_ROWS, row, dtype, gen)
    for name, (src_idx, dst_idx) in fixed_layouts(gen).items():
        dst = poisoned_rows(DST_ROWS, row, dtype)
        if path is SINGLE and name not in ("empty", "one_run"):
            with pytest.raises(ValueError):
                plan(src, dst, src_idx, dst_idx, direction=direction, force=path)
            continue
        done = check_transfer(mover, src, dst, src_idx, dst_idx, direction, force=path)
        assert done.path is path
        assert done.reason == ("forced" if path is FALLBACK else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=ident)
def test_sources_carry_nan_payloads(dtype):
    src = random_rows(4, ROWS["mha_4k"], dtype, torch.Generator().manual_seed(0))
    assert bool(src.float().isnan().any())


@pytest.mark.parametrize("path", [SINGLE, STAGED, BATCHED, GATHER], ids=ident)
@pytest.mark.parametrize(("src_offset", "dst_offset"), [(1, 0), (2, 8), (8, 4), (6, 3)])
def test_misaligned_buffers_use_a_common_word(path, src_offset, dst_offset):
    gen = torch.Generator().manual_seed(src_offset * 10 + dst_offset)
    row = 24
    src_base = torch.randint(0, 256, (SRC_ROWS * row + 16,), dtype=torch.uint8, generator=gen)
    dst_base = torch.full((DST_ROWS * row + 16,), POISON, dtype=torch.uint8)
    src = src_base[src_offset : src_offset + SRC_ROWS * row].view(SRC_ROWS, row)
    dst = dst_base[dst_offset : dst_offset + DST_ROWS * row].view(DST_ROWS, row)
    src_idx, dst_idx = torch.arange(3, 23), torch.arange(10, 30)
    if path is not SINGLE:
        dst_idx = torch.randperm(DST_ROWS, generator=gen)[:20]
    check_transfer(Mover(SMALL_POLICY), src, dst, src_idx, dst_idx, H2D, force=path)
    untouched_tail = dst_base[dst_offset + DST_ROWS * row :]
    assert bool((untouched_tail == POISON).all()) and bool((dst_base[:dst_offset] == POISON).all())


@st.composite
def index_layouts(draw: st.DrawFn, n: int, pool: int) -> torch.Tensor:
    """``n`` distinct rows of ``pool`` as runs: fragmentation 0..100 %, optionally shuffled."""
    rnd: random.Random = draw(st.randoms(use_true_random=False))
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    fragmentation = draw(st.floats(0.0, 1.0))
    count = 1 + round(fragmentation * (n - 1))
    cuts = sorted(rnd.sample(range(1, n), count - 1))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    free = pool - n
    gap_cuts = sorted(rnd.randint(0, free) for _ in range(count))
    gaps = [b - a for a, b in zip([0, *gap_cuts[:-1]], gap_cuts, strict=True)]
    runs, position = [], 0
    for gap, length in zip(gaps, lengths, strict=True):
        position += gap
        runs.append(torch.arange(position, position + length))
        position += length
    if draw(st.booleans()):
        rnd.shuffle(runs)
    return torch.cat(runs)


@st.composite
def transfers(draw: st.DrawFn):
    direction = draw(st.sampled_from([H2D, D2H]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.uint8, *FP8]))
    row = draw(st.sampled_from(list(ROWS.values())))
    n = draw(st.integers(0, 40))
    src_pool = n + draw(st.integers(0, 24))
    dst_pool = n + draw(st.integers(0, 24))
    src_idx = draw(index_layouts(n, max(src_pool, 1)))
    dst_idx = draw(index_layouts(n, max(dst_pool, 1)))
    if n and draw(st.booleans()):
        src_idx = src_idx[torch.randint(0, n, (n,), generator=torch.Generator().manual_seed(n))]
    seed = draw(st.integers(0, 2**31 - 1))
    return direction, dtype, row, max(src_pool, 1), max(dst_pool, 1), src_idx, dst_idx, seed


@settings(max_examples=150, deadline=None)
@given(transfers(), st.integers(1, 12), st.integers(1, 40))
def test_chosen_path_is_byte_identical(transfer, long_rows, staging_rows):
    direction, dtype, row, src_pool, dst_pool, src_idx, dst_idx, seed = transfer
    gen = torch.Generator().manual_seed(seed)
    src = random_rows(src_pool, row, dtype, gen)
    dst = poisoned_rows(dst_pool, row, dtype)
    row_size = src[0].numel() * src.element_size()
    policy = PathPolicy(staging_bytes=staging_rows * row_size, long_run_bytes=long_rows * row_size)
    done = check_transfer(Mover(policy), src, dst, src_idx, dst_idx, direction)
    assert done.path is not FALLBACK
    assert done.path is not SINGLE or done.runs.count <= 1


@settings(max_examples=100, deadline=None)
@given(transfers(), st.integers(1, 6), st.integers(0, 8447))
def test_staged_chunks_with_a_tiny_buffer(transfer, rows_per_chunk, slack):
    direction, dtype, row, src_pool, dst_pool, src_idx, dst_idx, seed = transfer
    gen = torch.Generator().manual_seed(seed)
    src = random_rows(src_pool, row, dtype, gen)
    dst = poisoned_rows(dst_pool, row, dtype)
    row_size = src[0].numel() * src.element_size()
    policy = PathPolicy(staging_bytes=rows_per_chunk * row_size + slack % row_size)
    check_transfer(Mover(policy), src, dst, src_idx, dst_idx, direction, force=STAGED)


def counting_kernels(calls: dict[str, int]) -> KernelSet:
    def counted(name: str, op: Callable) -> Callable:
        def run(*args):
            calls[name] = calls.get(name, 0) + 1
            return op(*args)

        return run

    return KernelSet(
        "counting",
        counted("copy_runs", REFERENCE.copy_runs),
        counted("prepare_gather", REFERENCE.prepare_gather),
        counted("stage_in", REFERENCE.stage_in),
        counted("stage_out", REFERENCE.stage_out),
    )


@pytest.mark.parametrize(("direction", "op"), [(H2D, "stage_in"), (D2H, "stage_out")])
def test_staging_is_chunked_and_dispatched_by_device(swap_kernels, direction, op):
    calls: dict[str, int] = {}
    swap_kernels("cpu", counting_kernels(calls))
    gen = torch.Generator().manual_seed(7)
    src = random_rows(SRC_ROWS, (1, 576), torch.bfloat16, gen)
    dst = poisoned_rows(DST_ROWS, (1, 576), torch.bfloat16)
    mover = Mover(PathPolicy(staging_bytes=7 * 1152 + 100))
    src_idx = torch.randperm(SRC_ROWS, generator=gen)[:30]
    dst_idx = torch.randperm(DST_ROWS, generator=gen)[:30]
    check_transfer(mover, src, dst, src_idx, dst_idx, direction, force=STAGED)
    assert calls == {op: math.ceil(30 / 7)}


def test_staged_chunks_are_planned_once_and_fit_a_smaller_buffer():
    gen = torch.Generator().manual_seed(8)
    src = random_rows(SRC_ROWS, (1, 576), torch.bfloat16, gen)
    host_idx = torch.cat([torch.arange(0, 20), torch.arange(30, 40)])
    dst_idx = torch.randperm(DST_ROWS, generator=gen)[:30]
    dst = poisoned_rows(DST_ROWS, (1, 576), torch.bfloat16)
    policy = PathPolicy(staging_bytes=8 * 1152)
    planned = plan(src, dst, host_idx, dst_idx, direction=H2D, policy=policy, force=STAGED)
    bounds = [(c.begin, c.end, c.host_runs.as_list()) for c in planned.staged_chunks]
    assert bounds == [(0, 8, [(0, 8)]), (8, 16, [(8, 8)]), (16, 24, [(16, 4), (30, 4)]),
                      (24, 30, [(34, 6)])]  # fmt: skip
    rebound = planned.rebind(src, poisoned_rows(DST_ROWS, (1, 576), torch.bfloat16))
    assert rebound.staged_chunks is planned.staged_chunks
    # A mover with less staging than the plan's policy re-cuts the chunks, still exact.
    expected = rebound.dst.clone()
    expected[dst_idx] = src[host_idx]
    Mover(PathPolicy(staging_bytes=8 * 1152), staging=StagingBuffers(5 * 1152)).execute(rebound)
    assert torch.equal(rebound.dst.view(torch.uint8), expected.view(torch.uint8))


def test_row_larger_than_staging():
    src = torch.zeros(8, 1024, dtype=torch.uint8)
    dst = torch.zeros(8, 1024, dtype=torch.uint8)
    idx = torch.arange(8)
    scattered = torch.tensor([7, 0, 5, 2, 3, 6, 1, 4])
    policy = PathPolicy(staging_bytes=1000, long_run_bytes=1 << 20)
    assert plan(src, dst, idx, scattered, direction=H2D, policy=policy).path is GATHER
    with pytest.raises(ValueError, match="staging"):
        plan(src, dst, idx, scattered, direction=H2D, policy=policy, force=STAGED)
    small = Mover(PathPolicy(staging_bytes=1 << 20), staging=StagingBuffers(1000))
    forced = plan(src, dst, idx, scattered, direction=H2D, force=STAGED)
    with pytest.raises(ValueError, match="staging"):
        small.execute(forced)


ROW = (1, 576)  # 1152 B
CHOICE_POLICY = PathPolicy(long_run_bytes=8 * 1152)


def chosen(src_idx, dst_idx, direction, policy=CHOICE_POLICY) -> TransferPath:
    src = torch.zeros(64, *ROW, dtype=torch.bfloat16)
    dst = torch.zeros(64, *ROW, dtype=torch.bfloat16)
    return plan(src, dst, src_idx, dst_idx, direction=direction, policy=policy).path


def scattered_idx(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
def test_path_choice(direction):
    run, shuffled = torch.arange(20), scattered_idx(20, 1)
    host_first = (run, shuffled) if direction is H2D else (shuffled, run)
    device_first = (shuffled, run) if direction is H2D else (run, shuffled)
    long_runs = torch.cat([torch.arange(40, 50), torch.arange(0, 10), torch.arange(20, 30)])
    host_long = (long_runs, scattered_idx(30, 2))
    host_long = host_long if direction is H2D else host_long[::-1]
    assert chosen(torch.arange(5, 25), torch.arange(30, 50), direction) is SINGLE
    assert (
        chosen(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), direction)
        is SINGLE
    )
    assert chosen(*host_first, direction) is STAGED
    assert chosen(*host_long, direction) is STAGED
    assert chosen(long_runs, long_runs + 4, direction) is BATCHED
    assert chosen(*device_first, direction) is GATHER
    assert chosen(scattered_idx(20, 3), scattered_idx(20, 4), direction) is GATHER


@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
def test_a_staged_copy_larger_than_the_staging_buffer_goes_to_the_gather(direction):
    run, shuffled = torch.arange(20), scattered_idx(20, 1)
    host_first = (run, shuffled) if direction is H2D else (shuffled, run)
    row_bytes = math.prod(ROW) * 2
    fits = dataclasses.replace(CHOICE_POLICY, staging_bytes=20 * row_bytes)
    assert chosen(*host_first, direction, fits) is STAGED
    # One row more than the buffer holds: staging would take two DMAs and two scatters.
    short = dataclasses.replace(CHOICE_POLICY, staging_bytes=20 * row_bytes - 1)
    assert chosen(*host_first, direction, short) is GATHER


def test_default_policy_thresholds():
    rows = 64  # 256 KiB of 4 KiB rows: the default long run
    src = torch.zeros(4 * rows, 2, 8, 128, dtype=torch.bfloat16)
    dst = torch.zeros(4 * rows, 2, 8, 128, dtype=torch.bfloat16)
    runs = torch.cat([torch.arange(2 * rows, 3 * rows), torch.arange(0, rows)])
    assert plan(src, dst, runs, runs + rows, direction=H2D).path is BATCHED
    device_scattered = torch.randperm(4 * rows, generator=torch.Generator().manual_seed(0))
    assert plan(src, dst, runs, device_scattered[: 2 * rows], direction=H2D).path is STAGED
    short = torch.cat([torch.arange(2 * rows, 3 * rows - 1), torch.arange(0, rows - 1)])
    assert plan(src, dst, short, short + rows, direction=H2D).path is GATHER


def test_plan_fields():
    src = torch.zeros(30, 3, dtype=torch.int16)
    dst = torch.zeros(20, 3, dtype=torch.int16)
    src_idx = torch.tensor([4, 5, 6, 9, 10], dtype=torch.int32)
    dst_idx = torch.tensor([0, 1, 7, 8, 2], dtype=torch.int16)
    for direction, host in ((H2D, [(4, 3), (9, 2)]), (D2H, [(0, 2), (7, 2), (2, 1)])):
        done = plan(src, dst, src_idx, dst_idx, direction=direction)
        assert done.src_idx.dtype == done.dst_idx.dtype == torch.int64
        assert done.runs.src_runs().as_list() == [(4, 2), (6, 1), (9, 1), (10, 1)]
        assert done.host_runs.as_list() == host
        assert (done.rows, done.row_bytes, done.nbytes) == (5, 6, 30)
        assert done.reason is None
        text = done.describe()
        assert direction.value in text and done.path.value in text and "5 rows" in text


def bf16(rows: int, *row: int) -> torch.Tensor:
    return torch.zeros(rows, *row, dtype=torch.bfloat16)


def test_bad_index_types():
    src, dst = bf16(8, 4), bf16(8, 4)
    ok = torch.arange(3)
    with pytest.raises(TypeError):
        plan(src, dst, ok.to("meta"), ok, direction=H2D)
    with pytest.raises(TypeError):
        plan(src, dst, ok, ok.to("meta"), direction=H2D)
    with pytest.raises(TypeError):
        plan(src, dst, ok.float(), ok, direction=H2D)
    with pytest.raises(TypeError):
        plan(src, dst, [0, 1, 2], ok, direction=H2D)


@pytest.mark.parametrize(
    ("src_idx", "dst_idx", "message"),
    [
        ([0, 1, 2], [0, 1], "entries"),
        ([0, -1, 2], [0, 1, 2], "src_idx"),
        ([0, 1, 8], [0, 1, 2], "src_idx"),
        ([0, 1, 2], [0, 1, 6], "dst_idx"),
        ([0, 1, 2], [-3, 1, 2], "dst_idx"),
        ([0, 1, 2], [4, 1, 4], "duplicate"),
    ],
)
def test_bad_indices(src_idx, dst_idx, message):
    with pytest.raises(ValueError, match=message):
        plan(bf16(8, 4), bf16(6, 4), torch.tensor(src_idx), torch.tensor(dst_idx), direction=H2D)


def test_bad_shapes_and_directions():
    idx = torch.arange(2)
    with pytest.raises(ValueError):
        plan(bf16(4, 2), bf16(4, 2), idx.view(1, 2), idx.view(1, 2), direction=H2D)
    with pytest.raises(ValueError):
        plan(torch.zeros(()), bf16(4, 2), torch.arange(0), torch.arange(0), direction=H2D)
    with pytest.raises(ValueError, match="direction"):
        plan(bf16(4, 2), bf16(4, 2), idx, idx)
    meta = torch.empty(4, 2, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="h2d"):
        plan(bf16(4, 2), meta, idx, idx, direction=D2H)
    with pytest.raises(ValueError, match="d2h"):
        plan(meta, bf16(4, 2), idx, idx, direction=H2D)
    with pytest.raises(ValueError):
        PathPolicy(staging_bytes=0)
    with pytest.raises(ValueError):
        StagingBuffers(0)


def fallback_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    base = torch.zeros(40, 8, dtype=torch.bfloat16)
    return {
        "dtype_mismatch": (bf16(10, 8), torch.zeros(10, 8, dtype=torch.float16)),
        "row_shape_mismatch": (bf16(10, 8), bf16(10, 2, 4)),
        "strided_rows": (torch.zeros(10, 16, dtype=torch.bfloat16)[:, :8], bf16(10, 8)),
        "overlapping_buffers": (base[0:20], base[10:30]),
        "unsupported_device": (
            bf16(10, 8),
            torch.empty(10, 8, dtype=torch.bfloat16, device="meta"),
        ),
    }


@pytest.mark.parametrize("reason", fallback_cases().keys())
@pytest.mark.parametrize("force", [None, GATHER, STAGED])
def test_fallback_reasons(reason, force):
    src, dst = fallback_cases()[reason]
    idx = torch.arange(3, 7)
    done = plan(src, dst, idx, idx.flip(0), direction=H2D, force=force)
    assert (done.path, done.reason) == (FALLBACK, reason)
    assert reason in done.describe()
    assert done.reason in FALLBACK_REASONS


def test_more_strided_rows():
    idx = torch.arange(3)
    every_other = torch.zeros(20, 8, dtype=torch.bfloat16)[::2]
    transposed = torch.zeros(8, 10, dtype=torch.bfloat16).t()
    assert plan(every_other, bf16(10, 8), idx, idx, direction=H2D).reason == "strided_rows"
    assert plan(bf16(10, 8), transposed, idx, idx, direction=D2H).reason == "strided_rows"


def test_disjoint_slices_of_one_buffer_are_not_a_fallback():
    gen = torch.Generator().manual_seed(8)
    base = random_rows(40, (8,), torch.bfloat16, gen)
    src, dst = base[0:20], base[20:40]
    dst.view(torch.uint8).fill_(POISON)
    src_idx, dst_idx = torch.arange(2, 12), torch.randperm(20, generator=gen)[:10]
    done = check_transfer(Mover(), src, dst, src_idx, dst_idx, H2D)
    assert done.path is not FALLBACK


def test_fallback_runs_only_stock(swap_kernels):
    failing = KernelSet("failing", *[pytest.fail] * 4)
    swap_kernels("cpu", failing)
    calls = []
    src = random_rows(10, (8,), torch.bfloat16, torch.Generator().manual_seed(9))
    dst = poisoned_rows(10, (8,), torch.float16)
    done = Mover().transfer(
        src, dst, torch.arange(4), torch.arange(4), direction=H2D, stock=lambda: calls.append(1)
    )
    assert done.reason == "dtype_mismatch"
    assert calls == [1]
    assert bool((row_bytes_of(dst) == POISON).all())


def test_stock_is_ignored_on_kvcore_paths():
    calls = []
    gen = torch.Generator().manual_seed(10)
    src, dst = random_rows(10, (8,), torch.bfloat16, gen), poisoned_rows(10, (8,), torch.bfloat16)
    idx = torch.arange(4)
    check_transfer(Mover(), src, dst, idx, idx, H2D, stock=lambda: calls.append(1))
    assert calls == []


def test_overlapping_fallback_reads_before_writing():
    base = torch.arange(30 * 4, dtype=torch.int16).view(30, 4).clone()
    src, dst = base[0:20], base[5:25]
    src_idx, dst_idx = torch.arange(0, 10), torch.arange(0, 10)
    expected = loop_reference(src, dst, src_idx, dst_idx)
    done = Mover().transfer(src, dst, src_idx, dst_idx, direction=D2H)
    assert done.reason == "overlapping_buffers"
    assert torch.equal(row_bytes_of(dst), expected)


def test_metrics_count_paths_bytes_and_fallbacks():
    metrics = Metrics()
    mover = Mover(SMALL_POLICY, metrics=metrics)
    gen = torch.Generator().manual_seed(12)
    src = random_rows(SRC_ROWS, (1, 576), torch.bfloat16, gen)
    layouts = fixed_layouts(gen)
    expected: dict[tuple[str, str], list[int]] = {}
    for path in (SINGLE, STAGED, BATCHED, GATHER):
        for direction in (H2D, D2H):
            for name in ("one_run", "scattered") if path is not SINGLE else ("one_run",):
                dst = poisoned_rows(DST_ROWS, (1, 576), torch.bfloat16)
                done = mover.transfer(src, dst, *layouts[name], direction=direction, force=path)
                count, nbytes = expected.get((direction.value, path.value), [0, 0])
                expected[(direction.value, path.value)] = [count + 1, nbytes + 24 * 1152]
                assert done.nbytes == 24 * 1152
    for reason, (fsrc, fdst) in fallback_cases().items():
        if reason != "unsupported_device":
            for n in (4, 2):
                idx = torch.arange(n)
                mover.transfer(fsrc, fdst, idx, idx, direction=H2D, stock=lambda: None)
            count, nbytes = expected.get(("h2d", "fallback"), [0, 0])
            expected[("h2d", "fallback")] = [count + 2, nbytes + 6 * 16]
    snapshot = metrics.snapshot()
    got = {(t["direction"], t["path"]): [t["count"], t["bytes"]] for t in snapshot["transfers"]}
    assert got == expected
    assert snapshot["fallbacks"] == {
        "dtype_mismatch": 2,
        "overlapping_buffers": 2,
        "row_shape_mismatch": 2,
        "strided_rows": 2,
    }
    assert all(t["seconds"] >= 0 for t in snapshot["transfers"])


@settings(max_examples=60, deadline=None)
@given(st.lists(transfers(), min_size=1, max_size=8))
def test_accounting_is_exact_after_stress(batch):
    metrics = Metrics()
    mover = Mover(SMALL_POLICY, metrics=metrics)
    expected: dict[tuple[str, str], list[int]] = {}
    for direction, dtype, row, src_pool, dst_pool, src_idx, dst_idx, seed in batch:
        gen = torch.Generator().manual_seed(seed)
        src = random_rows(src_pool, row, dtype, gen)
        dst = poisoned_rows(dst_pool, row, dtype)
        done = check_transfer(mover, src, dst, src_idx, dst_idx, direction)
        key = (direction.value, done.path.value)
        count, nbytes = expected.get(key, [0, 0])
        expected[key] = [count + 1, nbytes + done.nbytes]
    snapshot = metrics.snapshot()
    got = {(t["direction"], t["path"]): [t["count"], t["bytes"]] for t in snapshot["transfers"]}
    assert got == expected
    assert snapshot["fallbacks"] == {}


def test_no_metrics_recorded_without_an_instance():
    before = METRICS.snapshot()
    src, dst = bf16(10, 8), torch.zeros(10, 8, dtype=torch.float16)
    Mover().transfer(src, dst, torch.arange(3), torch.arange(3), direction=H2D, stock=lambda: None)
    Mover().transfer(src, src.clone(), torch.arange(3), torch.arange(3), direction=H2D)
    assert METRICS.snapshot() == before


def test_staging_buffers_are_lazy_bounded_and_reused():
    staging = StagingBuffers(4096)
    mover = Mover(PathPolicy(staging_bytes=4096), staging=staging)
    gen = torch.Generator().manual_seed(13)
    src = random_rows(SRC_ROWS, (3,), torch.uint8, gen)
    layouts = fixed_layouts(gen)
    for path in (SINGLE, BATCHED, GATHER):
        dst = poisoned_rows(DST_ROWS, (3,), torch.uint8)
        mover.transfer(src, dst, *layouts["one_run"], direction=H2D, force=path)
    assert staging.bytes_reserved == 0
    pointers = set()
    for direction in (H2D, D2H, H2D):
        dst = poisoned_rows(DST_ROWS, (3,), torch.uint8)
        check_transfer(mover, src, dst, *layouts["scattered"], direction, force=STAGED)
        with staging.lease(torch.device("cpu")) as buffer:
            pointers.add(buffer.data_ptr())
            assert buffer.numel() == 4096 and buffer.dtype == torch.uint8
        assert staging.bytes_reserved == 4096
    assert len(pointers) == 1


@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
def test_many_long_runs_go_to_the_gather_kernel(direction):
    """Past max_batched_runs (max_dma_runs for staged host runs), per-run submission cost
    loses to one kernel launch."""
    rows, runs = 8, 6
    policy = PathPolicy(
        long_run_bytes=rows * 1152, max_dma_runs=runs - 1, max_batched_runs=runs - 1
    )
    src = torch.zeros(4 * rows * runs, *ROW, dtype=torch.bfloat16)
    dst = torch.zeros(4 * rows * runs, *ROW, dtype=torch.bfloat16)
    order = torch.randperm(2 * runs, generator=torch.Generator().manual_seed(5))[:runs]
    long_runs = (order[:, None] * 2 * rows + torch.arange(rows)).flatten()
    assert plan(src, dst, long_runs, long_runs + 1, direction=direction, policy=policy).path is (
        GATHER
    )
    relaxed = PathPolicy(long_run_bytes=rows * 1152, max_dma_runs=runs, max_batched_runs=runs)
    assert plan(src, dst, long_runs, long_runs + 1, direction=direction, policy=relaxed).path is (
        BATCHED
    )
    staged_only = PathPolicy(
        long_run_bytes=rows * 1152, max_dma_runs=runs, max_batched_runs=runs - 1
    )
    assert plan(
        src, dst, long_runs, long_runs + 1, direction=direction, policy=staged_only
    ).path is (STAGED)
    scattered = torch.randperm(src.shape[0], generator=torch.Generator().manual_seed(6))
    host_long = (long_runs, scattered[: long_runs.numel()])
    host_long = host_long if direction is H2D else host_long[::-1]
    assert plan(src, dst, *host_long, direction=direction, policy=policy).path is GATHER
    assert plan(src, dst, *host_long, direction=direction, policy=relaxed).path is STAGED


def test_policy_follows_the_config():
    from kvcore.config import KVCoreConfig
    from kvcore.planning.path_policy import policy_from_config

    config = KVCoreConfig.from_env(
        {
            "KVCORE_STAGING_BYTES": "64MiB",
            "KVCORE_LONG_RUN_BYTES": "128KiB",
            "KVCORE_GATHER_CTAS": "12",
        }
    )
    policy = policy_from_config(config)
    assert (policy.staging_bytes, policy.long_run_bytes, policy.gather_ctas) == (
        64 << 20,
        128 << 10,
        12,
    )


def test_rebind_reuses_the_decision_for_another_layer():
    gen = torch.Generator().manual_seed(12)
    layers = torch.randint(0, 256, (3, 64, 1152), dtype=torch.uint8, generator=gen)
    device = torch.randint(0, 256, (3, 80, 1152), dtype=torch.uint8, generator=gen)
    src_idx = torch.randperm(64, generator=gen)[:40]
    dst_idx = torch.randperm(80, generator=gen)[:40]
    first = plan(layers[0], device[0], src_idx, dst_idx, direction=H2D)
    mover = Mover()
    for layer in range(3):
        again = first.rebind(layers[layer], device[layer])
        assert again.path is first.path
        assert again.paired_runs_found is first.paired_runs_found
        assert again.host_runs_found is first.host_runs_found
        expected = device[layer].clone()
        expected[dst_idx] = layers[layer][src_idx]
        mover.execute(again)
        assert torch.equal(device[layer], expected)


def test_rebind_plans_again_when_the_layout_changes():
    src = torch.zeros(64, 8, dtype=torch.int16)
    dst = torch.zeros(64, 8, dtype=torch.int16)
    idx = torch.arange(10, 20)
    first = plan(src, dst, idx, idx, direction=H2D)
    assert first.rebind(src[:, :4].contiguous(), dst[:, :4].contiguous()).row_bytes == 8
    strided = torch.zeros(64, 16, dtype=torch.int16)[:, ::2]
    assert first.rebind(strided, dst).reason == "strided_rows"
    with pytest.raises(ValueError, match="outside"):
        first.rebind(src[:15], dst)


# plan_device_indexed: the device side's index is never read (SGLang's kernel io backend).


def _device_indexed_case(direction: Direction, host_idx: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (64, *ROW), dtype=torch.uint8, generator=gen)
    device = torch.randint(0, 256, (64, *ROW), dtype=torch.uint8, generator=gen)
    device_idx = torch.randperm(64, generator=gen)[: host_idx.numel()].to(torch.int32)
    if direction is H2D:
        return host, device, host_idx, device_idx
    return device, host, device_idx, host_idx


@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
@pytest.mark.parametrize(
    ("host_idx", "path"),
    [
        (torch.arange(8, 40), STAGED),  # one host run: DMA, then a scatter on the device
        (torch.randperm(64, generator=torch.Generator().manual_seed(3))[:32], GATHER),
    ],
    ids=["host-run", "host-scattered"],
)
def test_device_indexed_plans_copy_exactly_without_device_runs(direction, host_idx, path):
    src, dst, src_idx, dst_idx = _device_indexed_case(direction, host_idx, 21)
    chosen = plan_device_indexed(src, dst, src_idx, dst_idx, direction=direction)
    assert chosen.path is path and chosen.device_index_opaque and chosen.runs.count == 0
    expected = dst.clone()
    expected[dst_idx.long()] = src[src_idx.long()]
    src_before = src.clone()
    Mover(SMALL_POLICY).execute(chosen)
    assert torch.equal(dst, expected)  # copied rows and untouched rows alike
    assert torch.equal(src, src_before)
    rebound = chosen.rebind(src.clone(), dst.clone())  # the next layer: same decision
    assert rebound.path is path and rebound.device_index_opaque


def test_device_indexed_plans_segment_the_host_index_only_where_read():
    src, dst, src_idx, dst_idx = _device_indexed_case(H2D, torch.randperm(64)[:32], 5)
    chosen = plan_device_indexed(src, dst, src_idx, dst_idx, direction=H2D)
    # A gather never reads the host runs: planning only counted them.
    assert chosen.path is GATHER and chosen.host_runs_found is None
    assert chosen.host_runs.as_list() == find_runs(src_idx).as_list()
    assert chosen.host_runs_found is chosen.host_runs  # found once
    staged = plan_device_indexed(src, dst, torch.arange(8, 40), dst_idx, direction=H2D)
    assert staged.path is STAGED and staged.host_runs.as_list() == [(8, 32)]
    assert [c.host_runs.as_list() for c in staged.staged_chunks] == [[(8, 32)]]


@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
def test_plans_from_checked_sides_equal_plans_from_the_buffers(direction):
    host_idx = torch.randperm(64, generator=torch.Generator().manual_seed(8))[:20]
    src, dst, src_idx, dst_idx = _device_indexed_case(direction, host_idx, 9)
    sides = check_sides(src, dst, direction)
    for force in (None, GATHER, STAGED, FALLBACK):
        mine = plan_device_indexed_for(sides, src_idx, dst_idx, policy=SMALL_POLICY, force=force)
        theirs = plan_device_indexed(
            src, dst, src_idx, dst_idx, direction=direction, policy=SMALL_POLICY, force=force
        )
        for field in dataclasses.fields(TransferPlan):
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            if isinstance(a, torch.Tensor):
                assert a is b or torch.equal(a, b), field.name
            elif field.name not in ("runs", "host_runs_found", "staged_chunks"):
                assert a == b, field.name
        assert mine.host_runs.as_list() == theirs.host_runs.as_list()
    mismatched = check_sides(src.half(), dst, direction)
    assert mismatched.reason == "dtype_mismatch"
    assert plan_device_indexed_for(mismatched, src_idx, dst_idx).path is FALLBACK


def _outcome(
    planner: Callable[..., TransferPlan], *args: object, **kwargs: object
) -> TransferPlan | tuple[type, str]:
    try:
        return planner(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


def _assert_same_plan(mine: TransferPlan, theirs: TransferPlan) -> None:
    for field in dataclasses.fields(TransferPlan):
        a, b = getattr(mine, field.name), getattr(theirs, field.name)
        if isinstance(a, torch.Tensor):
            assert a is b or torch.equal(a, b), field.name
        elif field.name not in ("paired_runs_found", "host_runs_found", "staged_chunks"):
            assert a == b, field.name
    assert [c.host_runs.as_list() for c in mine.staged_chunks] == [
        c.host_runs.as_list() for c in theirs.staged_chunks
    ]
    if mine.reason is None:
        assert mine.host_runs.as_list() == theirs.host_runs.as_list()
        assert mine.runs.src_runs().as_list() == theirs.runs.src_runs().as_list()
        assert mine.runs.dst_runs().as_list() == theirs.runs.dst_runs().as_list()


def _index_pairs(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Index pairs into 48 source and 40 destination rows that reach every path and error."""
    pages = torch.randperm(5, generator=gen)[:4]
    return {
        "scattered": (
            torch.randperm(48, generator=gen)[:30],
            torch.randperm(40, generator=gen)[:30],
        ),
        "one-run": (torch.arange(4, 36), torch.arange(2, 34).to(torch.int32)),
        "pages": ((pages[:, None] * 8 + torch.arange(8)).flatten(), torch.arange(32)),
        "few-rows": (torch.tensor([9, 3, 30]), torch.tensor([1, 0, 39])),
        "empty": (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)),
        "duplicate-destinations": (torch.arange(20), torch.arange(20) % 19),
        "out-of-bounds": (torch.arange(20) + 30, torch.arange(20)),
        "lengths": (torch.arange(20), torch.arange(19)),
        "float-index": (torch.arange(20).float(), torch.arange(20)),
        "2-d-index": (torch.arange(20)[None], torch.arange(20)),
    }


# Pages of 8 rows of 32 B: batched copies, where SMALL_POLICY stages or gathers them.
BATCHING_POLICY = PathPolicy(long_run_bytes=64, max_dma_runs=2)


@pytest.mark.parametrize("direction", [H2D, D2H], ids=ident)
@pytest.mark.parametrize("force", [None, SINGLE, BATCHED, STAGED, GATHER, FALLBACK], ids=ident)
def test_plans_for_checked_sides_equal_plans_for_the_buffers(direction, force):
    """plan_for checks the sides once for every plan between them: the same path, runs,
    spans and chunks as plan from the buffers, and the same error for the same bad input."""
    gen = torch.Generator().manual_seed(31)
    src = random_rows(SRC_ROWS, (2, 8), torch.bfloat16, gen)
    dst = random_rows(DST_ROWS, (2, 8), torch.bfloat16, gen)
    sides = check_sides(src, dst, direction)
    for name, (src_idx, dst_idx) in _index_pairs(gen).items():
        for policy in (SMALL_POLICY, PathPolicy(), BATCHING_POLICY):
            mine = _outcome(plan_for, sides, src_idx, dst_idx, policy=policy, force=force)
            theirs = _outcome(
                plan, src, dst, src_idx, dst_idx, direction=direction, policy=policy, force=force
            )
            if isinstance(theirs, TransferPlan):
                assert isinstance(mine, TransferPlan), name
                _assert_same_plan(mine, theirs)
            else:
                assert mine == theirs, name


def test_plans_for_sides_that_must_run_stock_fall_back_with_their_reason():
    gen = torch.Generator().manual_seed(32)
    src = random_rows(SRC_ROWS, (2, 8), torch.bfloat16, gen)
    dst = random_rows(DST_ROWS, (2, 8), torch.float16, gen)
    sides = check_sides(src, dst, H2D)
    for src_idx, dst_idx in _index_pairs(gen).values():
        if src_idx.dtype.is_floating_point or src_idx.dim() != 1 or src_idx.numel() != 32:
            continue
        chosen = plan_for(sides, src_idx, dst_idx)
        assert (chosen.path, chosen.reason) == (FALLBACK, "dtype_mismatch")


def test_a_plan_without_buffers_keeps_the_decision_and_none_of_the_memory():
    src, dst, src_idx, dst_idx = _device_indexed_case(H2D, torch.randperm(64)[:16], 4)
    chosen = plan_device_indexed(src, dst, src_idx, dst_idx, direction=H2D)
    kept = chosen.without_buffers()
    for side, original in ((kept.src, src), (kept.dst, dst)):
        assert side.shape == (0, *original.shape[1:]) and side.dtype == original.dtype
        assert side.device == original.device and side.untyped_storage().nbytes() == 0
    assert (kept.path, kept.rows, kept.nbytes, kept.src_idx) == (
        chosen.path,
        chosen.rows,
        chosen.nbytes,
        chosen.src_idx,
    )
    assert chosen.src is src and chosen.dst is dst  # the original is unchanged
    again = chosen.without_buffers()  # stand-ins of one kind are made once and shared
    assert again.src is kept.src and again.dst is kept.dst and again is not kept
    # The next layer's buffers bring the memory back: same decision, exact copy.
    expected = dst.clone()
    expected[dst_idx.long()] = src[src_idx.long()]
    Mover(SMALL_POLICY).execute(kept.rebind(src, dst))
    assert torch.equal(dst, expected)


def test_a_plan_without_buffers_takes_its_checked_sides_stand_ins():
    src, dst, src_idx, dst_idx = _device_indexed_case(H2D, torch.randperm(64)[:16], 4)
    sides = check_sides(src, dst, H2D)
    chosen = plan_device_indexed_for(sides, src_idx, dst_idx)
    kept = chosen.without_buffers(sides)
    assert (kept.src, kept.dst) == sides.stand_ins and sides.stand_ins is sides.stand_ins
    assert kept.src is chosen.without_buffers().src
    # Sides of other buffers are not this plan's: its own stand-ins are found instead.
    others = check_sides(torch.zeros(8, 3), torch.zeros(8, 3), H2D)
    elsewhere = chosen.without_buffers(others)
    assert elsewhere.src.shape[1:] == src.shape[1:] and elsewhere.src.dtype == src.dtype


def test_every_planner_makes_plans_with_every_field_and_no_other():
    fields = {field.name for field in dataclasses.fields(TransferPlan)}
    src, dst, src_idx, dst_idx = _device_indexed_case(H2D, torch.randperm(64)[:16], 4)
    sides = check_sides(src, dst, H2D)
    plans = [
        plan_for(sides, src_idx, torch.randperm(src.shape[0])[:16]),
        plan_for(sides, torch.arange(16), torch.arange(16)),
        plan_device_indexed_for(sides, src_idx, dst_idx),
    ]
    plans.append(plans[0].without_buffers(sides))
    for made in plans:
        assert set(vars(made)) == fields
        assert dataclasses.replace(made).path is made.path


def test_device_indexed_plans_check_what_they_can_read():
    host = torch.zeros(16, *ROW, dtype=torch.uint8)
    device = torch.zeros(16, *ROW, dtype=torch.uint8)
    idx = torch.arange(4)
    with pytest.raises(ValueError, match="outside"):
        plan_device_indexed(host, device, torch.tensor([0, 16]), idx[:2], direction=H2D)
    with pytest.raises(ValueError, match="4 entries but the device index 3"):
        plan_device_indexed(host, device, idx, idx[:3], direction=H2D)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        plan_device_indexed(host, device, idx, idx.float(), direction=H2D)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        plan_device_indexed(host, device, idx, idx[None], direction=H2D)
    narrow = plan_device_indexed(host, device, idx, idx.to(torch.int16), direction=H2D)
    assert narrow.dst_idx.dtype == torch.int64
    with pytest.raises(ValueError, match="duplicate destinations"):
        plan_device_indexed(device, host, idx, torch.tensor([1, 2, 1, 3]), direction=D2H)
    # Reading a host row twice is fine; single and batched copies need the device runs.
    assert plan_device_indexed(host, device, torch.tensor([1, 1, 2, 3]), idx, direction=H2D)
    with pytest.raises(ValueError, match="needs the device side's runs"):
        plan_device_indexed(host, device, idx, idx, direction=H2D, force=SINGLE)
    mismatched = plan_device_indexed(host.half(), device, idx, idx, direction=H2D)
    assert mismatched.path is FALLBACK and mismatched.reason == "dtype_mismatch"


def test_a_plan_executed_again_reuses_its_gather_set_up_until_the_plan_goes(swap_kernels):
    prepared: list[tuple[torch.Tensor, torch.Tensor]] = []

    def prepare_gather(src_words: torch.Tensor, dst_words: torch.Tensor):
        prepared.append((src_words, dst_words))
        return REFERENCE.prepare_gather(src_words, dst_words)

    with_prepare = dataclasses.replace(REFERENCE, prepare_gather=prepare_gather)
    swap_kernels("cpu", with_prepare)
    gen = torch.Generator().manual_seed(11)
    src = random_rows(SRC_ROWS, (2, 8, 128), torch.bfloat16, gen)
    dst = poisoned_rows(DST_ROWS, (2, 8, 128), torch.bfloat16)
    mover = Mover()
    chosen = plan(
        src,
        dst,
        torch.randperm(SRC_ROWS, generator=gen)[:40],
        torch.randperm(DST_ROWS, generator=gen)[:40],
        direction=H2D,
        force=GATHER,
    )
    for _ in range(3):
        dst.view(torch.uint8).fill_(POISON)
        mover.execute(chosen)
        expected = poisoned_rows(DST_ROWS, (2, 8, 128), torch.bfloat16)
        expected[chosen.dst_idx] = src[chosen.src_idx]
        assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    assert len(prepared) == 1 and len(mover._prepared) == 1
    # Another layer's plan sets up its own; a plan that is gone leaves nothing behind.
    other = chosen.rebind(src.clone(), dst)
    mover.execute(other)
    assert len(prepared) == 2 and len(mover._prepared) == 2
    del chosen, other
    gc.collect()
    assert len(mover._prepared) == 0


def test_a_staging_buffer_first_leased_in_inference_mode_takes_writes_outside_it() -> None:
    # vLLM's model runner runs under inference mode, other callers do not: the buffer, and
    # the rows kept on it, must take writes in both, whichever mode made them.
    staging = StagingBuffers(16 * 1152)
    like = torch.empty(1, 576, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    with torch.inference_mode(), staging.lease(cpu) as buffer:
        buffer_rows(buffer, 8, like).fill_(1)
    with staging.lease(cpu) as buffer:
        assert not buffer.is_inference()
        buffer[:4].copy_(torch.arange(4, dtype=torch.uint8))
        rows = buffer_rows(buffer, 8, like)
        rows.fill_(2)
        assert torch.equal(buffer[: 8 * 1152].view(torch.bfloat16), torch.full((8 * 576,), 2.0))


def test_a_device_indexed_plan_takes_a_host_run_found_before_only_where_it_holds() -> None:
    gen = torch.Generator().manual_seed(17)
    host = torch.randint(0, 256, (64, 1, 1152), dtype=torch.uint8, generator=gen).view(
        torch.bfloat16
    )
    device = torch.zeros(64, *ROW, dtype=torch.bfloat16)
    sides = check_sides(host, device, H2D)
    host_idx, device_idx = torch.arange(8, 40), torch.randperm(64, generator=gen)[:32]
    policy = CHOICE_POLICY
    found = one_host_run(host_idx)
    assert found.span == 40 and found.runs.as_list() == [(8, 32)]
    fresh = plan_device_indexed_for(sides, host_idx, device_idx, policy=policy)
    taken = plan_device_indexed_for(sides, host_idx, device_idx, policy=policy, host_found=found)
    assert (taken.path, taken.src_span) == (fresh.path, fresh.src_span) == (STAGED, 40)
    assert taken.host_runs is found.runs  # not read again
    # Another tensor of the same values: read again.
    same_values = plan_device_indexed_for(
        sides, host_idx.clone(), device_idx, policy=policy, host_found=found
    )
    assert same_values.host_runs is not found.runs
    host_idx[0] = 63  # written since: no longer one run
    rewritten = plan_device_indexed_for(
        sides, host_idx, device_idx, policy=policy, host_found=found
    )
    assert rewritten.host_runs.count == 2 and rewritten.src_span == 64  # read again
    # A run found before any buffer was known still meets the buffer's bound.
    past = torch.arange(40, 72)
    with pytest.raises(ValueError, match="holds 71, outside"):
        plan_device_indexed_for(
            sides, past, device_idx, policy=policy, host_found=one_host_run(past)
        )
    with torch.inference_mode():
        made_inside = torch.arange(4)
    assert not one_host_run(made_inside).holds_for(made_inside)  # no counter to hold it by
    with pytest.raises(ValueError, match="holds -1"):
        one_host_run(torch.tensor([-1, 0]))
    for not_one_run in (torch.tensor([5]), torch.tensor([3, 9, 4])):
        with pytest.raises(ValueError, match="not one run"):
            one_host_run(not_one_run)
