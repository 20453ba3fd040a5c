#!/usr/bin/env bash
# The vLLM offload A/B (issue 5 item 7) in one device call: benchmarks.vllm.ab.ab for
# vLLM's cross-layer layout (one KV tensor) and for 32 per-layer tensors in vLLM's shared
# host region, descriptors 4 KiB to 2 MiB at 0/50/100% fragmentation, both directions.
# Needs .vllm-tree/ (scripts/vllm_device_tree.sh) carried; .whl/ too when carried.
# Usage (on the GPU machine, from the repo root): scripts/vllm_ab.sh [repeats [jobs [KiB,...]]]
#   jobs: copies of each job issued back to back before waiting (1: one job's latency;
#   more: a busy worker's throughput, host time overlapping the copies); KiB: block sizes.
# Writes to $OUT (default out/vllm-ab): env.txt, vllm-ab.json, vllm-ab.md, vllm-ab.log.
set -uo pipefail
OUT=${OUT:-out/vllm-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/vllm_device_env.sh || exit 1

timeout 440 python3 - "$OUT" "${1:-10}" "${2:-1}" "${3:-4,16,64,256,2048}" 2>&1 <<'EOF' | tee "$OUT/vllm-ab.log"
import json
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
import triton

import vllm.platforms
from kvcore.kernels.batch_copy import batch_copy_available
from benchmarks.vllm import ab as bench
from benchmarks.vllm.offload_handlers import compiled_ops_loaded

out, repeats, jobs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
SIZES = tuple(int(kib) << 10 for kib in sys.argv[4].split(","))
env = {
    "torch": torch.__version__,
    "triton": triton.__version__,
    "cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name(0),
    "vllm_platform": type(vllm.platforms.current_platform).__name__,
    "vllm_compiled_ops": compiled_ops_loaded(),
    "batch_copy_available": batch_copy_available(),
    "repeats": repeats,
    "jobs": jobs,
}
with open(out / "env.txt", "a") as f:
    f.write(json.dumps(env) + "\n")
print(env)

CONFIGS = {
    "cross-layer (1 tensor)": {},
    "32 tensors, shared region": {"tensors": 32, "shared_region": True},
}
# What vLLM itself would run, best first; per_block_copy only where none of these can run.
STOCK = ("stock_handler", "stock_handler_emul", "stock_triton", "stock_batch_dma", "per_block_copy")
PATHS = (
    "stock_handler",
    "stock_handler_emul",
    "stock_batch_dma",
    "stock_triton",
    "per_block_copy",
    "kvcore",
    "kvcore_own",
)


class PathFailed(Exception):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


# A path that raises is dropped and its size run again, so one broken path costs only
# its own rows in this single device call.
disabled: set[str] = set()
failures: list[str] = []
stock_paths = bench.runnable_paths


def _guard(path):
    run = path.run

    def guarded():
        try:
            run()
        except Exception as error:
            raise PathFailed(path.name) from error

    path.run = guarded
    return path


def _paths(*args):
    return [_guard(p) for p in stock_paths(*args) if p.name not in disabled]


bench.runnable_paths = _paths


def cells(rows: list) -> dict:
    by_cell = defaultdict(dict)
    for r in rows:
        by_cell[(r["direction"], r["block_bytes"], r["frag"])][r["path"]] = r
    return by_cell


def size_name(block: int) -> str:
    return f"{block >> 10} KiB" if block < 1 << 20 else f"{block >> 20} MiB"


def table(rows: list) -> list[str]:
    paths = [p for p in PATHS if any(r["path"] == p for r in rows)]
    lines = [
        "| dir | block | frag | descriptors | " + " | ".join(f"{p} GB/s" for p in paths)
        + " | stock (vLLM's pick) | kvcore / stock | kvcore_own / stock"
        + " | submit us (stock handler / kvcore / kvcore_own) | bytes ok |",
        "|---|---|---|---|" + "---|" * len(paths) + "---|---|---|---|---|",
    ]
    for (direction, block, frag), by_path in sorted(cells(rows).items()):
        stock = next((by_path[p] for p in STOCK if p in by_path), None)
        ratios = [
            f"{by_path[p]['gbps'] / stock['gbps']:.2f}x" if p in by_path and stock else "-"
            for p in ("kvcore", "kvcore_own")
        ]
        ok = all(r["bytes_ok"] for r in by_path.values())
        descriptors = next(iter(by_path.values()))["descriptors"]
        submit = " / ".join(
            f"{by_path[p]['submit_us']:.0f}" if by_path.get(p, {}).get("submit_us") else "-"
            for p in (stock["path"] if stock else "-", "kvcore", "kvcore_own")
        )
        lines.append(
            f"| {direction} | {size_name(block)} | {frag:.0%} | {descriptors} | "
            + " | ".join(f"{by_path[p]['gbps']:.2f}" if p in by_path else "-" for p in paths)
            + f" | {stock['path'] if stock else '-'} | {' | '.join(ratios)} | {submit} | "
            + f"{'yes' if ok else 'NO'} |"
        )
    return lines


def goals(rows: list) -> list[str]:
    lines = []
    for (direction, block, frag), by_path in sorted(cells(rows).items()):
        stock = next((by_path[p] for p in STOCK if p in by_path), None)
        if "kvcore" not in by_path or stock is None:
            continue
        ratio = by_path["kvcore"]["gbps"] / stock["gbps"]
        if block <= 64 << 10 and frag == 0.5:
            verdict = "meets" if ratio >= 1.5 else "MISSES"
            lines.append(f"- {direction} {size_name(block)} 50%: {ratio:.2f}x ({verdict} >= 1.5x)")
        if block == 2 << 20:
            verdict = "ok" if ratio >= 0.95 else "SLOWER"
            lines.append(f"- {direction} 2 MiB {frag:.0%}: {ratio:.2f}x ({verdict}: >= 0.95x)")
    return lines


def write(results: dict, final: bool) -> None:
    (out / "vllm-ab.json").write_text(
        json.dumps({"env": env, "failures": failures, "results": results}, indent=1)
    )
    report = [f"# vLLM offload A/B, {env['gpu']}", "", "```", json.dumps(env), "```", ""]
    if not final:
        report += ["**Partial: the run stopped before the last size.**", ""]
    for name, rows in results.items():
        report += [f"## {name}", "", *table(rows), "", "Goals:", *goals(rows), ""]
    bad = sum(not r["bytes_ok"] for rows in results.values() for r in rows)
    report += [f"Rows with wrong bytes: {bad}", "", "Failed paths (dropped, size rerun):"]
    report += [f"- {f}" for f in failures] or ["- none"]
    (out / "vllm-ab.md").write_text("\n".join(report) + "\n")


results: dict[str, list] = {name: [] for name in CONFIGS}
started = time.perf_counter()
for name, kwargs in CONFIGS.items():
    for size in SIZES:
        while True:
            try:
                results[name] += bench.ab("cuda", [size], repeats=repeats, jobs=jobs, **kwargs)
                break
            except PathFailed as failed:
                disabled.add(failed.path)
                cause = failed.__cause__
                failures.append(f"{failed.path} at {name} {size_name(size)}: {cause!r}")
                traceback.print_exception(cause)
        write(results, final=False)
        print(f"{name} {size_name(size)} done at {time.perf_counter() - started:.0f} s", flush=True)
write(results, final=True)
print((out / "vllm-ab.md").read_text())
bad = any(not r["bytes_ok"] for rows in results.values() for r in rows)
sys.exit(1 if bad or failures else 0)
EOF
rc=${PIPESTATUS[0]}
echo "vllm_ab rc=$rc"
exit "$rc"
