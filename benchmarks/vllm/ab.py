"""A/B of vLLM's CPU offload copies: the stock handler's paths against kvcore's handler.

:func:`ab` builds one vLLM offload layout per descriptor size (GPU KV tensors, the
host tensors as vLLM lays them out, vLLM's own ``SingleDirectionOffloadingHandler``
over them), submits the same job to each path, checks the destination bytes against
the source after every timed copy, and returns one row per (direction, size,
fragmentation, path). Stock paths, whichever can run where it runs:

* ``stock_handler``: vLLM's handler end to end, when vLLM's compiled ops are loaded;
* ``stock_handler_emul``: where they are not, vLLM's handler end to end with its compiled
  copy op (when it picked that op over its Triton kernel) replaced by the same driver call
  on the same descriptor arrays, read in place through ctypes;
* ``stock_batch_dma``: what its compiled op does (one cudaMemcpyBatchAsync over one
  descriptor per page), issued through kvcore's binding of the same driver call;
* ``stock_triton``: vLLM's Triton swap kernel over the stock descriptors (loads whose
  pages stock would give it: under 28 KiB, 8-byte multiples, 16 descriptors or more);
* ``per_block_copy``: one ``copy_`` per descriptor, the Python-level floor.

kvcore paths: ``kvcore`` is its handler as installed (jobs whose stock copy it judges
cheaper stay stock); ``kvcore_own`` is the same handler with those rules off, so that
every job it can copy exactly runs on its own paths (what the rules should be is read
off the two).

On a CPU ``device`` only ``per_block_copy`` and the kvcore paths run (a tiny dry run).

What each path issues is :mod:`benchmarks.vllm.ab_paths`; the layout and the handlers,
which the sweep and the soak build the same way, are :mod:`benchmarks.vllm.offload_layout`
and :mod:`benchmarks.vllm.offload_handlers`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from benchmarks.vllm.ab_paths import runnable_paths
from benchmarks.vllm.offload_handlers import kvcore_handler, runnable_stock, stock_handler
from benchmarks.vllm.offload_layout import Layout, fragmented_ids, job_specs
from kvcore_vllm.releases import installed_shape


def ab(
    device: torch.device | str,
    block_bytes_list: Sequence[int] = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20),
    frag_levels: Sequence[float] = (0.0, 0.5, 1.0),
    *,
    job_bytes: int = 64 << 20,
    tensors: int = 1,
    shared_region: bool = False,
    directions: Iterable[bool] = (True, False),
    repeats: int = 10,
    passes: int = 2,
    jobs: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time each stock path and kvcore's handler; one dict per (direction, size, frag, path).

    Each job moves about ``job_bytes`` in pages of ``block_bytes`` per KV tensor
    (``tensors`` of them: 1 is a cross-layer layout), with both sides' ids broken at
    ``frag`` of the neighbour pairs. Each path runs ``repeats`` timed copies in each of
    ``passes`` passes; a timed copy is ``jobs`` copies of the job issued back to back,
    so that with more than one, host time overlaps the copies as in a busy worker. Keys:
    direction, block_bytes, frag, path, pages, descriptors, jobs, seconds (median, for
    all ``jobs``), gbps, submit_us (median host time of a handler's ``transfer_async``;
    None for paths that are no handler), bytes_ok (every pass's destination checked).
    """
    if installed_shape().device_pointers:
        raise RuntimeError(
            "the vLLM A/B issues stock's descriptors through its fill methods over GPU block "
            "ids; this vLLM fills them from device pointers inside transfer_async. Run the "
            "A/B on 0.25.1-0.33.0, or `kvcore bench --engine vllm --sweep` here"
        )
    device = torch.device(device)
    rows: list[dict[str, Any]] = []
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for block_bytes in block_bytes_list:
        pages = max(16, min(4096, job_bytes // (block_bytes * tensors)))
        # fragmented_ids steps by at most 4, and the ids start below `pages`.
        span = pages * 5
        layout = Layout(
            page_bytes=block_bytes,
            tensors=tensors,
            gpu_blocks=span,
            cpu_chunks=span,
            shared_region=shared_region,
        )
        gpu, host = layout.make_tensors(device, generator)
        for gpu_to_cpu in directions:
            stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
            # The jobs kvcore leaves to stock need stock's copy op: emulated where it is absent.
            kvcore = kvcore_handler(runnable_stock(stock, device))
            kvcore_own = kvcore_handler(runnable_stock(stock, device), stock_rules=False)
            for frag in frag_levels:
                gpu_ids = fragmented_ids(pages, frag, rng) + int(rng.integers(0, pages))
                cpu_ids = fragmented_ids(pages, frag, rng) + int(rng.integers(0, pages))
                specs = job_specs(gpu_ids, cpu_ids, gpu_to_cpu=gpu_to_cpu)
                check = _Pages(gpu, host, gpu_ids, cpu_ids, gpu_to_cpu)
                paths = runnable_paths(stock, kvcore, kvcore_own, specs, device, jobs)
                samples: dict[str, list[float]] = {p.name: [] for p in paths}
                copied = dict.fromkeys(samples, True)
                # Passes in alternating order, so that drift of the link or the host over
                # a cell's minutes is spread over every path instead of biasing one.
                for round_index in range(passes):
                    for path in paths if round_index % 2 == 0 else paths[::-1]:
                        check.poison()
                        samples[path.name] += _time(path.run, device, repeats)
                        copied[path.name] = copied[path.name] and check.copied()
                nbytes = pages * block_bytes * tensors * jobs
                for path in paths:
                    seconds = statistics.median(samples[path.name])
                    rows.append(
                        {
                            "direction": "d2h" if gpu_to_cpu else "h2d",
                            "block_bytes": block_bytes,
                            "frag": frag,
                            "path": path.name,
                            "pages": pages,
                            "descriptors": pages * tensors,
                            "jobs": jobs,
                            "seconds": seconds,
                            "gbps": nbytes / seconds / 1e9,
                            "submit_us": (
                                statistics.median(path.submit_seconds) * 1e6
                                if path.submit_seconds
                                else None
                            ),
                            "bytes_ok": copied[path.name],
                        }
                    )
            kvcore.shutdown()
            kvcore_own.shutdown()
    return rows


class _Pages:
    """A job's destination pages: poisoned before a path runs, compared after."""

    def __init__(
        self,
        gpu: list[torch.Tensor],
        host: list[torch.Tensor],
        gpu_ids: np.ndarray,
        cpu_ids: np.ndarray,
        gpu_to_cpu: bool,
    ) -> None:
        self._gpu, self._host, self._gpu_to_cpu = gpu, host, gpu_to_cpu
        self._gpu_index = torch.from_numpy(gpu_ids).to(gpu[0].device)
        self._cpu_index = torch.from_numpy(cpu_ids)

    def poison(self) -> None:
        """Every destination byte made different from its source byte."""
        for device_side, host_side in zip(self._gpu, self._host, strict=True):
            source = device_side[self._gpu_index].cpu()
            if self._gpu_to_cpu:
                host_side[self._cpu_index] = torch.bitwise_not(source)
            else:
                device_side[self._gpu_index] = torch.bitwise_not(host_side[self._cpu_index]).to(
                    device_side.device
                )

    def copied(self) -> bool:
        for device_side, host_side in zip(self._gpu, self._host, strict=True):
            if not torch.equal(device_side[self._gpu_index].cpu(), host_side[self._cpu_index]):
                return False
        return True


def _time(run: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs, each to the device's end, after one warm-up."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize()
        samples.append(time.perf_counter() - started)
    return samples
