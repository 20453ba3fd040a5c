"""What names an index upload, on the CPU (the uploads themselves are CUDA's: tests/gpu)."""

from __future__ import annotations

import torch

from kvcore.kernels.index_upload import cache_key
from kvcore.runs import version_of


def test_an_upload_is_named_by_memory_length_stride_and_version():
    index = torch.arange(10, 30)
    key = cache_key((index, index[::2]))
    assert key == cache_key((index, index[::2]))
    assert key != cache_key((index, index[1::2]))  # other memory
    index.add_(1)  # an in-place write: the old upload is stale
    assert version_of(index) == 1
    assert cache_key((index, index[::2])) != key


def test_inference_tensors_are_never_named_so_their_uploads_are_never_reused():
    with torch.inference_mode():
        made_inside = torch.arange(8)
    normal = torch.arange(8)
    assert version_of(made_inside) is None and version_of(normal) == 0
    assert cache_key((made_inside,)) is None
    assert cache_key((normal, made_inside)) is None
    assert cache_key((normal,)) is not None
