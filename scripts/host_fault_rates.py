"""How fast this host faults in and pins fresh memory, by mapping kind and thread count.

    python3 scripts/host_fault_rates.py [--gib 4] [--threads 1,4,16] [--json FILE]

Issue 46 picks how kvcore should obtain an engine's host pool from these rates: SGLang's
default pool is a shared anonymous mapping (4 KiB pages unless shmem hugepages are on), its
opt-in parallel path a private one, which transparent hugepages may back with 2 MiB pages.
The kernel serialises page-cache inserts per shmem file, so ``shared-segments`` maps the same
bytes contiguously from 32 memfd files, as vLLM 0.33's region does: where it faults much
faster than ``shared`` at 16 threads, one shared object is the limit kvcore's SGLang hook
meets. ``shared-kvcore`` is the mapping kvcore makes for that size
(:func:`kvcore.host_mapping.host_memory`: one file a GiB, up to 32), whose ``files`` says
how many it took. Each kind is faulted in by kvcore.host_pinning.populate from N threads, then
registered with CUDA where a GPU is present (and unregistered).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcore import host_pinning
from kvcore.host_mapping import host_memory, mapping_address
from kvcore.shared_segments import MAX_SEGMENTS as SEGMENTS
from kvcore.shared_segments import segment_count, segmented_shared

MADV_HUGEPAGE = 14
KINDS = ("shared", "shared-segments", "shared-kvcore", "private", "private-hugepage")


def _madvise(address: int, nbytes: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return int(libc.madvise(address, nbytes, advice))


def _mapped(kind: str, nbytes: int) -> tuple[int, Callable[[], None]]:
    """A fresh mapping of ``kind``: (address, what unmaps it)."""
    if kind == "shared-segments":
        shared = segmented_shared(nbytes, SEGMENTS)
        return shared.address, shared.release
    if kind == "shared-kvcore":
        memory = host_memory(nbytes)
        return memory.address, memory.close
    flags = mmap.MAP_SHARED if kind == "shared" else mmap.MAP_PRIVATE
    region = mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS)
    return mapping_address(region), region.close


def one_rate(kind: str, nbytes: int, threads: int, register: bool) -> dict[str, Any]:
    address, release = _mapped(kind, nbytes)
    try:
        advised = None
        if kind == "private-hugepage":
            advised = _madvise(address, nbytes, MADV_HUGEPAGE) == 0
        started = time.perf_counter()
        host_pinning.populate(address, nbytes, threads)
        faulted = time.perf_counter() - started
        register_s = None
        if register:
            registrar = host_pinning.CudaHostRegistrar()
            started = time.perf_counter()
            registrar.register(address, nbytes)
            register_s = time.perf_counter() - started
            registrar.unregister(address)
        gib = nbytes / (1 << 30)
        return {
            "kind": kind,
            "threads": threads,
            "gib": gib,
            "hugepage_advised": advised,
            "files": {"shared-segments": SEGMENTS, "shared-kvcore": segment_count(nbytes)}.get(
                kind, 1 if kind == "shared" else None
            ),
            "fault_gib_per_s": gib / faulted,
            "register_gib_per_s": None if register_s is None else gib / register_s,
        }
    finally:
        release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        import torch

        register = torch.cuda.is_available()
    except ImportError:
        register = False
    nbytes = int(args.gib * (1 << 30))
    nbytes -= nbytes % mmap.PAGESIZE
    rows = []
    for kind in KINDS:
        for threads in (int(t) for t in args.threads.split(",")):
            row = one_rate(kind, nbytes, threads, register)
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
