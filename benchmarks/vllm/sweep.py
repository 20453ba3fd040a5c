"""``kvcore bench --engine vllm --sweep``: whole vLLM offload requests, stock against kvcore.

A request is what vLLM's offloading worker does with one step's jobs: each job's
``transfer_async(job_id, src_spec, dst_spec)`` on the handler of its direction, back to
back, then ``wait`` on their ids and ``get_finished`` until every one is reported. Its
wall-clock runs from the first call until the last job is reported (host and device
time), and the host time of the ``transfer_async`` calls alone is kept beside it.

The sweep runs requests of 1 to 4096 blocks (16 tokens a block), one job alone or four
in flight, stores (GPU to host) and loads, host ids broken at 0/50/100% of neighbour
pairs, over vLLM's layouts: one KV tensor per layer (a 32-layer model with MHA pages, a
61-layer one with MLA pages) and cross-layer (one tensor, each page every layer's). Each
request gets block ids no earlier request had; stock and kvcore run it in turn, the
order alternating, in one process on one set of tensors (:mod:`benchmarks.vllm.sweep_pools`
checks every byte of every request). kvcore's handler counts the jobs it left to stock,
with the reason (its stock-is-cheaper rules, planner fallbacks).

Stock is vLLM's ``SingleDirectionOffloadingHandler`` end to end where its copy op can
run: its compiled op, or where the compiled ops are absent the same driver call over its
descriptors (:func:`benchmarks.vllm.ab.runnable_stock`), or its Triton kernel where vLLM
picks it. On a CPU vLLM's handler cannot run (it pins its descriptor buffers and records
device events): stock is reported not runnable (NaN times) and kvcore's handler runs
alone on host tensors, its stock fallbacks copying with a memmove per descriptor.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from benchmarks import sweep_report
from benchmarks.gemm_share import GemmBatch, gemm_summary
from benchmarks.paired_speed import paired_speed
from benchmarks.sweep_report import SweepRow
from benchmarks.vllm.offload_handlers import compiled_ops_loaded, stock_handler
from benchmarks.vllm.offload_layout import job_specs
from benchmarks.vllm.sweep_plan import BLOCK_TOKENS, FULL, QUICK, ModelLayout, SweepPlan
from benchmarks.vllm.sweep_pools import Pools, Request, RequestDrawer
from benchmarks.vllm.sweep_sides import Samples, Side, kvcore_side, stock_side
from kvcore.bench.host_buffers import HostBuffer, allocate_host_buffer
from kvcore.bench.measure import device_named
from kvcore.kernels.batch_copy import batch_copy_available


@dataclass
class SweepResult:
    rows: list[SweepRow] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """Passes that raised, requests of a warm-up that went wrong."""
    skipped: int = 0
    """Cells left out when the time budget ran out."""
    pool_checks: dict[str, bool] = field(default_factory=dict)
    """Per pass, whether every row of both sides held its expected bytes at its end."""
    ceiling_gbps: dict[str, float] = field(default_factory=dict)


def run(
    plan: SweepPlan,
    device: torch.device,
    *,
    progress: bool = True,
    budget_s: float | None = None,
) -> SweepResult:
    """Every cell of ``plan`` on ``device``; cells past ``budget_s`` are skipped (counted)."""
    return _Sweep(plan, device, progress, budget_s).run()


class _Sweep:
    def __init__(
        self, plan: SweepPlan, device: torch.device, progress: bool, budget_s: float | None
    ) -> None:
        self.plan = plan
        self.device = device
        self.progress = progress
        self.budget_s = budget_s
        self.result = SweepResult()
        self.started = time.perf_counter()
        self.blocks = plan.pool_blocks()
        self.cells_total = sum(1 for _ in plan.cells(plan.ops[0])) * len(plan.ops)
        self.cells_total *= len(plan.layouts)
        self._generator = torch.Generator().manual_seed(plan.seed)
        self._rng = np.random.default_rng(plan.seed)
        self._next_job_id = 0

    def run(self) -> SweepResult:
        rows = max(m.layout(self.blocks).host_row_bytes for m in self.plan.layouts)
        host = host_region(rows * self.blocks, self.device)
        try:
            for model in self.plan.layouts:
                pools = Pools(
                    model.layout(self.blocks),
                    host.tensor.view(torch.int8),
                    self.device,
                    self._generator,
                )
                if self.device.type == "cuda" and not self.result.ceiling_gbps:
                    self.result.ceiling_gbps = link_ceilings(pools)
                for op in self.plan.ops:
                    self._pass(model, op, pools)
                del pools
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            host.close()
        return self.result

    def _over_budget(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.started > self.budget_s

    def _pass(self, model: ModelLayout, op: str, pools: Pools) -> None:
        """One layout and one direction: one pair of handlers for every cell, as in vLLM."""
        cells = list(self.plan.cells(op))
        if self._over_budget():
            self.result.skipped += len(cells)
            return
        gpu_to_cpu = op == "store"
        stock = stock_handler(pools.gpu, pools.host, pools.layout, gpu_to_cpu=gpu_to_cpu)
        stock_label, stock_run = stock_side(stock, self.device)
        sides = [stock_run] if stock_run is not None else []
        first_row = len(self.result.rows)
        drawer = RequestDrawer(self.blocks, self._rng)
        try:
            sides.append(kvcore_side(stock, self.device))
            # Untimed: the handlers' first jobs allocate their streams and buffers, as many
            # in flight as the pass's busiest cell will have (kvcore's handler wraps a stock
            # handler of its own, which would otherwise pay that in kvcore's first cells).
            warm_up = {side.name: Samples() for side in sides}
            in_flight = max(jobs for _, jobs, _ in cells)
            first = drawer.draw(min(self.plan.sizes), 0.0, in_flight, gpu_to_cpu=gpu_to_cpu)
            self._request(sides, pools, first, warm_up)
            self.result.failures += [e for s in warm_up.values() for e in s.errors]
            for index, (frag, jobs, blocks) in enumerate(cells):
                if self._over_budget():
                    self.result.skipped += len(cells) - index
                    break
                row = self._cell(model, op, (frag, jobs, blocks), pools, drawer, sides)
                row.paths.insert(0, f"stock:{stock_label}")
                row.ceiling_gbps = self.result.ceiling_gbps.get(op)
                self.result.rows.append(row)
                if self.progress:
                    self._print_progress(row)
        except Exception as error:
            traceback.print_exc()
            self.result.failures.append(f"{model.name}/{op}: {error!r}")
        finally:
            for side in sides:
                side.handler.shutdown()
        clean = pools.verify_all()
        self.result.pool_checks[f"{model.name}/{op}"] = clean
        if not clean:
            for row in self.result.rows[first_row:]:
                row.identical = False
                row.extra["pool_check"] = "a row outside the requests' windows changed"

    def _cell(
        self,
        model: ModelLayout,
        op: str,
        cell: tuple[float, int, int],
        pools: Pools,
        drawer: RequestDrawer,
        sides: list[Side],
    ) -> SweepRow:
        frag, jobs, blocks = cell
        nbytes = jobs * blocks * model.block_bytes
        repeats = self.plan.repeats(nbytes)
        samples = {side.name: Samples() for side in sides}
        kvcore = sides[-1]
        fallbacks_before, paths_before = kvcore.fallbacks(), kvcore.mover_paths()
        degraded_before = kvcore.degraded()
        for repeat in range(repeats):
            request = drawer.draw(blocks, frag, jobs, gpu_to_cpu=op == "store")
            self._request(sides if repeat % 2 == 0 else sides[::-1], pools, request, samples)
        passed = kvcore.fallbacks() - fallbacks_before
        stock_jobs = sum(passed.values())
        served = repeats * jobs - stock_jobs
        stock, mine = samples.get("stock", Samples()), samples["kvcore"]
        gemm = self._gemm(op, (frag, jobs, blocks), nbytes, pools, drawer, sides, samples)
        return SweepRow(
            engine="vllm",
            case=f"{model.name}/host-{frag:.0%}/{op}/{jobs}-job{'s' if jobs > 1 else ''}",
            tokens=blocks * BLOCK_TOKENS,
            layers=model.layers,
            nbytes=nbytes,
            stock_ms=stock.median_ms(stock.wall),
            kvcore_ms=mine.median_ms(mine.wall),
            stock_host_ms=stock.median_ms(stock.host),
            kvcore_host_ms=mine.median_ms(mine.host),
            identical=all(s.ok for s in samples.values()),
            calls=jobs,
            kvcore_served=round(served / repeats),
            pass_reasons={reason: round(n / repeats) for reason, n in sorted(passed.items())},
            paths=[f"kvcore:{path}" for path in sorted(kvcore.mover_paths() - paths_before)]
            + (["kvcore:stock-fallback"] if stock_jobs else []),
            paired=paired_speed(stock.wall, mine.wall) if stock.wall else None,
            extra={
                "op": op,
                "blocks": blocks,
                "jobs_in_flight": jobs,
                "frag": frag,
                "repeats": repeats,
                "tensors": pools.tensors,
                "page_bytes": pools.page_bytes,
                "kvcore_jobs": {"jobs": repeats * jobs, "served": served, "stock": dict(passed)},
                "kvcore_degraded": dict(kvcore.degraded() - degraded_before),
                "identical_by_side": {name: s.ok for name, s in samples.items()},
                "errors": [e for s in samples.values() for e in s.errors][:5],
                **gemm,
            },
        )

    def _gemm(
        self,
        op: str,
        cell: tuple[float, int, int],
        nbytes: int,
        pools: Pools,
        drawer: RequestDrawer,
        sides: list[Side],
        samples: dict[str, Samples],
    ) -> dict[str, float]:
        """A GEMM batch's time alone and beside one more request of each side (each checked
        like the timed ones), where the plan asks and the cell is large enough."""
        frag, jobs, blocks = cell
        if not self.plan.gemm or self.device.type != "cuda" or nbytes < self.plan.gemm_min_bytes:
            return {}
        timed = samples.get("stock", samples["kvcore"])
        batch = GemmBatch(self.device, timed.median_ms(timed.wall))
        out = {"gemm_count": float(batch.count), "gemm_alone_ms": batch.alone_ms()}
        for side in sides:
            request = drawer.draw(blocks, frag, jobs, gpu_to_cpu=op == "store")
            kept = Samples()
            out[f"gemm_with_{side.name}_ms"] = batch.beside_ms(
                functools.partial(self._request, [side], pools, request, {side.name: kept})
            )
            samples[side.name].errors += kept.errors
        return out

    def _request(
        self, order: Sequence[Side], pools: Pools, request: Request, samples: dict[str, Samples]
    ) -> None:
        """``request`` through each side in turn, each checked before the next runs."""
        for side in order:
            ids = list(range(self._next_job_id, self._next_job_id + len(request.jobs)))
            self._next_job_id += len(ids)
            wall, host, errors = request_through(side, pools, request, ids)
            got = samples[side.name]
            got.wall.append(wall)
            got.host.append(host)
            got.errors += [f"{side.name}: {error}" for error in errors]

    def _print_progress(self, row: SweepRow) -> None:
        done = len(self.result.rows) + self.result.skipped
        print(
            f"[{done}/{self.cells_total} {time.perf_counter() - self.started:.0f}s] {row.case} "
            f"{row.extra['blocks']} blocks: stock {row.stock_ms:.3f} ms, kvcore "
            f"{row.kvcore_ms:.3f} ms ({row.ratio:.2f}x), served {row.kvcore_served}/{row.calls}"
            f"{'' if row.identical else ', WRONG BYTES'}",
            flush=True,
        )


def request_through(
    side: Side,
    pools: Pools,
    request: Request,
    ids: list[int],
    between: Callable[[], object] | None = None,
    before_check: Callable[[], object] | None = None,
) -> tuple[float, float, list[str]]:
    """``request``'s jobs (numbered ``ids``) through one side, then checked: wall-clock and
    host seconds, and what was wrong (reports, bytes). ``between`` runs once the jobs are
    submitted (:meth:`Side.run`), ``before_check`` once they are reported."""
    pools.prepare(request)
    wall, host, results = side.run(request_specs(request, ids), between)
    if before_check is not None:
        before_check()
    return wall, host, request_errors(results, ids, request, pools)


def request_specs(request: Request, ids: list[int]) -> list[tuple[int, tuple[Any, Any]]]:
    """``request``'s jobs as vLLM hands them to a handler, numbered ``ids``."""
    return [
        (job_id, job_specs(job.gpu_ids, job.cpu_ids, gpu_to_cpu=request.gpu_to_cpu))
        for job_id, job in zip(ids, request.jobs, strict=True)
    ]


def request_errors(results: list[Any], ids: list[int], request: Request, pools: Pools) -> list[str]:
    """What was wrong with a request's jobs (numbered ``ids``): their reports against vLLM's
    contract, then every byte; checked whatever the reports said, since the check also puts
    the request's rows back."""
    errors = [] if (error := _results_error(results, ids, request, pools)) is None else [error]
    if not pools.verify(request):
        errors.append("wrong bytes")
    return errors


def _results_error(
    results: list[Any], ids: list[int], request: Request, pools: Pools
) -> str | None:
    """Why the jobs' reports differ from vLLM's contract (each job once, with the bytes it
    moved; vLLM matches results by job id, so their order is free), or None."""
    reported = sorted(r.job_id for r in results)
    if reported != sorted(ids):
        return f"reported jobs {reported}, submitted {ids}"
    if not all(r.success for r in results):
        return "a job reported failure"
    expected = [len(job.gpu_ids) * pools.tensors * pools.page_bytes for job in request.jobs]
    size_of = {r.job_id: r.transfer_size for r in results}
    sizes = [size_of[job_id] for job_id in ids]
    if sizes != expected:
        return f"reported {sizes} bytes, moved {expected}"
    return None


def host_region(nbytes: int, device: torch.device) -> HostBuffer:
    """Host memory for every layout's region in turn: pinned once (vLLM pins its region),
    registered as one range, since a DMA copy cannot span two registrations."""
    if device.type != "cuda":
        return allocate_host_buffer(nbytes, pin=False)
    return allocate_host_buffer(nbytes, pin=True, register_chunk_bytes=nbytes)


def link_ceilings(pools: Pools) -> dict[str, float]:
    """GB/s of one contiguous copy of up to 1 GiB each way: what the link gives."""
    rows = max(1, min(pools.blocks, (1 << 30) // pools.region.shape[1]))
    host, device = pools.region[:rows], pools.host_ref[:rows]
    out = {}
    for op, (dst, src) in {"store": (host, device), "load": (device, host)}.items():
        seconds = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        out[op] = host.numel() / min(seconds) / 1e9
    # Both hold the same bytes, so the copies changed neither.
    return out


def main(args: argparse.Namespace) -> int:
    """Run the sweep ``args`` asks for (quick, json, plot, device, no_progress, and
    optionally budget_s); 1 if any cell moved a wrong byte or failed."""
    import vllm

    device = device_named(args.device)
    if isinstance(device, torch.device) and device.type != "cuda" and not args.quick:
        device = "the full sweep needs a GPU (its pools take about 50 GiB); add --quick"
    if isinstance(device, str):
        print(f"kvcore bench --sweep: {device}", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    if getattr(args, "gemm", False):
        plan = replace(plan, gemm=True)
    started = time.perf_counter()
    result = run(
        plan, device, progress=not args.no_progress, budget_s=getattr(args, "budget_s", None)
    )
    rows = result.rows
    print(sweep_report.format_table(rows))
    print(sweep_report.LEGEND)
    print(sweep_report.summary(rows))
    for line in gemm_summary(rows):
        print(line)
    if device.type != "cuda":
        print("stock: vLLM's handler cannot run on a CPU; kvcore's ran alone (times NaN)")
    if result.skipped:
        print(f"{result.skipped} cells skipped: the time budget ran out")
    for failure in result.failures:
        print(f"failed: {failure}", file=sys.stderr)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.json:
        document = sweep_report.report(
            name,
            rows,
            engine="vllm",
            version=vllm.__version__,
            torch=torch.__version__,
            plan="quick" if args.quick else "full",
            vllm_compiled_ops=compiled_ops_loaded(),
            batch_copy_available=batch_copy_available(),
            ceiling_gbps=result.ceiling_gbps,
            pool_checks=result.pool_checks,
            failures=result.failures,
            skipped_cells=result.skipped,
            seconds=time.perf_counter() - started,
        )
        sweep_report.write_json(args.json, document)
    if args.plot:
        _plot(rows, args.plot, f"vLLM {vllm.__version__} offload, {name}")
    wrong = any(not row.identical for row in rows)
    return 1 if wrong or result.failures else 0


def _plot(rows: list[SweepRow], path: str, title: str) -> None:
    if not any(math.isfinite(row.ratio) for row in rows):
        print("kvcore bench: no cell has stock and kvcore times; no plot written", file=sys.stderr)
        return
    try:
        sweep_report.plot(rows, path, title=title)
    except ImportError:
        print("kvcore bench: matplotlib is not installed; no plot written", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm.sweep", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--budget-s", type=float, help="skip the cells left after this many seconds"
    )
    parser.add_argument(
        "--gemm",
        action="store_true",
        help="time a concurrent GEMM batch beside one more request of each side (CUDA)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main(_parser().parse_args()))
