"""The beside-compute bench's sides (benchmarks/sglang/beside.py) on a CPU: SGLang's own pool
method as stock, kvcore's hook with its rule on and with it off, one after the other on the
same pool, as the bench alternates them on a GPU. The rule-on side must meet the pool as
its own requests left it, whatever the other sides did in between."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

from benchmarks.metric_deltas import paths_taken, served_per_request
from benchmarks.sglang import beside
from benchmarks.sglang.ab import bench_mover
from benchmarks.sglang.host_cost import stock_copies_left_out
from benchmarks.sglang.pool_case import Options, pool_case
from benchmarks.sglang.sweep_cells import _check, request_indices

pytestmark = pytest.mark.sglang


LAYERS = 2
CPU = torch.device("cpu")


@contextlib.contextmanager
def bench_case(
    monkeypatch: pytest.MonkeyPatch, kind: str, page_size: int
) -> Iterator[tuple[Any, Any, list[Any], Any]]:
    """(mover, case, sides, controller) of the bench on a CPU with the rule on: a pool of
    32k tokens and two layers, stock's JIT copies left out (they need a CUDA stream)."""
    import tvm_ffi

    monkeypatch.setattr(tvm_ffi, "use_torch_stream", contextlib.nullcontext)
    with (
        bench_mover(serve_rule=True) as mover,
        stock_copies_left_out(),
        pool_case(
            kind, "layer_first", page_size, Options(tokens=32768, layers=LAYERS, device=CPU)
        ) as case,
    ):
        sides = beside._sides(case, beside.BesideOptions(device=CPU))
        yield mover, case, sides, beside._Controller(case.pool, CPU)


def reload_as(
    side: Any, case: Any, controller: Any, mover: Any, indices: tuple[torch.Tensor, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One reload of every layer as ``side`` makes it, on a device restored to its poison:
    the mover's metrics before and after."""
    case.restore_device()
    with beside._as_side(case, side):
        host, device = side.move(controller, indices[0].clone(), indices[1])
        before = mover.metrics.snapshot()
        for layer in range(LAYERS):
            case.pool.load_to_device_per_layer_physical(
                case.device_pool, host, device, layer, "kernel"
            )
        return before, mover.metrics.snapshot()


def test_rule_on_side_serves_32k_reloads_after_its_8k_reloads_passed(
    monkeypatch: pytest.MonkeyPatch, device_indices_unread: None
) -> None:
    with bench_case(monkeypatch, "mla", 1) as (mover, case, sides, controller):
        assert [side.name for side in sides] == ["stock", "kvcore", "own"]
        gen = torch.Generator().manual_seed(3)
        seen: dict[tuple[int, str], list[tuple[list[str], dict[str, float]]]] = {}
        checked: list[tuple[int, str, bool]] = []
        for tokens in (8192, 32768):
            for indices in request_indices(case, tokens, "0%", 2, gen):
                for side in sides:
                    before, after = reload_as(side, case, controller, mover, indices)
                    passes = served_per_request(before, after, 1)[1]
                    seen.setdefault((tokens, side.name), []).append(
                        (paths_taken(before, after), passes)
                    )
                    if side.name != "stock":
                        ok = _check(case, "load", LAYERS, indices[0], indices[1])
                        checked.append((tokens, side.name, ok))
        # 8k token-granular MLA reloads pass under the rule (counted once a request), 32k
        # ones on one host run are staged; the rule-off side stages both; stock is stock.
        assert seen[(8192, "kvcore")] == [([], {"stock_kernel_small_mla_load": 1})] * 2
        assert seen[(32768, "kvcore")] == [(["staged"], {})] * 2
        assert all(
            found == (["staged"], {})
            for key, runs in seen.items()
            if key[1] == "own"
            for found in runs
        )
        assert all(
            found == ([], {}) for key, runs in seen.items() if key[1] == "stock" for found in runs
        )
        # Every request kvcore copied itself holds the host's bytes in its rows and its
        # poison elsewhere (the passes ran stock's copies, left out on a CPU).
        served = [ok for tokens, name, ok in checked if (tokens, name) != (8192, "kvcore")]
        assert len(served) == 6 and all(served)


def test_with_dma_in_place_whole_pages_go_by_dma_where_each_side_serves(
    monkeypatch: pytest.MonkeyPatch, device_indices_read: None
) -> None:
    """Under KVCORE_SGLANG_DMA_IN_PLACE (the device indices read back at the move, a copy
    of the CPU tensors here), the bench's kvcore sides copy paged MHA reloads by DMA
    straight into place: both sides at 8k and 32k (the rule serves MHA from 4k), every
    copied row exact."""
    monkeypatch.setenv("KVCORE_SGLANG_DMA_IN_PLACE", "1")
    with bench_case(monkeypatch, "mha", 64) as (mover, case, every_side, controller):
        sides = [side for side in every_side if side.name != "stock"]
        gen = torch.Generator().manual_seed(5)
        taken: dict[tuple[int, str], list[str]] = {}
        for tokens in (8192, 32768):
            (indices,) = request_indices(case, tokens, "0%", 1, gen)
            for side in sides:
                taken[tokens, side.name] = paths_taken(
                    *reload_as(side, case, controller, mover, indices)
                )
                if taken[tokens, side.name]:
                    assert _check(case, "load", LAYERS, indices[0], indices[1])
        assert taken == {
            (8192, "kvcore"): ["batched_runs"],
            (8192, "own"): ["batched_runs"],
            (32768, "kvcore"): ["batched_runs"],
            (32768, "own"): ["batched_runs"],
        }
