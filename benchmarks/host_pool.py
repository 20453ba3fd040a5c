"""An engine's host tier built stock's way and kvcore's, in one run: ``kvcore bench --host-pool``.

vLLM 0.25.1's worker, given no region, allocates each KV tensor's CPU copy with
``torch.zeros(..., pin_memory=True)`` (stock). kvcore's spec hands it an
:class:`~kvcore_vllm.host_region.ExactHostRegion`, which vLLM registers in one
``cudaHostRegister`` call (kvcore). Both are reproduced here call for call, for a
Llama-3-8B-shaped tier: 32 per-layer KV tensors of 64 KiB blocks (16 tokens x 8 KV heads x
128 dims x K and V in bf16), as many blocks as the size asks for.

SGLang's HiCache host pool buffer is built through SGLang's own allocation and registration,
with and without kvcore's hook (:mod:`benchmarks.sglang.host_pool_build`), where SGLang is
installed; its rows say why they are missing elsewhere.

From 0.32 vLLM's worker maps its tier as one shared region in ``/dev/shm`` and faults it in on
one thread; for an engine of one worker kvcore's spec has every usable CPU fault it in first.
The ``vllm-shared-region`` rows build the same tier as that region, through vLLM's own class
and registration, with and without kvcore's faulting
(:mod:`benchmarks.vllm.shared_region_build`), where vLLM 0.32 or later is installed.

Each side of each engine and size runs in a process of its own, so that each starts from the
same memory and its peak RSS is its own. Reported, per engine and size: the time until the
tier is usable and until it is pinned whole (the same but for ``sglang-pin-first`` and
``vllm-region-pin-first``, whose kvcore side pins a first share and the rest in the
background: :mod:`kvcore_sglang.pool_pinning`, :mod:`kvcore_vllm.region_pinning`), the
steady and peak RSS, the bytes the tier takes, and
a part of it read to the GPU (the pinned memory must be as fast to copy from), its bytes
compared. Without CUDA nothing is pinned, and the read is a host copy: a smoke run of the
same code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcore.host_mapping import torch_pinned_bytes

ENGINE = "vllm-0.25.1"
REGION_ENGINE = "vllm-shared-region"
SGLANG = "sglang"
SGLANG_PIN_FIRST = "sglang-pin-first"
REGION_PIN_FIRST = "vllm-region-pin-first"
ENGINES = (ENGINE, SGLANG, SGLANG_PIN_FIRST, REGION_ENGINE, REGION_PIN_FIRST)
LAYERS = 32
BLOCK_BYTES = 16 * 8 * 128 * 2 * 2
DEFAULT_GIB = (16.0, 32.0, 64.0, 96.0)
SIDES = ("stock", "kvcore")
MEASURED = ("ready_s", "full_s", "rss_gib", "peak_rss_gib", "tier_gib", "read_gbps", "identical")
"""What each side's process reports, each a row field ``<side>_<name>``."""

Built = tuple[torch.Tensor, int, Callable[[], None], Callable[[], None] | None]
"""What an engine's build hands back: the bytes to read back from, the tier's bytes, what
gives the tier back (once the bytes are dropped), and what waits until the tier is pinned
whole (None where it is pinned whole when the build returns)."""
Builder = tuple[Callable[[str, float, bool], Built], Callable[[torch.Tensor], torch.Tensor]]


def tier_shape(gib: float) -> tuple[int, int]:
    """(blocks, block bytes) of each of :data:`LAYERS` KV tensors for a tier of ``gib``."""
    blocks = max(1, int(gib * (1 << 30)) // (LAYERS * BLOCK_BYTES))
    return blocks, BLOCK_BYTES


def _rss_gib() -> tuple[float, float]:
    """(resident now, peak resident) of this process, in GiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / (1 << 20)
    return fields["VmRSS"], fields["VmHWM"]


def _build_vllm_0251(side: str, gib: float, pin: bool) -> Built:
    """vLLM 0.25.1's tier of ``gib`` as ``side`` builds it: the first KV tensor's host copy,
    the tier's bytes, and what gives the tier back."""
    blocks, page = tier_shape(gib)
    if side == "stock":
        tensors = [
            torch.zeros((blocks, page), dtype=torch.int8, pin_memory=pin) for _ in range(LAYERS)
        ]
        size = blocks * page
        pinned = (torch_pinned_bytes(size) if pin else size) * LAYERS
        return tensors[0], pinned, tensors.clear, None
    from kvcore_vllm.host_region import ExactHostRegion

    region = ExactHostRegion(blocks, [page] * LAYERS)
    if pin:
        register_as_vllm_does(region)
    views = [region.create_next_view(page) for _ in range(LAYERS)]

    def release() -> None:
        views.clear()
        region.cleanup()

    return views[0], region.total_size_bytes, release, None


def register_as_vllm_does(region: Any) -> None:
    """vLLM 0.25.1's ``pin_mmap_region`` for an ExactHostRegion: one cudaHostRegister of
    the whole mapping; RuntimeError where the driver refuses it."""
    result = torch.cuda.cudart().cudaHostRegister(region.address, region.total_size_bytes, 0)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(f"cudaHostRegister of {region.total_size_bytes} bytes: {result}")
    region.is_pinned = True


def _read_speed(tensor: torch.Tensor, pin: bool) -> tuple[float, bool]:
    """GB/s of reading ``tensor`` to the GPU (a host copy without one), its bytes compared."""
    source = torch.randint(-128, 128, tensor.shape, dtype=torch.int8)
    tensor.copy_(source)
    device = torch.device("cuda" if pin else "cpu")
    target = torch.empty(tensor.shape, dtype=torch.int8, device=device)
    best = float("inf")
    for _ in range(5):
        if pin:
            torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(tensor, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return tensor.numel() / best / 1e9, bool(torch.equal(target.cpu(), source))


def _builder(engine: str, pin: bool) -> Builder:
    """``engine``'s build and the part of its tier to read back, its engine imported."""
    if engine == ENGINE:
        importlib.import_module("kvcore_vllm.host_region")
        return _build_vllm_0251, lambda tensor: tensor
    if engine in (SGLANG, SGLANG_PIN_FIRST):
        from benchmarks.sglang import host_pool_build

        host_pool_build.load()
        if engine == SGLANG:
            return host_pool_build.build, host_pool_build.first_layer_bytes
        return host_pool_build.build_pin_first, host_pool_build.first_step_bytes
    from benchmarks.vllm import shared_region_build

    shared_region_build.load(pin)
    if engine == REGION_PIN_FIRST:
        return shared_region_build.build_pin_first, shared_region_build.first_step_chunks
    return shared_region_build.build, shared_region_build.first_chunks


def measure_side(engine: str, side: str, gib: float, pin: bool) -> dict[str, Any]:
    """Build one side's tier of ``gib`` for ``engine`` in this process and measure it."""
    if pin:
        torch.cuda.init()  # the CUDA context is not the tier's cost
    build, read_back = _builder(engine, pin)
    rss_before, _ = _rss_gib()
    started = time.perf_counter()
    tensor, nbytes, release, pinned_whole = build(side, gib, pin)
    ready = time.perf_counter() - started
    if pinned_whole is not None:
        pinned_whole()
    full = time.perf_counter() - started
    rss, peak = _rss_gib()
    gbps, identical = _read_speed(read_back(tensor), pin)
    del tensor  # a mapping that something still views is not given back
    release()
    return {
        "side": side,
        "ready_s": ready,
        "full_s": full,
        "rss_gib": rss - rss_before,
        "peak_rss_gib": peak - rss_before,
        "tier_gib": nbytes / (1 << 30),
        "read_gbps": gbps,
        "identical": identical,
    }


def _child(engine: str, side: str, gib: float, pin: bool, results: Any) -> None:
    try:
        results.put(measure_side(engine, side, gib, pin))
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != engine.split("-")[0]:
            results.put({"side": side, "error": f"{type(exc).__name__}: {exc}"})
        else:
            results.put({"side": side, "missing": f"{type(exc).__name__}: {exc}"})
    except Exception as exc:
        results.put({"side": side, "error": f"{type(exc).__name__}: {exc}"})


def _tensor_bytes(engine: str, gib: float) -> int:
    if engine == ENGINE:
        blocks, page = tier_shape(gib)
        return LAYERS * blocks * page
    if engine in (SGLANG, SGLANG_PIN_FIRST):
        from benchmarks.sglang.host_pool_build import TOKEN_ROW_BYTES, pool_dims

        return pool_dims(gib)[2] * TOKEN_ROW_BYTES
    from benchmarks.vllm.shared_region_build import region_shape

    chunks, chunk_bytes = region_shape(gib)
    return chunks * chunk_bytes


def _result_of(process: Any, results: Any) -> dict[str, Any]:
    """What the side's process reported; an error where it ended without a word (the
    kernel's OOM killer at a size the host cannot hold, say)."""
    while True:
        try:
            found: dict[str, Any] = results.get(timeout=1.0)
            return found
        except queue.Empty:
            if not process.is_alive():
                return {"error": f"its process ended (exit code {process.exitcode}) unreported"}


def measure(gib: float, pin: bool, engine: str = ENGINE) -> dict[str, Any]:
    """One engine and size: each side in a fresh process, the fields the issue names; a row
    with ``skipped`` where the engine is not installed."""
    context = multiprocessing.get_context("spawn")
    row: dict[str, Any] = {"engine": engine, "gib": gib, "layers": LAYERS}
    row["tensor_bytes_gib"] = _tensor_bytes(engine, gib) / (1 << 30)
    for side in SIDES:
        results = context.Queue()
        process = context.Process(target=_child, args=(engine, side, gib, pin, results))
        process.start()
        found = _result_of(process, results)
        process.join()
        if "missing" in found:
            return {**row, "skipped": found["missing"]}
        if "error" in found:
            row[f"{side}_error"] = found["error"]
            continue
        for key in MEASURED:
            row[f"{side}_{key}"] = found[key]
    if "stock_ready_s" in row and "kvcore_ready_s" in row:
        row["ready_ratio"] = row["kvcore_ready_s"] / row["stock_ready_s"]
        row["full_ratio"] = row["kvcore_full_s"] / row["stock_full_s"]
    return row


def parse_gib(text: str | None) -> tuple[float, ...]:
    """``--pool-gib``'s sizes; ValueError naming the entry that is no positive size."""
    if text is None:
        return DEFAULT_GIB
    sizes = []
    for entry in text.split(","):
        try:
            size = float(entry)
        except ValueError:
            size = 0.0
        if not size > 0:
            raise ValueError(
                f"--pool-gib {text}: {entry.strip() or 'an empty entry'!r} is not a size in "
                "GiB; give a comma list of positive numbers, e.g. 16,64"
            )
        sizes.append(size)
    return tuple(sizes)


def format_row(row: dict[str, Any]) -> str:
    held_in = (
        "one shared region" if row["engine"] in (REGION_ENGINE, REGION_PIN_FIRST) else "tensors"
    )
    head = f"{row['engine']} {row['gib']:g} GiB ({row['tensor_bytes_gib']:.2f} in {held_in}): "
    if "skipped" in row:
        return head + f"skipped ({row['skipped']})"

    def side(name: str) -> str:
        if f"{name}_error" in row:
            return f"{name} failed: {row[f'{name}_error']}"
        return (
            f"{name} {row[f'{name}_ready_s']:.2f} s (whole {row[f'{name}_full_s']:.2f} s), "
            f"{row[f'{name}_tier_gib']:.2f} GiB, "
            f"rss {row[f'{name}_rss_gib']:.2f} (peak {row[f'{name}_peak_rss_gib']:.2f}) GiB, "
            f"read {row[f'{name}_read_gbps']:.1f} GB/s"
            + ("" if row[f"{name}_identical"] else " WRONG BYTES")
        )

    return head + "; ".join(side(name) for name in SIDES)


def parse_engines(text: str | None) -> tuple[str, ...]:
    """``--host-engines``' engines, in :data:`ENGINES`' order; ValueError naming one that
    is not an engine here."""
    if text is None:
        return ENGINES
    asked = [entry.strip() for entry in text.split(",")]
    unknown = [entry for entry in asked if entry not in ENGINES]
    if unknown or not asked:
        raise ValueError(
            f"--host-engines {text}: {', '.join(map(repr, unknown))} is not an engine here; "
            f"give a comma list of {', '.join(ENGINES)}"
        )
    return tuple(engine for engine in ENGINES if engine in asked)


def main(args: argparse.Namespace) -> int:
    """Run the engines ``args.host_engines`` and sizes ``args.pool_gib`` name; 1 where a side
    failed or moved a wrong byte. The JSON is written again after every row, so that a run
    cut short keeps the rows it measured (``complete`` says whether it ran to the end)."""
    sizes = parse_gib(getattr(args, "pool_gib", None))
    engines = parse_engines(getattr(args, "host_engines", None))
    pin = torch.cuda.is_available()
    if not pin:
        print("kvcore bench --host-pool: no CUDA here; nothing is pinned (a smoke run)")
    rows: list[dict[str, Any]] = []
    report = {
        "engines": list(engines),
        "device": torch.cuda.get_device_name() if pin else "cpu",
        "pinned": pin,
        "command": " ".join(sys.argv),
        "complete": False,
        "rows": rows,
    }
    path = getattr(args, "json", None)

    def save() -> None:
        if path:
            Path(path).write_text(json.dumps(report, indent=2) + "\n")

    for engine in engines:
        for gib in sizes:
            row = measure(gib, pin, engine)
            rows.append(row)
            print(format_row(row), flush=True)
            save()
    report["complete"] = True
    save()
    failed = any(
        f"{side}_error" in row or not row.get(f"{side}_identical", False)
        for row in rows
        if "skipped" not in row
        for side in SIDES
    )
    return 1 if failed else 0
