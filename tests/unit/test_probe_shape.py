"""benchmarks.probe_shape: the page layouts the GPU probes share, checked on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.probe_shape import (
    GPU_BLOCKS,
    MHA,
    MLA,
    PageShape,
    chunks_landed,
    probe_device,
    probe_parser,
    write_probe_json,
)


def _loaded(
    blocks: int, shape: PageShape = MLA
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Random host chunks copied page by page into random blocks, as a correct load would."""
    generator = torch.Generator().manual_seed(7)
    host = torch.randint(
        -128, 128, (blocks * shape.chunk_bytes,), dtype=torch.int8, generator=generator
    )
    host = host.view(torch.uint8)
    tensors = [
        torch.zeros(GPU_BLOCKS * shape.row_bytes, dtype=torch.uint8) for _ in range(shape.tensors)
    ]
    dst_blocks = torch.randperm(GPU_BLOCKS, generator=generator)[:blocks]
    chunks = host.view(blocks, shape.chunk_bytes)
    row = shape.row_bytes
    for i, block in enumerate(dst_blocks.tolist()):
        for page, tensor in enumerate(tensors):
            tensor[block * row : (block + 1) * row] = chunks[i, page * row : (page + 1) * row]
    return host, tensors, dst_blocks


def test_the_chunk_row_is_vllms_padded_row() -> None:
    assert MLA.row_bytes == 18 << 10
    assert MLA.chunk_bytes % 4096 == 0
    assert 0 <= MLA.chunk_bytes - MLA.layers * MLA.row_bytes < 4096


def test_the_mha_chunk_row_holds_every_layers_k_and_v_page_unpadded() -> None:
    assert (MHA.tensors, MHA.row_bytes) == (2 * MHA.layers, 32 << 10)
    assert MHA.chunk_bytes == MHA.tensors * MHA.row_bytes


def test_a_correct_load_is_told_apart_from_one_wrong_byte_or_block() -> None:
    host, layers, dst_blocks = _loaded(3)
    assert chunks_landed(MLA, host, layers, dst_blocks)
    assert not chunks_landed(MLA, host, layers, dst_blocks.flip(0))
    layers[MLA.layers - 1][int(dst_blocks[1]) * MLA.row_bytes + 5] ^= 1
    assert not chunks_landed(MLA, host, layers, dst_blocks)


def test_an_mha_load_is_checked_page_by_page_of_every_k_and_v_tensor() -> None:
    host, tensors, dst_blocks = _loaded(2, MHA)
    assert chunks_landed(MHA, host, tensors, dst_blocks)
    assert not chunks_landed(MHA, host, tensors, dst_blocks.flip(0))
    tensors[MHA.layers][int(dst_blocks[0]) * MHA.row_bytes + MHA.row_bytes - 1] ^= 1
    assert not chunks_landed(MHA, host, tensors, dst_blocks)


def test_the_parser_and_the_report(tmp_path: Path) -> None:
    args = probe_parser().parse_args(["--sizes", "8192", "--json", str(tmp_path / "r.json")])
    assert (args.sizes, args.requests) == ("8192", 5)
    write_probe_json(args.json, {"rows": [1]})
    assert (tmp_path / "r.json").read_text().replace(" ", "").replace("\n", "") == '{"rows":[1]}'
    write_probe_json(None, {"rows": []})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's message")
def test_no_gpu_stops_with_the_probes_name() -> None:
    with pytest.raises(SystemExit, match="some_probe: needs a CUDA GPU"):
        probe_device("some_probe")
