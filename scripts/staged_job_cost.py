"""Wall-clock of one staged page-in over many layer pairs, a vLLM load job's shape: the
chunks made ready once for every pair (the mover's default) against staged pair by pair.

    python scripts/staged_job_cost.py [--tokens 2048,4096] [--layers 32] [--jobs 20]
        [--json FILE]

Each layer has a K and a V tensor of 16-token blocks (8 KV heads x 128, bf16: 32 KiB a
block), host blocks in one run (as kvcore's manager hands them out), GPU blocks scattered.
Every job gets new GPU block ids and is planned (staged, as the live run's jobs were),
executed through :meth:`kvcore.mover.Mover.execute_layers` and synchronised, timed from the
plan to the end; the two ways alternate job by job in one process, and the last job of each is
byte-checked against the same copy made row by row. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvcore.direction import Direction
from kvcore.layers import layer_pairs
from kvcore.mover import Mover, TransferPath, plan

BLOCK_TOKENS, BLOCK_BYTES = 16, 16 * 8 * 128 * 2
GPU_BLOCKS = 2048
LINK_GBPS = 55.0


class _PairByPair(Mover):
    """The mover staging one pair after another: its kernel set without the prepared ops."""

    def kernels(self, device: torch.device) -> Any:
        kernels = super().kernels(device)
        return dataclasses.replace(kernels, prepare_stage_in=None, stage_in_prepared=None)


def _job(
    mover: Mover, hosts: list[torch.Tensor], gpus: list[torch.Tensor], blocks: int, seed: int
) -> tuple[float, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dst_idx = torch.randperm(GPU_BLOCKS, generator=gen)[:blocks]
    src_idx = torch.arange(blocks)
    started = time.perf_counter()
    chosen = plan(
        hosts[0],
        gpus[0],
        src_idx,
        dst_idx,
        direction=Direction.H2D,
        policy=mover.policy,
        force=TransferPath.STAGED,
    )
    mover.execute_layers(chosen, layer_pairs(hosts, gpus))
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3, dst_idx


def _exact(hosts: list[torch.Tensor], gpus: list[torch.Tensor], dst_idx: torch.Tensor) -> bool:
    rows = dst_idx.cuda()
    return all(
        torch.equal(gpu[rows].view(torch.int16), host[: dst_idx.numel()].cuda().view(torch.int16))
        for host, gpu in zip(hosts, gpus, strict=True)
    )


def run(tokens: Sequence[int], layers: int, jobs: int) -> list[dict[str, Any]]:
    rows = []
    ways = {"prepared": Mover(), "pair_by_pair": _PairByPair()}
    for count in tokens:
        blocks = count // BLOCK_TOKENS
        words = BLOCK_BYTES // 2
        hosts = [
            torch.randint(-(2**15), 2**15, (blocks, words), dtype=torch.int16).pin_memory()
            for _ in range(2 * layers)
        ]
        gpus = [
            torch.randint(-(2**15), 2**15, (GPU_BLOCKS, words), dtype=torch.int16, device="cuda")
            for _ in range(2 * layers)
        ]
        times: dict[str, list[float]] = {name: [] for name in ways}
        exact = {}
        for job in range(jobs + 2):  # the first two warm both ways up
            for name, mover in ways.items() if job % 2 == 0 else reversed(ways.items()):
                ms, dst_idx = _job(mover, hosts, gpus, blocks, seed=job * 2 + len(name))
                if job >= 2:
                    times[name].append(ms)
                exact[name] = _exact(hosts, gpus, dst_idx)
        link_ms = 2 * layers * blocks * BLOCK_BYTES / (LINK_GBPS * 1e6)
        prepared, each = (statistics.median(times[name]) for name in ways)
        rows.append(
            {
                "tokens": count,
                "layers": layers,
                "bytes": 2 * layers * blocks * BLOCK_BYTES,
                "link_ms": round(link_ms, 3),
                "prepared_ms": round(prepared, 3),
                "pair_by_pair_ms": round(each, 3),
                "prepared_x_link": round(prepared / link_ms, 3),
                "pair_by_pair_x_link": round(each / link_ms, 3),
                "identical": all(exact.values()),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4096", help="comma list of job sizes")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = run([int(t) for t in args.tokens.split(",")], args.layers, args.jobs)
    for row in rows:
        print(json.dumps(row))
    if args.json is not None:
        report = {"device": torch.cuda.get_device_name(), "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
