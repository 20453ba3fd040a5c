"""Host cost of SGLang reloads that kvcore's serve-or-pass rule passes, called the way
SGLang 0.5.23 calls them, beside stock's.

    PYTHONPATH=.:integrations ~/.cache/kvcore-ci/matrix/venvs/sglang-0.5.23/bin/python \\
        scripts/sglang_pass_cost.py [--device cpu|cuda] [--case KIND/LAYOUT/BACKEND/pN] \\
        [--tokens 512] [--layers 61] [--requests 100] [--rounds 7]

On the GPU machine: carry ``.whl-sglang``, ``export OUT; source scripts/sglang_device_env.sh``,
then ``python3 scripts/sglang_pass_cost.py --device cuda``.

Builds one of SGLang's host pools and its device pool (:mod:`benchmarks.sglang.pool_case`)
and puts kvcore's load hook on the pool class the way SGLang's hook registry wraps a method
(``functools.wraps`` around the stock one), so that a pass can bind stock on the pool as
it does in the engine. Every request gets new index tensors, moved where SGLang's cache
controller moves them (through kvcore's ``move_indices`` hook on kvcore's side, as SGLang
moves every reload's; not timed),
then one ``load_to_device_per_layer_physical`` call per layer: the method SGLang's transfer
engine calls, which looks the pool's method up as SGLang does. The sides take turns request
by request, on the same pools: stock (the class holds SGLang's method) and kvcore (the
class holds the wrapper, the rule on).

Printed for each side: the Python function calls of one request (cProfile's count: the same
on every run, so a noisy machine still compares the two), and the host microseconds of the
request's first call and of its later calls together, each the median over ``--requests``
requests, the fastest of ``--rounds`` rounds (the round least disturbed by other work).

On a CPU, stock's ``direct`` copy (``sgl_kernel``'s, absent there) is given a stand-in
that copies nothing, on both sides alike; the default case there is MHA ``direct`` at page
size 64, which the rule passes below 4096 tokens. On CUDA the default is SGLang's token-
granular MLA ``layer_first`` pool with the ``kernel`` backend, passed below 8192 tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sglang.import_stubs import install_torchvision_stub
from benchmarks.sglang.sgl_kernel_stub import install_sgl_kernel_stub

SIDES = ("stock", "kvcore")


def _no_copy(*_: Any, **__: Any) -> None:
    return None


@contextmanager
def _copy_stand_in(device: torch.device) -> Iterator[None]:
    """On a CPU, stock's ``direct`` copy (sgl-kernel's, absent there) as one that copies
    nothing, while inside; SGLang's module as it was afterwards."""
    if device.type != "cpu":
        yield
        return
    from sglang.srt.mem_cache.pool_host import mha

    missing = object()
    before = getattr(mha, "transfer_kv_direct", missing)
    mha.transfer_kv_direct = _no_copy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if before is missing:
            del mha.transfer_kv_direct
        else:
            mha.transfer_kv_direct = before  # type: ignore[attr-defined]


@contextmanager
def _hooked(case: Any, kvcore: bool) -> Iterator[None]:
    """The pool class's load method as SGLang's hook registry leaves it: kvcore's hook
    around stock's (``kvcore``), or stock's alone; put back, with every binding kvcore set
    on the pool, on the way out."""
    from benchmarks.sglang import sweep_sides
    from benchmarks.sglang.hook_adapter import bench_adapter

    cls, name = type(case.pool), sweep_sides.METHOD_NAMES["load"]
    original = vars(cls)[name]
    hook = sweep_sides.pool_hook(case, "load")

    @functools.wraps(original)
    def wrapped(pool: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(original, pool, *args, **kwargs)

    if kvcore:
        setattr(cls, name, wrapped)
    try:
        yield
    finally:
        setattr(cls, name, original)
        bench_adapter().bindings.restore()


def _request(
    case: Any, side: str, backend: str, host: torch.Tensor, device: torch.Tensor
) -> list[Callable[[], None]]:
    """One request's calls on ``side``, its indices moved where SGLang moves them."""
    from benchmarks.sglang.ab_paths import stock_indices
    from benchmarks.sglang.hook_adapter import move_indices

    pool, device_pool = case.pool, case.device_pool
    moved_host, moved_device = stock_indices(case, "load", backend, host, device)
    if side == "kvcore":

        def to_place(controller: Any, h: torch.Tensor, d: torch.Tensor) -> Any:
            return moved_host, moved_device

        controller = types.SimpleNamespace(mem_pool_host=pool)
        moved_host, moved_device = move_indices(to_place, controller, host, device)
    return [
        functools.partial(
            pool.load_to_device_per_layer_physical,
            device_pool,
            moved_host,
            moved_device,
            layer,
            backend,
        )
        for layer in range(case.opts.layers)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(calls: Sequence[Callable[[], None]], device: torch.device) -> tuple[float, float]:
    """Host seconds of the first call and of the later ones together."""
    _sync(device)
    started = time.perf_counter()
    calls[0]()
    first = time.perf_counter()
    for call in calls[1:]:
        call()
    later = time.perf_counter()
    _sync(device)
    return first - started, later - first


def _python_calls(calls: Sequence[Callable[[], None]], device: torch.device) -> int:
    _sync(device)
    profile = cProfile.Profile()
    profile.enable()
    for call in calls:
        call()
    profile.disable()
    _sync(device)
    stats = pstats.Stats(profile)
    return int(sum(entry[1] for entry in stats.stats.values()))  # type: ignore[attr-defined]


def measure(case: Any, backend: str, tokens: int, requests: int, rounds: int) -> dict[str, Any]:
    """Each side's Python calls a request and the fastest round's median host times."""
    from benchmarks.sglang.sweep_cells import request_indices
    from kvcore.metrics import METRICS

    device = case.opts.device
    gen = torch.Generator().manual_seed(case.opts.seed + tokens)
    fastest: dict[str, tuple[float, float]] = {}
    python_calls: dict[str, int] = {}
    before = METRICS.snapshot()
    for round_index in range(rounds + 1):
        times: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
        for host, dev in request_indices(case, tokens, "100%", requests, gen):
            for side in SIDES:
                with _hooked(case, side == "kvcore"):
                    # The binding a pass sets lives until the next reload: two requests a
                    # turn, so the timed one finds the one its predecessor left.
                    _timed(_request(case, side, backend, host, dev), device)
                    calls = _request(case, side, backend, host.clone(), dev.clone())
                    if round_index == 0:
                        python_calls[side] = _python_calls(calls, device)
                    else:
                        times[side].append(_timed(calls, device))
        if round_index == 0:
            continue  # warm-up: JIT compiles, first-use costs
        for side, pairs in times.items():
            first = statistics.median(p[0] for p in pairs)
            later = statistics.median(p[1] for p in pairs)
            best = fastest.get(side)
            if best is None or first + later < sum(best):
                fastest[side] = (first, later)
    after = METRICS.snapshot()
    return {
        "tokens": tokens,
        "layers": case.opts.layers,
        "python_calls": python_calls,
        "first_us": {side: round(fastest[side][0] * 1e6, 2) for side in SIDES},
        "later_us": {side: round(fastest[side][1] * 1e6, 2) for side in SIDES},
        "passes": _passes(before, after),
    }


def _passes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    counted = {(d["decision"], d["reason"]): d["count"] for d in before.get("decisions", [])}
    out = {}
    for d in after.get("decisions", []):
        new = d["count"] - counted.get((d["decision"], d["reason"]), 0)
        if new:
            out[f"{d['decision']}:{d['reason']}"] = new
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--case", default="", help="KIND/LAYOUT/BACKEND/pN (default by device)")
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[512])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write the rows here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    install_sgl_kernel_stub()
    install_torchvision_stub()
    from benchmarks.sglang.pool_case import Options, pool_case

    device = torch.device(args.device)
    name = args.case or (
        "mla/layer_first/kernel/p1" if device.type == "cuda" else "mha/layer_first/direct/p64"
    )
    kind, layout, backend, page = name.split("/")
    page_size = int(page.removeprefix("p"))
    rows = []
    opts = Options(tokens=max(args.tokens), layers=args.layers, device=device)
    with _copy_stand_in(device), pool_case(kind, layout, page_size, opts) as case:
        for tokens in args.tokens:
            row = {"case": name, **measure(case, backend, tokens, args.requests, args.rounds)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            json.dump({"device": gpu, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
