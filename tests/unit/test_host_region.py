"""kvcore's exact host mapping and the vLLM 0.25 region built on it, on the CPU."""

from __future__ import annotations

import itertools
import mmap

import pytest
import torch

from kvcore import host_mapping
from kvcore_vllm.host_region import ExactHostRegion
from tests.support.resident import resident_pages


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_faulted_mapping_is_the_size_asked_every_page_in_and_zero(threads):
    nbytes = 37 * mmap.PAGESIZE + 123
    faulted = host_mapping.faulted_memory(nbytes, threads=threads, segments=1)
    assert faulted.nbytes == nbytes and len(faulted.buffer) == nbytes
    assert resident_pages(faulted.address, nbytes) == (-(-nbytes // mmap.PAGESIZE),) * 2
    assert faulted.node is None
    assert faulted.buffer[:] == bytes(nbytes)
    faulted.close()


def test_a_faulted_mapping_refuses_no_bytes():
    with pytest.raises(ValueError, match="positive"):
        host_mapping.faulted_memory(0)


def test_region_views_are_contiguous_page_aligned_and_distinct():
    pages = [3000, 512, 8192]
    region = ExactHostRegion(9, pages, threads=2)
    views = [region.create_next_view(page) for page in pages]
    base = views[0].data_ptr()
    assert base == region.address == region._base.data_ptr()
    ends = []
    for view, page in zip(views, pages, strict=True):
        assert view.shape == (9, page) and view.dtype == torch.int8 and view.is_contiguous()
        assert (view.data_ptr() - base) % mmap.PAGESIZE == 0
        ends.append((view.data_ptr(), view.data_ptr() + view.numel()))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))
    # Exactly the tensors' bytes, each rounded up to a page, never to a power of two.
    assert region.tensor_bytes == 9 * sum(pages)
    assert region.tensor_bytes <= region.total_size_bytes
    assert region.total_size_bytes - region.tensor_bytes < len(pages) * mmap.PAGESIZE
    region.cleanup()


def test_region_bytes_are_zero_and_each_view_writes_only_its_own():
    pages = [256, 1024]
    region = ExactHostRegion(5, pages)
    first, second = (region.create_next_view(page) for page in pages)
    assert not first.any() and not second.any()
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(-128, 128, first.shape, dtype=torch.int8, generator=generator)
    first.copy_(data)
    assert torch.equal(first, data) and not second.any()
    assert torch.equal(region._base[: first.numel()].view(first.shape), data)
    region.cleanup()


def test_region_stays_within_one_percent_at_engine_sizes():
    # 32 layers of 2 MiB pages over 512 blocks: what torch's allocator would round up.
    pages = [2 << 20] * 4
    region = ExactHostRegion(3, pages, threads=2)
    assert region.total_size_bytes <= 1.01 * region.tensor_bytes
    region.cleanup()


def test_region_refuses_a_view_it_was_not_built_for():
    region = ExactHostRegion(4, [512, 256])
    with pytest.raises(ValueError, match="KV tensor 0 asks for pages of 256 bytes"):
        region.create_next_view(256)
    region.create_next_view(512)
    region.create_next_view(256)
    with pytest.raises(ValueError, match="was built for none"):
        region.create_next_view(256)
    region.cleanup()


def test_region_refuses_empty_shapes():
    for blocks, pages in ((0, [512]), (4, []), (4, [512, 0])):
        with pytest.raises(ValueError, match="needs blocks and positive page sizes"):
            ExactHostRegion(blocks, pages)


def test_cleanup_unmaps_and_views_it_gave_out_keep_their_bytes_alive():
    region = ExactHostRegion(2, [4096])
    view = region.create_next_view(4096)
    view.fill_(7)
    region.cleanup()
    assert region.memory is None and region._base is None
    assert int(view[1, 4095]) == 7  # still mapped while a view lives
    with pytest.raises(RuntimeError, match="cleaned up"):
        region.create_next_view(4096)
    region.cleanup()  # twice is harmless


@pytest.mark.parametrize(
    ("nbytes", "reserved"),
    [(1, 1), (4096, 4096), (4097, 8192), (100 * 10**9, 128 * 2**30 // 1)],
)
def test_torch_pinned_bytes_is_the_next_power_of_two(nbytes, reserved):
    assert host_mapping.torch_pinned_bytes(nbytes) == reserved


def test_a_region_larger_than_available_memory_is_refused_before_any_page(monkeypatch):
    from kvcore.host_pinning import PinnedMemoryError, format_bytes
    from kvcore_vllm import host_region

    monkeypatch.setattr(host_region, "available_bytes", lambda: 3 * mmap.PAGESIZE)
    monkeypatch.setattr(
        host_region, "faulted_memory", lambda *a, **k: pytest.fail("mapped it anyway")
    )
    needs, available = format_bytes(4 * mmap.PAGESIZE), format_bytes(3 * mmap.PAGESIZE)
    with pytest.raises(PinnedMemoryError) as refused:
        ExactHostRegion(4, [mmap.PAGESIZE])
    assert f"needs {needs} of host memory and {available} is available" in str(refused.value)
    assert "--kv-offloading-size" in str(refused.value)


@pytest.mark.parametrize("segments", [1, 3])
def test_faulted_memory_is_shared_zero_and_resident_on_one_file_or_several(monkeypatch, segments):
    monkeypatch.setattr(host_mapping, "segment_count", lambda nbytes: segments)
    nbytes = 9 * mmap.PAGESIZE + 5
    memory = host_mapping.faulted_memory(nbytes, threads=2)
    assert (memory.nbytes, memory.segments, memory.node) == (nbytes, segments, None)
    assert resident_pages(memory.address, nbytes) == (10, 10)
    tensor = torch.frombuffer(memory.buffer, dtype=torch.uint8, count=nbytes)
    assert not tensor.any()
    memory.close()  # the tensor still views it: kept until the tensor goes
    tensor.fill_(9)
    assert int(tensor.sum()) == 9 * nbytes
    assert memory.buffer is None


def test_a_region_over_several_files_takes_its_views_and_gives_them_back(monkeypatch):
    monkeypatch.setattr(host_mapping, "segment_count", lambda nbytes: 4)
    region = ExactHostRegion(8, [4096, 12288])
    assert region.memory is not None and region.memory.segments == 4
    views = [region.create_next_view(4096), region.create_next_view(12288)]
    for view, value in zip(views, (3, -4), strict=True):
        view.fill_(value)
    assert int(views[0].sum()) == 3 * views[0].numel()
    assert int(views[1].sum()) == -4 * views[1].numel()
    del views
    region.cleanup()
    assert region.memory is None


def test_a_refused_unregistration_at_cleanup_leaves_no_error_for_torchs_next_check(
    monkeypatch, caplog
):
    """The worker pinned the region; an unregistration the runtime refuses is warned about
    and read off the runtime's last error, and the region is unmapped all the same."""
    from kvcore_vllm import host_region

    cleared: list[None] = []
    monkeypatch.setattr(host_region, "clear_pending_error", lambda: cleared.append(None) or True)

    class RefusingRuntime:
        @staticmethod
        def cudaHostUnregister(address: int) -> int:
            return 1

    monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingRuntime())
    region = ExactHostRegion(2, [4096], threads=1)
    region.is_pinned = True
    region.cleanup()
    assert cleared == [None] and not region.is_pinned and region.memory is None
    assert "cudaHostUnregister of the host tier failed" in caplog.text
