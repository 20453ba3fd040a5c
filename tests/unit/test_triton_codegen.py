"""The gather kernels compiled ahead of time for an H100/H200 (sm_90), without a GPU.

Triton's NVIDIA backend ships ptxas, so the kernels compile here to PTX. The checks are on
what decides PCIe throughput: every row is read and written in 16-byte vectors, and the
layered kernel (one launch for many buffer pairs) keeps the vector width of the one-pair
kernel, so the alignment hints on its per-pair offsets are in effect.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (optional dependency)"
)

H200 = ("cuda", 90, 32)
_POINTERS = ("src_ptr", "dst_ptr", "src_idx_ptr", "dst_idx_ptr")
_COMMON = {"n_rows": "i32", "src_pitch": "i32", "dst_pitch": "i32"}
_CONSTEXPRS = ("WORDS", "ROWS", "BLOCK_W", "ALIGN")


def _ptx(kernel_name: str, words: int, layered: bool) -> str:
    pointers = (*_POINTERS[:2], "table_ptr", *_POINTERS[2:]) if layered else _POINTERS
    signature = {name: "*i64" for name in pointers} | _COMMON
    if layered:
        signature["n_layers"] = "i32"
    signature |= {name: "constexpr" for name in _CONSTEXPRS}
    # The buffers are 16-byte aligned, as Triton specialises them at launch.
    return _compiled_ptx(kernel_name, signature, pointers, {}, words)


def _compiled_ptx(
    kernel_name: str,
    signature: dict[str, str],
    aligned: tuple[str, ...],
    more_constants: dict[str, int],
    words: int,
) -> str:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcore.kernels import triton_kernels, triton_tile

    rows, block_w = triton_tile.default_tile(words, 8)
    constants = {"WORDS": words, "ROWS": rows, "BLOCK_W": block_w, "ALIGN": 2, **more_constants}
    names = list(signature)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    source = ASTSource(
        fn=getattr(triton_kernels, kernel_name),
        signature=signature,
        constexprs=constants,
        attrs=attrs,
    )
    try:
        compiled = triton.compile(source, target=GPUTarget(*H200), options={"num_warps": 8})
    except RuntimeError as error:  # no ptxas in this Triton build
        pytest.skip(f"cannot compile for sm_90 here: {error}")
    return compiled.asm["ptx"]


@pytest.mark.parametrize("words", [144, 512], ids=["1152B_rows", "4KiB_rows"])
def test_layered_kernel_moves_rows_in_16_byte_vectors_like_the_one_pair_kernel(words):
    one_pair = _ptx("gather_rows_kernel", words, layered=False)
    layered = _ptx("gather_layers_kernel", words, layered=True)
    for ptx in (one_pair, layered):
        assert ptx.count("ld.global.v2.b64") > 0
        assert ptx.count("st.global.v2.b64") > 0
    assert layered.count("ld.global.v2.b64") == one_pair.count("ld.global.v2.b64")
    assert layered.count("st.global.v2.b64") == one_pair.count("st.global.v2.b64")


@pytest.mark.parametrize("words", [144, 512], ids=["1152B_rows", "4KiB_rows"])
def test_the_rings_scatter_moves_rows_in_16_byte_vectors(words):
    """The layer ring's scatter reads its slot in order and writes rows by index: with the
    four buffers on 16 bytes (the launcher refuses any other) both sides are vectors."""
    aligned = ("src_ptr", "second_src_ptr", "dst_ptr", "second_dst_ptr")
    signature = {name: "*i64" for name in (*aligned, "dst_idx_ptr")}
    signature |= {"n_rows": "i32", "dst_pitch": "i32", "PAIRS": "constexpr"}
    signature |= {name: "constexpr" for name in _CONSTEXPRS}
    ptx = _compiled_ptx("scatter_slot_kernel", signature, aligned, {"PAIRS": 2}, words)
    assert ptx.count("ld.global.v2.b64") > 0
    assert ptx.count("st.global.v2.b64") > 0
    # The source rows are in order: the only index read is the destination's.
    one_pair = _ptx("gather_rows_kernel", words, layered=False)
    assert ptx.count("ld.global.v2.b64") == 2 * one_pair.count("ld.global.v2.b64")
