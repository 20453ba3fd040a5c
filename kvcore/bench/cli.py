"""``kvcore bench``'s options and dispatch: the core suite, or an engine's A/B or sweep.

Each engine's module is imported only when ``--engine`` names it, so the core suite runs
without SGLang or vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvcore.bench import suite

# `kvcore bench --engine NAME` -> the module whose main(args) runs that A/B.
ENGINE_ABS: dict[str, str] = {"sglang": "kvcore.bench.sglang.ab"}
# `kvcore bench --engine NAME --sweep` -> the module whose main(args) runs the engine-shaped
# sweep (whole requests as the engine makes them, stock against kvcore).
ENGINE_SWEEPS: dict[str, str] = {
    "sglang": "kvcore.bench.sglang.sweep",
    "vllm": "kvcore.bench.vllm.sweep",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``kvcore bench`` option: the core suite's, then the engine benches'."""
    suite.add_arguments(parser)
    parser.add_argument(
        "--engine",
        choices=sorted({*ENGINE_ABS, *ENGINE_SWEEPS}),
        help="A/B an engine's own transfer methods against kvcore's hooks instead",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help=(
            "with --engine: time whole requests as the engine makes them (every layer's "
            "call, new indices per request), stock against kvcore, over request sizes"
        ),
    )
    parser.add_argument(
        "--repeats", type=int, default=0, help="with --sweep: timed requests per cell"
    )
    parser.add_argument(
        "--sizes", help="with --sweep: comma list of request sizes in tokens (vLLM: blocks)"
    )
    parser.add_argument(
        "--layouts",
        help="with --sweep: comma list of LAYOUT/IO_BACKEND (default: every one served)",
    )
    parser.add_argument(
        "--gemm",
        action="store_true",
        help="with --sweep: time a concurrent GEMM batch during each request (CUDA)",
    )
    parser.add_argument(
        "--no-rule",
        action="store_true",
        help="with --sweep: kvcore serves every call it can (serve-or-pass rule off)",
    )


def run(args: argparse.Namespace) -> int:
    """Run what the options ask for; 2 for an engine/--sweep combination that has no bench."""
    engine = getattr(args, "engine", None)
    if getattr(args, "sweep", False):
        if engine is None:
            print("kvcore bench: --sweep needs --engine (sglang or vllm)", file=sys.stderr)
            return 2
        return int(importlib.import_module(ENGINE_SWEEPS[engine]).main(args))
    if engine is not None:
        if engine not in ENGINE_ABS:
            print(f"kvcore bench: --engine {engine} runs only with --sweep", file=sys.stderr)
            return 2
        return int(importlib.import_module(ENGINE_ABS[engine]).main(args))
    return suite.main(args)
