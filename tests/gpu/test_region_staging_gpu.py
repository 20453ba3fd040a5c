"""Page-ins staged by region (``PathPolicy.stage_regions``) on a real GPU: vLLM's shared CPU
tier as one pinned region whose chunk rows hold every tensor's pages (padded to 4 KiB, as
vLLM aligns them), one device tensor per KV tensor. Checked against a per-index copy: the
copied rows, the untouched rows (random bytes, never zeros) and the unchanged region."""

from __future__ import annotations

import pytest
import torch

from kvcore.direction import Direction
from kvcore.kernels.triton_kernels import triton_available
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="the scatter is the Triton gather"),
]

CHUNKS, BLOCKS = 96, 128


def _random(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize(
    ("tensors", "page_bytes", "row_bytes"),
    [(61, 18 << 10, 2 << 10), (8, 32 << 10, 32 << 10)],
    ids=["mla-18k-in-2k-rows", "mha-32k"],
)
@pytest.mark.parametrize("staging_spans", [64, 7])
@pytest.mark.parametrize("path", [TransferPath.GATHER, TransferPath.BATCHED_RUNS])
@pytest.mark.parametrize("by_address", [False, True], ids=["torch_ring", "address_ring"])
def test_a_load_staged_by_region_copies_every_tensor_exactly(
    tensors, page_bytes, row_bytes, staging_spans, path, by_address
):
    spacing = page_bytes // row_bytes
    period = -(-tensors * page_bytes // 4096) * 4096 // row_bytes
    region = _random((CHUNKS * period, row_bytes)).cpu().pin_memory()
    before = region.clone()
    srcs = [region[t * spacing :] for t in range(tensors)]
    dsts = [_random((BLOCKS * spacing, row_bytes)) for _ in range(tensors)]
    expected = [d.clone() for d in dsts]
    gen = torch.Generator().manual_seed(tensors)
    chunks = torch.cat([torch.arange(5, 40), torch.arange(50, 71)])
    blocks = torch.randperm(BLOCKS, generator=gen)[: chunks.numel()]
    each = torch.arange(spacing)
    src_idx = (chunks[:, None] * period + each).reshape(-1)
    dst_idx = (blocks[:, None] * spacing + each).reshape(-1)
    for src, want in zip(srcs, expected, strict=True):
        want[dst_idx.cuda()] = src[src_idx].cuda()
    policy = PathPolicy(
        stage_regions="all",
        staging_bytes=staging_spans * tensors * page_bytes,
        address_ring=by_address,
    )
    mover = Mover(policy, metrics=Metrics())
    assert (mover.kernels(dsts[0].device).open_address_ring is not None) == by_address
    pairs = layer_pairs(srcs, dsts)
    chosen = plan(srcs[0], dsts[0], src_idx, dst_idx, direction=Direction.H2D, force=path)
    mover.execute(chosen, pairs)
    torch.cuda.synchronize()
    for got, want in zip(dsts, expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(region, before)
    assert mover.metrics is not None
    assert [row["path"] for row in mover.metrics.snapshot()["transfers"]] == ["staged"]
