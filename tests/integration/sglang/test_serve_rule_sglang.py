"""The serve-or-pass rule inside the SGLang hooks: what passes, what it costs, what serves.

Pools are built the way SGLang builds them (sglang_pools.py); the stock methods are
:class:`test_transfers.Recorder` stand-ins where a call must reach stock untouched.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch
from hicache_cpu import transfer_kv_direct
from test_transfers import (
    LAYERS,
    POOL_CLASSES,
    Recorder,
    _load_every_layer_and_check,
    _reload_expected,
    all_tensors,
    as_bytes,
    components,
    device_pool_of,
    make_indices,
    pool_for,
    randomise,
    small_mover,  # noqa: F401  (a fixture)
    transfer_hooks,  # noqa: F401  (a fixture)
)

from benchmarks.sglang.hook_adapter import (
    bench_adapter,
    move_indices,
)
from benchmarks.sglang.hook_adapter import hook as adapter_hook
from kvcore.internal_errors import InternalErrors
from kvcore.metrics import METRICS
from kvcore.planning import serve_rule
from kvcore_sglang import layer_loads, serve_or_pass, transfers

pytestmark = pytest.mark.sglang

MHA_LOAD = f"{POOL_CLASSES['mha'].__module__}.{POOL_CLASSES['mha'].__qualname__}"


@pytest.fixture(autouse=True)
def rule_on(monkeypatch) -> None:
    """The rule on, as deployed (each test's adapter is its own: conftest.py)."""
    monkeypatch.setenv("KVCORE_SERVE_RULE", "1")


@pytest.fixture
def direct_served_from(monkeypatch):
    """A rule table that serves the direct backend from ``tokens`` (test pools are small)."""

    def use(tokens: int) -> None:
        rules = (serve_rule.SGLangRule("*", "direct", "*", (1, 1 << 30), tokens, "r", "test"),)
        monkeypatch.setattr(serve_rule, "SGLANG_RULES", rules)
        serve_rule._sglang_rule.cache_clear()

    yield use
    serve_rule._sglang_rule.cache_clear()


def _load_hook() -> Any:
    return adapter_hook(f"{MHA_LOAD}.load_to_device_per_layer")


def _counts() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    snapshot = METRICS.snapshot()
    decisions = {(d["decision"], d["reason"]): d["count"] for d in snapshot["decisions"]}
    return dict(snapshot["fallbacks"]), decisions


def test_a_kernel_load_binds_stock_on_the_pool_and_later_calls_skip_kvcore(monkeypatch):
    pool = pool_for("mha", "layer_first")
    device_pool = device_pool_of("mha", pool)
    stock = Recorder()

    def stock_method(*args: Any, **kwargs: Any) -> None:
        stock(*args, **kwargs)

    # kvcore's hook is the outermost layer: the class's method is the stock one it gets.
    monkeypatch.setattr(type(pool), "load_to_device_per_layer", stock_method)
    host_idx, device_idx = torch.arange(32), torch.arange(1, 33)
    fallbacks, decisions = _counts()

    _load_hook()(stock_method, pool, device_pool, host_idx, device_idx, 0, "kernel")
    assert "load_to_device_per_layer" in pool.__dict__
    # Later calls go straight to stock through the binding, as SGLang's attribute lookup does.
    for layer in range(1, LAYERS):
        pool.load_to_device_per_layer(device_pool, host_idx, device_idx, layer, "kernel")
    assert [call[0][0] for call in stock.calls] == [pool] * LAYERS
    assert [call[0][4] for call in stock.calls] == list(range(LAYERS))
    after_fallbacks, after_decisions = _counts()
    reason = "stock_kernel_near_link"
    assert after_fallbacks.get(reason, 0) == fallbacks.get(reason, 0) + 1
    assert after_decisions.get(("pass", reason), 0) == decisions.get(("pass", reason), 0) + 1

    bench_adapter().bindings.restore()
    assert "load_to_device_per_layer" not in pool.__dict__


def test_no_binding_skips_another_plugins_hook_around_kvcore(monkeypatch):
    pool = pool_for("mha", "layer_first")
    device_pool = device_pool_of("mha", pool)
    stock = Recorder()
    outer = Recorder()

    def another_plugin(*args: Any, **kwargs: Any) -> None:
        outer(*args, **kwargs)
        _load_hook()(stock, *args, **kwargs)

    monkeypatch.setattr(type(pool), "load_to_device_per_layer", another_plugin)
    host_idx, device_idx = torch.arange(32), torch.arange(1, 33)
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(device_pool, host_idx, device_idx, layer, "kernel")
    assert "load_to_device_per_layer" not in pool.__dict__
    assert len(outer.calls) == LAYERS and len(stock.calls) == LAYERS


def test_a_small_request_passes_once_and_every_layer_reaches_stock():
    pool = pool_for("mha", "layer_first")
    device_pool = device_pool_of("mha", pool)
    reason = "stock_direct_small_request"
    for request in range(2):
        stock = Recorder()
        host_idx, device_idx = torch.arange(64), torch.arange(1, 65)  # new tensors each time
        fallbacks, decisions = _counts()
        for layer in range(LAYERS):
            _load_hook()(stock, pool, device_pool, host_idx, device_idx, layer, "direct")
        assert len(stock.calls) == LAYERS, request
        assert all(call[0][2] is host_idx and call[0][3] is device_idx for call in stock.calls)
        after_fallbacks, after_decisions = _counts()
        assert after_fallbacks.get(reason, 0) == fallbacks.get(reason, 0) + 1
        assert after_decisions.get(("pass", reason), 0) == decisions.get(("pass", reason), 0) + 1
    # The stock method here is not the class's, so no binding could skip only kvcore.
    assert "load_to_device_per_layer" not in pool.__dict__


def test_a_passing_reload_binds_its_later_layers_and_the_next_reload_is_decided_again(
    monkeypatch,
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    direct_served_from,
):
    """A reload that passes at its size binds stock for its later layers, so they reach
    stock through one frame. The next reload (new index tensors) is decided once: by the
    binding where the rule passes its size, else by the hook, which the binding gives way to;
    served or passed, every byte is exact."""
    from sglang.srt.mem_cache.pool_host import mha

    # Stock's direct copy is sgl-kernel's, absent here: a torch copy of the same rows.
    monkeypatch.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
    direct_served_from(64)
    transfer_hooks()
    decided: list[str] = []
    real_start = layer_loads._start_load

    def start(*args: Any, **kwargs: Any) -> Any:
        decided.append("hook")
        return real_start(*args, **kwargs)

    monkeypatch.setattr(layer_loads, "_start_load", start)
    pool = pool_for("mha", "layer_first")
    parts = components("mha", pool)
    gen = torch.Generator().manual_seed(31)
    randomise(all_tensors(parts), gen)
    name = "load_to_device_per_layer"
    # (size, served, who decided): the first pass has no binding yet; a served reload takes
    # the binding off, so the pass after it is the hook's again.
    reloads = (
        (40, False, "hook"),
        (120, True, "hook"),
        (30, False, "hook"),
        (50, False, "binding"),
        (20, False, "binding"),
        (100, True, "hook"),
    )
    for size, served, decider in reloads:
        fallbacks, decisions = _counts()
        decided.clear()
        host_idx, device_idx = make_indices("mha", pool, "scattered", size, gen)
        _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
        # The hook decided the first call, or the binding did (with no call to count).
        assert decided == ([decider] if decider == "hook" else []), size
        after_fallbacks, after_decisions = _counts()
        key = ("serve", "rule_serves") if served else ("pass", "r")
        assert after_decisions.get(key, 0) == decisions.get(key, 0) + 1, size
        assert (name in pool.__dict__) is not served, size
        if not served:
            assert after_fallbacks.get("r", 0) == fallbacks.get("r", 0) + 1
    bench_adapter().bindings.restore()
    assert name not in pool.__dict__


def test_after_a_move_a_passing_reloads_later_layers_run_stock_itself_until_the_next_move(
    monkeypatch,
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    direct_served_from,
):
    """Where SGLang's controller moves each reload's indices first (kvcore's move_indices
    hook sees it), a passing reload's later layers find stock's own method bound on the
    pool, no kvcore frame. The next move puts the checking binding back, so that the next
    reload is decided, once; a move in the midst of a passing reload does not count it
    again. Every byte matches stock's."""
    from sglang.srt.mem_cache.pool_host import mha

    monkeypatch.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
    direct_served_from(64)
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    device_pool = device_pool_of("mha", pool)
    controller = types.SimpleNamespace(mem_pool_host=pool)
    name = "load_to_device_per_layer"
    gen = torch.Generator().manual_seed(37)

    def move(host_idx: torch.Tensor, device_idx: torch.Tensor) -> None:
        move_indices(lambda c, h, d: (h, d), controller, host_idx, device_idx)

    def stock_itself() -> bool:
        bound = pool.__dict__.get(name)
        return isinstance(bound, types.MethodType) and bound.__self__ is pool

    for size, served in ((40, False), (120, True), (30, False), (50, False)):
        fallbacks, decisions = _counts()
        host_idx, device_idx = make_indices("mha", pool, "scattered", size, gen)
        move(host_idx, device_idx)
        # After a move nothing answers a call without deciding it first.
        assert not stock_itself(), size
        _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
        after_fallbacks, after_decisions = _counts()
        key = ("serve", "rule_serves") if served else ("pass", "r")
        assert after_decisions.get(key, 0) == decisions.get(key, 0) + 1, size
        assert stock_itself() is not served, size

    # A move in the midst of a passing reload (another transfer's): its later layers still
    # run stock, not decided or counted again.
    fallbacks, decisions = _counts()
    host_idx, device_idx = make_indices("mha", pool, "scattered", 20, gen)
    targets, expected = _reload_expected("mha", pool, host_idx, device_idx, 41)
    move(host_idx, device_idx)
    for layer in range(LAYERS):
        if layer == 1:
            move(*make_indices("mha", pool, "scattered", 200, gen))
            assert not stock_itself()
        pool.load_to_device_per_layer(device_pool, host_idx, device_idx, layer, "direct")
    for target, want in zip(targets, expected, strict=True):
        assert torch.equal(target.view(torch.uint8), want)
    after_fallbacks, after_decisions = _counts()
    assert after_decisions.get(("pass", "r"), 0) == decisions.get(("pass", "r"), 0) + 1
    assert after_fallbacks.get("r", 0) == fallbacks.get("r", 0) + 1
    bench_adapter().bindings.restore()
    assert name not in pool.__dict__


def test_after_a_backup_passes_a_gate_decides_each_later_backup_by_its_size(
    monkeypatch,
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    direct_served_from,
):
    """Once a backup passes by its size, the pool gets a gate: a later backup under the
    rule's size runs stock with no hook, counted once; a larger one goes to the hook and is
    served; the gate stays for the next. Every backed-up row lands where stock puts it."""
    from sglang.srt.mem_cache.pool_host import mha

    monkeypatch.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
    direct_served_from(64)
    transfer_hooks()
    entered: list[int] = []
    bindings = bench_adapter().bindings
    real_bypass = bindings.bypass_if_never

    def bypass(*args: Any) -> bool:  # the backup hook's first step
        entered.append(1)
        return real_bypass(*args)

    monkeypatch.setattr(bindings, "bypass_if_never", bypass)
    pool = pool_for("mha", "layer_first")
    device_pool = device_pool_of("mha", pool)
    gen = torch.Generator().manual_seed(43)
    name = "backup_from_device_all_layer"
    for size, served, through_hook in ((20, False, True), (30, False, False), (100, True, True)):
        randomise(all_tensors(components("mha", pool)), gen)
        host_idx = torch.randperm(400, generator=gen)[:size]
        device_idx = torch.randperm(200, generator=gen)[:size] + 1
        entered.clear()
        fallbacks, decisions = _counts()
        pool.backup_from_device_all_layer(device_pool, host_idx, device_idx, "direct")
        assert bool(entered) is through_hook, size
        after_fallbacks, after_decisions = _counts()
        key = ("serve", "rule_serves") if served else ("pass", "r")
        assert after_decisions.get(key, 0) == decisions.get(key, 0) + 1, size
        assert after_fallbacks.get("r", 0) == fallbacks.get("r", 0) + (not served), size
        assert name in pool.__dict__, size  # the gate stays once bound
        for part in components("mha", pool):
            for layer, device in enumerate(part.devices):
                for slot, row in zip(host_idx.tolist(), device_idx.tolist(), strict=True):
                    host_bytes = part.row(part.host.view(torch.uint8), layer, slot)
                    assert torch.equal(host_bytes, device.view(torch.uint8)[row]), size
    bench_adapter().bindings.restore()
    assert name not in pool.__dict__


def test_a_binding_whose_rule_lookup_fails_sends_every_reload_to_the_hook(
    monkeypatch,
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    direct_served_from,
):
    """Where the binding cannot read the rule's size, it does not raise into SGLang: the
    reload goes to kvcore's hook, which decides it (once) and copies it exactly."""
    from sglang.srt.mem_cache.pool_host import mha

    monkeypatch.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)
    direct_served_from(64)
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    gen = torch.Generator().manual_seed(47)
    host_idx, device_idx = make_indices("mha", pool, "scattered", 40, gen)
    _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")  # binds

    def broken(*args: Any) -> Any:
        raise RuntimeError("rule lookup broke")

    monkeypatch.setattr(transfers, "pass_limit", broken)
    bench_adapter().bindings.restore()
    _load_every_layer_and_check(
        "mha", pool, *make_indices("mha", pool, "scattered", 30, gen), "direct"
    )
    decided: list[int] = []
    real_start = layer_loads._start_load

    def start(*args: Any, **kwargs: Any) -> Any:
        decided.append(1)
        return real_start(*args, **kwargs)

    monkeypatch.setattr(layer_loads, "_start_load", start)
    _, decisions = _counts()
    host_idx, device_idx = make_indices("mha", pool, "scattered", 20, gen)
    _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
    assert decided == [1]  # the hook decided it, once
    _, after_decisions = _counts()
    assert after_decisions.get(("pass", "r"), 0) == decisions.get(("pass", "r"), 0) + 1


def test_a_request_the_rule_serves_is_copied_exactly(
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    direct_served_from,
):
    direct_served_from(16)
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    host_idx, device_idx = make_indices(
        "mha", pool, "scattered", 100, torch.Generator().manual_seed(3)
    )
    fallbacks, decisions = _counts()
    _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
    after_fallbacks, after_decisions = _counts()
    assert after_fallbacks == fallbacks
    assert after_decisions.get(("serve", "rule_serves"), 0) == (
        decisions.get(("serve", "rule_serves"), 0) + 1
    )


def test_a_failure_inside_kvcore_sends_the_call_to_stock(
    monkeypatch,
    small_mover,  # noqa: F811
    direct_served_from,
    caplog,
):
    direct_served_from(16)
    monkeypatch.setattr(
        bench_adapter(), "internal_errors", InternalErrors("SGLang", logging.getLogger("kvcore"))
    )

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("planner broke")

    monkeypatch.setattr(layer_loads, "_serve_layer", broken)
    pool = pool_for("mha", "layer_first")
    parts = components("mha", pool)
    randomise(all_tensors(parts), torch.Generator().manual_seed(9))
    before = as_bytes(all_tensors(parts))
    host_idx, device_idx = make_indices(
        "mha", pool, "scattered", 100, torch.Generator().manual_seed(4)
    )
    fallbacks, _ = _counts()
    stock = Recorder()
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        for layer in range(LAYERS):
            _load_hook()(
                stock, pool, device_pool_of("mha", pool), host_idx, device_idx, layer, "direct"
            )
    assert len(stock.calls) == LAYERS
    assert all(torch.equal(a, b) for a, b in zip(before, as_bytes(all_tensors(parts)), strict=True))
    after_fallbacks, _ = _counts()
    reason = "internal_error:RuntimeError"
    # The first call fails and marks the request; the later layers pass with it.
    assert after_fallbacks.get(reason, 0) == fallbacks.get(reason, 0) + 1
    assert len([r for r in caplog.records if "planner broke" in r.getMessage()]) == 1


def test_a_cuda_error_after_a_launch_is_raised_not_retried(
    monkeypatch,
    small_mover,  # noqa: F811
    direct_served_from,
):
    direct_served_from(16)

    def device_fault(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(layer_loads, "_serve_layer", device_fault)
    pool = pool_for("mha", "layer_first")
    stock = Recorder()
    host_idx, device_idx = make_indices(
        "mha", pool, "scattered", 100, torch.Generator().manual_seed(5)
    )
    with pytest.raises(RuntimeError, match="CUDA error"):
        _load_hook()(stock, pool, device_pool_of("mha", pool), host_idx, device_idx, 0, "direct")
    assert stock.calls == []


@pytest.mark.parametrize(("order", "served"), [("ascending", False), ("permuted", True)])
def test_a_backup_passes_on_one_ascending_host_run_only(
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    monkeypatch,
    order,
    served,
):
    """The rule hands stock a backup whose host slots are one ascending run (stock's kernel
    is as fast there); the same slots in another order are scattered, and kvcore serves."""
    rule = serve_rule.SGLangRule(
        "backup", "*", "*", (1, 1 << 30), 16, "r", "test", dense_host=False
    )
    monkeypatch.setattr(serve_rule, "SGLANG_RULES", (rule,))
    serve_rule._sglang_rule.cache_clear()
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    hook = adapter_hook(f"{MHA_LOAD}.backup_from_device_all_layer")
    host_idx = torch.arange(40, 140)
    if order == "permuted":
        host_idx = host_idx[torch.randperm(100, generator=torch.Generator().manual_seed(4))]
    stock = Recorder()
    fallbacks, _ = _counts()
    try:
        hook(stock, pool, device_pool_of("mha", pool), host_idx, torch.arange(1, 101), "direct")
    finally:
        serve_rule._sglang_rule.cache_clear()
    passed = _counts()[0].get("stock_dense_host", 0) - fallbacks.get("stock_dense_host", 0)
    assert (len(stock.calls), passed) == ((0, 0) if served else (1, 1))


@pytest.mark.parametrize(
    ("slots", "served"),
    [("one_run", True), ("four_runs", True), ("scattered", False)],
)
def test_a_backup_row_for_dense_host_runs_serves_them_and_passes_scattered_slots(
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    monkeypatch,
    slots,
    served,
):
    """A row that serves only few long host runs (kvcore's DMA): those are copied by
    kvcore, byte for byte, and scattered slots of the same size go to stock, counted."""
    rule = serve_rule.SGLangRule(
        "backup", "*", "*", (1, 1 << 30), None, "scattered_r", "test", dense_min_tokens=16
    )
    monkeypatch.setattr(serve_rule, "SGLANG_RULES", (rule,))
    serve_rule._sglang_rule.cache_clear()
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    device_pool = device_pool_of("mha", pool)
    gen = torch.Generator().manual_seed(11)
    randomise(all_tensors(components("mha", pool)), gen)
    host_idx = {
        "one_run": torch.arange(40, 140),
        "four_runs": torch.cat([torch.arange(s, s + 25) for s in (300, 10, 200, 120)]),
        "scattered": torch.randperm(400, generator=gen)[:100],
    }[slots]
    device_idx = torch.randperm(200, generator=gen)[:100] + 1
    stock = Recorder()
    before, _ = _counts()
    try:
        hook = adapter_hook(f"{MHA_LOAD}.backup_from_device_all_layer")
        hook(stock, pool, device_pool, host_idx, device_idx, "direct")
    finally:
        serve_rule._sglang_rule.cache_clear()
    passed = _counts()[0].get("scattered_r", 0) - before.get("scattered_r", 0)
    assert (len(stock.calls), passed) == ((0, 0) if served else (1, 1))
    if served:
        for part in components("mha", pool):
            for layer, device in enumerate(part.devices):
                for slot, row in zip(host_idx.tolist(), device_idx.tolist(), strict=True):
                    host_bytes = part.row(part.host.view(torch.uint8), layer, slot)
                    assert torch.equal(host_bytes, device.view(torch.uint8)[row])


@pytest.mark.parametrize(
    ("slots", "tokens", "served"),
    [("one_run", 32, True), ("scattered", 32, False), ("scattered", 64, True)],
)
def test_a_load_row_for_dense_host_runs_serves_them_sooner_than_scattered_slots(
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    monkeypatch,
    slots,
    tokens,
    served,
):
    """A load row that serves few long host runs from fewer tokens than scattered slots
    (token-granular MLA reloads, as the rule has them): a reload is decided on its host
    slots once, on its first call; served, every layer is copied byte for byte by kvcore;
    passed, every layer reaches stock and the pass is counted once."""
    rule = serve_rule.SGLangRule(
        "load", "*", "*", (1, 1 << 30), 64, "scattered_r", "test", dense_min_tokens=16
    )
    monkeypatch.setattr(serve_rule, "SGLANG_RULES", (rule,))
    serve_rule._sglang_rule.cache_clear()
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    gen = torch.Generator().manual_seed(12)
    host_idx = (
        torch.arange(40, 40 + tokens)
        if slots == "one_run"
        else torch.randperm(400, generator=gen)[:tokens]
    )
    device_idx = torch.randperm(200, generator=gen)[:tokens] + 1
    before, decided = _counts()
    try:
        if served:
            _load_every_layer_and_check("mha", pool, host_idx, device_idx, "direct")
        else:
            stock = Recorder()
            for layer in range(LAYERS):
                _load_hook()(
                    stock, pool, device_pool_of("mha", pool), host_idx, device_idx, layer, "direct"
                )
            assert len(stock.calls) == LAYERS
    finally:
        serve_rule._sglang_rule.cache_clear()
    after, after_decided = _counts()
    passed = after.get("scattered_r", 0) - before.get("scattered_r", 0)
    serves = after_decided.get(("serve", "rule_serves"), 0) - decided.get(
        ("serve", "rule_serves"), 0
    )
    assert (serves, passed) == ((1, 0) if served else (0, 1))


def test_the_rule_sees_each_served_pool_by_its_kind():
    assert serve_or_pass._pool_kind(pool_for("mha", "layer_first")) == "mha"
    assert serve_or_pass._pool_kind(pool_for("mla", "layer_first")) == "mla"
    assert serve_or_pass._pool_kind(object()) == ""


def test_a_passing_reloads_binding_keeps_no_pool_alive(monkeypatch, direct_served_from):
    import gc
    import weakref

    from sglang_pools import mha_host

    direct_served_from(1 << 20)  # every reload of these small pools passes
    pool = mha_host(64, 16, "layer_first", layers=LAYERS, heads=2)  # not pool_for's, kept
    calls: list[int] = []

    def stock_method(*args: Any, **kwargs: Any) -> None:
        calls.append(args[4])  # the layer alone: nothing here may hold the pool

    monkeypatch.setattr(type(pool), "load_to_device_per_layer", stock_method)
    host_idx, device_idx = torch.arange(32), torch.arange(1, 33)
    _load_hook()(stock_method, pool, device_pool_of("mha", pool), host_idx, device_idx, 0, "direct")
    pool.load_to_device_per_layer(device_pool_of("mha", pool), host_idx, device_idx, 1, "direct")
    assert calls == [0, 1] and pool in bench_adapter().bindings.passing
    gone = weakref.ref(pool)
    bench_adapter().load_requests.clear()
    del pool
    gc.collect()
    assert gone() is None


def test_a_served_device_indexed_reload_plans_from_the_runs_its_rule_found(
    transfer_hooks,  # noqa: F811
    small_mover,  # noqa: F811
    monkeypatch,
    device_indices_unread,
):
    """The rule counts a reload's host runs on its first call; where the slots are one run,
    the plan takes that run from its ends instead of reading the slots again, and every
    layer is still copied byte for byte (tests/unit/test_mover.py: a run that no longer
    holds)."""
    from kvcore.planning import device_indexed

    rule = serve_rule.SGLangRule(
        "load", "*", "*", (1, 1 << 30), 64, "scattered_r", "test", dense_min_tokens=16
    )
    monkeypatch.setattr(serve_rule, "SGLANG_RULES", (rule,))
    serve_rule._sglang_rule.cache_clear()
    read: list[int] = []
    segment = device_indexed.span_and_runs_of
    monkeypatch.setattr(
        device_indexed,
        "span_and_runs_of",
        lambda values, *args, **kwargs: (
            read.append(values.size) or segment(values, *args, **kwargs)
        ),
    )
    transfer_hooks()
    pool = pool_for("mha", "layer_first")
    gen = torch.Generator().manual_seed(13)
    try:
        host_idx = torch.arange(40, 72)
        device_idx = torch.randperm(200, generator=gen)[:32] + 1
        _load_every_layer_and_check("mha", pool, host_idx, device_idx, "kernel")
        assert read == []  # the rule counted one run; the plan took it from its ends
        # Two runs: the rule's count does not keep them, and the plan reads the slots.
        _load_every_layer_and_check(
            "mha",
            pool,
            torch.cat([torch.arange(100, 116), torch.arange(40, 56)]),
            device_idx,
            "kernel",
        )
        assert read == [32]
    finally:
        serve_rule._sglang_rule.cache_clear()
