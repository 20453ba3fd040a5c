"""Can a reload go straight into vLLM's pages by copy engine alone? One pitched DMA
(``cudaMemcpy2DAsync``) a block carries that block's page of every GPU tensor (MLA: a layer's;
MHA, ``--layout mha``: a layer's K or V): its source pages lie side by side in the block's
chunk row on the host, its destinations one tensor apart on the GPU, which is a fixed
distance where the tensors are evenly spaced (an upper bound for MHA, whose K and V share
one tensor a layer in vLLM, so two copies a block would be needed there).

Per request size and compute load it reports the reload's wall-clock time from the first
call to the copy's end, the host's time issuing it, the other forward's time alone and
beside it, and whether every copied byte matches its source. Arms: ``plain`` (one copy of
the same bytes: the link), ``pitched`` (a 2D copy a block), ``batched`` (one descriptor a
block and tensor through cudaMemcpyBatchAsync, where cuda-bindings is installed: kvcore's
way for MHA today).

    python3 scripts/pitched_dma_probe.py [--layout mla] [--sizes 8192,32768]
        [--compute none,decode-256] [--requests 5] [--json out.json]

Measuring code only; needs CUDA.
"""

from __future__ import annotations

import ctypes
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# The measuring code is in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.beside_rows import LINK_GBPS
from benchmarks.model_forward import measured_forward
from benchmarks.probe_shape import (
    BLOCK_TOKENS,
    GPU_BLOCKS,
    SHAPES,
    PageShape,
    chunks_landed,
    probe_device,
    probe_parser,
    write_probe_json,
)
from kvcore.kernels.batch_copy import BatchCopyError
from kvcore.kernels.cudart import loaded_cudart

_HOST_TO_DEVICE = 1


def page_tensors(shape: PageShape, device: torch.device) -> tuple[list[torch.Tensor], int | None]:
    """The shape's GPU tensors, allocated one after another as vLLM does, and their spacing
    where it is even."""
    tensors = [
        torch.zeros(GPU_BLOCKS * shape.row_bytes, dtype=torch.uint8, device=device)
        for _ in range(shape.tensors)
    ]
    gaps = {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(tensors)}
    return tensors, (gaps.pop() if len(gaps) == 1 and min(gaps) > 0 else None)


def pitched_copier(lib: ctypes.CDLL) -> Callable[[int, int, int, int, int, int, int], int]:
    call = lib.cudaMemcpy2DAsync
    call.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    )
    call.restype = ctypes.c_int

    def copy(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, s: int) -> int:
        return call(dst, dpitch, src, spitch, width, height, _HOST_TO_DEVICE, s)

    return copy


def main() -> None:
    parser = probe_parser()
    parser.add_argument("--compute", default="none,decode-64,decode-256,prefill-4096")
    parser.add_argument("--layout", choices=sorted(SHAPES), default="mla")
    args = parser.parse_args()
    shape = SHAPES[args.layout]
    device = probe_device("pitched_dma_probe")
    lib = loaded_cudart()
    assert lib is not None, "no CUDA runtime loaded"
    copy2d = pitched_copier(lib)
    sizes = [int(s) for s in args.sizes.split(",")]
    most_blocks = max(sizes) // BLOCK_TOKENS
    host = torch.empty(most_blocks * shape.chunk_bytes, dtype=torch.uint8, pin_memory=True)
    host.view(torch.int32).random_()
    tensors, spacing = page_tensors(shape, device)
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(device),
        "layout": shape.kind,
        "layers": shape.layers,
        "tensors": shape.tensors,
        "row_bytes": shape.row_bytes,
        "chunk_bytes": shape.chunk_bytes,
        "layer_spacing": spacing,
        "rows": [],
    }
    print(f"GPU tensors evenly spaced: {spacing}", flush=True)
    if spacing is None:
        base = torch.zeros(
            shape.tensors * GPU_BLOCKS * shape.row_bytes, dtype=torch.uint8, device=device
        )
        tensors = list(base.view(shape.tensors, -1).unbind(0))
        spacing = GPU_BLOCKS * shape.row_bytes
    dst0 = tensors[0].data_ptr()
    copy_stream = torch.cuda.Stream(device)
    raw = copy_stream.cuda_stream
    batched = _batched_arm(shape, tensors, host, copy_stream)
    rows: list[dict[str, object]] = report["rows"]  # type: ignore[assignment]
    for tokens in sizes:
        blocks = tokens // BLOCK_TOKENS
        nbytes = blocks * shape.tensors * shape.row_bytes
        link_ms = nbytes / LINK_GBPS / 1e6
        staging = torch.empty(blocks * shape.chunk_bytes, dtype=torch.uint8, device=device)

        def plain(
            dst_blocks: torch.Tensor, blocks: int = blocks, staging: torch.Tensor = staging
        ) -> None:
            with torch.cuda.stream(copy_stream):
                staging.copy_(host[: blocks * shape.chunk_bytes], non_blocking=True)

        def pitched(dst_blocks: torch.Tensor, blocks: int = blocks) -> None:
            src = host.data_ptr()
            for chunk, block in enumerate(dst_blocks.tolist()):
                code = copy2d(
                    dst0 + block * shape.row_bytes,
                    spacing,
                    src + chunk * shape.chunk_bytes,
                    shape.row_bytes,
                    shape.row_bytes,
                    shape.tensors,
                    raw,
                )
                if code:
                    raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {code}")

        arms: dict[str, Callable[[torch.Tensor], None]] = {"plain": plain, "pitched": pitched}
        if batched is not None:
            arms["batched"] = batched
        for compute in args.compute.split(","):
            forward = (
                None
                if compute == "none"
                else measured_forward(shape.kind, compute, shape.layers, device)
            )
            if forward is not None:
                forward.size_for(link_ms * 1.3)
            for name, arm in list(arms.items()):
                times, holds, fwd_with, fwd_alone, identical = [], [], [], [], True
                for _ in range(args.requests + 1):
                    dst_blocks = torch.randperm(GPU_BLOCKS)[:blocks]
                    torch.cuda.synchronize()
                    if forward is not None:
                        a0, a1 = forward.replay()
                        a1.synchronize()
                        fwd_alone.append(a0.elapsed_time(a1))
                        f0, f1 = forward.replay()
                    start = time.perf_counter()
                    try:
                        arm(dst_blocks)
                    except BatchCopyError as error:
                        print(f"{name}: {error}", flush=True)
                        break
                    held = time.perf_counter() - start
                    copy_stream.synchronize()
                    took = time.perf_counter() - start
                    if forward is not None:
                        f1.synchronize()
                        fwd_with.append(f0.elapsed_time(f1))
                    times.append(took * 1e3)
                    holds.append(held * 1e3)
                    if name != "plain":
                        identical &= chunks_landed(shape, host, tensors, dst_blocks)
                if len(times) <= args.requests:
                    arms.pop(name)
                    continue
                times, holds = times[1:], holds[1:]
                fwd_alone, fwd_with = fwd_alone[1:], fwd_with[1:]
                row = {
                    "arm": name,
                    "tokens": tokens,
                    "compute": compute,
                    "link_ms": link_ms,
                    "reload_ms": statistics.median(times),
                    "reload_ms_all": times,
                    "host_ms": statistics.median(holds),
                    "forward_alone_ms": statistics.median(fwd_alone) if fwd_alone else None,
                    "forward_with_ms": statistics.median(fwd_with) if fwd_with else None,
                    "identical": identical if name != "plain" else None,
                }
                rows.append(row)
                slow = (
                    f" forward {row['forward_with_ms'] / row['forward_alone_ms']:.3f}x"
                    if fwd_alone
                    else ""
                )
                print(
                    f"{tokens} {compute} {name}: {row['reload_ms']:.2f} ms "
                    f"({row['reload_ms'] / link_ms:.2f}x link) host {row['host_ms']:.2f} ms"
                    f"{slow} identical={row['identical']}",
                    flush=True,
                )
        del staging
    write_probe_json(args.json, report)


def _batched_arm(
    shape: PageShape, tensors: list[torch.Tensor], host: torch.Tensor, stream: torch.cuda.Stream
) -> Callable[[torch.Tensor], None] | None:
    try:
        from kvcore.kernels.batch_copy import batch_copy_pointers
    except ImportError:
        return None
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    offsets = np.arange(shape.tensors, dtype=np.int64) * shape.row_bytes

    def batched(dst_blocks: torch.Tensor) -> None:
        blocks = dst_blocks.numpy().astype(np.int64)
        dsts = (bases[None, :] + blocks[:, None] * shape.row_bytes).ravel()
        chunk = np.arange(blocks.size, dtype=np.int64) * shape.chunk_bytes
        srcs = (host.data_ptr() + chunk[:, None] + offsets[None, :]).ravel()
        sizes = np.full(dsts.size, shape.row_bytes, dtype=np.int64)
        batch_copy_pointers(dsts, srcs, sizes, stream, source_in_stream_order=False)

    return batched


if __name__ == "__main__":
    main()
