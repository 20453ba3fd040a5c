"""SGLang host-pool transfers through kvcore's mover, against a per-index reference on CPU.

SGLang's own transfer ops need CUDA, so the served calls are compared with a copy
computed here row by row; calls that must stay stock are checked to reach the
original method once, unchanged, with their reason counted.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_pools import mha_host

from kvcore.engine_status import release_of
from kvcore.metrics import METRICS
from kvcore.mover import Mover, PathPolicy
from kvcore_sglang import guard, plugin, transfers

pytestmark = pytest.mark.sglang

VERSION = release_of(importlib.metadata.version("sglang"))
PAGE = 16
TOKENS = 512
LAYERS = 3
POOL_CLASSES = {"mha": MHATokenToKVPoolHost, "mla": MLATokenToKVPoolHost}
METHODS = ("load_to_device_per_layer", "backup_from_device_all_layer")
# Collected at import, before any test applies hooks.
STOCK = {(cls, name): vars(cls)[name] for cls in POOL_CLASSES.values() for name in METHODS}
# A small staging buffer and short "long" runs, so that every mover path is taken.
SMALL_POLICY = PathPolicy(staging_bytes=2048, long_run_bytes=64, max_dma_runs=8)


def _host_args() -> dict[str, Any]:
    return dict(
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout="layer_first",
        pin_memory=False,
    )


@functools.cache
def mha_pair() -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    device = MHATokenToKVPool(
        size=TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    host_cls, buffer_info, kwargs = _mha_host_inputs(device)
    return device, host_cls(buffer_info, **kwargs, **_host_args())


@functools.cache
def mla_pair() -> tuple[MLATokenToKVPool, MLATokenToKVPoolHost]:
    device = MLATokenToKVPool(
        size=TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        target_layer_num=device.layer_num,
        override_kv_cache_dim=device.kv_cache_dim,
        **_host_args(),
    )
    return device, host


PAIRS: dict[str, Callable[[], tuple[Any, Any]]] = {"mha": mha_pair, "mla": mla_pair}


def layers(kind: str, host: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host layer, device layer) for every layer the pool moves, in SGLang's order."""
    if kind == "mha":
        host_side = [*host.k_buffer, *host.v_buffer]
        return list(zip(host_side, [*host.device_k_buffers, *host.device_v_buffers], strict=True))
    return list(zip(host.kv_buffer, host.device_kv_buffers, strict=True))


def randomise(tensors: list[torch.Tensor], generator: torch.Generator) -> None:
    """Random bits (NaN payloads included) in every tensor: data and poison alike."""
    for tensor in tensors:
        bits = tensor.view(torch.int16)
        bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, generator=generator))


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone().view(torch.uint8) for t in tensors]


def reference_copy(src: torch.Tensor, dst: torch.Tensor, src_idx, dst_idx) -> None:
    for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
        dst[d] = src[s]


def make_indices(
    kind_of_host: str, n: int, host_size: int, device_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if kind_of_host == "contiguous":
        start = int(torch.randint(0, host_size - n + 1, (1,), generator=generator))
        host_idx = torch.arange(start, start + n)
    else:
        host_idx = torch.randperm(host_size, generator=generator)[:n]
    # Device slot 0 is SGLang's padding slot; real loads never write it.
    device_idx = torch.randperm(device_size - 1, generator=generator)[:n] + 1
    return host_idx, device_idx


@pytest.fixture
def transfer_hooks(sglang_hooks, monkeypatch) -> Iterator[Callable[..., Any]]:
    """Applies the plugin with the transfer hooks; the pool methods are restored afterwards."""
    for (cls, name), function in STOCK.items():
        monkeypatch.setattr(cls, name, function)

    def apply() -> Any:
        status = plugin.register_hooks(with_transfers=True)
        HookRegistry.apply_hooks()
        return status

    yield apply


@pytest.fixture
def small_mover(monkeypatch) -> Mover:
    chosen = Mover(SMALL_POLICY, metrics=METRICS)
    monkeypatch.setattr(transfers, "_mover", chosen)
    return chosen


def fallbacks() -> dict[str, int]:
    return dict(METRICS.snapshot()["fallbacks"])


def paths_taken() -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in METRICS.snapshot()["transfers"]:
        counts[row["path"]] = counts.get(row["path"], 0) + row["count"]
    return counts


def check_served_call(kind, direction, io_backend, host_kind, n, seed) -> None:
    _, host = PAIRS[kind]()
    generator = torch.Generator().manual_seed(seed)
    pairs = layers(kind, host)
    randomise([t for pair in pairs for t in pair], generator)
    device_size = pairs[0][1].shape[0]
    host_idx, device_idx = make_indices(host_kind, n, host.size, device_size, generator)
    before = fallbacks()
    if direction == "load":
        layer = int(torch.randint(0, LAYERS, (1,), generator=generator))
        sources = [h for h, _ in pairs]
        targets = [d for _, d in pairs]
        expected = as_bytes(targets)
        for position, (host_layer, _) in enumerate(pairs):
            if position % LAYERS == layer:  # K and V (MHA) or the one row (MLA) of this layer
                reference_copy(
                    host_layer.view(torch.uint8), expected[position], host_idx, device_idx
                )
        source_bytes = as_bytes(sources)
        host.load_to_device_per_layer(None, host_idx, device_idx, layer, io_backend)
    else:
        sources = [d for _, d in pairs]
        targets = [h for h, _ in pairs]
        expected = as_bytes(targets)
        for position, (_, device_layer) in enumerate(pairs):
            reference_copy(device_layer.view(torch.uint8), expected[position], device_idx, host_idx)
        source_bytes = as_bytes(sources)
        host.backup_from_device_all_layer(None, host_idx, device_idx, io_backend)
    for target, want in zip(targets, expected, strict=True):
        assert torch.equal(target.view(torch.uint8), want)
    for source, want in zip(sources, source_bytes, strict=True):
        assert torch.equal(source.view(torch.uint8), want), "a source was written"
    assert fallbacks() == before


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_patched_methods_match_per_index_reference(
    transfer_hooks, small_mover, kind, direction, io_backend
):
    transfer_hooks()
    seen_before = paths_taken()
    for seed, (host_kind, n) in enumerate(
        [("contiguous", 1), ("contiguous", 100), ("scattered", 1), ("scattered", 150)]
    ):
        check_served_call(kind, direction, io_backend, host_kind, n, seed)
    seen = paths_taken()
    assert sum(seen.values()) > sum(seen_before.values()), "nothing went through the mover"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["mha", "mla"]),
    direction=st.sampled_from(["load", "backup"]),
    io_backend=st.sampled_from(["kernel", "direct"]),
    host_kind=st.sampled_from(["contiguous", "scattered"]),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**31 - 1),
    small=st.booleans(),
)
def test_random_calls_match_reference_on_every_path(
    transfer_hooks, monkeypatch, kind, direction, io_backend, host_kind, n, seed, small
):
    transfer_hooks()  # idempotent: registers and wraps once
    monkeypatch.setattr(
        transfers, "_mover", Mover(SMALL_POLICY if small else PathPolicy(), metrics=METRICS)
    )
    check_served_call(kind, direction, io_backend, host_kind, n, seed)


def test_all_paths_are_exercised(transfer_hooks, small_mover):
    transfer_hooks()
    before = paths_taken()
    generator = torch.Generator().manual_seed(3)
    _, host = mha_pair()
    cases = [
        (torch.arange(40, 140), torch.arange(200, 300)),  # one run both sides
        (torch.cat([torch.arange(0, 50), torch.arange(300, 350)]), torch.arange(1, 101)),
        (torch.arange(0, 100), torch.randperm(400, generator=generator)[:100] + 1),
        (torch.randperm(host.size, generator=generator)[:100], torch.arange(1, 101)),
    ]
    for host_idx, device_idx in cases:
        host.load_to_device_per_layer(None, host_idx, device_idx, 0, "kernel")
    taken = {p: c - before.get(p, 0) for p, c in paths_taken().items()}
    for path in ("single_copy", "batched_runs", "staged", "gather"):
        assert taken.get(path, 0) > 0, f"{path} not taken: {taken}"


def test_layer_the_pool_does_not_hold_is_a_no_op(transfer_hooks):
    transfer_hooks()
    for kind in ("mha", "mla"):
        _, host = PAIRS[kind]()
        pairs = layers(kind, host)
        randomise([t for pair in pairs for t in pair], torch.Generator().manual_seed(5))
        snapshot = as_bytes([t for pair in pairs for t in pair])
        before = (fallbacks(), paths_taken())
        host.load_to_device_per_layer(None, torch.arange(8), torch.arange(1, 9), LAYERS, "kernel")
        after = as_bytes([t for pair in pairs for t in pair])
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True))
        assert (fallbacks(), paths_taken()) == before


class Recorder:
    """Stands in for the stock method: records each call, copies nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    return wide[..., : t.shape[-1]]


def _meta_indices(n: int) -> torch.Tensor:
    # Not on the CPU and impossible to read back: a read would raise.
    return torch.empty(n, dtype=torch.int64, device="meta")


FALLBACK_CASES: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "indices_on_device": (
        "sglang_indices_on_device",
        lambda pool: {"host_indices": _meta_indices(8)},
    ),
    "device_side_on_device": (
        "sglang_indices_on_device",
        lambda pool: {"device_indices": _meta_indices(8)},
    ),
    "io_backend": ("sglang_io_backend", lambda pool: {"io_backend": "kernel_ascend"}),
    "float_indices": ("sglang_index_dtype", lambda pool: {"host_indices": torch.ones(8)}),
    "out_of_range": (
        "sglang_invalid_indices",
        lambda pool: {"host_indices": torch.arange(pool.size, pool.size + 8)},
    ),
    "duplicate_destination": (
        "sglang_invalid_indices",
        lambda pool: {
            "host_indices": torch.ones(8, dtype=torch.int64),
            "device_indices": torch.ones(8, dtype=torch.int64),
        },
    ),
}


def call_hook(kind: str, direction: str, pool: Any, **overrides: Any) -> Recorder:
    """Runs one transfer hook directly, with a Recorder as the stock method."""
    original = Recorder()
    args: dict[str, Any] = dict(
        host_indices=torch.arange(8), device_indices=torch.arange(1, 9), io_backend="kernel"
    )
    args.update(overrides)
    target = f"{POOL_CLASSES[kind].__module__}.{POOL_CLASSES[kind].__qualname__}"
    if direction == "load":
        hook = transfers.HOOKS[f"{target}.load_to_device_per_layer"]
        hook(
            original,
            pool,
            None,
            args["host_indices"],
            args["device_indices"],
            1,
            args["io_backend"],
            is_draft=False,
        )
        expected_args = (
            pool,
            None,
            args["host_indices"],
            args["device_indices"],
            1,
            args["io_backend"],
        )
        expected_kwargs = {"is_draft": False}
    else:
        hook = transfers.HOOKS[f"{target}.backup_from_device_all_layer"]
        hook(original, pool, None, args["host_indices"], args["device_indices"], args["io_backend"])
        expected_args = (
            pool,
            None,
            args["host_indices"],
            args["device_indices"],
            args["io_backend"],
        )
        expected_kwargs = {}
    assert len(original.calls) <= 1
    if original.calls:
        called_args, called_kwargs = original.calls[0]
        assert called_kwargs == expected_kwargs
        assert len(called_args) == len(expected_args)
        assert all(a is b for a, b in zip(called_args, expected_args, strict=True))
    return original


def assert_stock_once(kind, direction, pool, reason, **overrides) -> None:
    pairs = layers(kind, pool)
    randomise([t for pair in pairs for t in pair], torch.Generator().manual_seed(11))
    snapshot = as_bytes([t for pair in pairs for t in pair])
    before = fallbacks()
    original = call_hook(kind, direction, pool, **overrides)
    assert len(original.calls) == 1, "the stock method should run exactly once"
    after = fallbacks()
    assert after.get(reason, 0) == before.get(reason, 0) + 1
    assert sum(after.values()) == sum(before.values()) + 1
    current = as_bytes([t for pair in pairs for t in pair])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, current, strict=True)), (
        "kvcore wrote before handing the call to stock"
    )


@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("case", sorted(FALLBACK_CASES))
def test_calls_kvcore_cannot_serve_run_stock_once_with_reason(kind, direction, case):
    reason, overrides = FALLBACK_CASES[case]
    _, pool = PAIRS[kind]()
    assert_stock_once(kind, direction, pool, reason, **overrides(pool))


@pytest.mark.parametrize("direction", ["load", "backup"])
def test_strided_device_rows_run_stock(monkeypatch, direction):
    _, pool = mha_pair()
    strided = tuple(_strided_like(t) for t in pool.device_v_buffers)
    monkeypatch.setattr(pool, "device_v_buffers", strided)
    # K would be served alone; the call is decided as a whole, so nothing is copied.
    assert_stock_once("mha", direction, pool, "strided_rows")


def test_dtype_mismatch_runs_stock(monkeypatch):
    _, pool = mla_pair()
    wider = tuple(t.to(torch.float32) for t in pool.device_kv_buffers)
    monkeypatch.setattr(pool, "device_kv_buffers", wider)
    assert_stock_once("mla", "backup", pool, "dtype_mismatch")


def test_page_first_layout_runs_stock():
    pool = mha_host(TOKENS, PAGE, layout="page_first")
    before = fallbacks()
    original = call_hook("mha", "load", pool)
    assert len(original.calls) == 1
    assert (
        fallbacks().get("sglang_layout_page_first", 0)
        == before.get("sglang_layout_page_first", 0) + 1
    )


@pytest.mark.parametrize(
    ("attribute", "value", "reason"),
    [
        ("dcp_size", 2, "sglang_dcp"),
        ("_native_buffers", object(), "sglang_split_buffers"),
        ("_layer_shard_enabled", True, "sglang_layer_shard"),
    ],
)
def test_mla_pools_kvcore_does_not_serve_run_stock(monkeypatch, attribute, value, reason):
    _, pool = mla_pair()
    monkeypatch.setattr(pool, attribute, value)
    # Layer sharding changes only the backup; the other two change both methods.
    directions = ["backup"] if attribute == "_layer_shard_enabled" else ["load", "backup"]
    for direction in directions:
        assert_stock_once("mla", direction, pool, reason)


def test_subclass_pools_run_stock(monkeypatch):
    class OwnData(MHATokenToKVPoolHost):
        pass

    _, pool = mha_pair()
    monkeypatch.setattr(pool, "__class__", OwnData)
    for direction in ("load", "backup"):
        assert_stock_once("mha", direction, pool, "sglang_pool_class")


def test_patched_methods_hand_unserved_calls_to_stock(transfer_hooks):
    # Through the real wrappers: SGLang's stock op needs CUDA, so reaching it fails here.
    transfer_hooks()
    _, pool = mha_pair()
    before = fallbacks().get("sglang_io_backend", 0)
    with pytest.raises(ValueError, match="Unsupported IO backend"):
        pool.load_to_device_per_layer(None, torch.arange(4), torch.arange(1, 5), 0, "bogus")
    assert fallbacks().get("sglang_io_backend", 0) == before + 1


def test_guard_covers_the_transfer_targets():
    result = guard.check_targets(VERSION, guard.TRANSFER_GROUPS)
    assert result.skipped == ()
    assert set(result.patchable) == set(transfers.HOOKS) == set(guard.TRANSFER_TARGETS)
    older = guard.check_targets("0.5.22", guard.TRANSFER_GROUPS)
    assert older.patchable == ()
    assert all("no fingerprint recorded" in s.reason for s in older.skipped)


def test_plugin_registers_transfer_hooks_over_stock(transfer_hooks):
    status = transfer_hooks()
    assert set(guard.TRANSFER_TARGETS) <= set(status.patched_targets)
    assert set(guard.ALLOCATOR_TARGETS) <= set(status.patched_targets)
    for (cls, name), function in STOCK.items():
        assert vars(cls)[name].__wrapped__ is function


def test_entry_point_leaves_transfers_stock(sglang_hooks, monkeypatch):
    for (cls, name), function in STOCK.items():
        monkeypatch.setattr(cls, name, function)
    status = sglang_hooks()
    assert not set(guard.TRANSFER_TARGETS) & set(status.patched_targets)
    assert all(vars(cls)[name] is function for (cls, name), function in STOCK.items())


def test_changed_fingerprint_leaves_the_transfer_group_stock(transfer_hooks, monkeypatch, caplog):
    changed = guard.TRANSFER_TARGETS[3]
    monkeypatch.setitem(
        guard.FINGERPRINTS, VERSION, {**guard.FINGERPRINTS[VERSION], changed: "0" * 64}
    )
    caplog.set_level(logging.WARNING)
    status = transfer_hooks()
    assert not set(guard.TRANSFER_TARGETS) & set(status.patched_targets)
    assert set(guard.ALLOCATOR_TARGETS) <= set(status.patched_targets)
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert skipped[changed].startswith("source changed")
    for target in guard.TRANSFER_TARGETS:
        assert target in skipped
    assert all(vars(cls)[name] is function for (cls, name), function in STOCK.items())
    assert any(changed in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_transfers_setting_turns_the_hooks_on(sglang_hooks, monkeypatch):
    for (cls, name), function in STOCK.items():
        monkeypatch.setattr(cls, name, function)
    monkeypatch.setenv("KVCORE_TRANSFERS", "1")
    status = sglang_hooks()
    assert set(guard.TRANSFER_TARGETS) <= set(status.patched_targets)
    for (cls, name), function in STOCK.items():
        assert vars(cls)[name].__wrapped__ is function
