"""Reference kernels: byte views, and every op against a per-index python loop."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvcore import kernels
from kvcore.kernels import (
    REFERENCE,
    KernelSet,
    kernels_for,
    register_kernels,
    unregister_kernels,
)
from kvcore.kernels.reference import (
    buffer_rows,
    copy_runs,
    gather_range,
    gather_rows,
    index_copy_rows,
    prepare_gather,
    prepare_rows,
    stage_in,
    stage_out,
    staging_words,
)
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.row_words import as_row_words, row_bytes, row_word_bytes
from kvcore.runs import find_paired_runs, find_runs

POISON = 0xA5


def random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def random_words(rows: int, words: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    return random_bytes(rows * words * width, gen).view(dtype).view(rows, words)


def poisoned(rows: int, words: int, dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    return torch.full((rows * words * width,), POISON, dtype=torch.uint8).view(dtype).view(rows, -1)


def loop_copy(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor):
    out = dst.clone()
    for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
        out[d] = src[s]
    return out


def scattered(n: int, pool: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(pool, generator=gen)[:n]


def untouched(rows: int, idx: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(rows, dtype=torch.bool)
    keep[idx] = False
    return keep


@pytest.mark.parametrize(
    ("shape", "dtype", "width"),
    [
        ((4, 2, 8, 128), torch.bfloat16, 8),
        ((4, 1, 576), torch.bfloat16, 8),
        ((4, 64 * 132), torch.uint8, 8),
        ((4, 10), torch.uint8, 2),
        ((4, 12), torch.uint8, 4),
        ((4, 3), torch.uint8, 1),
        ((4, 3), torch.float16, 2),
        ((4, 6), torch.int8, 2),
        ((4,), torch.int32, 4),
        ((4, 5), torch.float64, 8),
    ],
)
def test_widest_word_divides_row_bytes(shape, dtype, width):
    t = torch.zeros(shape, dtype=dtype)
    assert row_word_bytes(t) == width
    words = as_row_words(t)
    assert words is not None
    assert words.element_size() == width
    assert tuple(words.shape) == (shape[0], row_bytes(t) // width)


@pytest.mark.parametrize(("offset", "width"), [(1, 1), (2, 2), (4, 4), (8, 8), (6, 2)])
def test_word_narrows_to_alignment(offset, width):
    base = torch.zeros(8 * 4 + 16, dtype=torch.uint8)
    t = base[offset : offset + 32].view(4, 8)
    assert row_word_bytes(t) == width
    words = as_row_words(t)
    assert words is not None and words.element_size() == width


@pytest.mark.parametrize(("offset", "width"), [(3, 1), (2, 2), (4, 4)])
def test_word_narrows_to_a_misaligned_storage_base(offset, width):
    # The storage offset is 0 here: only the data pointer shows the misalignment.
    memory = bytearray(96)
    t = torch.frombuffer(memoryview(memory)[offset : offset + 64], dtype=torch.uint8)
    assert t.storage_offset() == 0 and t.data_ptr() % 8 == offset % 8
    assert row_word_bytes(t.view(4, 16)) == width


def test_no_byte_view_for_non_dense_rows():
    t = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    assert row_word_bytes(torch.zeros((), dtype=torch.float32)) is None
    assert as_row_words(t[:, :, :3]) is None
    assert as_row_words(t[::2]) is None
    assert as_row_words(t.transpose(1, 2)) is None
    assert as_row_words(t[:1].expand(6, 4, 8)) is None
    assert as_row_words(torch.zeros(3, 2, dtype=torch.complex64).conj()) is None
    assert as_row_words(t[1:4]) is not None


def test_row_words_share_memory_and_bytes():
    gen = torch.Generator().manual_seed(1)
    t = random_bytes(5 * 1152, gen).view(torch.bfloat16).view(5, 1, 576)
    words = as_row_words(t)
    assert words is not None
    assert words.data_ptr() == t.data_ptr()
    assert torch.equal(words.view(torch.uint8), t.view(torch.uint8).view(5, 1152))
    fresh = random_words(1, words.shape[1], words.dtype, gen)
    words[3] = fresh[0]
    assert torch.equal(t[3].reshape(-1).view(torch.uint8), fresh[0].view(torch.uint8))


def test_explicit_word_size():
    t = torch.zeros(4, 16, dtype=torch.uint8)
    narrowed = as_row_words(t, 2)
    assert narrowed is not None and narrowed.dtype == torch.int16 and narrowed.shape == (4, 8)
    with pytest.raises(ValueError):
        as_row_words(t, 16)
    with pytest.raises(ValueError):
        as_row_words(torch.zeros(34, dtype=torch.uint8)[2:].view(4, 8), 8)


def test_staging_words_views_the_buffer_front():
    buffer = torch.zeros(100, dtype=torch.uint8)
    like = torch.zeros(3, 6, dtype=torch.int16)
    view = staging_words(buffer, 8, like)
    assert view.shape == (8, 6) and view.dtype == torch.int16
    assert view.data_ptr() == buffer.data_ptr()
    with pytest.raises(ValueError):
        staging_words(buffer, 9, like)


def test_buffer_rows_are_staging_words_kept_on_the_buffer_without_holding_it():
    gen = torch.Generator().manual_seed(5)
    buffer = random_bytes(100, gen)
    like = torch.zeros(3, 6, dtype=torch.int16)
    first = buffer_rows(buffer, 8, like)
    assert torch.equal(first, staging_words(buffer, 8, like))
    assert first.data_ptr() == buffer.data_ptr() and first.shape == (8, 6)
    # Another request's rows come from the same kept rows; writes land in the buffer.
    again = buffer_rows(buffer, 5, like)
    assert again._base is first._base and again._base is not None
    again.fill_(7)
    assert torch.equal(buffer[:60], torch.full((30,), 7, dtype=torch.int16).view(torch.uint8))
    with pytest.raises(ValueError, match="do not fit"):
        buffer_rows(buffer, 9, like)
    # The kept rows do not keep the buffer's tensor: it goes once dropped, with no collector.
    gone = weakref.ref(buffer)
    del buffer, first, again
    assert gone() is None


def test_buffer_rows_of_a_buffer_that_starts_inside_its_storage_start_there_too():
    base = torch.arange(102, dtype=torch.int64).to(torch.uint8)
    inner = base[2:]
    rows = buffer_rows(inner, 8, torch.zeros(1, 6, dtype=torch.int16))
    assert rows.data_ptr() == inner.data_ptr()
    assert torch.equal(rows.reshape(-1).view(torch.uint8), base[2:98])
    # A buffer strided over its storage gets plain views, and nothing kept on it.
    strided = base[::2]
    assert torch.equal(
        buffer_rows(strided, 2, torch.zeros(1, 6, dtype=torch.uint8)), strided[:12].view(2, 6)
    )
    assert "_kvcore_rows_by_word" not in vars(strided)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8])
def test_copy_runs_matches_loop(dtype):
    gen = torch.Generator().manual_seed(2)
    src = random_words(40, 7, dtype, gen)
    dst = poisoned(30, 7, dtype)
    src_idx = torch.cat([torch.arange(3, 9), torch.tensor([20]), torch.arange(30, 40)])
    dst_idx = torch.cat(
        [torch.arange(0, 4), torch.arange(10, 14), torch.tensor([29]), scattered(8, 9, gen) + 15]
    )
    expected = loop_copy(src, dst, src_idx, dst_idx)
    before = src.clone()
    copy_runs(src, dst, find_paired_runs(src_idx, dst_idx))
    assert torch.equal(dst, expected)
    assert torch.equal(src, before)
    assert bool((dst[untouched(30, dst_idx)].view(torch.uint8) == POISON).all())


def test_gather_rows_matches_loop_with_repeated_sources():
    gen = torch.Generator().manual_seed(3)
    src = random_words(20, 5, torch.int32, gen)
    dst = poisoned(25, 5, torch.int32)
    src_idx = torch.randint(0, 20, (18,), generator=gen)
    dst_idx = scattered(18, 25, gen)
    expected = loop_copy(src, dst, src_idx, dst_idx)
    gather_rows(src, src_idx, dst, dst_idx)
    assert torch.equal(dst, expected)


def test_stage_in_matches_loop():
    gen = torch.Generator().manual_seed(4)
    src = random_words(30, 9, torch.int16, gen)
    dst = poisoned(24, 9, torch.int16)
    src_idx = torch.cat([torch.arange(2, 10), torch.arange(20, 26), torch.tensor([0, 29])])
    dst_idx = scattered(16, 24, gen)
    staging = random_words(16, 9, torch.int16, gen)
    expected = loop_copy(src, dst, src_idx, dst_idx)
    stage_in(src, find_runs(src_idx), staging, dst, dst_idx)
    assert torch.equal(dst, expected)
    assert torch.equal(staging, src[src_idx])


def test_stage_out_matches_loop():
    gen = torch.Generator().manual_seed(5)
    src = random_words(24, 3, torch.uint8, gen)
    dst = poisoned(30, 3, torch.uint8)
    src_idx = torch.randint(0, 24, (16,), generator=gen)
    dst_idx = torch.cat([torch.arange(12, 20), torch.arange(0, 6), torch.tensor([29, 27])])
    staging = random_words(16, 3, torch.uint8, gen)
    expected = loop_copy(src, dst, src_idx, dst_idx)
    stage_out(src, src_idx, staging, dst, find_runs(dst_idx))
    assert torch.equal(dst, expected)


def test_index_copy_rows_moves_values_unchanged_or_refuses():
    gen = torch.Generator().manual_seed(6)
    src = random_words(12, 4, torch.int16, gen).view(torch.bfloat16)
    dst = poisoned(10, 4, torch.int16).view(torch.bfloat16)
    src_idx = torch.tensor([3, 3, 0, 11])
    dst_idx = torch.tensor([9, 1, 4, 0])
    expected = loop_copy(src.view(torch.int16), dst.view(torch.int16), src_idx, dst_idx)
    index_copy_rows(src, dst, src_idx, dst_idx)
    assert torch.equal(dst.view(torch.int16), expected)
    with pytest.raises(TypeError, match="conversion"):
        index_copy_rows(src, dst.view(torch.float16), src_idx, dst_idx)
    with pytest.raises(ValueError, match="broadcast"):
        index_copy_rows(src[:, :1], dst, src_idx, dst_idx)
    assert torch.equal(dst.view(torch.int16), expected)


def test_reference_serves_unregistered_devices(swap_kernels):
    swap_kernels("cpu", None)
    swap_kernels("meta", None)
    assert kernels_for(torch.device("cpu")) is REFERENCE
    assert kernels_for(torch.device("meta")) is REFERENCE
    custom = KernelSet("custom", copy_runs, prepare_gather, stage_in, stage_out)
    register_kernels("meta", custom)
    assert kernels_for(torch.device("meta")) is custom
    assert kernels_for(torch.device("cpu")) is REFERENCE


def test_unregister_kernels_hands_back_the_entry_and_the_reference_set_serves_again(
    swap_kernels,
):
    swap_kernels("meta", None)
    meta = torch.device("meta")
    assert unregister_kernels("meta") is None
    custom = KernelSet("custom", copy_runs, prepare_gather, stage_in, stage_out)
    register_kernels("meta", custom)
    assert unregister_kernels("meta") is custom
    assert kernels_for(meta) is REFERENCE
    assert unregister_kernels("meta") is None
    # A factory comes back as it was registered, to be registered again later.
    register_kernels("meta", lambda policy: custom)
    factory = unregister_kernels("meta")
    assert callable(factory) and not isinstance(factory, KernelSet)
    assert kernels_for(meta) is REFERENCE
    register_kernels("meta", factory)
    assert kernels_for(meta) is custom


def test_one_registry_serves_sets_and_factories_and_movers_keep_what_they_built(swap_kernels):
    swap_kernels("meta", None)
    # CUDA's set is a factory in the same registry, built only when asked for (Triton).
    assert not isinstance(kernels.registered("cuda"), KernelSet)
    built: list[PathPolicy] = []

    def factory(policy: PathPolicy) -> KernelSet:
        built.append(policy)
        return KernelSet(f"built-{len(built)}", copy_runs, prepare_gather, stage_in, stage_out)

    register_kernels("meta", factory)
    meta = torch.device("meta")
    mover = Mover(PathPolicy(gather_ctas=3, staged_pieces=2))
    first = mover.kernels(meta)
    assert mover.kernels(meta) is first and built == [PathPolicy(gather_ctas=3, staged_pieces=2)]
    assert Mover().kernels(meta) is not first  # another mover, its own tuning
    assert built[-1] == PathPolicy()
    assert kernels_for(meta).name == "built-3"
    fixed = KernelSet("fixed", copy_runs, prepare_gather, stage_in, stage_out)
    register_kernels("meta", fixed)  # a replaced entry replaces what movers built
    assert mover.kernels(meta) is fixed
    register_kernels("meta", factory)  # the same factory back: the same set, not rebuilt
    assert mover.kernels(meta) is first and len(built) == 3


class _LateRows(torch.Tensor):
    """Rows whose move to another device, when asked not to block, hands back poison: what
    a host reader sees of a device-to-host copy still in flight."""

    def to(self, *args, **kwargs):
        moved = torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)
        return torch.full_like(moved, POISON) if kwargs.get("non_blocking") else moved


def test_gather_into_host_rows_waits_for_the_rows(monkeypatch):
    """The host-side scatter reads the gathered rows at once: the copy that brings them
    must have finished (a non-blocking one to the host returns before it has)."""
    gen = torch.Generator().manual_seed(31)
    src = random_words(16, 4, torch.int32, gen)
    dst = random_words(16, 4, torch.int32, gen)
    expected = dst.clone()
    src_idx, dst_idx = torch.tensor([3, 9, 0]), torch.tensor([5, 1, 12])
    expected[dst_idx] = src[src_idx]
    monkeypatch.setattr(torch.Tensor, "index_select", _late_index_select)
    gather_rows(src, src_idx, dst, dst_idx)
    assert torch.equal(dst, expected)


def _late_index_select(self, dim, index, **kwargs):
    rows = torch.index_select(self.as_subclass(torch.Tensor), dim, index, **kwargs)
    return rows.as_subclass(_LateRows)


def test_a_ranged_gather_copies_its_entries_only():
    """``gather_range``: the rows of entries ``begin`` to ``end`` of the prepared indices, in
    every pair; the other destination rows untouched; a range outside them refused."""
    gen = torch.Generator().manual_seed(5)
    srcs = [torch.randint(-(2**62), 2**62, (12, 4), generator=gen) for _ in range(3)]
    dsts = [torch.full((12, 4), -7, dtype=torch.int64) for _ in range(3)]
    src_idx, dst_idx = torch.randperm(12, generator=gen), torch.randperm(12, generator=gen)
    rows = prepare_rows(src_idx, dst_idx, torch.device("cpu"))
    gather_range(layer_pairs(srcs, dsts), rows, 3, 8)
    for src, dst in zip(srcs, dsts, strict=True):
        assert torch.equal(dst[dst_idx[3:8]], src[src_idx[3:8]])
        untouched = torch.cat([dst_idx[:3], dst_idx[8:]])
        assert bool((dst[untouched] == -7).all())
    with pytest.raises(ValueError, match="outside 12 prepared rows"):
        gather_range(layer_pairs(srcs, dsts), rows, 8, 13)
