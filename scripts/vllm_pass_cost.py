"""Host cost of a job that kvcore's vLLM handler passes whole to stock, beside stock's own.

    PYTHONPATH=.:integrations ~/.cache/kvcore-ci/matrix/venvs/vllm-0.33.0/bin/python \\
        scripts/vllm_pass_cost.py [--device cpu|cuda] [--jobs 500] [--rounds 41] \\
        [--tensors 1] [--page-kib 4] [--load]

On the GPU machine, carry ``.vllm-tree`` (scripts/vllm_device_tree.sh), run
``OUT=... source scripts/vllm_device_env.sh``, then ``python3 scripts/vllm_pass_cost.py
--device cuda``.

Builds vLLM's ``SingleDirectionOffloadingHandler`` over one block pool and kvcore's
handler over it, as an engine installs it (serve rule on, metrics counted), and runs the
same jobs through stock's handler called directly and through kvcore's: one handler object
on both sides, so that the difference is kvcore's alone. Each job moves one block, which
kvcore's rules leave to stock (the reason is printed, and checked counted once a job). A
job goes as vLLM's offloading worker drives it: ``transfer_async``, ``wait`` on its id,
then ``get_finished`` until it is reported; ``idle get_finished`` is the call with nothing
in flight, which the worker makes on every handler each step.

Printed per job and per call, for both sides: the Python calls made (cProfile's count: the
same on every run, so a noisy machine still compares the two), and the host microseconds
of the fastest of ``--rounds`` rounds of ``--jobs`` jobs (the round least disturbed by
other work on the machine; the sides take turns, the profiler off); then each function
kvcore's handler calls beyond stock's.

On a CPU, vLLM's handler runs with host stand-ins for its streams and events
(:mod:`benchmarks.vllm.host_platform`) and copies with one memmove per descriptor; on a
GPU without vLLM's compiled ops, with the same driver call
(:func:`benchmarks.vllm.offload_handlers.runnable_stock`). Both sides pay for those alike.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.script_env import need_vllm

need_vllm("vllm_pass_cost")

from benchmarks.vllm.offload_handlers import (
    kvcore_handler,
    runnable_stock,
    stock_handler,
    transfer_args,
)
from benchmarks.vllm.offload_layout import Layout, job_specs
from kvcore.metrics import Metrics

PHASES = ("transfer_async", "wait", "get_finished", "idle get_finished")
JOB_PHASES = PHASES[:3]

FunctionKey = tuple[str, int, str]


@dataclass
class Side:
    """One way of calling the handler, its next job id, and what its calls cost."""

    name: str
    handler: Any
    args: tuple[Any, Any]
    """What ``transfer_async`` takes after the job id, as the installed vLLM passes it."""
    next_id: int = 0
    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    """Per phase, the host seconds a job (a call, when idle) of each timed round."""
    calls: dict[str, Counter[FunctionKey]] = field(
        default_factory=lambda: {p: Counter() for p in PHASES}
    )
    """Per phase, the calls of each function over the profiled round."""
    profiled_jobs: int = 0

    def run(self, jobs: int, *, profiled: bool = False) -> None:
        """``jobs`` jobs one after another, each reported before the next, then as many idle
        ``get_finished`` calls: timed per phase, or profiled per phase."""
        if not profiled:
            self._run(jobs, profiled=False)
            return
        # A collection inside a profiled call would count the finalizers and weak-reference
        # callbacks of objects made elsewhere as that call's own calls.
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._run(jobs, profiled=True)
        finally:
            if enabled:
                gc.enable()

    def _run(self, jobs: int, *, profiled: bool) -> None:
        handler = self.handler
        spent = dict.fromkeys(PHASES, 0.0)
        profiles = {p: cProfile.Profile() for p in PHASES} if profiled else {}

        def call(phase: str, fn: Callable[..., Any], *args: Any) -> Any:
            if profiled:
                profile = profiles[phase]
                profile.enable()
                result = fn(*args)
                profile.disable()
                return result
            started = time.perf_counter()
            result = fn(*args)
            spent[phase] += time.perf_counter() - started
            return result

        for _ in range(jobs):
            job_id = self.next_id
            self.next_id += 1
            call("transfer_async", handler.transfer_async, job_id, *self.args)
            call("wait", handler.wait, {job_id})
            reported: list[Any] = []
            while not reported:
                reported = call("get_finished", handler.get_finished)
            if [(r.job_id, r.success) for r in reported] != [(job_id, True)]:
                raise AssertionError(f"{self.name} reported {reported} for job {job_id}")
        for _ in range(jobs):
            if call("idle get_finished", handler.get_finished):
                raise AssertionError(f"{self.name} reported a job with none in flight")
        if profiled:
            for phase, profile in profiles.items():
                self.calls[phase] += _call_counts(profile)
            self.profiled_jobs += jobs
        else:
            for phase, seconds in spent.items():
                self.seconds[phase].append(seconds / jobs)

    def calls_per_job(self, phase: str) -> float:
        return sum(self.calls[phase].values()) / self.profiled_jobs

    def micros(self, phase: str) -> float:
        return min(self.seconds[phase]) * 1e6


def _call_counts(profile: cProfile.Profile) -> Counter[FunctionKey]:
    """Calls per function, less the profiler's own ``disable``."""
    stats: dict[FunctionKey, tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return Counter({key: calls for key, (_, calls, *_) in stats.items() if "_lsprof" not in key[2]})


def sides(
    device: torch.device, *, tensors: int, page_bytes: int, gpu_to_cpu: bool
) -> tuple[Side, Side, Metrics]:
    """Stock's handler and kvcore's over it, each with a job of one block; the metrics
    kvcore's handler counts into."""
    layout = Layout(page_bytes=page_bytes, tensors=tensors, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(0))
    stock = runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu), device)
    metrics = Metrics()
    kvcore = kvcore_handler(stock, metrics=metrics)
    # What the installed vLLM passes transfer_async after the job id, resolved once: both
    # sides take the same arguments, made before either is timed.
    args = transfer_args(stock, *job_specs(np.array([3]), np.array([5]), gpu_to_cpu=gpu_to_cpu))
    return Side("stock", stock, args), Side("kvcore", kvcore, args), metrics


def measure(stock: Side, kvcore: Side, jobs: int, rounds: int) -> None:
    """A warm-up, one profiled round a side, then ``rounds`` timed rounds a side in turns."""
    for side in (stock, kvcore):
        side.run(min(jobs, 50))
        side.seconds = {p: [] for p in PHASES}
    for side in (stock, kvcore):
        side.run(jobs, profiled=True)
    for index in range(rounds):
        for side in (stock, kvcore) if index % 2 == 0 else (kvcore, stock):
            side.run(jobs)


def table(stock: Side, kvcore: Side) -> Iterator[str]:
    """Calls and host microseconds per job, a line a phase, then the whole job's."""
    header = ("", "stock", "kvcore", "extra", "stock", "kvcore", "extra")
    yield f"{'per job':<18} {'Python calls':^22} {'host us':^28}".rstrip()
    yield "{:<18} {:>6} {:>7} {:>7} {:>8} {:>9} {:>9}".format(*header)

    def line(name: str, phases: tuple[str, ...]) -> str:
        calls = [sum(side.calls_per_job(p) for p in phases) for side in (stock, kvcore)]
        micros = [sum(side.micros(p) for p in phases) for side in (stock, kvcore)]
        return (
            f"{name:<18} {calls[0]:>6.1f} {calls[1]:>7.1f} {calls[1] - calls[0]:>+7.1f} "
            f"{micros[0]:>8.2f} {micros[1]:>9.2f} {micros[1] - micros[0]:>+9.2f}"
        )

    for phase in PHASES:
        yield line(phase, (phase,))
    yield line("whole job", JOB_PHASES)


def extra_functions(stock: Side, kvcore: Side) -> Iterator[str]:
    """Per phase, each function kvcore's side calls more often than stock's, per job."""
    for phase in PHASES:
        extra = kvcore.calls[phase].copy()
        extra.subtract(stock.calls[phase])
        listed = [(key, n) for key, n in extra.most_common() if n > 0]
        if listed:
            yield f"{phase}:"
        for (path, line, name), n in listed:
            where = name if path == "~" else f"{path.rsplit('/', 1)[-1]}:{line}({name})"
            yield f"  {n / kvcore.profiled_jobs:>5.1f}  {where}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--jobs", type=int, default=500, help="jobs a round")
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds a side")
    # What kvcore adds to a passed job does not depend on the tensors; stock's fill of their
    # descriptors does, and on a CPU (host stand-ins for GPU tensors) it is slow enough to
    # hide that addition.
    parser.add_argument("--tensors", type=int, default=1, help="KV tensors (32: per-layer)")
    parser.add_argument("--page-kib", type=int, default=4, help="bytes of one page, KiB")
    parser.add_argument("--load", action="store_true", help="host to GPU (default: stores)")
    args = parser.parse_args(argv)

    stock, kvcore, metrics = sides(
        torch.device(args.device),
        tensors=args.tensors,
        page_bytes=args.page_kib << 10,
        gpu_to_cpu=not args.load,
    )
    measure(stock, kvcore, args.jobs, args.rounds)
    passed = metrics.snapshot()["fallbacks"]
    if sum(passed.values()) != kvcore.next_id:
        raise AssertionError(f"kvcore counted {passed} passes of {kvcore.next_id} jobs")
    print(
        f"{args.device}: {'load' if args.load else 'store'} of 1 block x {args.tensors} "
        f"tensor(s) of {args.page_kib} KiB, every job passed to stock by kvcore ("
        + ", ".join(f"{reason}: {n}" for reason, n in passed.items())
        + f"); fastest of {args.rounds} rounds of {args.jobs} jobs a side"
    )
    for text in table(stock, kvcore):
        print(text)
    print("kvcore's calls beyond stock's, per job:")
    for text in extra_functions(stock, kvcore):
        print(text)
    kvcore.handler.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
