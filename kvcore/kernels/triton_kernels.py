"""The Triton kernels of the UVA row gather: device code only, no launch logic.

``_copy_tile`` copies one tile of rows; ``gather_rows_kernel`` runs it over one pair of
buffers, ``gather_layers_kernel`` over many pairs at once, each pair an offset from the
first, and ``scatter_slot_kernel`` from a staging slot's rows in order to one or two pairs'
rows (the layer ring's scatter). Apart from the host code that picks their tiles and
launches them (:mod:`~kvcore.kernels.triton_rows`, :mod:`~kvcore.kernels.triton_layers`,
:mod:`~kvcore.kernels.triton_scatter`) so that the launchers share one tile loop and the
codegen checks compile every kernel from one module.
Triton is optional: without it ``triton`` and ``tl`` are None and no kernel is defined, so
import this module freely and ask ``triton_available()`` first.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None


def triton_available() -> bool:
    """True when Triton is importable (the gather kernel's only optional dependency)."""
    return triton is not None


# Arguments that change from call to call, left out of Triton's specialisation, so that a
# kernel compiled once serves every later call between the same buffers
# (:class:`~kvcore.kernels.triton_layers.LayeredLaunch` launches it without Triton's
# front end).
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
        SRC_IN_ORDER: tl.constexpr,
    ):
        row_lane = tl.arange(0, ROWS)
        col_lane = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
        k = tile * ROWS + row_lane
        row_ok = k < n_rows
        # A staging slot's rows are in order: no source index to read.
        src_row = k.to(tl.int64) if SRC_IN_ORDER else tl.load(src_idx_ptr + k, mask=row_ok, other=0)
        dst_row = tl.load(dst_idx_ptr + k, mask=row_ok, other=0)
        src_off = tl.multiple_of(src_row * src_pitch, ALIGN)
        dst_off = tl.multiple_of(dst_row * dst_pitch, ALIGN)
        for col in tl.range(0, WORDS, BLOCK_W):
            cols = col + col_lane
            mask = row_ok[:, None] & (cols < WORDS)[None, :]
            values = tl.load(src_ptr + src_off[:, None] + cols[None, :], mask=mask)
            tl.store(dst_ptr + dst_off[:, None] + cols[None, :], values, mask=mask)

    @triton.jit(**_PER_CALL_ARGS)
    def gather_rows_kernel(
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
                False,
            )
            tile += n_programs

    @triton.jit(**_PER_CALL_ARGS)
    def gather_layers_kernel(
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
                False,
            )
            work += n_programs

    @triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["dst_idx_ptr"])
    def scatter_slot_kernel(
        src_ptr,
        second_src_ptr,
        dst_ptr,
        second_dst_ptr,
        dst_idx_ptr,
        n_rows,
        dst_pitch,
        PAIRS: tl.constexpr,
        WORDS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        # One staging slot's rows, in order, of one or two pairs (K and V) to rows
        # dst_idx of each pair's destination: the layer ring's scatter, one launch a layer.
        n_programs = tl.num_programs(0)
        n_tiles = tl.cdiv(n_rows, ROWS)
        work = tl.program_id(0)
        while work < n_tiles * PAIRS:
            if work < n_tiles:
                _copy_tile(
                    src_ptr,
                    dst_ptr,
                    dst_idx_ptr,
                    dst_idx_ptr,
                    work,
                    n_rows,
                    WORDS,
                    dst_pitch,
                    WORDS,
                    ROWS,
                    BLOCK_W,
                    ALIGN,
                    True,
                )
            else:
                _copy_tile(
                    second_src_ptr,
                    second_dst_ptr,
                    dst_idx_ptr,
                    dst_idx_ptr,
                    work - n_tiles,
                    n_rows,
                    WORDS,
                    dst_pitch,
                    WORDS,
                    ROWS,
                    BLOCK_W,
                    ALIGN,
                    True,
                )
            work += n_programs
