"""Could a load's copies be issued from a worker thread, so that ``transfer_async`` returns at
once and vLLM queues its next forward without waiting? Today an MHA load of 8k tokens holds
the engine's thread for about 9 ms and one of 32k for about 35 (one DMA descriptor a page
in the driver: docs/bench/h100-beside-compute-vllm-2026-12-07-defaults-mha.json).

One MHA-shaped load (32 layers, 32 KiB blocks, vLLM-shaped host chunk rows, random
destination blocks) goes by kvcore's ``batch_copy_pointers`` in batches of 256 copies:
``inline`` on the main thread, then ``worker`` from a thread while the main thread replays
the other batch's forward and then runs ``--python-ms`` of pure Python (the worst case for
the GIL); ``beside`` queues the forward first, then issues inline (the overlap without a
thread). Per arm: the main thread's hold before the forward is queued, the load's time from
the first call to the copy's end, the forward's GPU time, the Python work's own time, and
whether every byte matches.

    python3 scripts/background_issue_probe.py [--sizes 8192,32768] [--python-ms 0,5]
        [--requests 5] [--json out.json]

Measuring code only; needs CUDA and cuda-bindings.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# The measuring code is in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.beside_rows import LINK_GBPS
from benchmarks.model_forward import measured_forward
from benchmarks.probe_shape import probe_device, probe_parser, write_probe_json
from kvcore.kernels.batch_copy import batch_copy_pointers

LAYERS = 32
BLOCK_BYTES = 32 << 10
CHUNK_BYTES = LAYERS * BLOCK_BYTES
GPU_BLOCKS = 4096


def _busy(ms: float) -> float:
    """Pure Python for ``ms``: the main thread's own time, stretched where a thread holds
    the GIL."""
    start = time.perf_counter()
    total = 0
    while (time.perf_counter() - start) * 1e3 < ms:
        for value in range(200):
            total += value
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = probe_parser()
    parser.add_argument("--python-ms", default="0,5")
    args = parser.parse_args()
    device = probe_device("background_issue_probe")
    layers = [
        torch.zeros(GPU_BLOCKS, BLOCK_BYTES, dtype=torch.uint8, device=device)
        for _ in range(LAYERS)
    ]
    bases = np.array([t.data_ptr() for t in layers], dtype=np.int64)
    stream = torch.cuda.Stream(device)
    rows: list[dict[str, object]] = []
    for tokens in (int(s) for s in args.sizes.split(",")):
        blocks = tokens // 16
        host = torch.empty(blocks * CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        host.view(torch.int32).random_()
        link_ms = blocks * CHUNK_BYTES / LINK_GBPS / 1e6
        forward = measured_forward("mha", "decode-256", LAYERS, device)
        forward.size_for(link_ms * 1.3)

        def issue(dst_blocks: np.ndarray, host: torch.Tensor = host, blocks: int = blocks) -> None:
            dsts = (bases[None, :] + dst_blocks[:, None] * BLOCK_BYTES).ravel()
            offsets = np.arange(LAYERS, dtype=np.int64) * BLOCK_BYTES
            chunks = np.arange(blocks, dtype=np.int64) * CHUNK_BYTES
            srcs = (host.data_ptr() + chunks[:, None] + offsets[None, :]).ravel()
            sizes = np.full(dsts.size, BLOCK_BYTES, dtype=np.int64)
            batch_copy_pointers(dsts, srcs, sizes, stream, source_in_stream_order=False)

        for python_ms in (float(p) for p in args.python_ms.split(",")):
            for arm in ("inline", "worker", "beside"):
                rows.append(
                    _cell(
                        arm, issue, forward, layers, host, blocks, stream, python_ms, args.requests
                    )
                    | {"tokens": tokens, "link_ms": link_ms, "python_ms": python_ms}
                )
                row = rows[-1]
                ratio = float(row["load_ms"]) / link_ms  # type: ignore[arg-type]
                print(
                    f"{tokens} python {python_ms} {arm}: hold {row['hold_ms']:.2f} ms, load "
                    f"{row['load_ms']:.2f} ms ({ratio:.2f}x link), forward "
                    f"{row['forward_ms']:.2f} (alone {row['forward_alone_ms']:.2f}), python "
                    f"{row['python_took_ms']:.2f} ms, identical={row['identical']}",
                    flush=True,
                )
        del host
    write_probe_json(args.json, {"device": torch.cuda.get_device_name(device), "rows": rows})


def _cell(
    arm: str,
    issue: Callable[[np.ndarray], None],
    forward: object,
    layers: list[torch.Tensor],
    host: torch.Tensor,
    blocks: int,
    stream: torch.cuda.Stream,
    python_ms: float,
    requests: int,
) -> dict[str, object]:
    holds, loads, fwd, alone, took = [], [], [], [], []
    identical = True
    for _ in range(requests + 1):
        dst_blocks = np.random.permutation(GPU_BLOCKS)[:blocks].astype(np.int64)
        torch.cuda.synchronize()
        a0, a1 = forward.replay()  # type: ignore[attr-defined]
        a1.synchronize()
        alone.append(a0.elapsed_time(a1))
        start = time.perf_counter()
        worker = None
        if arm == "beside":
            f0, f1 = forward.replay()  # type: ignore[attr-defined]
            issue(dst_blocks)
        else:
            if arm == "inline":
                issue(dst_blocks)
            else:
                worker = threading.Thread(target=issue, args=(dst_blocks,))
                worker.start()
            f0, f1 = forward.replay()  # type: ignore[attr-defined]
        holds.append((time.perf_counter() - start) * 1e3)
        took.append(_busy(python_ms) if python_ms else 0.0)
        if worker is not None:
            worker.join()
        stream.synchronize()
        loads.append((time.perf_counter() - start) * 1e3)
        f1.synchronize()
        fwd.append(f0.elapsed_time(f1))
        chunks = host.view(blocks, LAYERS, BLOCK_BYTES)
        index = torch.from_numpy(dst_blocks).to(layers[0].device)
        identical &= all(
            torch.equal(t[index], chunks[:, layer].to(t.device)) for layer, t in enumerate(layers)
        )
    return {
        "arm": arm,
        "hold_ms": statistics.median(holds[1:]),
        "load_ms": statistics.median(loads[1:]),
        "load_ms_all": loads[1:],
        "forward_ms": statistics.median(fwd[1:]),
        "forward_alone_ms": statistics.median(alone[1:]),
        "python_took_ms": statistics.median(took[1:]),
        "identical": identical,
    }


if __name__ == "__main__":
    main()
