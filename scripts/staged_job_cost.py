"""Wall-clock of one page-in over many layer pairs, a vLLM load job's shape, by each way
kvcore could move it: the staged copy with its chunks made ready once for every pair (the
mover's default, whose DMAs run on a second stream through a ring of staging slots while
each pair's scatter follows its own DMA), the same with its ring held to 2, 4 or 8 slots,
the same with its pairs in turn on one stream, staged pair by pair, the layered
gather, and a prototype of DMAs into per-pair staging (one copy each, or one batched
call a group where the CUDA runtime has it) followed by one layered scatter launch per
group of pairs (measuring code only).

    python scripts/staged_job_cost.py [--tokens 2048,4096] [--layers 32] [--row-kib 32]
        [--jobs 20] [--timelines 3] [--json FILE]

Each layer has 16-token blocks of 8 KV heads x 128, bf16: with ``--row-kib 32`` a K and a
V tensor per layer (two pairs a layer, a block's K a row), with 64 one tensor whose row is
a block's K and V. Host blocks lie in one run (as kvcore's manager hands them out), GPU
blocks scattered. Every job gets new GPU block ids and is planned, executed and
synchronised, timed from the plan to the end; the ways take turns job by job in one
process (the order alternating), and every way's last job is byte-checked against the
same copy made row by row. Host time (until the call returns) is reported beside the
wall-clock; a job's layer pairs are built once, as vLLM's handler keeps them. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvcore.direction import Direction
from kvcore.kernels.batch_copy import batch_copy_available, copy_pointers_batched
from kvcore.kernels.triton_layers import LayeredLaunch, layer_table
from kvcore.mover import Mover
from kvcore.planning.layers import LayerPairs, layer_pairs
from kvcore.planning.path_policy import TransferPath
from kvcore.planning.plans import plan

BLOCK_TOKENS = 16
GPU_BLOCKS = 2048
LINK_GBPS = 55.0
Way = Callable[[LayerPairs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class _PairByPair(Mover):
    """The mover staging one pair after another: its kernel set without the prepared ops."""

    def kernels(self, device: torch.device) -> Any:
        kernels = super().kernels(device)
        return dataclasses.replace(kernels, prepare_stage_in=None, stage_in_prepared=None)


class _RingOf(Mover):
    """The mover's prepared staged page-in with its ring held to ``slots`` slots (one: the
    units in turn on one stream, as a ring needs two slots)."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots = slots

    def kernels(self, device: torch.device) -> Any:
        kernels = super().kernels(device)
        # The CUDA set's ops object, which the prepared page-in is a method of.
        ops = getattr(kernels.stage_in_prepared, "__self__", None)
        if ops is None:
            raise RuntimeError("the kernel set has no CUDA prepared staged page-in")
        ops.overlap_max_slots = self.slots
        return kernels


class _LayeredScatterPrototype:
    """Measuring code only, to size a change before the mover gets it: every pair's DMA
    into a staging area of its own (one per pair, on a second stream), and the scatter of
    each group of pairs in one layered launch (kvcore's Triton row gather, device to
    device) once that group's DMAs are done; a job is planned as the mover's are."""

    def __init__(
        self, pairs: LayerPairs, blocks: int, groups: int, ctas: int, batched: bool = False
    ) -> None:
        words = pairs.dst_words[0]
        staging = torch.empty(
            len(pairs.dsts), blocks, words.shape[1], dtype=words.dtype, device="cuda"
        )
        self.staging = [staging[p] for p in range(len(pairs.dsts))]
        per_group = -(-len(self.staging) // groups)
        self.groups = [
            range(start, min(start + per_group, len(self.staging)))
            for start in range(0, len(self.staging), per_group)
        ]
        self.launches = []
        for group in self.groups:
            table = layer_table(
                [self.staging[p] for p in group], [pairs.dst_words[p] for p in group]
            )
            self.launches.append(LayeredLaunch(table, table.offsets.cuda(), ctas))
        self.staged_rows = torch.arange(blocks, device="cuda")
        self.done = [torch.cuda.Event() for _ in self.groups]
        self.dma = torch.cuda.Stream()
        # With ``batched``, each group's DMAs go in one cudaMemcpyBatchAsync call.
        self.batched = batched
        self.row_bytes = pairs.row_bytes
        self.src_bases = np.array([w.data_ptr() for w in pairs.src_words], dtype=np.uint64)
        self.staging_bases = np.array([t.data_ptr() for t in self.staging], dtype=np.uint64)

    def __call__(
        self,
        pairs: LayerPairs,
        host: torch.Tensor,
        gpu: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        chosen = plan(host, gpu, src, dst, direction=Direction.H2D, force=TransferPath.STAGED)
        rows = dst.pin_memory().cuda(non_blocking=True)
        host_runs = chosen.host_runs.as_list()
        if len(host_runs) != 1:
            raise ValueError("the prototype takes host blocks in one run, the job's layout")
        ((start, length),) = host_runs
        current = torch.cuda.current_stream()
        self.dma.wait_stream(current)
        with torch.cuda.stream(self.dma):
            for group, done in zip(self.groups, self.done, strict=True):
                if self.batched:
                    first, end = group.start, group.stop
                    copy_pointers_batched(
                        self.staging_bases[first:end],
                        self.src_bases[first:end] + np.uint64(start * self.row_bytes),
                        np.full(end - first, length * self.row_bytes, dtype=np.uint64),
                        torch.device("cuda", torch.cuda.current_device()),
                        host_pinned=True,
                        stream=self.dma,
                    )
                else:
                    for p in group:
                        self.staging[p][:length].copy_(
                            pairs.src_words[p][start : start + length], non_blocking=True
                        )
                done.record()
        for done, launch in zip(self.done, self.launches, strict=True):
            current.wait_event(done)
            launch(self.staged_rows[:length], rows)


def _through_mover(mover: Mover, path: TransferPath) -> Way:
    def move(
        pairs: LayerPairs,
        host: torch.Tensor,
        gpu: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> None:
        chosen = plan(host, gpu, src, dst, direction=Direction.H2D, policy=mover.policy, force=path)
        mover.execute(chosen, pairs)

    return move


def _job(move: Way, pairs: LayerPairs, blocks: int, seed: int) -> tuple[float, float, torch.Tensor]:
    """Wall-clock and host time (ms) of one job, and its destination blocks."""
    gen = torch.Generator().manual_seed(seed)
    dst_idx = torch.randperm(GPU_BLOCKS, generator=gen)[:blocks]
    src_idx = torch.arange(blocks)
    started = time.perf_counter()
    move(pairs, pairs.srcs[0], pairs.dsts[0], src_idx, dst_idx)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3, (issued - started) * 1e3, dst_idx


def timeline_parts(
    job: tuple[float, float],
    copies: Sequence[tuple[float, float]],
    kernels: Sequence[tuple[float, float]],
) -> dict[str, float] | None:
    """Where a job's wall-clock goes, from a profiler's timeline (µs, one clock): ``lead``
    from the job's host start to its first host-to-device copy, the copies' ``dma_busy``
    time and the ``dma_gaps`` between them (span less busy: the link idle mid-job), and
    the ``tail`` from the last copy's end to the job's last device op. Copies under a
    fifth of the median copy's time (index uploads) are left out. None without copies."""
    if not copies:
        return None
    shortest = statistics.median(end - start for start, end in copies) / 5
    copies = [(start, end) for start, end in copies if end - start >= shortest]
    first = min(start for start, _ in copies)
    last = max(end for _, end in copies)
    busy = sum(end - start for start, end in copies)
    finish = max([last, *(end for _, end in kernels)])
    return {
        "lead_us": round(first - job[0], 1),
        "dma_busy_us": round(busy, 1),
        "dma_gaps_us": round(last - first - busy, 1),
        "tail_us": round(finish - last, 1),
    }


def _profiled_jobs(
    ways: dict[str, Way], pairs: LayerPairs, blocks: int, count: int
) -> dict[str, dict[str, float]]:
    """Per way, the medians of :func:`timeline_parts` over ``count`` jobs, all under one
    session of torch's profiler (each job synchronises before the next starts, so a device
    op belongs to the job whose host range holds it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for name, move in ways.items():
            for number in range(count):
                with record_function(f"job:{name}"):
                    _job(move, pairs, blocks, seed=9000 + number)
    jobs: list[tuple[str, tuple[float, float]]] = []
    device_ops: list[tuple[str, tuple[float, float]]] = []
    for event in prof.events():
        span = (event.time_range.start, event.time_range.end)
        if event.device_type == DeviceType.CUDA:
            device_ops.append((event.name, span))
        elif event.name.startswith("job:"):
            jobs.append((event.name[len("job:") :], span))
    parts: dict[str, list[dict[str, float]]] = {}
    for name, (begin, end) in jobs:
        inside = [(op, span) for op, span in device_ops if begin <= span[0] <= end]
        copies = [span for op, span in inside if op.startswith("Memcpy HtoD")]
        kernels = [span for op, span in inside if not op.startswith(("Memcpy", "Memset"))]
        found = timeline_parts((begin, end), copies, kernels)
        if found is not None:
            parts.setdefault(name, []).append(found)
    return {
        name: {key: round(statistics.median(p[key] for p in found), 1) for key in found[0]}
        for name, found in parts.items()
    }


def _exact(hosts: list[torch.Tensor], gpus: list[torch.Tensor], dst_idx: torch.Tensor) -> bool:
    rows = dst_idx.cuda()
    return all(
        torch.equal(gpu[rows], host[: dst_idx.numel()].cuda())
        for host, gpu in zip(hosts, gpus, strict=True)
    )


def run(
    tokens: Sequence[int], layers: int, row_kib: int, jobs: int, timelines: int = 0
) -> list[dict[str, Any]]:
    words = row_kib * 1024 // 2
    pair_count = layers * (64 // row_kib)
    rows = []
    for count in tokens:
        blocks = count // BLOCK_TOKENS
        ways: dict[str, Way] = {
            "staged": _through_mover(Mover(), TransferPath.STAGED),
            "staged_in_turn": _through_mover(_RingOf(1), TransferPath.STAGED),
            **{
                f"staged_ring_{slots}": _through_mover(_RingOf(slots), TransferPath.STAGED)
                for slots in (2, 4, 8)
            },
            "staged_pair_by_pair": _through_mover(_PairByPair(), TransferPath.STAGED),
            "gather": _through_mover(Mover(), TransferPath.GATHER),
        }
        hosts = [
            torch.randint(-(2**15), 2**15, (blocks, words), dtype=torch.int16).pin_memory()
            for _ in range(pair_count)
        ]
        gpus = [
            torch.randint(-(2**15), 2**15, (GPU_BLOCKS, words), dtype=torch.int16, device="cuda")
            for _ in range(pair_count)
        ]
        # Built once, as vLLM's handler keeps its layers' pairs.
        pairs = layer_pairs(hosts, gpus)
        for groups in (1, 4):
            ways[f"staged_layered_prototype_{groups}"] = _LayeredScatterPrototype(
                pairs, blocks, groups, ctas=132
            )
        if batch_copy_available():
            ways["staged_layered_batched_prototype_4"] = _LayeredScatterPrototype(
                pairs, blocks, 4, ctas=132, batched=True
            )
        times: dict[str, list[float]] = {name: [] for name in ways}
        host_times: dict[str, list[float]] = {name: [] for name in ways}
        exact = {}
        for job in range(jobs + 2):  # the first two warm every way up
            order = list(ways.items())
            for name, move in order if job % 2 == 0 else reversed(order):
                ms, host_ms, dst_idx = _job(move, pairs, blocks, seed=job * 7 + len(name))
                if job >= 2:
                    times[name].append(ms)
                    host_times[name].append(host_ms)
                exact[name] = _exact(hosts, gpus, dst_idx)
        nbytes = pair_count * blocks * words * 2
        link_ms = nbytes / (LINK_GBPS * 1e6)
        row: dict[str, Any] = {
            "tokens": count,
            "layers": layers,
            "pairs": pair_count,
            "row_bytes": words * 2,
            "bytes": nbytes,
            "link_ms": round(link_ms, 3),
        }
        for name in ways:
            ms = statistics.median(times[name])
            row[f"{name}_ms"] = round(ms, 3)
            row[f"{name}_x_link"] = round(ms / link_ms, 3)
            row[f"{name}_host_ms"] = round(statistics.median(host_times[name]), 3)
            row[f"{name}_identical"] = exact[name]
        if timelines:
            try:
                profiled = _profiled_jobs(ways, pairs, blocks, timelines)
            except Exception as exc:  # the timed figures above still stand
                print(f"no timelines at {count} tokens: {exc!r}", file=sys.stderr)
                profiled = {}
            for name, parts in profiled.items():
                row.update({f"{name}_{key}": value for key, value in parts.items()})
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4096", help="comma list of job sizes")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--row-kib", type=int, choices=(32, 64), default=32)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument(
        "--timelines",
        type=int,
        default=0,
        help="jobs per way profiled after the timed ones, for where the time goes (lead, "
        "DMA busy and gaps, tail; medians)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = run(
        [int(t) for t in args.tokens.split(",")],
        args.layers,
        args.row_kib,
        args.jobs,
        args.timelines,
    )
    for row in rows:
        print(json.dumps(row))
    if args.json is not None:
        report = {"device": torch.cuda.get_device_name(), "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    identical = all(
        value for row in rows for key, value in row.items() if key.endswith("_identical")
    )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
