"""Sweep the UVA gather kernel's tile, warps and CTAs on one GPU; print GB/s per setting.

Each setting copies ``--tokens`` rows between a registered host buffer and device memory,
host rows scattered token by token (the worst case), in both directions, and is checked
byte for byte. The contiguous pinned copy of the same bytes, measured in the same run, is
the ceiling. Used to choose ``default_tile`` and the default CTA count in
kvcore/kernels/triton_tile.py; the chosen defaults are then measured by ``kvcore bench``.

    python scripts/tune_gather.py --row-bytes 1152,4096 --json out/tune.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics

import torch

from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.kernels.triton_rows import gather_rows_uva
from kvcore.kernels.triton_tile import default_tile

WORD_BYTES = 8
MAX_TILE_BYTES = 128 * 1024


def _seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _settings(words: int, ctas_list: list[int]):
    rows_default, block_default = default_tile(words, WORD_BYTES)
    blocks = sorted({block_default, 16, 32, 64})
    for ctas, rows, warps, block in itertools.product(
        ctas_list, (8, 16, 32, 64, 128, 256), (4, 8, 16), blocks
    ):
        if rows * block * WORD_BYTES > MAX_TILE_BYTES:
            continue
        yield {"ctas": ctas, "rows_per_iter": rows, "num_warps": warps, "block_words": block}
    for ctas in ctas_list:
        yield {"ctas": ctas, "default_tile": [rows_default, block_default]}


def sweep(row_bytes: int, tokens: int, repeats: int, ctas_list: list[int]) -> list[dict]:
    words = row_bytes // WORD_BYTES
    pool = 2 * tokens
    buffer = allocate_host_buffer(pool * row_bytes, pin=True)
    host = buffer.tensor.view(torch.int64).view(pool, words)
    host.copy_(torch.randint(-(2**62), 2**62, (pool, words)))
    device = torch.randint(-(2**62), 2**62, (pool, words), device="cuda")
    host_idx = torch.randperm(pool)[:tokens]
    device_idx = torch.randperm(pool)[:tokens]
    host_idx_gpu, device_idx_gpu = host_idx.cuda(), device_idx.cuda()
    nbytes = tokens * row_bytes
    results = []
    for direction in ("h2d", "d2h"):
        if direction == "h2d":
            src, src_idx, dst, dst_idx = host, host_idx_gpu, device, device_idx_gpu
            ceiling = _seconds(lambda: device[:tokens].copy_(host[:tokens], non_blocking=True), 5)
        else:
            src, src_idx, dst, dst_idx = device, device_idx_gpu, host, host_idx_gpu
            ceiling = _seconds(lambda: host[:tokens].copy_(device[:tokens], non_blocking=True), 5)
        ceiling_gbs = nbytes / ceiling / 1e9
        expected = src[src_idx.to(src.device)].to("cuda")
        for setting in _settings(words, ctas_list):
            kwargs = {k: v for k, v in setting.items() if k != "default_tile"}
            run = functools.partial(gather_rows_uva, src, src_idx, dst, dst_idx, **kwargs)
            seconds = _seconds(run, repeats)
            identical = torch.equal(dst[dst_idx.to(dst.device)].to("cuda"), expected)
            gbs = nbytes / seconds / 1e9
            results.append(
                {
                    "row_bytes": row_bytes,
                    "direction": direction,
                    **setting,
                    "gb_per_s": round(gbs, 2),
                    "of_ceiling": round(gbs / ceiling_gbs, 3),
                    "ceiling_gb_per_s": round(ceiling_gbs, 2),
                    "identical": identical,
                }
            )
    buffer.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-bytes", default="1152,4096")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ctas", default="8,16")
    parser.add_argument("--json")
    args = parser.parse_args()
    ctas_list = [int(c) for c in args.ctas.split(",")]
    results = []
    for row_bytes in (int(b) for b in args.row_bytes.split(",")):
        results += sweep(row_bytes, args.tokens, args.repeats, ctas_list)
    for key in sorted({(r["row_bytes"], r["direction"]) for r in results}):
        rows = sorted(
            (r for r in results if (r["row_bytes"], r["direction"]) == key),
            key=lambda r: -r["gb_per_s"],
        )
        print(f"== {key[0]} B rows, {key[1]}: ceiling {rows[0]['ceiling_gb_per_s']} GB/s")
        for r in rows[:8] + [r for r in rows if "default_tile" in r]:
            print("  ", {k: v for k, v in r.items() if k not in ("row_bytes", "direction")})
    bad = [r for r in results if not r["identical"]]
    print(f"{len(results)} settings, {len(bad)} not byte-identical")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
