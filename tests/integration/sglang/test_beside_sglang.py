"""The beside-compute bench's sides (benchmarks/sglang/beside.py) on a CPU: SGLang's own pool
method as stock, kvcore's hook with its rule on and with it off, one after the other on the
same pool, as the bench alternates them on a GPU. The rule-on side must meet the pool as
its own requests left it, whatever the other sides did in between."""

from __future__ import annotations

import contextlib

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


def test_rule_on_side_serves_32k_reloads_after_its_8k_reloads_passed(
    monkeypatch: pytest.MonkeyPatch, device_indices_unread: None
) -> None:
    import tvm_ffi

    # Stock's JIT kernels need a CUDA stream; their copies are left out on a CPU.
    monkeypatch.setattr(tvm_ffi, "use_torch_stream", contextlib.nullcontext)
    cpu = torch.device("cpu")
    opts = beside.BesideOptions(device=cpu)
    layers = 2
    with (
        bench_mover(serve_rule=True) as mover,
        stock_copies_left_out(),
        pool_case(
            "mla", "layer_first", 1, Options(tokens=32768, layers=layers, device=cpu)
        ) as case,
    ):
        sides = beside._sides(case, opts)
        assert [side.name for side in sides] == ["stock", "kvcore", "own"]
        controller = beside._Controller(case.pool, cpu)
        gen = torch.Generator().manual_seed(3)
        seen: dict[tuple[int, str], list[tuple[list[str], dict[str, float]]]] = {}
        checked: list[tuple[int, str, bool]] = []
        for tokens in (8192, 32768):
            for indices in request_indices(case, tokens, "0%", 2, gen):
                for side in sides:
                    case.restore_device()
                    with beside._as_side(case, side):
                        host, device = side.move(controller, indices[0].clone(), indices[1])
                        before = mover.metrics.snapshot()
                        for layer in range(layers):
                            case.pool.load_to_device_per_layer_physical(
                                case.device_pool, host, device, layer, "kernel"
                            )
                        after = mover.metrics.snapshot()
                    passes = served_per_request(before, after, 1)[1]
                    seen.setdefault((tokens, side.name), []).append(
                        (paths_taken(before, after), passes)
                    )
                    if side.name != "stock":
                        ok = _check(case, "load", layers, indices[0], indices[1])
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
    straight into place: the rule-off side at 8k and 32k, the rule-on side at 32k (it
    passes 8k), every copied row exact."""
    import tvm_ffi

    monkeypatch.setattr(tvm_ffi, "use_torch_stream", contextlib.nullcontext)
    monkeypatch.setenv("KVCORE_SGLANG_DMA_IN_PLACE", "1")
    cpu = torch.device("cpu")
    opts = beside.BesideOptions(device=cpu)
    layers = 2
    with (
        bench_mover(serve_rule=True) as mover,
        stock_copies_left_out(),
        pool_case(
            "mha", "layer_first", 64, Options(tokens=32768, layers=layers, device=cpu)
        ) as case,
    ):
        sides = [side for side in beside._sides(case, opts) if side.name != "stock"]
        controller = beside._Controller(case.pool, cpu)
        gen = torch.Generator().manual_seed(5)
        taken: dict[tuple[int, str], list[str]] = {}
        for tokens in (8192, 32768):
            (indices,) = request_indices(case, tokens, "0%", 1, gen)
            for side in sides:
                case.restore_device()
                with beside._as_side(case, side):
                    host, device = side.move(controller, indices[0].clone(), indices[1])
                    before = mover.metrics.snapshot()
                    for layer in range(layers):
                        case.pool.load_to_device_per_layer_physical(
                            case.device_pool, host, device, layer, "kernel"
                        )
                    taken[tokens, side.name] = paths_taken(before, mover.metrics.snapshot())
                if taken[tokens, side.name]:
                    assert _check(case, "load", layers, indices[0], indices[1])
        assert taken == {
            (8192, "kvcore"): [],
            (8192, "own"): ["batched_runs"],
            (32768, "kvcore"): ["batched_runs"],
            (32768, "own"): ["batched_runs"],
        }
