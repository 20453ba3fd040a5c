"""What lets SGLang's HiCache run on a machine without CUDA, for the live driver's CPU tests.

Two stand-ins, nothing else changed: SGLang pins its host pool with ``cudaHostRegister``
(``pin_memory=True`` by default), which needs CUDA, so host pools are built unpinned; and
its ``direct`` io backend copies with ``sgl_kernel``'s ``transfer_kv_direct``, which is
not importable here (``pool_host.mha`` imports it only on CUDA or ROCm), so that name is
given a torch implementation of the same copy: for each (source, destination) layer pair,
the destination's rows at the destination indices take the source's rows at the source
indices. Everything else (the tree, the controller, the transfer engine with torch.cpu's
stream and event, the layer-done counter) is SGLang's own code running on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct``'s copy, in torch (page_size only groups
    the kernel's copies; the rows it moves are the same)."""
    for source, destination in zip(src_layers, dst_layers, strict=True):
        destination[dst_indices.to(destination.device)] = source[src_indices.to(source.device)]


@contextmanager
def cpu_hicache() -> Iterator[None]:
    from sglang.srt.mem_cache.pool_host import mha
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    original_init = HostKVCache.__init__
    had_direct = hasattr(mha, "transfer_kv_direct")
    original_direct = getattr(mha, "transfer_kv_direct", None)

    def unpinned_init(self: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        original_init(self, **kwargs)

    HostKVCache.__init__ = unpinned_init  # type: ignore[method-assign]
    mha.transfer_kv_direct = transfer_kv_direct
    try:
        yield
    finally:
        HostKVCache.__init__ = original_init  # type: ignore[method-assign]
        if had_direct:
            mha.transfer_kv_direct = original_direct
        else:
            del mha.transfer_kv_direct


@contextmanager
def one_flipped_byte() -> Iterator[None]:
    """The first load-back's layer-0 K row of its first token gets one byte flipped after the
    copy: what a broken copy would leave, for the checker to find."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    original = MHATokenToKVPoolHost.load_to_device_per_layer
    done: list[bool] = []

    def flipping(
        self: Any,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: str,
        **kwargs: Any,
    ) -> None:
        original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
        if not done and layer_id == 0:
            row = device_pool._get_key_buffer(device_pool.start_layer)[int(device_indices[0])]
            row.view(torch.uint8).view(-1)[3] ^= 0x10
            done.append(True)

    MHATokenToKVPoolHost.load_to_device_per_layer = flipping  # type: ignore[method-assign]
    try:
        yield
    finally:
        MHATokenToKVPoolHost.load_to_device_per_layer = original  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """``hicache_live``'s command line on the CPU, inside the stand-ins (``--flip-one-byte``
    first: also break one loaded byte)."""
    import conftest  # noqa: F401  (its torchvision stand-in, as in the test session)

    from benchmarks.sglang import hicache_live
    from benchmarks.sglang.protocol_stubs import install_protocol_stubs

    install_protocol_stubs()
    flip = argv[:1] == ["--flip-one-byte"]
    with cpu_hicache(), one_flipped_byte() if flip else nullcontext():
        return hicache_live.main(argv[1:] if flip else argv)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
