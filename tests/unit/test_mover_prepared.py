"""Mover.prepare_layers / execute_prepared: a plan made ready once, then one call a layer.

Engines reload layer by layer with the same indices; the prepared path must move exactly
what :meth:`Mover.execute` over the pairs moves, refuse what it refuses, and never read indices
written after planning. On a CPU the reference kernels stand for the device's ops.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from kvcore import mover as mover_module
from kvcore.direction import Direction
from kvcore.kernels import REFERENCE, reference
from kvcore.metrics import Metrics
from kvcore.mover import Mover, PreparedLayers
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import StalePlanError, plan

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


def each_layer_then_check(
    mover: Mover,
    prepared: PreparedLayers,
    srcs: list[torch.Tensor],
    dsts: list[torch.Tensor],
    want: list[torch.Tensor],
    sources: list[torch.Tensor],
) -> None:
    """Run ``prepared`` on every layer in turn: each destination as wanted, each source as
    it was."""
    for layer in range(LAYERS):
        mover.execute_prepared(prepared, layer_pairs([srcs[layer]], [dsts[layer]]))
    for got, wanted in zip(dsts, want, strict=True):
        assert torch.equal(got, wanted)
    for src, kept in zip(srcs, sources, strict=True):
        assert torch.equal(src, kept)


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
    each_layer_then_check(mover, prepared, srcs, dsts, want, sources)
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
    # A page-in's chunks are made ready once; a page-out runs stage_out a chunk at a time.
    assert (prepared.rows is not None) == h2d
    both = layer_pairs(srcs[1:], dsts[1:])
    for pairs in (layer_pairs(srcs[:1], dsts[:1]), both, both):
        mover.execute_prepared(prepared, pairs)
    assert len(fitted) == 2  # each pairs object checked the first time only
    for got, wanted in zip(dsts, want, strict=True):
        assert torch.equal(got, wanted)
    for src, kept in zip(srcs, sources, strict=True):
        assert torch.equal(src, kept)
    assert mover.staging.bytes_reserved == 8 * WIDTH * 2


@pytest.mark.parametrize("prepared_ops", [True, False])
def test_staged_page_in_of_several_host_runs_through_a_smaller_buffer_matches_stock(
    prepared_ops: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(17)
    srcs, dsts = layered(gen)
    # Three host runs, the rows landing scattered on the device.
    src_idx = torch.cat([torch.arange(2, 9), torch.arange(20, 31), torch.arange(40, 44)])
    dst_idx = torch.randperm(ROWS, generator=gen)[: src_idx.numel()]
    want = expected(srcs, dsts, src_idx, dst_idx)
    sources = [src.clone() for src in srcs]
    if not prepared_ops:
        monkeypatch.setattr(
            mover_module,
            "registered",
            lambda device_type: dataclasses.replace(
                REFERENCE, prepare_stage_in=None, stage_in_prepared=None
            ),
        )
    first = plan(
        srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D, force=TransferPath.STAGED
    )
    # The plan was cut for the default buffer; this mover's holds 5 rows.
    mover = Mover(PathPolicy(staging_bytes=5 * WIDTH * 2))
    assert len(first.staged_chunks) == 1
    prepared = mover.prepare_layers(first.without_buffers())
    assert (prepared.rows is not None) == prepared_ops
    if prepared_ops:
        assert [rows for _, _, rows in prepared.rows.chunks] == [5, 5, 5, 5, 2]
    each_layer_then_check(mover, prepared, srcs, dsts, want, sources)


def test_a_prepared_page_in_refuses_what_another_kernel_set_prepared() -> None:
    gen = torch.Generator().manual_seed(18)
    srcs, dsts = layered(gen)
    with pytest.raises(TypeError, match="prepare_stage_in"):
        reference.stage_in_prepared(
            layer_pairs(srcs[:1], dsts[:1]), object(), torch.empty(64, dtype=torch.uint8)
        )


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


def _count_mismatch_checks(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The pairs each :func:`layers_mismatch` call was asked about."""
    asked: list[object] = []
    real_mismatch = mover_module.layers_mismatch

    def counted(plan_: object, pairs: object) -> str | None:
        asked.append(pairs)
        return real_mismatch(plan_, pairs)  # type: ignore[arg-type]

    monkeypatch.setattr(mover_module, "layers_mismatch", counted)
    return asked


def _request(
    mover: Mover, srcs: list[torch.Tensor], dsts: list[torch.Tensor], gen: torch.Generator
) -> tuple[object, torch.Tensor, torch.Tensor]:
    """A request as an engine keeps it: new indices, the plan kept without its buffers."""
    src_idx, dst_idx = scattered(gen)
    first = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D)
    return mover.prepare_layers(first.without_buffers()), src_idx, dst_idx


def test_pairs_found_to_fit_a_kind_of_plan_are_not_checked_again_by_later_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(17)
    srcs, dsts = layered(gen)
    asked = _count_mismatch_checks(monkeypatch)
    mover = Mover()
    pairs = [layer_pairs([src], [dst]) for src, dst in zip(srcs, dsts, strict=True)]
    for _ in range(3):  # three requests, each with indices of its own
        prepared, src_idx, dst_idx = _request(mover, srcs, dsts, gen)
        want = expected(srcs, dsts, src_idx, dst_idx)
        for each in pairs:
            mover.execute_prepared(prepared, each)
        for got, wanted in zip(dsts, want, strict=True):
            assert torch.equal(got, wanted)
    assert asked == pairs  # the first request's look at each layer serves the later ones


def test_a_fit_kept_across_requests_never_vouches_for_what_it_did_not_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(18)
    srcs, dsts = layered(gen)
    asked = _count_mismatch_checks(monkeypatch)
    mover = Mover()
    # Pairs shorter than the first layer: a request's rows may reach past them.
    short = layer_pairs([srcs[1]], [dsts[1][: ROWS // 2]])
    low = torch.arange(ROWS // 2)
    first = plan(srcs[0], dsts[0], low, low.flip(0), direction=Direction.H2D)
    mover.execute_prepared(mover.prepare_layers(first.without_buffers()), short)
    assert asked == [short]
    # A later request whose destination rows reach past them: refused, nothing copied.
    kept = short.dsts[0].clone()
    high = torch.arange(ROWS // 2 - 4, ROWS // 2 + 4)
    beyond = plan(srcs[0], dsts[0], high, high, direction=Direction.H2D)
    with pytest.raises(ValueError, match="destination rows"):
        mover.execute_prepared(mover.prepare_layers(beyond.without_buffers()), short)
    assert torch.equal(short.dsts[0], kept)
    # A plan of another kind (rows of another size) is looked at in full, and refused.
    wide = [torch.zeros(ROWS, 2 * WIDTH, dtype=torch.int16) for _ in range(2)]
    other = plan(wide[0], wide[1], low, low, direction=Direction.H2D)
    with pytest.raises(ValueError, match="rows of"):
        mover.execute_prepared(mover.prepare_layers(other.without_buffers()), short)
    assert asked[-1] is short and len(asked) == 3
    assert torch.equal(short.dsts[0], kept)


def test_a_kept_fit_holds_its_plans_buffers_weakly() -> None:
    gen = torch.Generator().manual_seed(19)
    srcs, dsts = layered(gen)
    src_idx, dst_idx = scattered(gen)
    mover = Mover()
    src, dst = srcs[0].clone(), dsts[0].clone()
    pairs = layer_pairs(srcs[1:], dsts[1:])
    mover.execute_prepared(
        mover.prepare_layers(plan(src, dst, src_idx, dst_idx, direction=Direction.H2D)), pairs
    )
    assert pairs.fitted_kind
    alive = weakref.ref(dst)
    del src, dst
    gc.collect()
    assert alive() is None  # the pairs' entry keeps no plan's buffers alive
