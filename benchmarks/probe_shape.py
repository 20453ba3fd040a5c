"""What the GPU probes of scripts/ share: vLLM's page layouts as its CPU offloading
connector lays them out (one GPU tensor a layer, or a layer's K or V, of 16-token blocks; one
chunk row a block on the host holding that block's page of every tensor), the check that a
load put every host chunk's pages into its destination blocks, and the probes' common
command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16
GPU_BLOCKS = 4096
"""Blocks in each probe's GPU tensors; a request's destinations are drawn among them."""


@dataclass(frozen=True)
class PageShape:
    """A model's pages: ``tensors`` GPU tensors of ``row_bytes`` a block, for the forward of
    ``kind`` (:func:`benchmarks.model_forward.measured_forward`) with ``layers`` layers."""

    kind: str
    layers: int
    tensors: int
    row_bytes: int

    @property
    def chunk_bytes(self) -> int:
        """A block's host chunk row: vLLM aligns each to 4 KiB."""
        return -(-self.tensors * self.row_bytes // 4096) * 4096


MLA = PageShape("mla", layers=61, tensors=61, row_bytes=576 * 2 * BLOCK_TOKENS)
"""DeepSeek-V3's: one 18 KiB page a block and layer."""
MHA = PageShape("mha", layers=32, tensors=64, row_bytes=8 * 128 * 2 * BLOCK_TOKENS)
"""Llama-3-8B's: a 32 KiB K page and a V page a block and layer."""
SHAPES = {shape.kind: shape for shape in (MLA, MHA)}


def chunks_landed(
    shape: PageShape, host: torch.Tensor, tensors: list[torch.Tensor], dst_blocks: torch.Tensor
) -> bool:
    """Whether host chunk row ``i``'s pages are in block ``dst_blocks[i]`` of each of the
    ``shape``'s GPU ``tensors``, byte for byte."""
    blocks = dst_blocks.numel()
    device = tensors[0].device
    chunks = host[: blocks * shape.chunk_bytes].view(blocks, shape.chunk_bytes)
    expected = (
        chunks[:, : shape.tensors * shape.row_bytes]
        .to(device)
        .reshape(blocks, shape.tensors, shape.row_bytes)
    )
    index = dst_blocks.to(device)
    return all(
        torch.equal(t.view(GPU_BLOCKS, shape.row_bytes)[index], expected[:, page])
        for page, t in enumerate(tensors)
    )


def probe_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The options every probe takes: request sizes in tokens, requests a cell (after one
    warm-up) and where to write the JSON."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default="8192,32768")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--json")
    return parser


def probe_device(probe: str) -> torch.device:
    """GPU 0, made current; a probe without one stops with a line saying so."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{probe}: needs a CUDA GPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def write_probe_json(path: str | None, report: dict[str, object]) -> None:
    """The probe's report as indented JSON at ``path``, where one was given."""
    if path:
        with open(path, "w") as out:
            json.dump(report, out, indent=1)
