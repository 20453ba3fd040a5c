"""Triton row gather between pinned host memory and device memory, through UVA addresses.

``gather_rows_uva`` copies ``dst[dst_idx[k]] = src[src_idx[k]]`` with a persistent grid of a
few CTAs. PCIe needs many bytes in flight, so each CTA handles a 2-D tile of several rows per
iteration and issues the loads of the whole tile before its stores. Triton is optional: import
this module freely and ask ``triton_available()`` before calling ``gather_rows_uva``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.kernels.reference import check_word_views

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# Real bytes per tile: PCIe needs many bytes in flight per CTA, and tiles of this size keep
# a few CTAs at the link where smaller ones need twice as many (scripts/tune_gather.py,
# docs/benchmarks.md).
TILE_BYTES = 64 * 1024
# Register footprint of one tile, masked padding lanes included (rows are padded to a power of 2).
_MAX_TILE_LANES_BYTES = 128 * 1024
_MAX_BLOCK_BYTES = 32 * 1024
# Each row of a tile holds two indices and two addresses in registers: cap rows for tiny rows.
_MAX_TILE_ROWS = 1024
_VECTOR_BYTES = 16
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_WORD_DTYPE_BY_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def triton_available() -> bool:
    """True when Triton is importable (the gather kernel's only optional dependency)."""
    return triton is not None


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


def _widest_word(src: torch.Tensor, dst: torch.Tensor) -> torch.dtype:
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
            return _WORD_DTYPE_BY_SIZE[size]
    return torch.uint8


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in _WORD_DTYPES:
        raise TypeError(f"{name} must be an integer word view {_WORD_DTYPES}, got {tensor.dtype}")
    if tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise ValueError(f"{name} rows must be dense (stride(1) == 1), got {tensor.stride()}")


def _check_index(index: torch.Tensor, name: str, device: torch.device) -> None:
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


def _kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
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
    vectors = rows * block_w * word_bytes // _VECTOR_BYTES
    # Aim for ~8 16-byte vectors a thread: all loads of a tile can then be in flight at once.
    # Capped at 8 warps: more lost bandwidth in the tuning runs (scripts/tune_gather.py,
    # docs/benchmarks.md).
    return max(1, min(8, _prev_pow2(max(1, vectors // (32 * 8)))))


# Arguments that change from call to call, left out of Triton's specialisation, so that a
# kernel compiled once serves every later call between the same buffers
# (:class:`LayeredLaunch` launches it without Triton's front end).
_PER_CALL_ARGS: dict[str, list[str]] = {
    "do_not_specialize": ["n_rows"],
    "do_not_specialize_on_alignment": ["src_idx_ptr", "dst_idx_ptr"],
}

if triton is not None:

    @triton.jit
    def _copy_tile(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        tile,
        n_rows,
        src_pitch,
        dst_pitch,
        WORDS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        row_lane = tl.arange(0, ROWS)
        col_lane = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
        k = tile * ROWS + row_lane
        row_ok = k < n_rows
        src_row = tl.load(src_idx_ptr + k, mask=row_ok, other=0)
        dst_row = tl.load(dst_idx_ptr + k, mask=row_ok, other=0)
        src_off = tl.multiple_of(src_row * src_pitch, ALIGN)
        dst_off = tl.multiple_of(dst_row * dst_pitch, ALIGN)
        for col in tl.range(0, WORDS, BLOCK_W):
            cols = col + col_lane
            mask = row_ok[:, None] & (cols < WORDS)[None, :]
            values = tl.load(src_ptr + src_off[:, None] + cols[None, :], mask=mask)
            tl.store(dst_ptr + dst_off[:, None] + cols[None, :], values, mask=mask)

    @triton.jit(**_PER_CALL_ARGS)
    def _gather_rows_kernel(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        n_rows,
        src_pitch,
        dst_pitch,
        WORDS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        n_programs = tl.num_programs(0)
        n_tiles = tl.cdiv(n_rows, ROWS)
        # A while loop, not range(pid, ...): Triton 3.6's interpreter cannot take a tensor as a
        # range bound under numpy >= 2.4 (triton-lang/triton#9171), and CI runs the interpreter.
        tile = tl.program_id(0)
        while tile < n_tiles:
            _copy_tile(
                src_ptr,
                dst_ptr,
                src_idx_ptr,
                dst_idx_ptr,
                tile,
                n_rows,
                src_pitch,
                dst_pitch,
                WORDS,
                ROWS,
                BLOCK_W,
                ALIGN,
            )
            tile += n_programs

    @triton.jit(**_PER_CALL_ARGS)
    def _gather_layers_kernel(
        src_ptr,
        dst_ptr,
        table_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        n_rows,
        n_layers,
        src_pitch,
        dst_pitch,
        WORDS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        n_programs = tl.num_programs(0)
        n_tiles = tl.cdiv(n_rows, ROWS)
        work = tl.program_id(0)
        while work < n_tiles * n_layers:
            layer = work // n_tiles
            src_base = tl.multiple_of(tl.load(table_ptr + layer), ALIGN)
            dst_base = tl.multiple_of(tl.load(table_ptr + n_layers + layer), ALIGN)
            _copy_tile(
                src_ptr + src_base,
                dst_ptr + dst_base,
                src_idx_ptr,
                dst_idx_ptr,
                work - layer * n_tiles,
                n_rows,
                src_pitch,
                dst_pitch,
                WORDS,
                ROWS,
                BLOCK_W,
                ALIGN,
            )
            work += n_programs


def gather_rows_uva(
    src_words: torch.Tensor,
    src_idx: torch.Tensor,
    dst_words: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    ctas: int = 8,
    rows_per_iter: int | None = None,
    num_warps: int | None = None,
    block_words: int | None = None,
) -> None:
    """``dst_words[dst_idx[k]] = src_words[src_idx[k]]`` for every k, on the current stream.

    One of src/dst may be pinned host memory, addressed from the GPU through UVA. The indices
    are int64 tensors on the kernel's device; they are never read back on the host, so they are
    not bounds-checked here (the caller checked them on CPU before uploading).

    ``rows_per_iter``, ``num_warps`` and ``block_words`` override the tile for tuning;
    ``block_words`` counts words of the widest width both sides' alignment allows (8 B for
    rows of a multiple of 8 B at 8-B aligned addresses).
    """
    gather = row_gather(
        src_words,
        dst_words,
        rows_per_iter=rows_per_iter,
        num_warps=num_warps,
        block_words=block_words,
    )
    gather(src_idx, dst_idx, ctas=ctas)


@dataclass(frozen=True, eq=False)
class RowGather:
    """:func:`gather_rows_uva` between two row views, their checks and tile done once: a
    caller that gathers between the same buffers again (a plan executed layer after layer)
    pays only for the indices' checks and the launch."""

    src: torch.Tensor
    """The source as a view of the kernel's word type."""
    dst: torch.Tensor
    align: int
    device: torch.device
    launch: _Launch

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, *, ctas: int = 8) -> None:
        """The gather for these int64 indices on the kernel's device, on the current stream."""
        _check_indices(src_idx, dst_idx, self.device)
        _check_ctas(ctas)
        n_rows = src_idx.numel()
        if n_rows == 0 or self.src.shape[1] == 0:
            return
        src, dst = self.src, self.dst
        args = (src, dst, src_idx, dst_idx, n_rows, src.stride(0), dst.stride(0))
        tiles = -(-n_rows // self.launch.rows)
        self.launch.run(_gather_rows_kernel, args, tiles, ctas, self.align, self.device)


def row_gather(
    src_words: torch.Tensor,
    dst_words: torch.Tensor,
    *,
    rows_per_iter: int | None = None,
    num_warps: int | None = None,
    block_words: int | None = None,
) -> RowGather:
    """The :class:`RowGather` between ``src_words`` and ``dst_words`` (checked as
    :func:`gather_rows_uva` checks them, host pinning included)."""
    if triton is None:
        raise RuntimeError("gather_rows_uva needs Triton, which is not installed")
    check_word_views(src_words, dst_words)
    _check_rows(src_words, "src_words")
    _check_rows(dst_words, "dst_words")
    device = _kernel_device(src_words, dst_words)
    _check_tile(rows_per_iter, num_warps, block_words)
    word = _widest_word(src_words, dst_words)
    src_view = src_words.view(word)
    dst_view = dst_words.view(word)
    align = math.gcd(src_view.stride(0), dst_view.stride(0), _VECTOR_BYTES // word.itemsize)
    launch = _Launch(src_view.shape[1], word.itemsize, rows_per_iter, num_warps, block_words)
    return RowGather(src_view, dst_view, align, device, launch)


@dataclass(frozen=True, eq=False)
class LayerTable:
    """Pairs of row views that one layered gather launch copies, checked once.

    The kernel addresses pair ``i`` as the first pair's buffers plus ``offsets[i]`` words
    (sources) and ``offsets[layers + i]`` words (destinations).
    """

    src_words: tuple[torch.Tensor, ...]
    """The sources as views of the kernel's word type (they keep the buffers alive)."""
    dst_words: tuple[torch.Tensor, ...]
    offsets: torch.Tensor
    """CPU int64 ``[2 * layers]``: to upload before each launch's first use."""
    align: int
    """Words that every offset and both pitches are a multiple of (at most 16 bytes)."""
    device: torch.device
    launch: _Launch
    """The tile and warps for the pairs' rows, fixed with the table."""
    src_address: int = 0
    """Where the kernel reaches the first source's first row (``address`` of it)."""
    dst_address: int = 0

    @property
    def layers(self) -> int:
        return len(self.src_words)


def layer_table(
    src_words: Sequence[torch.Tensor],
    dst_words: Sequence[torch.Tensor],
    address: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr,
) -> LayerTable:
    """The table of :func:`gather_layers_uva` for these pairs of ``[rows, words]`` views.

    Every pair is checked as :func:`gather_rows_uva` checks one (so each host buffer's
    pinning once, here); all sources must share one row pitch, all destinations another.
    ``address(view)`` is where the kernel reaches a view's first row: the launch passes
    the first pair's buffers, which Triton translates as the GPU sees them, and the others
    are offsets from them, so on CUDA every address must be the GPU's.
    """
    if triton is None:
        raise RuntimeError("layer_table needs Triton, which is not installed")
    if not src_words or len(src_words) != len(dst_words):
        raise ValueError(
            f"need as many sources as destinations, at least one: {len(src_words)}, "
            f"{len(dst_words)}"
        )
    devices = set()
    for src, dst in zip(src_words, dst_words, strict=True):
        check_word_views(src, dst)
        _check_rows(src, "src_words")
        _check_rows(dst, "dst_words")
        devices.add(_kernel_device(src, dst))
    if len(devices) > 1:
        raise ValueError(f"the pairs run on different devices: {sorted(map(str, devices))}")
    if len({t.dtype for t in src_words}) > 1 or len({t.shape[1] for t in src_words}) > 1:
        raise ValueError("the pairs' rows differ in word type or width")
    for side, name in ((src_words, "sources"), (dst_words, "destinations")):
        if len({t.stride(0) for t in side}) > 1:
            raise ValueError(f"the {name} differ in row pitch")
    word = min(
        (_widest_word(s, d) for s, d in zip(src_words, dst_words, strict=True)),
        key=lambda dtype: dtype.itemsize,
    )
    srcs = tuple(t.view(word) for t in src_words)
    dsts = tuple(t.view(word) for t in dst_words)
    src_base, dst_base = address(srcs[0]), address(dsts[0])
    offsets = [(address(t) - src_base) // word.itemsize for t in srcs]
    offsets += [(address(t) - dst_base) // word.itemsize for t in dsts]
    align = math.gcd(srcs[0].stride(0), dsts[0].stride(0), _VECTOR_BYTES // word.itemsize, *offsets)
    return LayerTable(
        src_words=srcs,
        dst_words=dsts,
        offsets=torch.tensor(offsets, dtype=torch.int64),
        align=align,
        device=devices.pop(),
        launch=_Launch(srcs[0].shape[1], word.itemsize, None, None, None),
        src_address=src_base,
        dst_address=dst_base,
    )


def gather_layers_uva(
    table: LayerTable,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    offsets: torch.Tensor,
    *,
    ctas: int = 8,
) -> None:
    """:func:`gather_rows_uva` for every pair of ``table`` at once, in one launch.

    ``offsets`` is ``table.offsets`` on the kernel's device (uploaded with the indices).
    """
    if triton is None:
        raise RuntimeError("gather_layers_uva needs Triton, which is not installed")
    device = table.device
    _check_indices(src_idx, dst_idx, device)
    _check_index(offsets, "offsets", device)
    if offsets.numel() != table.offsets.numel():
        raise ValueError(f"{offsets.numel()} offsets for {table.layers} pairs")
    _check_ctas(ctas)
    src, dst = table.src_words[0], table.dst_words[0]
    n_rows = src_idx.numel()
    if n_rows == 0 or src.shape[1] == 0:
        return
    launch = table.launch
    args = (src, dst, offsets, src_idx, dst_idx, n_rows, table.layers, src.stride(0), dst.stride(0))
    tiles = -(-n_rows // launch.rows) * table.layers
    launch.run(_gather_layers_kernel, args, tiles, ctas, table.align, device)


def _check_indices(src_idx: torch.Tensor, dst_idx: torch.Tensor, device: torch.device) -> None:
    _check_index(src_idx, "src_idx", device)
    _check_index(dst_idx, "dst_idx", device)
    if src_idx.numel() != dst_idx.numel():
        raise ValueError(f"index lengths differ: {src_idx.numel()} vs {dst_idx.numel()}")


def _check_ctas(ctas: int) -> None:
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")


def _check_tile(rows_per_iter: int | None, num_warps: int | None, block_words: int | None) -> None:
    for name, value in (
        ("rows_per_iter", rows_per_iter),
        ("num_warps", num_warps),
        ("block_words", block_words),
    ):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two, got {value}")


class _Launch:
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


# Private but long-standing (Triton and inductor read streams through it); absent in CPU
# builds, where no compiled kernel is launched.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device_index = getattr(torch._C, "_cuda_getDevice", None)
_I32_LIMIT = 1 << 31


def launch_hooked() -> bool:
    """Whether a launch hook (a profiler's) wants to see Triton launches. Triton 3.6 keeps
    the hooks in a chain that is never None; older releases hold one callable or None."""
    hook = triton.knobs.runtime.launch_enter_hook if triton is not None else None
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


class LayeredLaunch:
    """:func:`gather_layers_uva` over one table, its offsets kept on the device.

    The first launch goes through Triton's JIT, which compiles (or finds) the kernel; every
    later one calls that kernel's launcher directly, with the table's addresses as plain
    integers. Triton's front end (binding, specialisation, cache key) costs more host time
    than the launch itself, on every layer of every request; the kernel it would find is
    always this one, because everything it specialises on (the buffers, their pitches, the
    offsets' address, the tile) is fixed here and the per-call arguments (the rows and the
    indices' addresses) are left out of its specialisation. A launch hook (a profiler's),
    another current device, or a row count past 32 bits take the JIT path again.
    """

    def __init__(self, table: LayerTable, offsets: torch.Tensor, ctas: int) -> None:
        _check_index(offsets, "offsets", table.device)
        if offsets.numel() != table.offsets.numel():
            raise ValueError(f"{offsets.numel()} offsets for {table.layers} pairs")
        _check_ctas(ctas)
        self.table = table
        self.offsets = offsets
        self.ctas = ctas
        self.device = table.device
        self._compiled: Any = None
        src, dst = table.src_words[0], table.dst_words[0]
        self._fixed_head = (table.src_address, table.dst_address, offsets.data_ptr())
        self._fixed_tail = (
            table.layers,
            src.stride(0),
            dst.stride(0),
            *table.launch.constants(table.align),
        )
        self._empty = src.shape[1] == 0

    @property
    def direct(self) -> bool:
        """Whether the next launch skips Triton's JIT front end."""
        return self._compiled is not None

    def __call__(self, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """Copy rows ``src_idx`` of every source to rows ``dst_idx`` of its destination, on
        the current stream; int64 indices on the kernel's device, checked by the caller."""
        n_rows = src_idx.numel()
        if n_rows == 0 or self._empty:
            return
        table = self.table
        launch = table.launch
        tiles = -(-n_rows // launch.rows) * table.layers
        compiled = self._compiled
        device_index = self.device.index
        if (
            compiled is None
            or n_rows >= _I32_LIMIT
            or _current_raw_stream is None
            or _current_device_index is None
            or _current_device_index() != device_index
            or launch_hooked()
        ):
            self._jit(src_idx, dst_idx, n_rows, tiles)
            return
        compiled.run(
            min(self.ctas, tiles),
            1,
            1,
            _current_raw_stream(device_index),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *self._fixed_head,
            src_idx.data_ptr(),
            dst_idx.data_ptr(),
            n_rows,
            *self._fixed_tail,
        )

    def _jit(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, n_rows: int, tiles: int) -> None:
        _check_indices(src_idx, dst_idx, self.device)
        table = self.table
        src, dst = table.src_words[0], table.dst_words[0]
        args = (
            src,
            dst,
            self.offsets,
            src_idx,
            dst_idx,
            n_rows,
            table.layers,
            src.stride(0),
            dst.stride(0),
        )
        compiled = table.launch.run(
            _gather_layers_kernel, args, tiles, self.ctas, table.align, self.device
        )
        if self.device.type == "cuda" and n_rows < _I32_LIMIT and hasattr(compiled, "run"):
            self._compiled = compiled
