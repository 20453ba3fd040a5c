"""Host time of each call of an SGLang reload, as SGLang makes them: ``python -m
benchmarks.sglang.host_cost``.

A reload is one ``load_to_device_per_layer`` call per layer, every request with new index
tensors. For each case this times every call on its own, stock's method and kvcore's hook
(with the serve-or-pass rule off, so kvcore serves every call it can copy exactly), and
reports the median host time of a request's first call (where kvcore decides, plans and
uploads the indices) and of its later calls (where kvcore should issue one launch), with
the path kvcore took. On CUDA the copies are queued, so host time is what the engine's
load thread spends; on a CPU the copies run inside the calls, so ``--no-copy`` swaps the
CPU kernels for ones that copy nothing, leaving kvcore's own cost (stock is not timed
there, and the SGLang copies of a call kvcore passes copy nothing either).
With ``--rule`` the serve-or-pass rule stays on and kvcore's calls go through the pool's
attribute first, as SGLang's lookup does: a reload that passes is then timed through the
stock binding kvcore sets on the pool, and ``bound_share`` says how many later calls found it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import functools
import importlib
import inspect
import json
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from benchmarks import phase_timer
from benchmarks.attribute_swap import swapped_attributes
from benchmarks.metric_deltas import paths_taken
from benchmarks.sglang import sweep, sweep_cells, sweep_sides
from benchmarks.sglang.host_cost_phases import PHASES
from benchmarks.sglang.import_stubs import install_torchvision_stub
from benchmarks.sglang.pool_case import Options, PoolCase, pool_case
from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub
from kvcore import kernels
from kvcore.kernels import KernelSet
from kvcore.metrics import METRICS

# kind, layout, io backend, page size: SGLang's default and the cells kvcore serves.
CASES: tuple[tuple[str, str, str, int], ...] = (
    ("mha", "layer_first", "kernel", 64),
    ("mha", "layer_first", "kernel", 1),
    ("mla", "layer_first", "kernel", 1),
    ("mha", "layer_first", "direct", 64),
    ("mha", "page_first", "kernel", 1),
)
TOKENS = (512, 2048, 8192, 32768)

"""What ``--phases`` times in kvcore's calls: the steps of a load's first call and of a
later one, outermost first (the times are inclusive)."""


@dataclasses.dataclass(frozen=True)
class CostRow:
    case: str
    tokens: int
    layers: int
    host_frag: str
    side: str
    first_us: float
    later_us: float
    later_p90_us: float
    paths: list[str]
    bound_share: float = 0.0
    """The share of later calls that found a method bound on the pool (``--rule`` only)."""


def _no_copy(_: Any, *__: Any) -> None:
    return None


def _stock_copy_left_out(*_: Any, **__: Any) -> None:
    return None


_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla")


@contextlib.contextmanager
def stock_copies_left_out() -> Iterator[None]:
    """SGLang's host pools with every ``transfer_kv_*`` copy they call copying nothing.

    Its CPU build imports none of them, so a call kvcore passes to stock would raise
    there; with these it costs stock's Python and kvcore's decision, as kvcore's own
    copies under ``--no-copy`` do. The stock methods stay the pools' own, so kvcore's
    bindings of a passing reload's later layers are made as in a served engine."""
    with swapped_attributes() as swap:
        for name in _POOL_MODULES:
            module = importlib.import_module(name)
            source = inspect.getsource(module)
            for kernel in sorted(set(re.findall(r"\b(transfer_kv_\w+)\(", source))):
                swap(module, kernel, _stock_copy_left_out)
        yield


NO_COPY = KernelSet(
    name="no-copy",
    copy_runs=_no_copy,
    prepare_gather=lambda src_words, dst_words: _no_copy,
    stage_in=_no_copy,
    stage_out=_no_copy,
    copy_runs_layers=_no_copy,
    prepare_rows=lambda src_idx, dst_idx, device: (src_idx, dst_idx),
    gather_prepared=_no_copy,
    prepare_stage_in=lambda chunks, dst_idx, device: (chunks, dst_idx),
    stage_in_prepared=_no_copy,
)


def _request_pools(
    case: PoolCase, side: sweep_sides.Side, tokens: int, gen: torch.Generator, host_frag: str
) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """The pools and a new request's indices (host slots fragmented ``host_frag``: a key of
    :data:`~benchmarks.sglang.pool_case.HOST_LEVELS`), where ``side`` has SGLang put them:
    the arguments of each of the request's load calls."""
    host, dev = sweep_cells.request_indices(case, tokens, host_frag, 1, gen)[0]
    return (case.pool, case.device_pool, *side.prepare(host, dev))


def _call_times(calls: Sequence[Callable[[], Any]], device: torch.device) -> list[float]:
    """Host seconds of each call of one request, in order."""
    sweep_cells.sync_device(device)
    times = []
    for call in calls:
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    sweep_cells.sync_device(device)
    return times


def _row(
    label: str,
    tokens: int,
    layers: int,
    host_frag: str,
    side: str,
    firsts: list[float],
    laters: list[float],
) -> CostRow:
    laters = sorted(laters)
    return CostRow(
        case=label,
        tokens=tokens,
        layers=layers,
        host_frag=host_frag,
        side=side,
        first_us=statistics.median(firsts) * 1e6,
        later_us=statistics.median(laters) * 1e6 if laters else 0.0,
        later_p90_us=laters[(9 * len(laters)) // 10] * 1e6 if laters else 0.0,
        paths=[],
    )


def _kvcore_calls(
    case: PoolCase,
    hook: Callable[..., Any],
    original: Callable[..., Any],
    pools: tuple[Any, ...],
    backend: str,
    through_pool: bool,
    bound: list[int],
) -> list[Callable[[], Any]]:
    """One request's calls to kvcore: its hook as SGLang's HookRegistry calls it, or with
    ``through_pool`` whatever the pool's attribute holds first (a binding kvcore set on the
    pool, counted in ``bound``), as SGLang's ``pool.load_to_device_per_layer`` finds it."""
    if not through_pool:
        return [
            functools.partial(hook, original, *pools, n, backend) for n in range(case.opts.layers)
        ]
    pool, rest = pools[0], pools[1:]
    name = sweep_sides.METHOD_NAMES["load"]

    def call(layer: int) -> Any:
        binding = pool.__dict__.get(name)
        if binding is None:
            return hook(original, pool, *rest, layer, backend)
        if layer:
            bound[0] += 1
        return binding(*rest, layer, backend)

    return [functools.partial(call, n) for n in range(case.opts.layers)]


def measure_case(
    case: PoolCase,
    backend: str,
    tokens: int,
    requests: int,
    stock: bool,
    host_frag: str = "100%",
    *,
    through_pool: bool = False,
) -> list[CostRow]:
    """Stock's and kvcore's per-call host time over ``requests`` requests of ``tokens``;
    ``through_pool``: kvcore's calls as :func:`_kvcore_calls` says."""
    device = case.opts.device
    layers = case.opts.layers
    label = f"{case.kind}/{case.layout}/{backend}/p{case.page_size}"
    gen = torch.Generator().manual_seed(case.opts.seed + tokens)
    sides: list[tuple[str, sweep_sides.Side]] = [
        ("kvcore", sweep_sides.kvcore_side(case, "load", backend, 1))
    ]
    if stock:
        sides.insert(0, ("stock", sweep_sides.stock_side(case, "load", backend, 1)))
    hook, original = sweep_sides.pool_hook(case, "load"), sweep_sides.pool_method(case, "load")
    rows = []
    for name, side in sides:
        if side.call is None or side.label == sweep_sides.MODEL:
            continue  # stock not runnable here, or only its Python model: no host figure
        firsts, laters = [], []
        bound = [0]
        before = METRICS.snapshot()
        # The first request pays one-time costs (JIT compiles, each layer's checks): not kept.
        for request in range(requests + 1):
            pools = _request_pools(case, side, tokens, gen, host_frag)
            calls: list[Callable[[], Any]]
            if name == "stock":
                calls = [functools.partial(original, *pools, n, backend) for n in range(layers)]
            else:
                calls = _kvcore_calls(case, hook, original, pools, backend, through_pool, bound)
            times = _call_times(calls, device)
            if request:
                firsts.append(times[0])
                laters.extend(times[1:])
            else:
                bound[0] = 0
        row = _row(label, tokens, layers, host_frag, name, firsts, laters)
        if name == "kvcore":
            row = dataclasses.replace(
                row,
                paths=paths_taken(before, METRICS.snapshot()),
                bound_share=bound[0] / len(laters) if laters else 0.0,
            )
        rows.append(row)
    return rows


def _layer_calls(
    case: PoolCase, backend: str, tokens: int, requests: int, host_frag: str
) -> Iterator[tuple[int, int, Callable[[], None]]]:
    """``(request, layer, call)`` for every load call kvcore's hook gets over ``requests``
    requests and one before them (request 0, which pays one-time costs), each request
    with new indices and the device synced before and after it."""
    side = sweep_sides.kvcore_side(case, "load", backend, 1)
    hook, original = sweep_sides.pool_hook(case, "load"), sweep_sides.pool_method(case, "load")
    gen = torch.Generator().manual_seed(case.opts.seed)
    for request in range(requests + 1):
        pools = _request_pools(case, side, tokens, gen, host_frag)
        sweep_cells.sync_device(case.opts.device)
        for layer in range(case.opts.layers):
            yield request, layer, functools.partial(hook, original, *pools, layer, backend)
        sweep_cells.sync_device(case.opts.device)


def profile_case(
    case: PoolCase, backend: str, tokens: int, requests: int, path: str, host_frag: str
) -> None:
    """cProfile of kvcore's first calls and of its later calls, apart, added to ``path``."""
    first, later = cProfile.Profile(), cProfile.Profile()
    for request, layer, call in _layer_calls(case, backend, tokens, requests, host_frag):
        profile = first if layer == 0 else later
        if request:
            profile.enable()
        call()
        profile.disable()
    with open(path, "a") as fh:
        for name, profile in (("first calls", first), ("later calls", later)):
            fh.write(f"== {case.kind}/{case.layout}/{backend}/p{case.page_size} {tokens} tokens: ")
            fh.write(f"{name} of {requests} requests, microseconds per request\n")
            fh.write(profile_table(pstats.Stats(profile), requests))


def phase_case(
    case: PoolCase, backend: str, tokens: int, requests: int, path: str, host_frag: str
) -> None:
    """Time in each of :data:`PHASES` (and the whole call) over kvcore's first calls and,
    apart, its later calls (:mod:`benchmarks.phase_timer`), added to ``path``."""
    whole = "the whole call"
    with phase_timer.timing(PHASES) as first, phase_timer.timing(PHASES) as later:
        for request, layer, call in _layer_calls(case, backend, tokens, requests, host_frag):
            times = first if layer == 0 else later
            times.on = request > 0
            started = time.perf_counter()
            call()
            if times.on:
                times.add(whole, time.perf_counter() - started)
            times.on = False
    label = f"{case.kind}/{case.layout}/{backend}/p{case.page_size} {tokens} tokens"
    with open(path, "a") as fh:
        for name, times in (("first calls", first), ("later calls", later)):
            fh.write(f"== {label}, host slots {host_frag}: {name} of {requests} requests, ")
            fh.write("inclusive microseconds per request\n")
            fh.write(times.table(requests, (whole, *PHASES)) + "\n")


def profile_table(stats: pstats.Stats, requests: int, top: int = 30) -> str:
    """The ``top`` functions by own time, as microseconds per request (pstats prints
    seconds to three places, which rounds every call of this hot path to 0)."""
    entries = stats.stats  # type: ignore[attr-defined]  # pstats keeps no public accessor
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
    lines = [f"{'own us':>9} {'total us':>9} {'calls':>7}  function"]
    for (filename, line, function), (_, calls, own, total, _) in ranked:
        where = f"{filename.rsplit('/', 2)[-1]}:{line}({function})"
        lines.append(
            f"{own * 1e6 / requests:9.1f} {total * 1e6 / requests:9.1f} {calls / requests:7.1f}  "
            f"{where}"
        )
    return "\n".join(lines) + "\n\n"


def run(args: argparse.Namespace) -> list[CostRow]:
    device = torch.device(args.device)
    stock = device.type == "cuda"
    rows: list[CostRow] = []
    install_sgl_kernel_stub()
    install_torchvision_stub()
    with contextlib.ExitStack() as stack:
        if not args.rule:
            stack.enter_context(sweep_sides.serve_rule_off())
        if args.device_indices_unread or args.device_indices_read:
            if device.type != "cpu":
                raise SystemExit(
                    "--device-indices-unread and --device-indices-read are for a CPU run: a "
                    "GPU plans so itself (the second under KVCORE_SGLANG_DMA_IN_PLACE=1)"
                )
            if args.device_indices_unread and args.device_indices_read:
                raise SystemExit("give one of --device-indices-unread and --device-indices-read")
            stack.enter_context(
                sweep_sides.device_indices_unread()
                if args.device_indices_unread
                else sweep_sides.device_indices_read()
            )
        if device.type == "cuda":
            # SGLang issues its loads on a stream of its own, and cudaMemcpyBatchAsync refuses
            # the legacy default stream: there kvcore's batched DMA would go one copy per run.
            stack.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
        if args.no_copy:
            if device.type == "cpu":
                stack.enter_context(stock_copies_left_out())
            saved = kernels.unregister_kernels("cpu")
            kernels.register_kernels("cpu", NO_COPY)
            if saved is None:
                stack.callback(kernels.unregister_kernels, "cpu")
            else:
                stack.callback(kernels.register_kernels, "cpu", saved)
        cases = _cases(args.cases)
        profiled_cases = set(args.profile_cases) or ({_name(cases[0])} if cases else set())
        for path in (args.profile, args.phases):
            if path:
                open(path, "w").close()
        for kind, layout, backend, page in cases:
            tokens = [t for t in args.tokens if t % page == 0]
            opts = Options(tokens=max(tokens), layers=args.layers, device=device)
            with pool_case(kind, layout, page, opts) as case:
                looked_at = _name((kind, layout, backend, page)) in profiled_cases
                profiled = args.profile_tokens if args.profile_tokens in tokens else tokens[0]
                if args.profile and looked_at:
                    profile_case(
                        case, backend, profiled, args.requests, args.profile, args.host_frag[0]
                    )
                if args.phases and looked_at:
                    for frag in args.host_frag:
                        phase_case(case, backend, profiled, args.requests, args.phases, frag)
                for count in tokens:
                    for frag in args.host_frag:
                        for row in measure_case(
                            case, backend, count, args.requests, stock, frag, through_pool=args.rule
                        ):
                            rows.append(row)
                            print(_line(row), file=sys.stderr, flush=True)
            sweep.release_pools()
    return rows


def _cases(names: Sequence[str]) -> list[tuple[str, str, str, int]]:
    if not names:
        return list(CASES)
    wanted = set(names)
    return [c for c in CASES if _name(c) in wanted]


def _name(case: tuple[str, str, str, int]) -> str:
    kind, layout, backend, page = case
    return f"{kind}/{layout}/{backend}/p{page}"


def _line(row: CostRow) -> str:
    return (
        f"{row.case:28} {row.tokens:>7} {row.host_frag:>4} {row.side:7} "
        f"first {row.first_us:8.1f} us  "
        f"later {row.later_us:7.1f} us (p90 {row.later_p90_us:7.1f})  "
        f"bound {row.bound_share:4.2f}  {','.join(row.paths)}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sglang.host_cost", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=TOKENS)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--cases", nargs="*", default=[], help="kind/layout/backend/pN names")
    p.add_argument(
        "--host-frag",
        type=lambda s: s.split(","),
        default=["100%"],
        help="host slot fragmentation levels, comma-separated (0%%: one run, served staged)",
    )
    p.add_argument("--no-copy", action="store_true", help="CPU kernels that copy nothing")
    p.add_argument(
        "--device-indices-unread",
        action="store_true",
        help="on a CPU, plan the kernel backend's calls around their device indices, as on "
        "a GPU (the same Python as there)",
    )
    p.add_argument(
        "--device-indices-read",
        action="store_true",
        help="on a CPU, plan the kernel backend's calls as on a GPU under "
        "KVCORE_SGLANG_DMA_IN_PLACE=1: device indices on the device, read back at the move",
    )
    p.add_argument(
        "--rule",
        action="store_true",
        help="keep the serve-or-pass rule on and call through the pool's attribute first",
    )
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--profile", help="write a cProfile of kvcore's calls here")
    p.add_argument(
        "--phases",
        help="write the time in each step of kvcore's calls here (every --host-frag level)",
    )
    p.add_argument(
        "--profile-cases",
        nargs="*",
        default=[],
        help="the cases --profile and --phases look at, one after another (default: the first)",
    )
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=0,
        help="the request size --profile profiles (default: the first of --tokens)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "rows": [dataclasses.asdict(r) for r in rows],
                },
                fh,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
