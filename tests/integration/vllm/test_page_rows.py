"""kvcore_vllm.page_rows: a GPU KV tensor and its CPU offload tensor as dense rows, checked
byte for byte against the tensors' own pages (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore_vllm.page_rows import PageRows, page_rows


def strided(memory: torch.Tensor, rows: int, row: int, stride: int) -> torch.Tensor:
    """``[rows, row]`` of ``memory``, 3 elements in, rows ``stride`` elements apart: one layer
    of every chunk of vLLM's shared host region is laid out so."""
    return memory[3:].as_strided((rows, row), (stride, 1))


def random_memory(elements: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 127, (elements,), dtype=torch.int8, generator=generator)


pairs = st.tuples(
    st.sampled_from([8, 16, 24]),  # page elements
    st.integers(1, 3),  # blocks per chunk
    st.integers(1, 6),  # GPU blocks
    st.integers(1, 6),  # CPU chunks
    st.sampled_from([0, 4, 8, 40]),  # GPU row padding
    st.sampled_from([0, 4, 8, 24]),  # CPU row padding
    st.integers(0, 2**16),  # seed
)


class Pair:
    """A strided GPU and CPU tensor pair on random memory, and their row views."""

    def __init__(self, page, per_chunk, blocks, chunks, gpu_pad, cpu_pad, seed) -> None:
        self.page, self.per_chunk = page, per_chunk
        self.gpu_shape = (blocks, page, page + gpu_pad)
        self.cpu_shape = (chunks, page * per_chunk, page * per_chunk + cpu_pad)
        self.gpu_memory = random_memory(blocks * (page + gpu_pad) + 3, seed)
        self.cpu_memory = random_memory(chunks * (page * per_chunk + cpu_pad) + 3, seed + 1)
        self.gpu, self.cpu = strided(self.gpu_memory, *self.gpu_shape), self.cpu_of(self.cpu_memory)
        rows = page_rows(self.gpu, self.cpu, per_chunk)
        assert isinstance(rows, PageRows)
        self.rows = rows

    def cpu_of(self, memory: torch.Tensor) -> torch.Tensor:
        return strided(memory, *self.cpu_shape)

    def cpu_page(self, cpu: torch.Tensor, sub_block: int) -> torch.Tensor:
        chunk, within = divmod(sub_block, self.per_chunk)
        return cpu[chunk, within * self.page : (within + 1) * self.page]


def int64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(pairs, st.data())
def test_page_rows_hold_each_pages_own_bytes(case, data):
    pair = Pair(*case)
    blocks = int64(data.draw(st.lists(st.integers(0, pair.gpu.shape[0] - 1), max_size=8)))
    sub_blocks = pair.cpu.shape[0] * pair.per_chunk
    subs = data.draw(st.lists(st.integers(0, sub_blocks - 1), max_size=8))
    gpu_rows = torch.from_numpy(pair.rows.gpu_pages.rows_of_array(blocks))
    cpu_rows = torch.from_numpy(pair.rows.cpu_pages.rows_of_array(int64(subs)))
    assert torch.equal(
        pair.rows.gpu[gpu_rows].flatten(), pair.gpu[torch.from_numpy(blocks)].flatten()
    )
    expected = [pair.cpu_page(pair.cpu, s) for s in subs]
    assert torch.equal(
        pair.rows.cpu[cpu_rows].flatten(), torch.cat([torch.zeros(0, dtype=torch.int8), *expected])
    )


@settings(max_examples=40, deadline=None)
@given(pairs, st.data())
def test_writes_through_page_rows_touch_only_the_pages_named(case, data):
    pair = Pair(*case)
    sub_blocks = pair.cpu.shape[0] * pair.per_chunk
    named = sorted(data.draw(st.sets(st.integers(0, sub_blocks - 1))))
    expected = pair.cpu_memory.clone()
    for sub_block in named:
        pair.cpu_page(pair.cpu_of(expected), sub_block).fill_(0x55)
    pair.rows.cpu[torch.from_numpy(pair.rows.cpu_pages.rows_of_array(int64(named)))] = 0x55
    assert torch.equal(pair.cpu_memory, expected)  # padding and other pages kept


def test_geometry_is_the_row_and_the_strides_of_a_page():
    gpu = torch.zeros(4, 256, dtype=torch.int8)
    cpu = torch.zeros(4 * 320, dtype=torch.int8).as_strided((4, 256), (320, 1))
    rows = page_rows(gpu, cpu, 1)
    assert isinstance(rows, PageRows)
    # Rows of gcd(256, 256, 320) = 64 elements: 4 a page, a GPU block every 4, a chunk every 5.
    assert rows.geometry == (64, 4, 4, 5)
    assert rows.gpu.shape == (16, 64) and rows.cpu.shape == (3 * 5 + 4, 64)


def test_page_rows_refuses_what_it_cannot_express():
    gpu = torch.zeros(4, 256, dtype=torch.int8)
    assert page_rows(gpu, torch.zeros(4, 256, dtype=torch.uint8), 1) == "dtype_mismatch"
    assert page_rows(gpu, torch.zeros(4, 256, 1, dtype=torch.int8), 1) == "row_shape_mismatch"
    assert page_rows(gpu, torch.zeros(4, 512, dtype=torch.int8), 1) == "row_shape_mismatch"
    assert page_rows(gpu, torch.zeros(0, 256, dtype=torch.int8), 1) == "empty_tensor"
    columns = torch.zeros(256, 8, dtype=torch.int8).t()
    assert page_rows(torch.zeros(8, 256, dtype=torch.int8), columns, 1) == "strided_rows"
    overlapping = torch.zeros(4 * 128 + 128, dtype=torch.int8).as_strided((4, 256), (128, 1))
    assert page_rows(gpu, overlapping, 1) == "overlapping_rows"
    odd_rows = torch.zeros(4 * 257, dtype=torch.int8).as_strided((4, 256), (257, 1))
    assert page_rows(gpu, odd_rows, 1) == "unaligned_rows"
