"""Host-side choices shared by the row gather's launchers, and their launch through the JIT.

The tile and warps for a row width (``default_tile``), the widest word both sides'
alignment allows, the checks on the views, indices and tuning arguments, and
``Launch``, which launches a kernel with them. Apart from the launchers
(:mod:`~kvcore.kernels.triton_rows`, :mod:`~kvcore.kernels.triton_layers`) so that the
one-pair gather and the layered launch choose and check alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvcore.kernels.triton_kernels import triton

# Real bytes per tile: PCIe needs many bytes in flight per CTA, and tiles of this size keep
# a few CTAs at the link where smaller ones need twice as many (scripts/tune_gather.py,
# docs/lab/benchmarks.md).
TILE_BYTES = 64 * 1024
# Register footprint of one tile, masked padding lanes included (rows are padded to a power of 2).
_MAX_TILE_LANES_BYTES = 128 * 1024
_MAX_BLOCK_BYTES = 32 * 1024
# Each row of a tile holds two indices and two addresses in registers: cap rows for tiny rows.
_MAX_TILE_ROWS = 1024
VECTOR_BYTES = 16
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
WORD_DTYPE_BY_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Triton passes a count below this as a 32-bit integer: a compiled kernel takes no more.
I32_LIMIT = 1 << 31


def gather_sm_count(ctas: int) -> int:
    """SMs the gather occupies when launched with ``ctas`` programs.

    Assumes one CTA per SM: on an idle GPU the block scheduler spreads a grid this small over
    distinct SMs, and a default CTA (up to 16 warps holding a tile of up to 128 KiB in registers)
    leaves no room for a second one. So the kernel takes ``ctas`` SMs, capped by the device's
    SM count when one is visible. Grids are also capped by the number of tiles to copy.
    """
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    if torch.cuda.is_available():
        return min(ctas, torch.cuda.get_device_properties().multi_processor_count)
    return ctas


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


def widest_word(src: torch.Tensor, dst: torch.Tensor) -> torch.dtype:
    row_bytes = src.shape[1] * src.element_size()
    byte_facts = (
        row_bytes,
        src.stride(0) * src.element_size(),
        dst.stride(0) * dst.element_size(),
        src.data_ptr(),
        dst.data_ptr(),
    )
    for size in (8, 4, 2):
        if all(fact % size == 0 for fact in byte_facts):
            return WORD_DTYPE_BY_SIZE[size]
    return torch.uint8


def check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in _WORD_DTYPES:
        raise TypeError(f"{name} must be an integer word view {_WORD_DTYPES}, got {tensor.dtype}")
    if tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise ValueError(f"{name} rows must be dense (stride(1) == 1), got {tensor.stride()}")


def check_index(index: torch.Tensor, name: str, device: torch.device) -> None:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(index).__name__}")
    if index.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(index.shape)}")
    if index.numel() > 1 and index.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {index.stride(0)}")
    if index.device != device:
        raise ValueError(f"{name} is on {index.device}; the kernel runs on {device}")


def kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    if _interpreting():
        for tensor, name in ((src, "src_words"), (dst, "dst_words")):
            if tensor.device.type != "cpu":
                raise ValueError(f"under TRITON_INTERPRET=1 {name} must be a CPU tensor")
        return torch.device("cpu")
    cuda_sides = [t.device for t in (src, dst) if t.device.type == "cuda"]
    if not cuda_sides:
        raise ValueError("one of src_words / dst_words must be a CUDA tensor")
    if len(cuda_sides) == 2 and cuda_sides[0] != cuda_sides[1]:
        raise ValueError(f"src_words and dst_words are on different GPUs: {cuda_sides}")
    for tensor, name in ((src, "src_words"), (dst, "dst_words")):
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {tensor.device}; expected cpu (pinned) or cuda")
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            raise ValueError(f"{name} is host memory that is not pinned; the GPU cannot address it")
    return cuda_sides[0]


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _prev_pow2(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


def default_tile(words: int, word_bytes: int) -> tuple[int, int]:
    """(rows_per_iter, block_w) for rows of ``words`` words: about TILE_BYTES of data a tile."""
    block_w = min(_next_pow2(words), _MAX_BLOCK_BYTES // word_bytes)
    row_bytes_in_block = min(words, block_w) * word_bytes
    rows = 1 << max(0, round(math.log2(TILE_BYTES / row_bytes_in_block)))
    rows = min(rows, _prev_pow2(max(1, _MAX_TILE_LANES_BYTES // (block_w * word_bytes))))
    return min(rows, _MAX_TILE_ROWS), block_w


def _default_num_warps(rows: int, block_w: int, word_bytes: int) -> int:
    vectors = rows * block_w * word_bytes // VECTOR_BYTES
    # Aim for ~8 16-byte vectors a thread: all loads of a tile can then be in flight at once.
    # Capped at 8 warps: more lost bandwidth in the tuning runs (scripts/tune_gather.py,
    # docs/lab/benchmarks.md).
    return max(1, min(8, _prev_pow2(max(1, vectors // (32 * 8)))))


def check_indices(src_idx: torch.Tensor, dst_idx: torch.Tensor, device: torch.device) -> None:
    check_index(src_idx, "src_idx", device)
    check_index(dst_idx, "dst_idx", device)
    if src_idx.numel() != dst_idx.numel():
        raise ValueError(f"index lengths differ: {src_idx.numel()} vs {dst_idx.numel()}")


def check_ctas(ctas: int) -> None:
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")


def check_tile(rows_per_iter: int | None, num_warps: int | None, block_words: int | None) -> None:
    for name, value in (
        ("rows_per_iter", rows_per_iter),
        ("num_warps", num_warps),
        ("block_words", block_words),
    ):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two, got {value}")


class Launch:
    """The tile and warps for rows of ``words`` words, and the launch of a kernel with them."""

    def __init__(
        self,
        words: int,
        word_bytes: int,
        rows_per_iter: int | None,
        num_warps: int | None,
        block_words: int | None,
    ) -> None:
        rows, block_w = default_tile(words, word_bytes)
        self.words = words
        self.rows = rows_per_iter or rows
        self.block_w = block_words or block_w
        self.warps = num_warps or _default_num_warps(self.rows, self.block_w, word_bytes)

    def run(
        self,
        kernel: Any,
        args: tuple[Any, ...],
        tiles: int,
        ctas: int,
        align: int,
        device: torch.device,
    ) -> Any:
        """Launch through Triton's JIT; returns what it returns (the compiled kernel)."""
        grid = (min(ctas, tiles),)
        constants = {
            "WORDS": self.words,
            "ROWS": self.rows,
            "BLOCK_W": self.block_w,
            "ALIGN": align,
        }
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return kernel[grid](*args, **constants, num_warps=self.warps)
        return kernel[grid](*args, **constants, num_warps=self.warps)

    def constants(self, align: int) -> tuple[int, int, int, int]:
        """The kernels' constexpr arguments, in their order (WORDS, ROWS, BLOCK_W, ALIGN)."""
        return (self.words, self.rows, self.block_w, align)
