"""What pinning a host pool in the background would cost: three questions for the GPU.

    python3 scripts/registration_probe.py [--gib 8] [--json FILE]

Issue 46's "ready early" stretch would let the engine start once a first share of its host
pool is registered with CUDA and register the rest from a thread. Whether that can work
turns on what this probe measures:

- ``span``: a copy whose host range spans two adjacent registrations, by ``copy_`` (one
  cudaMemcpyAsync) and by one cudaMemcpyBatchAsync entry, against the same copy inside one
  registration: its bytes, and its speed (a copy the driver takes for pageable memory runs
  at a fraction of the link). If spanning is slow or refused, kvcore's runs would have to
  be cut at every registration boundary.
- ``chunks``: the same bytes registered in one call, and in chunks of 1 GiB, 64 MiB and
  4 MiB: the cost of each call, since a layer_first pool registered a slot range at a time
  takes one registration per layer and step.
- ``beside``: host-to-device copies of 1 MiB out of registered memory, each followed by a
  small kernel, timed alone and while another thread registers ``--gib`` more in 256 MiB
  chunks: whether registration in the background stalls the engine's copies and launches
  (the driver may serialise them behind one lock).

Needs a CUDA GPU; writes one JSON document (stdout, or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvcore.host_mapping import HostMemory, faulted_memory
from kvcore.host_pinning import CudaHostRegistrar

GIB = 1 << 30
MIB = 1 << 20
SPAN_BYTES = 256 * MIB
"""The copy of ``span``: half on each side of the boundary."""
CHUNKS = (GIB, 64 * MIB, 4 * MIB)
BESIDE_COPIES = 400


def _memory(nbytes: int) -> HostMemory:
    return faulted_memory(nbytes, segments=1)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def _timed_copy(copy: Any, repeats: int = 5) -> float:
    """The best of ``repeats`` runs of ``copy()``, synchronised, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def span(registrar: CudaHostRegistrar) -> dict[str, Any]:
    """A copy across two adjacent registrations against one inside a single registration."""
    from kvcore.kernels.batch_copy import batch_copy_available, batch_copy_pointers

    half = 2 * SPAN_BYTES
    memory = _memory(2 * half)
    host = torch.frombuffer(memory.buffer, dtype=torch.uint8, count=2 * half)
    host.copy_(torch.randint(0, 256, (2 * half,), dtype=torch.uint8))
    device = torch.empty(SPAN_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    result: dict[str, Any] = {"copy_bytes": SPAN_BYTES}
    inside = host[:SPAN_BYTES]
    across = host[half - SPAN_BYTES // 2 : half + SPAN_BYTES // 2]
    registrar.register(memory.address, half)
    registrar.register(memory.address + half, half)
    try:
        for name, source in (("inside_one", inside), ("across_two", across)):
            try:
                seconds = _timed_copy(lambda source=source: device.copy_(source, non_blocking=True))
                result[f"copy_{name}_gbps"] = _gbps(SPAN_BYTES, seconds)
                result[f"copy_{name}_exact"] = bool(torch.equal(device.cpu(), source))
            except Exception as exc:  # the H200 refuses a copy across two: record it
                result[f"copy_{name}_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if not batch_copy_available():
                result["batch"] = "unavailable"
                continue

            def batch(source: torch.Tensor = source) -> None:
                batch_copy_pointers(
                    np.array([device.data_ptr()], dtype=np.uint64),
                    np.array([source.data_ptr()], dtype=np.uint64),
                    np.array([SPAN_BYTES], dtype=np.uint64),
                    stream,
                    source_in_stream_order=False,
                )

            device.zero_()
            try:
                seconds = _timed_copy(batch)
                result[f"batch_{name}_gbps"] = _gbps(SPAN_BYTES, seconds)
                result[f"batch_{name}_exact"] = bool(torch.equal(device.cpu(), source))
            except Exception as exc:  # the answer may be "refused": record it
                result[f"batch_{name}_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        registrar.unregister(memory.address)
        registrar.unregister(memory.address + half)
        memory.close()
    return result


def chunks(registrar: CudaHostRegistrar, nbytes: int) -> list[dict[str, Any]]:
    """``nbytes`` registered in one call, then in each size of :data:`CHUNKS`."""
    memory = _memory(nbytes)
    rows = []
    try:
        for chunk in (nbytes, *CHUNKS):
            if chunk > nbytes:
                continue
            starts = range(0, nbytes - chunk + 1, chunk)
            started = time.perf_counter()
            for start in starts:
                registrar.register(memory.address + start, chunk)
            register_s = time.perf_counter() - started
            started = time.perf_counter()
            for start in starts:
                registrar.unregister(memory.address + start)
            rows.append(
                {
                    "chunk_bytes": chunk,
                    "calls": len(starts),
                    "register_s": round(register_s, 4),
                    "register_gib_per_s": round(len(starts) * chunk / GIB / register_s, 2),
                    "per_call_ms": round(register_s / len(starts) * 1e3, 4),
                    "unregister_s": round(time.perf_counter() - started, 4),
                }
            )
    finally:
        memory.close()
    return rows


def beside(registrar: CudaHostRegistrar, nbytes: int) -> dict[str, Any]:
    """Small copies and launches timed alone and while another thread registers ``nbytes``."""
    source_memory, pool = _memory(MIB), _memory(nbytes)
    source = torch.frombuffer(source_memory.buffer, dtype=torch.uint8, count=MIB)
    registrar.register(source_memory.address, MIB)
    device = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    scratch = torch.zeros(1024, device="cuda")

    def copies() -> list[float]:
        times = []
        for _ in range(BESIDE_COPIES):
            started = time.perf_counter()
            device.copy_(source, non_blocking=True)
            scratch.add_(1.0)
            torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter() - started)
        return times

    def register_all(done: list[float]) -> None:
        started = time.perf_counter()
        for start in range(0, nbytes, 256 * MIB):
            registrar.register(pool.address + start, min(256 * MIB, nbytes - start))
        done.append(time.perf_counter() - started)

    try:
        copies()  # warm-up
        alone = copies()
        done: list[float] = []
        thread = threading.Thread(target=register_all, args=(done,))
        thread.start()
        during = copies()
        thread.join()
        for start in range(0, nbytes, 256 * MIB):
            registrar.unregister(pool.address + start)
    finally:
        registrar.unregister(source_memory.address)
        source_memory.close()
        pool.close()

    def us(values: list[float], q: float) -> float:
        return round(float(np.quantile(values, q)) * 1e6, 1)

    return {
        "copies": BESIDE_COPIES,
        "alone_us_p50": us(alone, 0.5),
        "alone_us_p99": us(alone, 0.99),
        "during_registration_us_p50": us(during, 0.5),
        "during_registration_us_p99": us(during, 0.99),
        "during_registration_us_max": round(max(during) * 1e6, 1),
        "registration_s": round(done[0], 3) if done else None,
        "registered_bytes": nbytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bytes registered (GiB)")
    parser.add_argument("--json", type=Path, help="write the document here (default: stdout)")
    args = parser.parse_args(argv)
    if args.gib <= 0:
        parser.error(f"--gib must be positive, got {args.gib}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: no folder {args.json.parent}")
    if not torch.cuda.is_available():
        print("registration_probe.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    nbytes = int(args.gib * GIB) // (4 * MIB) * (4 * MIB)
    registrar = CudaHostRegistrar()
    document = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "span": span(registrar),
        "chunks": chunks(registrar, nbytes),
        "beside": beside(registrar, nbytes),
    }
    text = json.dumps(document, indent=2) + "\n"
    if args.json is None:
        sys.stdout.write(text)
    else:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
