"""`kvcore bench --engine sglang` at tiny sizes on CPU: the A/B machinery, its byte checks
and its reporting, with SGLang's stock ops reported as not runnable (they need CUDA)."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")
import torch

from benchmarks.sglang import ab, sgl_kernel_stub
from benchmarks.sglang.ab_measure import measure
from benchmarks.sglang.ab_paths import LOAD_LAYER, OPS, PathRun, kvcore_path
from benchmarks.sglang.ab_report import failures, format_table, speedups
from benchmarks.sglang.pool_case import Options, PoolCase, pool_case
from benchmarks.sglang.pool_rows import index_pairs
from benchmarks.sglang.sgl_kernel_stub import StockNotRunnable, install_sgl_kernel_stub
from kvcore import cli

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        importlib.metadata.version("sglang") != "0.5.23",
        reason="the SGLang A/B builds SGLang 0.5.23's pools",
    ),
]

CPU = torch.device("cpu")
TOKENS = 128
PAGE = 16


@pytest.fixture(autouse=True)
def no_stub_left() -> Iterator[None]:
    """The sgl_kernel stand-in is process-wide: take it out again after each test."""
    yield
    sys.meta_path[:] = [
        f for f in sys.meta_path if not isinstance(f, sgl_kernel_stub._SglKernelStub)
    ]
    for name in ("sgl_kernel.kvcacheio", "sgl_kernel"):
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if spec is not None and isinstance(spec.loader, sgl_kernel_stub._SglKernelStub):
            del sys.modules[name]


def tiny(**overrides: Any) -> Options:
    base = dict(tokens=TOKENS, layers=2, device=CPU, repeats=1, host_levels=("0%", "100%"))
    return Options(**{**base, **overrides})


# --- the full A/B at tiny sizes --------------------------------------------------------------


def test_every_kvcore_result_is_identical_and_stock_is_reported_not_runnable() -> None:
    report = ab.run(tiny(page_sizes=(64,)))
    rows = report["results"]
    # 2 kinds x 3 layouts x 2 levels x 2 ops, each with its stock backends and kvcore.
    kvcore = [r for r in rows if r["path"].startswith("kvcore")]
    stock = [r for r in rows if r["path"].startswith("stock")]
    assert len(kvcore) == 2 * 3 * 2 * 2
    assert len(stock) == 2 * (2 + 1 + 1) * 2 * 2
    assert all(r["identical"] is True and r["stock_calls"] == 0 for r in kvcore)
    assert all(r["fallbacks"] == {} and r["kvcore_paths"] for r in kvcore)
    assert all(r["not_runnable"] == "stock transfers need CUDA" for r in stock)
    assert {r["bytes"] for r in kvcore if r["pool"] == "mla" and r["op"] == "load"} == {
        TOKENS * 1152
    }
    # sgl_kernel's direct copies, issued from Python, where a layout has a direct backend.
    model = [r for r in rows if r["path"] == "model:direct"]
    assert len(model) == 2 * 2 * 2 * 2
    assert all(r["identical"] is True and "copy_ calls" in r["sms"] for r in model)
    assert {r["layout"] for r in model} == {"layer_first", "page_first_direct"}
    assert failures(report) == []
    ratios = speedups(rows)
    assert len(ratios) == len(model) and {s["vs"] for s in ratios} == {"model:direct"}
    prefix = [r for r in report["prefix_reload"] if r["path"].startswith("kvcore")]
    assert len(prefix) == 2 * 2 * 2  # kinds x (layer_first, page_first) x levels
    assert all(r["identical"] is True for r in prefix)
    table = format_table(report)
    assert "not runnable: stock transfers need CUDA" in table
    assert "evicted-prefix round trip" in table


# --- the byte checks -------------------------------------------------------------------------


def reference_row(case: PoolCase, buffer: torch.Tensor, layer: int, slot: int):
    """One host slot's row of ``layer``, addressed as SGLang's layout defines it."""
    if case.layout == "layer_first":
        return buffer[layer, slot]
    if case.layout == "page_first":
        return buffer[slot, layer]
    return buffer[slot // case.page_size, layer, slot % case.page_size]


def per_index_path(
    case: PoolCase,
    op: str,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    damage: Callable[[], None] = lambda: None,
) -> PathRun:
    """A plain per-index copy (the right answer), then ``damage``."""

    def copy() -> None:
        for c in case.components:
            layers = [LOAD_LAYER] if op == "load" else range(case.opts.layers)
            for layer in layers:
                for h, d in zip(host_idx.tolist(), dev_idx.tolist(), strict=True):
                    row = reference_row(case, c.host, layer, h)
                    if op == "load":
                        c.devices[layer][d] = row
                    else:
                        row.copy_(c.devices[layer][d])
        damage()

    return PathRun("reference", copy, "")


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("op", OPS)
def test_byte_checks_pass_a_right_copy_and_fire_on_a_corrupted_one(layout: str, op: str) -> None:
    with pool_case("mha", layout, PAGE, tiny()) as case:
        gen = torch.Generator().manual_seed(5)
        host_idx, dev_idx = index_pairs(TOKENS, "100%", PAGE, gen)
        untouched = sorted(set(range(2 * TOKENS)) - set(dev_idx.tolist()))[0]
        spare_host = sorted(set(range(2 * TOKENS)) - set(host_idx.tolist()))[0]
        c = case.components[1]  # V: damage away from the first component

        def flip_written() -> None:
            if op == "load":
                c.devices[LOAD_LAYER][int(dev_idx[-1])].view(torch.uint8)[0] ^= 1
            else:
                reference_row(case, c.host, 1, int(host_idx[-1])).view(torch.uint8)[0] ^= 1

        # Assigned, not toggled: a timed path runs more than once.
        def spoil(actual: torch.Tensor, intended: torch.Tensor) -> None:
            actual.view(torch.uint8)[-1] = intended.view(torch.uint8)[-1] ^ 0x80

        def write_untouched() -> None:
            if op == "load":
                layer = LOAD_LAYER
                spoil(c.devices[layer][untouched], c.poison[layer][untouched])
            else:
                spoil(
                    reference_row(case, c.host, 0, spare_host),
                    reference_row(case, c.mirror, 0, spare_host),
                )

        def other_layer() -> None:
            d = int(dev_idx[0])
            spoil(c.devices[0][d], c.poison[0][d])

        verdicts = {}
        for name, damage in (
            ("right", lambda: None),
            ("flip_written", flip_written),
            ("write_untouched", write_untouched),
            ("other_layer", other_layer),
        ):
            run = per_index_path(case, op, host_idx, dev_idx, damage)
            result = measure(case, op, run, host_idx, dev_idx, ceiling=1.0)
            verdicts[name] = result["identical"]
    # A backup's repeat copies the spoiled device row to the host: caught there too.
    expected = {"right": True, "flip_written": False, "write_untouched": False}
    assert verdicts == {**expected, "other_layer": False}


def test_a_path_that_raises_is_reported_not_runnable_and_a_missing_one_is_kept() -> None:
    with pool_case("mla", "layer_first", PAGE, tiny()) as case:
        host_idx, dev_idx = index_pairs(TOKENS, "0%", PAGE, torch.Generator())

        def raises() -> None:
            raise StockNotRunnable("no op here")

        broken = measure(case, "load", PathRun("stock:x", raises, ""), host_idx, dev_idx, 1.0)
        absent = measure(case, "load", PathRun("stock:y", None, "", "why"), host_idx, dev_idx, 1.0)
    assert broken["not_runnable"] == "StockNotRunnable: no op here"
    assert broken["identical"] is None
    assert absent["not_runnable"] == "why"


def test_kvcore_fallback_is_caught_by_the_byte_check_with_its_reason() -> None:
    with pool_case("mha", "page_first_direct", PAGE, tiny()) as case:
        host_idx, dev_idx = index_pairs(TOKENS, "0%", PAGE, torch.Generator())
        # Half-page groups: page_first_direct's stock copy would move whole pages.
        host_idx = host_idx + PAGE // 2
        with ab.bench_mover() as mover:
            run = kvcore_path(case, "load", "direct", host_idx, dev_idx, mover)
            result = measure(case, "load", run, host_idx, dev_idx, 1.0, mover)
    assert result["stock_calls"] == 1 + case.opts.repeats  # the warm-up call, then each timed
    assert result["fallbacks"] == {"sglang_unpaged_indices": result["stock_calls"]}
    assert result["identical"] is False


# --- reporting, stub and command line --------------------------------------------------------


def row(path: str, gbps: float | None, identical: bool | None = True, **extra: Any) -> dict:
    base = dict(pool="mha", layout="layer_first", page_size=64, host_fragmentation="0%", op="load")
    return {**base, "path": path, "gbps": gbps, "identical": identical, **extra}


def test_speedups_pair_kvcore_with_stock_on_the_same_data_and_failures_skip_unrunnable() -> None:
    rows = [
        row("stock:kernel", 40.0),
        row("stock:direct", None, None, not_runnable="no sgl_kernel"),
        row("kvcore:kernel", 50.0),
        row("kvcore:kernel", 30.0, host_fragmentation="100%"),
        row("kvcore:kernel", 9.0, False, page_size=1),
    ]
    [ratio] = speedups(rows)
    assert ratio["x"] == pytest.approx(1.25) and ratio["vs"] == "stock:kernel"
    report = {"results": rows, "prefix_reload": [row("stock:kernel", 1.0, False)]}
    assert [r["page_size"] for r in failures(report)] == [1, 64]


def test_stub_serves_every_sgl_kernel_name_and_calling_one_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = sgl_kernel_stub.importlib.util.find_spec
    monkeypatch.setattr(
        sgl_kernel_stub.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sgl_kernel" else real_find_spec(name, *a),
    )
    assert install_sgl_kernel_stub()
    assert install_sgl_kernel_stub()  # once only
    assert sum(isinstance(f, sgl_kernel_stub._SglKernelStub) for f in sys.meta_path) == 1
    # What SGLang imports at module level on CUDA, some of it without a fallback.
    from sgl_kernel import int8_scaled_mm
    from sgl_kernel.kvcacheio import transfer_kv_direct
    from sgl_kernel.scalar_type import ScalarType, scalar_types

    with pytest.raises(StockNotRunnable, match="transfer_kv_direct: sgl_kernel is not"):
        transfer_kv_direct([], [], None, None, 1)
    with pytest.raises(StockNotRunnable, match=r"sgl_kernel\.int8_scaled_mm"):
        int8_scaled_mm()
    with pytest.raises(StockNotRunnable, match=r"scalar_types\.uint4b8"):
        scalar_types.uint4b8()

    class Derived(ScalarType):  # subclassable, as type annotations and subclasses need
        pass

    assert issubclass(Derived, ScalarType)
    with pytest.raises(AttributeError):
        transfer_kv_direct.__wrapped__  # noqa: B018


def test_cli_dispatches_engine_sglang_with_the_bench_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []

    def fake_main(args: Any) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(ab, "main", fake_main)
    argv = ["bench", "--engine", "sglang", "--tokens", "4096", "--json", "x.json"]
    assert cli.main(argv) == 0
    [args] = seen
    assert (args.engine, args.tokens, args.json) == ("sglang", 4096, "x.json")
    opts = ab.options_for(args)
    assert opts.tokens == 4096
    assert cli.main(["bench", "--engine", "vllm"]) == 2
