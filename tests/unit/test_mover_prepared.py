"""Mover.prepare_layers / execute_prepared: a plan made ready once, then one call a layer.

Engines reload layer by layer with the same indices; the prepared path must move exactly
what :meth:`Mover.execute_layers` moves, refuse what it refuses, and never read indices
written after planning. On a CPU the reference kernels stand for the device's ops.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvcore import mover as mover_module
from kvcore.direction import Direction
from kvcore.layers import layer_pairs
from kvcore.metrics import Metrics
from kvcore.mover import Mover, PathPolicy, StalePlanError, TransferPath, plan

ROWS, WIDTH, LAYERS = 64, 48, 3


def random_rows(rows: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**15), 2**15, (rows, WIDTH), dtype=torch.int16, generator=gen)


def layered(gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    srcs = [random_rows(ROWS, gen) for _ in range(LAYERS)]
    dsts = [random_rows(ROWS, gen) for _ in range(LAYERS)]
    return srcs, dsts


def scattered(gen: torch.Generator, count: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randperm(ROWS, generator=gen)[:count], torch.randperm(ROWS, generator=gen)[:count]


def expected(
    srcs: list[torch.Tensor], dsts: list[torch.Tensor], src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> list[torch.Tensor]:
    out = [dst.clone() for dst in dsts]
    for src, dst in zip(srcs, out, strict=True):
        dst[dst_idx] = src[src_idx]
    return out


@pytest.mark.parametrize("path", [TransferPath.GATHER, TransferPath.SINGLE_COPY, None])
def test_each_layer_gets_exactly_the_planned_rows(path: TransferPath | None) -> None:
    gen = torch.Generator().manual_seed(11)
    srcs, dsts = layered(gen)
    if path is TransferPath.SINGLE_COPY:
        src_idx, dst_idx = torch.arange(5, 25), torch.arange(30, 50)
    else:
        src_idx, dst_idx = scattered(gen)
    want = expected(srcs, dsts, src_idx, dst_idx)
    sources = [src.clone() for src in srcs]
    metrics = Metrics()
    mover = Mover(metrics=metrics)
    first = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D, force=path)
    prepared = mover.prepare_layers(first)
    assert (prepared.rows is not None) == (first.path is TransferPath.GATHER)
    for layer in range(LAYERS):
        mover.execute_prepared(prepared, layer_pairs([srcs[layer]], [dsts[layer]]))
    for got, wanted in zip(dsts, want, strict=True):
        assert torch.equal(got, wanted)
    for src, kept in zip(srcs, sources, strict=True):
        assert torch.equal(src, kept)
    done = metrics.snapshot()["transfers"]
    assert sum(t["count"] for t in done) == LAYERS
    assert sum(t["bytes"] for t in done) == LAYERS * first.nbytes


def test_several_pairs_of_one_layer_move_together() -> None:
    gen = torch.Generator().manual_seed(12)
    srcs, dsts = layered(gen)
    src_idx, dst_idx = scattered(gen)
    want = expected(srcs, dsts, src_idx, dst_idx)
    mover = Mover()
    first = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    mover.execute_prepared(mover.prepare_layers(first), layer_pairs(srcs, dsts))
    for got, wanted in zip(dsts, want, strict=True):
        assert torch.equal(got, wanted)


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_staged_layers_move_every_pair_in_chunks_and_are_fitted_once(
    direction: Direction, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(13)
    srcs, dsts = layered(gen)
    scattered_rows = torch.randperm(ROWS, generator=gen)[:30]
    host_run = torch.arange(7, 37)  # the host side one run: the staged path
    h2d = direction is Direction.H2D
    src_idx, dst_idx = (host_run, scattered_rows) if h2d else (scattered_rows, host_run)
    want = expected(srcs, dsts, src_idx, dst_idx)
    sources = [src.clone() for src in srcs]
    fitted: list[object] = []
    real_mismatch = mover_module.layers_mismatch

    def counted(plan_: object, pairs: object) -> str | None:
        fitted.append(pairs)
        return real_mismatch(plan_, pairs)  # type: ignore[arg-type]

    monkeypatch.setattr(mover_module, "layers_mismatch", counted)
    # Room for 8 rows: the 30 rows go in 4 chunks, each pair after the other.
    mover = Mover(PathPolicy(staging_bytes=8 * WIDTH * 2))
    first = plan(
        srcs[0],
        dsts[0],
        src_idx,
        dst_idx,
        direction=direction,
        policy=mover.policy,
        force=TransferPath.STAGED,
    )
    assert first.path is TransferPath.STAGED and len(first.staged_chunks) == 4
    prepared = mover.prepare_layers(first)
    both = layer_pairs(srcs[1:], dsts[1:])
    for pairs in (layer_pairs(srcs[:1], dsts[:1]), both, both):
        mover.execute_prepared(prepared, pairs)
    assert len(fitted) == 2  # each pairs object checked the first time only
    for got, wanted in zip(dsts, want, strict=True):
        assert torch.equal(got, wanted)
    for src, kept in zip(srcs, sources, strict=True):
        assert torch.equal(src, kept)
    assert mover.staging.bytes_reserved == 8 * WIDTH * 2


def test_indices_written_after_preparing_are_refused_and_nothing_is_copied() -> None:
    gen = torch.Generator().manual_seed(13)
    srcs, dsts = layered(gen)
    src_idx, dst_idx = scattered(gen)
    mover = Mover()
    prepared = mover.prepare_layers(
        plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    )
    before = [dst.clone() for dst in dsts]
    dst_idx.add_(0)  # the same values, a new version: the plan cannot know they are equal
    with pytest.raises(StalePlanError):
        mover.execute_prepared(prepared, layer_pairs([srcs[1]], [dsts[1]]))
    with pytest.raises(StalePlanError):
        mover.prepare_layers(prepared.plan)
    for got, kept in zip(dsts, before, strict=True):
        assert torch.equal(got, kept)


def test_pairs_too_short_for_the_plan_are_refused_before_any_copy() -> None:
    gen = torch.Generator().manual_seed(14)
    srcs, dsts = layered(gen)
    src_idx, dst_idx = scattered(gen)
    mover = Mover()
    prepared = mover.prepare_layers(
        plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    )
    short = dsts[1][: int(dst_idx.max())]
    kept = short.clone()
    with pytest.raises(ValueError, match="destination rows"):
        mover.execute_prepared(prepared, layer_pairs([srcs[1]], [short]))
    assert torch.equal(short, kept)


def test_the_engines_own_copy_of_the_source_rows_stands_in_for_an_upload() -> None:
    gen = torch.Generator().manual_seed(15)
    srcs, dsts = layered(gen)
    src_idx, dst_idx = scattered(gen)
    want = expected(srcs, dsts, src_idx, dst_idx)
    mover = Mover()
    first = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    own = src_idx.clone()
    prepared = mover.prepare_layers(first, src_idx_on_device=own)
    assert isinstance(prepared.rows, tuple) and prepared.rows[0] is own
    mover.execute_prepared(prepared, layer_pairs(srcs, dsts))
    for got, wanted in zip(dsts, want, strict=True):
        assert torch.equal(got, wanted)
    # One that cannot stand for the rows (another length, another dtype) is not used.
    for unfit in (own[:-1], own.to(torch.int32)):
        assert mover.prepare_layers(first, src_idx_on_device=unfit).rows[0] is not unfit


def test_fitted_pairs_are_known_by_identity_and_held_weakly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(17)
    srcs, dsts = layered(gen)
    src_idx, dst_idx = scattered(gen)
    fitted: list[object] = []
    real_mismatch = mover_module.layers_mismatch

    def counted(plan_: object, pairs: object) -> str | None:
        fitted.append(pairs)
        return real_mismatch(plan_, pairs)  # type: ignore[arg-type]

    monkeypatch.setattr(mover_module, "layers_mismatch", counted)
    mover = Mover()
    first = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    prepared = mover.prepare_layers(first)
    seen, other = layer_pairs(srcs[:1], dsts[:1]), layer_pairs(srcs[1:], dsts[1:])
    mover.execute_prepared(prepared, seen)
    # An entry under the other pairs' id (a dead pairs' id, reused) vouches only for its own.
    prepared.fits[id(other)] = prepared.fits[id(seen)]
    mover.execute_prepared(prepared, other)
    mover.execute_prepared(prepared, other)
    assert fitted == [seen, other]
    fitted.clear()
    alive = weakref.ref(seen)
    del seen
    gc.collect()
    assert alive() is None  # the request's entries keep no pairs (nor their buffers) alive
