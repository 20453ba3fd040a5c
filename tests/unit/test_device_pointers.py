"""Reading a vLLM 0.34 job's GPU blocks back from its device pointers, on host tensors.

The pointers are laid out as 0.34's connector lays them out: group by group, within a
group one row of addresses per layer reference, one address per block.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcore_vllm.device_pointers import PointerReader, gpu_rows


def pointers(tensors, refs_per_group, ids_per_group, block_indices=None):
    """A DevicePointers look-alike for these blocks of each group."""
    ptrs = []
    for refs, ids in zip(refs_per_group, ids_per_group, strict=True):
        for t in refs:
            tensor = tensors[t]
            ptrs += [tensor.data_ptr() + b * tensor.stride(0) for b in ids]
    return SimpleNamespace(
        ptrs=np.array(ptrs, dtype=np.uint64),
        group_block_counts=tuple(len(ids) for ids in ids_per_group),
        group_data_ref_counts=tuple(len(refs) for refs in refs_per_group),
        block_indices=tuple(block_indices or [0] * len(ids_per_group)),
    )


@pytest.fixture
def layout():
    # Three KV tensors of 16 blocks, pages of 64 bytes in rows of 96 (padded), and two
    # groups: one over tensors 0 and 1, one over tensor 2.
    storage = torch.randint(-128, 127, (3, 16, 96), dtype=torch.int8)
    tensors = [storage[t, :, :64] for t in range(3)]
    return tensors, [[0, 1], [2]]


def test_block_ids_are_read_back_group_by_group(layout):
    tensors, refs = layout
    reader = PointerReader(tensors, refs)
    job = reader.read(pointers(tensors, refs, [[5, 1, 9], [15, 0]], block_indices=[3, 0]))
    assert not isinstance(job, str)
    assert job.gpu_ids.tolist() == [5, 1, 9, 15, 0]
    assert job.group_sizes == (3, 2) and job.block_indices == (3, 0)


def test_an_empty_group_is_skipped(layout):
    tensors, refs = layout
    job = PointerReader(tensors, refs).read(pointers(tensors, refs, [[], [4, 2]]))
    assert not isinstance(job, str)
    assert job.gpu_ids.tolist() == [4, 2] and job.group_sizes == (0, 2)


def test_addresses_that_are_not_those_blocks_rows_are_refused(layout):
    tensors, refs = layout
    reader = PointerReader(tensors, refs)
    good = pointers(tensors, refs, [[5, 1], [3]])

    def with_ptrs(change):
        ptrs = good.ptrs.copy()
        change(ptrs)
        return SimpleNamespace(**{**vars(good), "ptrs": ptrs})

    # Mid-row, the second reference naming another block, before the tensor, past its end.
    assert reader.read(with_ptrs(lambda p: p.__setitem__(0, p[0] + 8))) == (
        "device_pointers_unknown"
    )
    assert reader.read(with_ptrs(lambda p: p.__setitem__(2, p[3]))) == "device_pointers_unknown"
    assert reader.read(with_ptrs(lambda p: p.__setitem__(4, 0))) == "device_pointers_unknown"
    beyond = tensors[2].data_ptr() + 16 * tensors[2].stride(0)
    assert reader.read(with_ptrs(lambda p: p.__setitem__(4, beyond))) == ("device_pointers_unknown")


def test_groups_unlike_the_handlers_are_refused(layout):
    tensors, refs = layout
    reader = PointerReader(tensors, refs)
    other_refs = pointers(tensors, [[0], [2]], [[5], [3]])
    assert reader.read(other_refs) == "device_pointers_groups"
    short = pointers(tensors, refs, [[5, 1], [3]])
    short.ptrs = short.ptrs[:-1]
    assert reader.read(short) == "device_pointers_groups"


def test_gpu_rows_are_each_blocks_page_in_a_tensor_of_any_dtype():
    raw = torch.randn(8, 4, 24)  # float32 blocks of 384 bytes
    canonical = SimpleNamespace(tensor=raw, page_size_bytes=256)
    rows = gpu_rows(canonical)
    assert rows.dtype == torch.int8 and rows.shape == (8, 256) and rows.stride() == (384, 1)
    assert rows.data_ptr() == raw.data_ptr()
    as_bytes = raw.view(torch.int8).reshape(8, 384)
    assert torch.equal(rows, as_bytes[:, :256])
