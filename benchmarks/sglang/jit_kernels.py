"""SGLang's JIT HiCache kernels: built before anything is timed, launched on a stream of ours.

Apart from the A/B (:mod:`benchmarks.sglang.ab`) because the sweep, the soak and the live
HiCache run build and launch them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from benchmarks.sglang.pool_case import MHA_HEAD_DIM, MHA_HEADS, MLA_RANK, MLA_ROPE, Options


def warm_jit(opts: Options) -> dict[str, str]:
    """Build SGLang's JIT HiCache modules in parallel, before anything is timed."""
    if opts.device.type != "cuda":
        return {}
    from concurrent.futures import ThreadPoolExecutor

    from sglang.kernels.ops.kvcache import hicache

    builds: dict[str, Callable[[], Any]] = {
        "tma": partial(hicache._jit_hicache_tma_module, block_quota=hicache.TMA_BLOCK_QUOTA)
    }
    # The element sizes the pools below use (MHA K or V rows, MLA rows), with SGLang's defaults.
    for element in (MHA_HEADS * MHA_HEAD_DIM * 2, (MLA_RANK + MLA_ROPE) * 2):
        args = dict(
            element_size=element,
            unroll=hicache._default_unroll(element),
            block_quota=hicache.DEFAULT_BLOCK_QUOTA,
        )
        builds[f"register-{element}"] = partial(hicache._jit_hicache_module, **args)
        builds[f"staged-{element}"] = partial(hicache._jit_hicache_staged_module, **args)
    status: dict[str, str] = {}
    with ThreadPoolExecutor(len(builds)) as pool:
        futures = {name: pool.submit(build) for name, build in builds.items()}
        for name, future in futures.items():
            try:
                future.result()
                status[name] = "built"
            except Exception as exc:
                status[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return status


@contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """A stream of our own, as SGLang's transfer engine uses (the batched copy API refuses
    the legacy default stream); SGLang's JIT kernels launch through tvm-ffi, told to use it."""
    if stream is None:
        yield
        return
    import tvm_ffi

    with torch.cuda.stream(stream), tvm_ffi.use_torch_stream():
        yield
