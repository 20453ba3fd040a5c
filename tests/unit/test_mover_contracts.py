"""The mover's contract at its edges: a plan's indices written after planning, rows of no
bytes, and fallbacks run without the engine's stock function."""

from __future__ import annotations

import pytest
import torch

from kvcore.direction import Direction
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import StalePlanError, plan

H2D, D2H = Direction.H2D, Direction.D2H
POISON = 0x5A
SRC_ROWS = DST_ROWS = 48
ROW = (4, 24)
# Small enough that the fixtures below reach every path.
POLICY = PathPolicy(staging_bytes=64 << 10, long_run_bytes=1 << 10)


def random_rows(rows: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """Random bytes seen as ``dtype`` rows (bf16 ones include NaNs with payloads)."""
    size = torch.empty(0, dtype=dtype).element_size()
    count = rows * ROW[0] * ROW[1] * size
    data = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
    return data.view(dtype).view(rows, *ROW)


def poisoned(rows: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    data = torch.full((rows * ROW[0] * ROW[1] * size,), POISON, dtype=torch.uint8)
    return data.view(dtype).view(rows, *ROW)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def copied(src, dst, src_idx, dst_idx) -> torch.Tensor:
    """``dst``'s bytes after a per-index copy."""
    out = as_bytes(dst).clone()
    for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
        out[d] = as_bytes(src)[s]
    return out


def layouts(gen: torch.Generator) -> dict[TransferPath, tuple[torch.Tensor, torch.Tensor]]:
    """Host and device rows that POLICY sends down each path, either direction."""
    scattered_src = torch.randperm(SRC_ROWS, generator=gen)[:40]
    scattered_dst = torch.randperm(DST_ROWS, generator=gen)[:40]
    return {
        TransferPath.SINGLE_COPY: (torch.arange(8, 40), torch.arange(16, 48)),
        TransferPath.BATCHED_RUNS: (
            torch.cat([torch.arange(0, 16), torch.arange(32, 48)]),
            torch.cat([torch.arange(24, 40), torch.arange(0, 16)]),
        ),
        TransferPath.STAGED: (torch.arange(8, 48), scattered_dst),
        # Every row its own run: the plan's runs are the index values themselves.
        TransferPath.GATHER: (scattered_src, scattered_dst),
        TransferPath.FALLBACK: (scattered_src, scattered_dst),
    }


def planned(path: TransferPath, direction: Direction, seed: int):
    """A plan taking ``path``, its tensors and the bytes it must leave in ``dst``."""
    gen = torch.Generator().manual_seed(seed)
    host_idx, device_idx = layouts(gen)[path]
    src, dst = random_rows(SRC_ROWS, gen), poisoned(DST_ROWS)
    src_idx, dst_idx = (host_idx, device_idx) if direction is H2D else (device_idx, host_idx)
    force = TransferPath.FALLBACK if path is TransferPath.FALLBACK else None
    chosen = plan(src, dst, src_idx, dst_idx, direction=direction, policy=POLICY, force=force)
    assert chosen.path is path
    return chosen, src, dst, src_idx, dst_idx


PATHS = list(TransferPath)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("direction", [H2D, D2H], ids=lambda d: d.value)
@pytest.mark.parametrize("written", ["dst_idx", "src_idx"])
def test_an_index_written_after_planning_is_refused_before_any_copy(path, direction, written):
    chosen, src, dst, src_idx, dst_idx = planned(path, direction, seed=1)
    index, rows = (dst_idx, DST_ROWS) if written == "dst_idx" else (src_idx, SRC_ROWS)
    # Past every row: a plan reading it would skip the rows, or write out of bounds.
    index += rows
    metrics = Metrics()
    with pytest.raises(StalePlanError, match=f"{written} was written in place"):
        Mover(POLICY, metrics=metrics).execute(chosen)
    index -= rows
    index.copy_(index.flip(0))  # in range, but other rows than planned
    with pytest.raises(StalePlanError):
        Mover(POLICY, metrics=metrics).execute(chosen)
    with pytest.raises(StalePlanError):
        chosen.rebind(src.clone(), dst.clone())
    assert bool((as_bytes(dst) == POISON).all())
    assert metrics.snapshot()["transfers"] == []


def test_an_index_written_after_planning_is_refused_for_every_layer():
    chosen, src, dst, _, dst_idx = planned(TransferPath.GATHER, H2D, seed=2)
    pairs = layer_pairs([src, src.clone()], [dst, poisoned(DST_ROWS)])
    dst_idx += DST_ROWS
    with pytest.raises(StalePlanError):
        Mover(POLICY).execute(chosen, pairs)
    assert all(bool((as_bytes(d) == POISON).all()) for d in pairs.dsts)


def test_a_stock_fallback_reads_its_own_indices():
    chosen, _, _, _, dst_idx = planned(TransferPath.FALLBACK, H2D, seed=3)
    dst_idx += DST_ROWS
    calls: list[int] = []
    Mover(POLICY).execute(chosen, stock=lambda: calls.append(1))
    assert calls == [1]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
def test_indices_the_plan_converted_are_its_own(path):
    chosen, src, dst, src_idx, dst_idx = planned(path, H2D, seed=4)
    narrow_src, narrow_dst = src_idx.to(torch.int32), dst_idx.to(torch.int32)
    own = plan(src, dst, narrow_src, narrow_dst, direction=H2D, policy=POLICY, force=chosen.path)
    expected = copied(src, dst, src_idx, dst_idx)
    # The caller's int32 tensors are not what the plan reads: changing them changes nothing.
    narrow_dst.copy_(narrow_dst.flip(0))
    narrow_src += 1
    Mover(POLICY).execute(own)
    assert torch.equal(as_bytes(dst), expected)


def test_inference_tensors_are_copied_at_plan_time():
    # Inference tensors have no version counter: the plan keeps a copy instead.
    gen = torch.Generator().manual_seed(5)
    src, dst = random_rows(SRC_ROWS, gen), poisoned(DST_ROWS)
    with torch.inference_mode():
        src_idx = torch.randperm(SRC_ROWS, generator=gen)[:40]
        dst_idx = torch.randperm(DST_ROWS, generator=gen)[:40]
        chosen = plan(src, dst, src_idx, dst_idx, direction=H2D, policy=POLICY)
        expected = copied(src, dst, src_idx, dst_idx)
        dst_idx += DST_ROWS
    assert not chosen.src_idx.is_inference() and not chosen.dst_idx.is_inference()
    Mover(POLICY).execute(chosen)
    assert torch.equal(as_bytes(dst), expected)


@pytest.mark.parametrize("direction", [H2D, D2H], ids=lambda d: d.value)
def test_device_indexed_plans_watch_the_host_index_only(direction):
    gen = torch.Generator().manual_seed(6)
    host, device = random_rows(DST_ROWS, gen), random_rows(DST_ROWS, gen)
    host_idx = torch.randperm(DST_ROWS, generator=gen)[:24]
    device_idx = torch.randperm(DST_ROWS, generator=gen)[:24]
    src, dst = (host, device) if direction is H2D else (device, host)
    src_idx, dst_idx = (host_idx, device_idx) if direction is H2D else (device_idx, host_idx)
    chosen = plan_device_indexed(src, dst, src_idx, dst_idx, direction=direction, policy=POLICY)
    # The device index was never read: like the engine's kernels, the copy reads it when
    # it runs, whatever it holds then.
    device_idx.copy_(device_idx.roll(5))
    expected = copied(src, dst, src_idx, dst_idx)
    Mover(POLICY).execute(chosen)
    assert torch.equal(as_bytes(dst), expected)
    host_idx.copy_(host_idx.flip(0))
    before = as_bytes(dst).clone()
    with pytest.raises(StalePlanError, match="was written in place"):
        Mover(POLICY).execute(chosen)
    assert torch.equal(as_bytes(dst), before)


# Rows of no bytes: a valid transfer that moves nothing, still bounds-checked.


def no_bytes(rows: int) -> torch.Tensor:
    return torch.empty(rows, 0, 8, dtype=torch.bfloat16)


@pytest.mark.parametrize("direction", [H2D, D2H], ids=lambda d: d.value)
@pytest.mark.parametrize(
    "force",
    [None, TransferPath.STAGED, TransferPath.BATCHED_RUNS, TransferPath.GATHER],
    ids=lambda p: "chosen" if p is None else p.value,
)
def test_rows_of_no_bytes_plan_and_execute_as_a_no_op(direction, force):
    # One host run and scattered device rows: the planner's choice is a staged copy.
    host_idx, device_idx = torch.arange(4, 20), torch.randperm(24)[:16]
    src_idx, dst_idx = (host_idx, device_idx) if direction is H2D else (device_idx, host_idx)
    metrics = Metrics()
    mover = Mover(POLICY, metrics=metrics)
    planners = [plan] if force is TransferPath.BATCHED_RUNS else [plan, plan_device_indexed]
    for planner in planners:
        chosen = planner(
            no_bytes(24), no_bytes(24), src_idx, dst_idx, direction=direction, force=force
        )
        assert chosen.path is (force or TransferPath.STAGED)
        assert (chosen.rows, chosen.row_bytes, chosen.nbytes) == (16, 0, 0)
        mover.execute(chosen)
        pairs = layer_pairs([no_bytes(24), no_bytes(24)], [no_bytes(24), no_bytes(24)])
        mover.execute(chosen, pairs)
        # Host rows past the end: the only index both planners read.
        bad = (host_idx + 24, device_idx) if direction is H2D else (device_idx, host_idx + 24)
        with pytest.raises(ValueError, match="outside"):
            planner(no_bytes(24), no_bytes(24), *bad, direction=direction)
    assert {t["bytes"] for t in metrics.snapshot()["transfers"]} == {0}


# Fallbacks without the engine's stock function: bytes unchanged, or a clear refusal.


@pytest.mark.parametrize(
    ("src", "dst", "error", "message"),
    [
        (
            random_rows(10, torch.Generator().manual_seed(7)),
            poisoned(12, torch.float16),
            TypeError,
            r"torch\.bfloat16 cannot move into rows of torch\.float16",
        ),
        (
            random_rows(10, torch.Generator().manual_seed(8))[:, :1],
            poisoned(12),
            ValueError,
            r"shape \(1, 24\) cannot move into rows of shape \(4, 24\)",
        ),
    ],
    ids=["conversion", "broadcast"],
)
def test_a_fallback_without_stock_never_converts_or_broadcasts(src, dst, error, message):
    metrics = Metrics()
    idx = torch.tensor([9, 0, 4])
    with pytest.raises(error, match=message):
        Mover(metrics=metrics).transfer(src, dst, idx, idx.flip(0), direction=H2D)
    assert bool((as_bytes(dst) == POISON).all())
    assert metrics.snapshot()["transfers"] == [] and metrics.snapshot()["fallbacks"] == {}


def fallback_case(reason: str, gen: torch.Generator):
    """A source, the memory a destination lies in, and the destination as a view of it:
    one dtype and row shape, which kvcore's own paths cannot take for ``reason``."""
    if reason == "strided_rows":
        # Every other half-row of a wider buffer.
        wide = poisoned(DST_ROWS).view(DST_ROWS, ROW[0], 2, ROW[1] // 2)
        return random_rows(SRC_ROWS, gen)[:, :, :12], wide, lambda m: m[:, :, 0]
    if reason == "overlapping_buffers":
        shared = random_rows(SRC_ROWS, gen)
        return shared[:40], shared, lambda m: m[16:]
    return random_rows(SRC_ROWS, gen), poisoned(DST_ROWS), lambda m: m


@pytest.mark.parametrize("reason", ["strided_rows", "overlapping_buffers", "forced"])
def test_a_fallback_without_stock_copies_bytes_unchanged(reason):
    gen = torch.Generator().manual_seed(9)
    src, memory, view = fallback_case(reason, gen)
    dst = view(memory)
    src_idx = torch.randperm(src.shape[0], generator=gen)[:20]
    dst_idx = torch.randperm(dst.shape[0], generator=gen)[:20]
    # Every source row read before any is written, as stock indexing does; compared as
    # integers, so that NaN payloads must come through.
    expected = memory.view(torch.int16).clone()
    view(expected)[dst_idx] = src[src_idx].view(torch.int16)
    force = TransferPath.FALLBACK if reason == "forced" else None
    done = Mover().transfer(src, dst, src_idx, dst_idx, direction=H2D, force=force)
    assert done.reason == reason
    # Copied rows, rows left out and the bytes between a strided view's rows alike.
    assert torch.equal(memory.view(torch.int16), expected)
