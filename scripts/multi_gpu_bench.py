"""Several GPUs of one host reloading and paging out a long prefix through kvcore at once.

Engines run one process per GPU and every rank moves its share of a prefix at the same
moment, so host memory bandwidth and NUMA placement set the speed, not one PCIe link. This
script starts one process per visible GPU. In each NUMA round (``off``: default placement;
``auto``: the host buffer bound to the GPU's node and pre-faulted from its CPUs) every
process builds one registered kvcore host buffer and, for each row kind x host layout x
direction:

1. each GPU alone, in turn: the plain contiguous pinned copy of the same bytes (the
   single-GPU ceiling of this run) and the kvcore transfer;
2. all GPUs at once, after a barrier: timed repeats of the kvcore transfer, each GPU timed
   by CUDA events, the aggregate by the wall-clock span of all of them;

every result checked byte for byte against a per-index reference. The report sets the
aggregate GB/s beside the sum of the GPUs' ceilings (N x the single-GPU ceiling).
``--device cpu`` runs the same process, barrier and report logic on the CPU (two processes
by default) as a smoke test.

    python scripts/multi_gpu_bench.py --json docs/bench/multi-gpu.json
    python scripts/multi_gpu_bench.py --device cpu --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from kvcore import numa
from kvcore.bench.host_buffers import HostBuffer, allocate_host_buffer
from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.plans import TransferPlan, plan
from kvcore.row_words import as_row_words

PAGE_TOKENS = 64
GOAL_SHARE = 0.85

ROW_KINDS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "mha-4KiB": ((2, 8, 128), torch.bfloat16),
    "mla-1152B": ((1, 576), torch.bfloat16),
}
HOST_LAYOUTS = ("contiguous", "page-scattered")


@dataclass(frozen=True)
class BenchConfig:
    device_type: str
    world: int
    tokens: int
    repeats: int
    rounds: tuple[str | int, ...]
    out_dir: str
    barrier_timeout_s: float


def row_bytes(kind: str) -> int:
    shape, dtype = ROW_KINDS[kind]
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def host_index(layout: str, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Host slots of ``tokens`` rows in a pool of twice as many.

    ``page-scattered`` puts every 64-token page at a random page of the pool, as a
    long-running host pool under churn does.
    """
    if layout == "contiguous":
        return torch.arange(tokens, dtype=torch.int64)
    pages = tokens // PAGE_TOKENS
    where = torch.randperm(2 * pages, generator=generator)[:pages]
    return (where[:, None] * PAGE_TOKENS + torch.arange(PAGE_TOKENS)).flatten()


def random_bytes(nbytes: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Random bytes, never zeros; made on ``device`` so that a GiB takes milliseconds."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    wa, wb = as_row_words(a), as_row_words(b)
    return wa is not None and wb is not None and bool(torch.equal(wa, wb))


class Clock:
    """Times a block of work on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self, fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
        """Device seconds for ``repeats`` calls, and the monotonic start and end around them."""
        if self.device.type != "cuda":
            started = time.monotonic()
            for _ in range(repeats):
                fn()
            ended = time.monotonic()
            return ended - started, started, ended
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        started = time.monotonic()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        ended = time.monotonic()
        return start.elapsed_time(end) / 1e3, started, ended


class Worker:
    """One rank: its device, its host buffer for the round, and the barrier it shares."""

    def __init__(self, rank: int, config: BenchConfig, barrier: Any) -> None:
        self.rank = rank
        self.config = config
        self.barrier = barrier
        if config.device_type == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
        self.clock = Clock(self.device)
        self.mover = Mover(PathPolicy())
        self.generator = torch.Generator(self.device).manual_seed(1000 + rank)
        self.index_generator = torch.Generator().manual_seed(2000 + rank)

    def wait(self) -> None:
        self.barrier.wait(self.config.barrier_timeout_s)

    def run(self) -> dict[str, Any]:
        rounds = []
        for setting in self.config.rounds:
            buffer, info = self.build_buffer(setting)
            try:
                info["scenarios"] = [
                    result for kind in ROW_KINDS for result in self.run_kind(buffer, kind)
                ]
            finally:
                buffer.close()
            rounds.append(info)
        return {"rank": self.rank, "rounds": rounds}

    def build_buffer(self, setting: str | int) -> tuple[HostBuffer, dict[str, Any]]:
        pin = self.device.type == "cuda"
        node = numa.resolve_node(setting, self.device)
        nbytes = 2 * self.config.tokens * max(row_bytes(kind) for kind in ROW_KINDS)
        self.wait()  # all ranks fault their buffers at once, as engine ranks do at start
        started = time.monotonic()
        buffer = allocate_host_buffer(nbytes, pin=pin, numa_node=node)
        built = time.monotonic() - started
        pages = numa.pages_by_node(buffer.tensor.data_ptr(), nbytes)
        return buffer, {
            "numa": str(setting),
            "requested_node": node,
            "placed_node": buffer.numa_node,
            "pages_by_node": {str(n): count for n, count in sorted(pages.items())},
            "buffer_bytes": nbytes,
            "build_seconds": built,
        }

    def run_kind(self, buffer: HostBuffer, kind: str) -> list[dict[str, Any]]:
        shape, dtype = ROW_KINDS[kind]
        tokens = self.config.tokens
        pool_bytes = 2 * tokens * row_bytes(kind)
        host_raw = buffer.tensor[:pool_bytes]
        host = host_raw.view(dtype).view(2 * tokens, *shape)
        device_raw = torch.empty(tokens * row_bytes(kind), dtype=torch.uint8, device=self.device)
        device_rows = device_raw.view(dtype).view(tokens, *shape)
        device_idx = torch.arange(tokens, dtype=torch.int64)
        results = []
        for layout in HOST_LAYOUTS:
            idx = host_index(layout, tokens, self.index_generator)
            for direction in Direction:
                if direction is Direction.H2D:
                    chosen = plan(host, device_rows, idx, device_idx, direction=direction)
                else:
                    chosen = plan(device_rows, host, device_idx, idx, direction=direction)
                scenario = f"{kind}/{direction.value}/host-{layout}"
                results.append(
                    {"scenario": scenario, **self.measure(chosen, host_raw, device_raw, idx)}
                )
        return results

    def measure(
        self,
        chosen: TransferPlan,
        host_raw: torch.Tensor,
        device_raw: torch.Tensor,
        idx: torch.Tensor,
    ) -> dict[str, Any]:
        nbytes, repeats = chosen.nbytes, self.config.repeats
        page_in = chosen.direction is Direction.H2D
        src, dst = (host_raw, device_raw) if page_in else (device_raw, host_raw)

        def ceiling_copy() -> None:
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)

        def transfer() -> None:
            self.mover.execute(chosen)

        ceiling = alone = 0.0
        for turn in range(self.config.world):
            self.wait()
            if turn == self.rank:
                for fn in (ceiling_copy, transfer):
                    fn()
                self.clock.sync()
                ceiling = nbytes * repeats / self.clock.seconds(ceiling_copy, repeats)[0] / 1e9
                alone = nbytes * repeats / self.clock.seconds(transfer, repeats)[0] / 1e9
        self.wait()
        _, together_started, together_ended = self.clock.seconds(ceiling_copy, repeats)
        expected = self.poison(chosen, host_raw, device_raw, idx)
        self.wait()
        seconds, started, ended = self.clock.seconds(transfer, repeats)
        return {
            "path": chosen.path.value,
            "bytes": nbytes * repeats,
            "gbps": nbytes * repeats / seconds / 1e9,
            "started": started,
            "ended": ended,
            "ceiling_gbps": ceiling,
            "ceiling_together_started": together_started,
            "ceiling_together_ended": together_ended,
            "alone_gbps": alone,
            "identical": identical(chosen.dst.to(self.device), expected),
        }

    def poison(
        self,
        chosen: TransferPlan,
        host_raw: torch.Tensor,
        device_raw: torch.Tensor,
        idx: torch.Tensor,
    ) -> torch.Tensor:
        """Fill the destination with fresh random bytes; returns what it must hold after.

        A page-in must turn every device row into its host row; a page-out must write
        the host rows at ``idx`` and leave every other host row as poisoned.
        """
        if chosen.direction is Direction.H2D:
            device_raw.copy_(random_bytes(device_raw.numel(), self.device, self.generator))
            return chosen.src.to(self.device)[idx.to(self.device)]
        fresh = random_bytes(host_raw.numel(), self.device, self.generator)
        device_raw.copy_(random_bytes(device_raw.numel(), self.device, self.generator))
        host_raw.copy_(fresh)
        expected = fresh.view(chosen.dst.dtype).view(chosen.dst.shape).clone()
        expected[idx.to(self.device)] = chosen.src
        self.clock.sync()
        return expected


def worker_main(rank: int, config: BenchConfig, barrier: Any) -> None:
    worker = Worker(rank, config, barrier)
    if worker.device.type == "cuda":
        # The batched copy API refuses the legacy default stream.
        with torch.cuda.stream(torch.cuda.Stream(worker.device)):
            report = worker.run()
    else:
        report = worker.run()
    path = Path(config.out_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(report))


def wall_span(per_gpu: list[dict[str, Any]], start_key: str, end_key: str) -> float:
    return max(g[end_key] for g in per_gpu) - min(g[start_key] for g in per_gpu)


def summarise(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per round x scenario: per-GPU figures, aggregate and the summed ceilings."""
    rows = []
    for r, first in enumerate(ranks[0]["rounds"]):
        for s, scenario in enumerate(first["scenarios"]):
            per_gpu = [rank["rounds"][r]["scenarios"][s] for rank in ranks]
            moved = sum(g["bytes"] for g in per_gpu)
            aggregate = moved / wall_span(per_gpu, "started", "ended") / 1e9
            span = wall_span(per_gpu, "ceiling_together_started", "ceiling_together_ended")
            together = moved / span / 1e9
            ceiling_sum = sum(g["ceiling_gbps"] for g in per_gpu)
            rows.append(
                {
                    "numa": first["numa"],
                    "scenario": scenario["scenario"],
                    "paths": sorted({g["path"] for g in per_gpu}),
                    "gpus": len(per_gpu),
                    "per_gpu_gbps": [g["gbps"] for g in per_gpu],
                    "alone_gbps": [g["alone_gbps"] for g in per_gpu],
                    "ceiling_gbps": [g["ceiling_gbps"] for g in per_gpu],
                    "aggregate_gbps": aggregate,
                    "sum_per_gpu_gbps": sum(g["gbps"] for g in per_gpu),
                    "n_x_ceiling_gbps": ceiling_sum,
                    "share_of_n_x_ceiling": aggregate / ceiling_sum if ceiling_sum else 0.0,
                    "ceiling_together_gbps": together,
                    "share_of_ceiling_together": aggregate / together if together else 0.0,
                    "identical": all(g["identical"] for g in per_gpu),
                }
            )
    return rows


def numa_gain(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Aggregate GB/s with ``auto`` placement over ``off``, per scenario."""
    by_round = {(row["numa"], row["scenario"]): row["aggregate_gbps"] for row in rows}
    return {
        scenario: by_round[("auto", scenario)] / off
        for (setting, scenario), off in by_round.items()
        if setting == "off" and ("auto", scenario) in by_round and off
    }


def measure_host_copy(nbytes: int = 1 << 31, repeats: int = 3) -> dict[str, Any]:
    """Host memory bandwidth on all CPU threads, the bound N links share on one node."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return {"bytes": nbytes, "threads": torch.get_num_threads(), "gbps": nbytes / best / 1e9}


def describe_host(config: BenchConfig) -> dict[str, Any]:
    if config.device_type == "cuda":
        gpus = [torch.cuda.get_device_name(i) for i in range(config.world)]
        bus_ids = [numa.cuda_pci_bus_id(i) for i in range(config.world)]
        gpu_nodes = [numa.cuda_numa_node(i) for i in range(config.world)]
    else:
        gpus = ["cpu"] * config.world
        bus_ids, gpu_nodes = [None] * config.world, [None] * config.world
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nodes = numa.node_count()
    names = ", ".join(f"{gpus.count(n)}x {n}" for n in dict.fromkeys(gpus))
    return {
        "device": f"{names}; {nodes} NUMA node{'s' if nodes > 1 else ''}; "
        f"{cpu} ({os.cpu_count()} CPUs)",
        "gpus": gpus,
        "gpu_pci_bus_ids": bus_ids,
        "gpu_numa_nodes": gpu_nodes,
        "numa_nodes": nodes,
        "host_cpu": cpu,
        "host_cpus": os.cpu_count(),
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"device: {report['device']}",
        f"{report['tokens']} tokens per transfer, {report['repeats']} timed repeats; "
        f"aggregate = all bytes / wall span of all GPUs; goal >= {GOAL_SHARE:.0%} of N x ceiling",
        "ceil all = the plain contiguous pinned copy run by every GPU at once (what the host "
        "gives N links together)",
        f"host memory: one {report['host_copy']['bytes'] >> 20} MiB CPU-to-CPU copy on "
        f"{report['host_copy']['threads']} threads reads and writes "
        f"{report['host_copy']['gbps']:.1f} GB/s each way",
    ]
    for info in report["buffers"]:
        lines.append(
            f"  rank {info['rank']} numa={info['numa']}: requested node "
            f"{info['requested_node']}, placed {info['placed_node']}, pages by node "
            f"{info['pages_by_node'] or 'n/a'}, built in {info['build_seconds']:.2f} s"
        )
    header = (
        f"{'numa':<5} {'scenario':<32} {'path':<14} {'per-GPU GB/s':>17} {'alone':>7} "
        f"{'aggr':>8} {'N x ceil':>9} {'share':>6} {'ceil all':>9} {'share':>6} ok"
    )
    lines += ["", header]
    for row in report["summary"]:
        per_gpu = row["per_gpu_gbps"]
        spread = (
            f"{min(per_gpu):.1f}..{max(per_gpu):.1f}" if len(per_gpu) > 1 else f"{per_gpu[0]:.1f}"
        )
        lines.append(
            f"{row['numa']:<5} {row['scenario']:<32} {','.join(row['paths']):<14} {spread:>17} "
            f"{statistics.mean(row['alone_gbps']):>7.1f} {row['aggregate_gbps']:>8.1f} "
            f"{row['n_x_ceiling_gbps']:>9.1f} {100 * row['share_of_n_x_ceiling']:>5.0f}% "
            f"{row['ceiling_together_gbps']:>9.1f} {100 * row['share_of_ceiling_together']:>5.0f}% "
            f"{'yes' if row['identical'] else 'NO'}"
        )
    if report["numa_gain"]:
        lines.append("")
        lines.append("aggregate with numa=auto / numa=off:")
        lines += [f"  {name:<32} {gain:.3f}" for name, gain in report["numa_gain"].items()]
    if report["numa_nodes"] == 1:
        lines.append("this host has one NUMA node: both rounds place memory alike")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--gpus", type=int, default=0, help="processes (default: all GPUs; 2 on cpu)"
    )
    parser.add_argument("--tokens", type=int, default=131072, help="rows per transfer")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per measurement")
    parser.add_argument(
        "--numa", default="off,auto", help="rounds: comma list of off, auto or a node number"
    )
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--barrier-timeout", type=float, default=600.0, help="seconds")
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.tokens % PAGE_TOKENS:
        parser.error(f"--tokens must be a positive multiple of {PAGE_TOKENS}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        args.rounds = tuple(
            numa.parse_setting(part) for part in args.numa.split(",") if part.strip()
        )
    except numa.NumaError as exc:
        parser.error(f"--numa: {exc}")
    if not args.rounds:
        parser.error("--numa names no round")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "multi_gpu_bench: CUDA is not available (use --device cpu for a smoke run)"
        )
    visible = torch.cuda.device_count() if args.device == "cuda" else 2
    world = args.gpus or visible
    if args.device == "cuda" and world > visible:
        raise SystemExit(f"multi_gpu_bench: {world} processes asked for, {visible} GPUs visible")
    with tempfile.TemporaryDirectory(prefix="kvcore-multi-gpu-") as out_dir:
        config = BenchConfig(
            args.device,
            world,
            args.tokens,
            args.repeats,
            args.rounds,
            out_dir,
            args.barrier_timeout,
        )
        barrier = mp.get_context("spawn").Barrier(world)
        mp.spawn(worker_main, args=(config, barrier), nprocs=world, join=True)
        ranks = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
    summary = summarise(ranks)
    host = describe_host(config)
    host_copy = measure_host_copy(1 << 31 if args.device == "cuda" else 1 << 24)
    buffers = [
        {"rank": rank["rank"], **{k: v for k, v in info.items() if k != "scenarios"}}
        for rank in ranks
        for info in rank["rounds"]
    ]
    return {
        **host,
        "host_copy": host_copy,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "config": {k: v for k, v in asdict(config).items() if k != "out_dir"},
        "buffers": buffers,
        "summary": summary,
        "numa_gain": numa_gain(summary),
        "ranks": ranks,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(row["identical"] for row in report["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
