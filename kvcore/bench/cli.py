"""``kvcore bench``'s options and dispatch: the core suite, or an engine's A/B or sweep.

Each engine's module is imported only when ``--engine`` names it, so the core suite runs
without SGLang or vLLM installed. The engines' benches live in the checkout's top-level
``benchmarks/`` package, which the wheel does not carry: they run from a checkout
(``pip install -e .``), and elsewhere ``--engine`` says so in one line. Every option is
checked before anything runs: a bad one ends the command with one line per problem on
stderr and exit status 2, not a traceback minutes into a measurement.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from kvcore.bench import suite, suite_options

# `kvcore bench --engine NAME` -> the module whose main(args) runs that A/B.
ENGINE_ABS: dict[str, str] = {"sglang": "benchmarks.sglang.ab"}
# `kvcore bench --engine NAME --sweep` -> the module whose main(args) runs the engine-shaped
# sweep (whole requests as the engine makes them, stock against kvcore).
ENGINE_SWEEPS: dict[str, str] = {
    "sglang": "benchmarks.sglang.sweep",
    "vllm": "benchmarks.vllm.sweep",
}

# `kvcore bench --host-pool` -> an engine's host tier built stock's way and kvcore's.
HOST_POOL = "benchmarks.host_pool"

# `kvcore bench --engine NAME --sweep --beside-compute` -> reloads beside a model's forward.
BESIDE_COMPUTE: dict[str, str] = {
    "sglang": "benchmarks.sglang.beside",
    "vllm": "benchmarks.vllm.beside",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``kvcore bench`` option: the core suite's, then the engine benches'."""
    suite_options.add_arguments(parser)
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
        "--repeats",
        type=int,
        help="with --sweep: timed requests per cell, at least 1 (default: the sweep's own)",
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
        "--beside-compute",
        action="store_true",
        help=(
            "with --engine sglang --sweep: reloads through SGLang's L2TransferEngine alone, "
            "beside another batch's forward and feeding the hit's own forward (CUDA)"
        ),
    )
    parser.add_argument(
        "--compute",
        help="with --beside-compute: comma list of decode-64, decode-256, prefill-4096",
    )
    parser.add_argument(
        "--pages", help="with --beside-compute: comma list of page sizes (default 64,16,1)"
    )
    parser.add_argument(
        "--forward-span",
        type=float,
        help="with --beside-compute: size another batch's forward to this many times stock's "
        "copy alone (default 1; 3 or more keeps the GPU busy through the copy, as an engine "
        "running forwards back to back does)",
    )
    parser.add_argument(
        "--stores",
        action="store_true",
        help="with --beside-compute: also the engine's page-outs (vLLM's stores, SGLang's "
        "backups), GPU to CPU",
    )
    parser.add_argument(
        "--engine-steps",
        action="store_true",
        help="with --engine vllm --sweep --beside-compute: also the engine's step loop: the "
        "loads submitted, then the model's forward step after step, each step's end asking "
        "which jobs finished, until the request's are (the hit ready at a step's end, the "
        "running batch's steps until then)",
    )
    parser.add_argument(
        "--gpu-levels",
        help="with --engine vllm --sweep --beside-compute: one of 0%%, 50%%, 100%%, the share of "
        "a request's GPU blocks not next to the one before (default: --host-levels')",
    )
    parser.add_argument(
        "--host-pool",
        action="store_true",
        help=(
            "build vLLM 0.25.1's CPU tier stock's way (torch's pinned tensors) and kvcore's "
            "(its exact mapping), each size in a process of its own: time, RSS, bytes, reads"
        ),
    )
    parser.add_argument(
        "--pool-gib",
        help="with --host-pool: comma list of tier sizes in GiB (default 16,32,64,96)",
    )
    parser.add_argument(
        "--host-engines",
        help=(
            "with --host-pool: comma list of vllm-0.25.1, sglang, sglang-pin-first, "
            "vllm-shared-region, vllm-region-pin-first (default all)"
        ),
    )
    parser.add_argument(
        "--no-rule",
        action="store_true",
        help="with --sweep: kvcore serves every call it can (serve-or-pass rule off)",
    )


def run(args: argparse.Namespace) -> int:
    """Run what the options ask for; 2 for a bad option, an engine that is not installed or
    an engine/--sweep combination that has no bench."""
    problems = argument_problems(args)
    for problem in problems:
        print(f"kvcore bench: {problem}", file=sys.stderr)
    if problems:
        return 2
    if getattr(args, "host_pool", False):
        return int(importlib.import_module(HOST_POOL).main(args))
    engine = getattr(args, "engine", None)
    if engine is not None and engine_benchmarks() is None:
        print(f"kvcore bench: --engine {engine}: {NO_CHECKOUT}", file=sys.stderr)
        return 2
    if engine is not None and importlib.util.find_spec(engine) is None:
        # The engine's bench modules import it at the top: say so before they do.
        print(f"kvcore bench: --engine {engine}: {_not_installed(engine)}", file=sys.stderr)
        return 2
    if getattr(args, "sweep", False):
        if engine is None:
            print("kvcore bench: --sweep needs --engine (sglang or vllm)", file=sys.stderr)
            return 2
        if getattr(args, "beside_compute", False):
            if engine not in BESIDE_COMPUTE:
                print(
                    f"kvcore bench: --beside-compute runs for {', '.join(BESIDE_COMPUTE)}",
                    file=sys.stderr,
                )
                return 2
            return int(importlib.import_module(BESIDE_COMPUTE[engine]).main(args))
        return int(importlib.import_module(ENGINE_SWEEPS[engine]).main(args))
    if engine is not None:
        if engine not in ENGINE_ABS:
            print(f"kvcore bench: --engine {engine} runs only with --sweep", file=sys.stderr)
            return 2
        return int(importlib.import_module(ENGINE_ABS[engine]).main(args))
    return suite.main(args)


NO_CHECKOUT = (
    "the engine benches are in a kvcore checkout's benchmarks/ package, which the wheel "
    "does not carry; run them from a checkout (git clone, then pip install -e .)"
)


def engine_benchmarks() -> Path | None:
    """The checkout holding the ``benchmarks`` package, put first on ``sys.path`` so that it
    is the one imported (a package of that name elsewhere would be another's); None where
    kvcore is installed without its checkout."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "sglang" / "__init__.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root


def argument_problems(args: argparse.Namespace) -> list[str]:
    """One line per option ``args`` holds that no bench could run with, each naming the
    value and what to give instead."""
    problems = [
        _tokens_problem(getattr(args, "tokens", None), per_page=not getattr(args, "sweep", False)),
        _repeats_problem(getattr(args, "repeats", None)),
        _sizes_problem(getattr(args, "sizes", None)),
        _output_problem("--json", getattr(args, "json", None)),
        _output_problem("--plot", getattr(args, "plot", None)),
        _plot_format_problem(getattr(args, "plot", None)),
        *_beside_compute_problems(args),
        *_host_pool_problems(args),
    ]
    return [problem for problem in problems if problem is not None]


def _beside_compute_problems(args: argparse.Namespace) -> list[str]:
    """``--beside-compute`` needs an engine sweep that has one; ``--compute`` and
    ``--pages`` mean something only with it."""
    problems: list[str] = []
    compute = getattr(args, "compute", None)
    if compute is not None and engine_benchmarks() is None:
        return [f"--compute {compute}: {NO_CHECKOUT}"]
    beside = bool(getattr(args, "beside_compute", False))
    engine = getattr(args, "engine", None)
    if beside and (engine not in BESIDE_COMPUTE or not getattr(args, "sweep", False)):
        problems.append(
            f"--beside-compute: give it with --engine {' or '.join(BESIDE_COMPUTE)} --sweep"
        )
    for option in ("--compute", "--pages"):
        value = getattr(args, option[2:], None)
        if value is not None and not beside:
            problems.append(f"{option} {value}: it applies only with --beside-compute")
    pages = getattr(args, "pages", None)
    if pages is not None and beside and engine == "vllm":
        problems.append(f"--pages {pages}: vLLM's blocks are 16 tokens; --pages is SGLang's")
    if getattr(args, "stores", False) and not beside:
        problems.append("--stores: it applies only with --beside-compute")
    if getattr(args, "engine_steps", False) and not (beside and engine == "vllm"):
        problems.append(
            "--engine-steps: it applies only with --engine vllm --sweep --beside-compute"
        )
    gpu_levels = getattr(args, "gpu_levels", None)
    if gpu_levels is not None and not (beside and engine == "vllm"):
        problems.append(
            f"--gpu-levels {gpu_levels}: it applies only with --engine vllm --sweep "
            "--beside-compute"
        )
    span = getattr(args, "forward_span", None)
    if span is not None and not beside:
        problems.append(f"--forward-span {span:g}: it applies only with --beside-compute")
    elif span is not None and not 0.1 <= span <= 100:
        problems.append(
            f"--forward-span {span:g}: give a multiple of stock's copy time from 0.1 to 100 "
            "(1, the default, lasts about as long as the copy)"
        )
    if compute is not None:
        from benchmarks.model_forward import COMPUTE_LOADS

        unknown = [load for load in compute.split(",") if load not in COMPUTE_LOADS]
        if unknown:
            problems.append(
                f"--compute {compute}: {', '.join(map(repr, unknown))} is no compute load; "
                f"give a comma list of {', '.join(COMPUTE_LOADS)}"
            )
    pages = getattr(args, "pages", None)
    if pages is not None and _sizes_problem(pages) is not None:
        problems.append(f"--pages {pages}: give a comma list of page sizes of 1 or more, e.g. 64,1")
    return problems


def _host_pool_problems(args: argparse.Namespace) -> list[str]:
    """``--host-pool`` runs alone; ``--pool-gib`` and ``--host-engines`` mean something only
    with it."""
    gib = getattr(args, "pool_gib", None)
    engines = getattr(args, "host_engines", None)
    if not getattr(args, "host_pool", False):
        return [
            f"{option} {value}: it applies only with --host-pool"
            for option, value in (("--pool-gib", gib), ("--host-engines", engines))
            if value is not None
        ]
    problems = [
        f"{option}: --host-pool runs alone; leave {option} out"
        for option in ("--engine", "--sweep")
        if getattr(args, option[2:], None)
    ]
    if engine_benchmarks() is None:
        problems.append(f"--host-pool: {NO_CHECKOUT}")
    else:
        from benchmarks.host_pool import parse_engines, parse_gib

        for check, value in ((parse_gib, gib), (parse_engines, engines)):
            try:
                check(value)
            except ValueError as exc:
                problems.append(str(exc))
    return problems


def _tokens_problem(tokens: int | None, *, per_page: bool) -> str | None:
    if tokens is None:
        return None
    if not per_page:
        # A sweep's request size, as in --sizes: a page-size-1 pool takes any count.
        return None if tokens >= 1 else f"--tokens {tokens}: give a request size of 1 or more"
    if tokens < suite_options.PAGE or tokens % suite_options.PAGE:
        # Host and device layouts are built from whole pages of PAGE rows on both sides.
        return (
            f"--tokens {tokens}: give a multiple of {suite_options.PAGE} rows (one page), at least "
            f"{suite_options.PAGE}, or leave it out for the default"
        )
    return None


def _repeats_problem(repeats: int | None) -> str | None:
    if repeats is None or repeats >= 1:
        return None
    return f"--repeats {repeats}: give 1 or more timed requests per cell, or leave it out"


def _sizes_problem(sizes: str | None) -> str | None:
    if sizes is None:
        return None
    for entry in sizes.split(","):
        try:
            size = int(entry)
        except ValueError:
            size = 0
        if size < 1:
            return (
                f"--sizes {sizes}: {entry.strip() or 'an empty entry'!r} is not a request size; "
                "give a comma list of whole numbers of 1 or more, e.g. 2048,8192"
            )
    return None


def _output_problem(option: str, path: str | None) -> str | None:
    """Why ``path`` cannot be written, checked now so that a run is not lost at its end."""
    if path is None:
        return None
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        return f"{option} {path}: is a folder; give a file name in it"
    if not folder.is_dir():
        return f"{option} {path}: the folder {folder} does not exist; create it first"
    if not os.access(folder, os.W_OK):
        return f"{option} {path}: the folder {folder} is not writable; pick another one"
    return None


def _plot_format_problem(path: str | None) -> str | None:
    suffix = Path(path).suffix.lower().lstrip(".") if path else ""
    if not suffix:
        # matplotlib writes its default format (PNG) and adds the extension itself.
        return None
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        # The run goes on and says that no plot was written, as it always has.
        return None
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix in formats:
        return None
    known = ", ".join(f".{name}" for name in sorted(formats))
    return f"--plot {path}: matplotlib cannot write .{suffix} files; end the name in one of {known}"


# How to get each engine; the lanes' scripts pin a CPU torch so that pip cannot swap it for
# a CUDA build while it resolves the engine's dependencies.
ENGINE_INSTALLS: dict[str, str] = {
    "sglang": "ci/install_sglang.sh",
    "vllm": "ci/install_vllm.sh",
}


def _not_installed(engine: str) -> str:
    versions = importlib.import_module(f"kvcore_{engine}").SUPPORTED_VERSIONS
    return (
        f"{engine} is not installed for {sys.executable}; install a release kvcore supports "
        f"({', '.join(versions)}) into this environment, or from a kvcore checkout run "
        f"{ENGINE_INSTALLS[engine]} for a CPU venv with it, and run kvcore bench from that venv"
    )
