"""SGLang 0.5.23's own HiCache machinery driven by a request trace, stock or with kvcore's hooks.

    python -m benchmarks.sglang.hicache_live --mode stock|kvcore --json OUT.json
        [--layout layer_first|page_first] [--seconds N] [--scale N] ...

SGLang cannot be served on the GPU machine, so this plays the scheduler's part around the
real cache: a ``UnifiedRadixCache`` with HiCache (``init_hicache``: its
``HybridCacheController``, host pool and ``L2TransferEngine``), write-through, over a
model-shaped MHA device pool (default 32 layers, 8 KV heads x 128, bf16, page 64) small
enough that the trace (:mod:`.hicache_trace`) pushes conversations out to the host pool
between their turns. Per request, as the scheduler and the model runner do:

1. ``check_hicache_events()`` (the scheduler's per-step poll: write-through and load-back
   acks, their locks);
2. ``match_prefix``; a host-only part is loaded back with the cache's ``load_back`` and
   ``ready_to_load_host_cache`` (the per-layer H2D loads on the transfer engine's stream);
3. the forward pass: the consumer index is set on the layer-done counter
   (``tp_worker.set_hicache_consumer``), then every layer in order reads its KV through
   the device pool's ``get_kv_buffer``, which waits for that layer's load
   (``LayerDoneCounter.wait_until``); right after each wait the layer's loaded rows are
   copied on the forward stream, as attention would read them. A load-back is timed from
   the ``load_back`` call until the forward stream has passed the last layer's wait (an
   event after it, synchronised: host and device together);
4. every loaded token's K and V in every layer is checked byte for byte against the
   content that belongs there (:mod:`.kv_content`): as read after each layer's wait (a
   layer signalled before its copy landed fails here), and again from the pool once the
   device is idle, with the tokens that were already resident;
5. prefill: device slots for the new tokens (``evict_from_tree_cache`` first, the
   allocator's eviction as the scheduler calls it), content written, the whole sequence
   inserted, which starts its write-through backup.

Two differences from a live scheduler, both so that the two modes see one trace: a step's
backups are submitted at its end (``flush_pending_backups``; the scheduler does it at the
next step's poll) and the device is drained before the next step starts, so a load-back
never shares the link with a backup and every ack is reaped at the same point in both
modes (the same evictions, the same hits). Before the trace a short warm-up trace (its
own token ids) builds SGLang's JIT kernels and kvcore's, then the cache is reset as
``flush_cache`` resets it.

``--mode kvcore`` sets ``KVCORE_ENABLE=sglang`` and unsets ``KVCORE_TRANSFERS`` (kvcore's
default: transfers on), ``kvcore-allocator`` sets ``KVCORE_TRANSFERS=0`` as well (kvcore's
host-slot allocator alone), ``kvcore-no-warm-up`` is ``kvcore`` with the pools' warm-up
skipped, ``kvcore-ab`` is ``kvcore`` with ``KVCORE_STOCK_SHARE=0.5`` (half the load-backs
kvcore would serve drawn for stock's copy; each load-back's ``copy`` says whose it got, and
the summary's ``in_process_ab`` compares the two inside the process), and ``stock`` sets
``KVCORE_ENABLE=0``; each then loads SGLang's plugins as its scheduler does
(:mod:`.engine_plugins`), before anything is built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.process_state import process_state
from benchmarks.sglang.engine_plugins import MODE_ENV, load_sglang_plugins
from benchmarks.sglang.hicache_live_rig import (
    DEVICE_TOKENS,
    HOST_RATIO,
    LiveOptions,
    build_rig,
    release,
)
from benchmarks.sglang.hicache_live_serve import run_trace, warm_up
from benchmarks.sglang.hicache_live_summary import summarize
from benchmarks.sglang.hicache_trace import TraceShape, make_trace

MODES = tuple(MODE_ENV)
LAYOUTS = ("layer_first", "page_first")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _kvcore_counters() -> dict[str, Any]:
    from kvcore.metrics import METRICS

    return METRICS.snapshot()


def prepare(opts: LiveOptions) -> dict[str, Any]:
    """What must happen before SGLang builds anything: import stand-ins, plugins, JIT."""
    from benchmarks.sglang.protocol_stubs import install_protocol_stubs

    done: dict[str, Any] = {"stubbed_imports": install_protocol_stubs()}
    if opts.device.startswith("cuda"):
        from benchmarks.sglang.jit_kernels import warm_jit
        from benchmarks.sglang.pool_case import Options
        from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub

        done["sgl_kernel"] = "stub (not installed)" if install_sgl_kernel_stub() else "installed"
        done["jit"] = warm_jit(Options(device=torch.device(opts.device)))
    done["plugins"] = load_sglang_plugins(opts.mode)
    return done


def run(opts: LiveOptions, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Prepare, build, warm up, serve the trace; the report (JSON-ready)."""
    prepared = prepare(opts)
    import sglang

    rig = build_rig(opts)
    requests = make_trace(opts.trace)
    try:
        warm = warm_up(rig, requests) if opts.warmup else None
        state = {"before_trace": process_state(rig.device)}
        started = time.perf_counter()
        results, cut_short = run_trace(rig, requests, opts.seconds, progress)
        wall = time.perf_counter() - started
        state["after_trace"] = process_state(rig.device)
        summary = summarize(results, rig.counters, opts.token_bytes)
        summary.update(wall_s=round(wall, 3), cut_short=cut_short, trace_requests=len(requests))
    finally:
        release(rig)
    return {
        "mode": opts.mode,
        "label": opts.label or opts.mode,
        "layout": opts.layout,
        "io_backend": opts.io_backend,
        "device": _device_name(rig.device),
        "engine": "sglang",
        "version": getattr(sglang, "__version__", "unknown"),
        "torch": torch.__version__,
        "geometry": {
            "layers": opts.layers,
            "kv_heads": opts.heads,
            "head_dim": opts.head_dim,
            "dtype": "bfloat16",
            "page_size": opts.page_size,
            "token_bytes": opts.token_bytes,
        },
        "trace": asdict(opts.trace),
        "cache": rig.settings,
        "prepared": prepared,
        "warmup": warm,
        "process_state": state,
        "summary": summary,
        "requests": [r.to_dict() for r in results],
        "kvcore_counters": None if opts.mode == "stock" else _kvcore_counters(),
    }


# --- command line -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--json", type=Path, required=True, help="where the report goes")
    parser.add_argument(
        "--label",
        default="",
        help="the run's name in the combined summary (default: the mode), e.g. stock-2 for a "
        "second stock run that tells the machine's drift from a mode's difference",
    )
    parser.add_argument("--layout", choices=LAYOUTS, default="layer_first")
    parser.add_argument("--seconds", type=float, default=60.0, help="the trace's time budget")
    parser.add_argument("--io-backend", choices=("kernel", "direct"), default="kernel")
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda; cpu only inside the test stand-ins (tests/integration/sglang/hicache_cpu.py)",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--device-tokens", type=int, default=None, help="default 40960 / scale")
    parser.add_argument("--host-ratio", type=float, default=HOST_RATIO)
    parser.add_argument("--conversations", type=int, default=TraceShape.conversations)
    parser.add_argument("--turns", type=int, default=TraceShape.turns)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, default=1, help="divide every trace length by this")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument(
        "--tree-core",
        choices=("python", "rust"),
        default="python",
        help="SGLang's radix tree implementation (its Rust one panics on the GPU image's torch)",
    )
    return parser.parse_args(argv)


def options_for(args: argparse.Namespace) -> LiveOptions:
    trace = TraceShape(
        conversations=args.conversations,
        turns=args.turns,
        seed=args.seed,
        page_size=args.page_size,
        scale=args.scale,
    )
    device_tokens = args.device_tokens or trace.length(DEVICE_TOKENS)
    return LiveOptions(
        mode=args.mode,
        label=args.label,
        layout=args.layout,
        io_backend=args.io_backend,
        device=args.device,
        layers=args.layers,
        heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        device_tokens=device_tokens,
        host_ratio=args.host_ratio,
        trace=trace,
        seconds=args.seconds,
        warmup=not args.no_warmup,
        tree_core=args.tree_core,
    )


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = options_for(args)

    def progress(line: str) -> None:
        print(f"[{opts.mode}] {line}", file=sys.stderr, flush=True)

    report = run(opts, progress)
    write_report(report, args.json)
    s = report["summary"]
    print(
        f"[{opts.mode}] {report['device']} {opts.layout}/{opts.io_backend}: "
        f"{s['requests']} requests, {s['loadbacks']} load-backs, "
        f"p50 {s['loadback_ms_p50']} ms, p99 {s['loadback_ms_p99']} ms, "
        f"mismatched bytes {s['mismatched_bytes']}, evicted {s['evictions']['device_tokens']}, "
        f"written through {s['write_throughs']['tokens']} tokens"
    )
    return 1 if s["checks_failed"] or s["loadbacks"] == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
