"""What the GPU probes of scripts/ share: vLLM's MLA page layout as its CPU offloading
connector lays it out (61 layer tensors of 16-token blocks on the GPU, one chunk row a block
on the host holding that block's row of every layer), the check that a load put every host
chunk's rows into its destination blocks, and the probes' common command line."""

from __future__ import annotations

import argparse
import json

import torch

MLA_LAYERS = 61
BLOCK_TOKENS = 16
MLA_ROW_BYTES = 576 * 2 * BLOCK_TOKENS
"""One block of one layer: 18 KiB."""
MLA_CHUNK_BYTES = -(-MLA_LAYERS * MLA_ROW_BYTES // 4096) * 4096
"""A block's host chunk row: vLLM aligns each to 4 KiB."""
GPU_BLOCKS = 4096
"""Blocks in each probe's GPU layer tensors; a request's destinations are drawn among them."""


def mla_chunks_landed(
    host: torch.Tensor, layers: list[torch.Tensor], dst_blocks: torch.Tensor
) -> bool:
    """Whether host chunk row ``i``'s layer rows are in block ``dst_blocks[i]`` of each layer
    tensor, byte for byte."""
    blocks = dst_blocks.numel()
    device = layers[0].device
    chunks = host[: blocks * MLA_CHUNK_BYTES].view(blocks, MLA_CHUNK_BYTES)
    expected = (
        chunks[:, : MLA_LAYERS * MLA_ROW_BYTES]
        .to(device)
        .reshape(blocks, MLA_LAYERS, MLA_ROW_BYTES)
    )
    index = dst_blocks.to(device)
    return all(
        torch.equal(t.view(GPU_BLOCKS, MLA_ROW_BYTES)[index], expected[:, layer])
        for layer, t in enumerate(layers)
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
