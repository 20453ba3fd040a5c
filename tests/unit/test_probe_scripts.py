"""The GPU probes of scripts/ (pitched_dma_probe, resident_scatter_probe,
background_issue_probe): without a GPU they stop with one line; the resident scatter's
kernels, run by Triton's interpreter, copy every block of every layer exactly and touch no
other block."""

from __future__ import annotations

import pytest
import torch
from interpreted import needs_triton, run_interpreted

from tests.support.scripts import load_script

_RUNNER = """
import sys
import torch
from tests.support.scripts import load_script

probe = load_script("resident_scatter_probe")
results = []
for case in torch.load(sys.argv[1]):
    staging, layers, dst_blocks = case["staging"], case["layers"], case["dst_blocks"]
    base = layers[0].data_ptr()
    offsets = torch.tensor([(t.data_ptr() - base) // 8 for t in layers], dtype=torch.int64)
    blocks = dst_blocks.numel()
    pieces = -(-blocks // probe.PER_PIECE)
    if case["kernel"] == "resident":
        ready = torch.ones(pieces, dtype=torch.int32)
        done = torch.zeros(pieces * case["ctas"], dtype=torch.int32)
        probe._resident_scatter[(case["ctas"],)](
            staging, layers[0], offsets, dst_blocks, ready, done, blocks, pieces
        )
    else:
        done = torch.zeros(0, dtype=torch.int32)
        for piece in range(pieces):
            first = piece * probe.PER_PIECE
            count = min(probe.PER_PIECE, blocks - first)
            slot_base = (piece % probe.SLOTS) * probe.PER_PIECE
            probe._piece_scatter[(case["ctas"],)](
                staging, layers[0], offsets, dst_blocks, first, count, slot_base
            )
    results.append({"layers": layers, "done": done})
torch.save(results, sys.argv[2])
"""

GPU_BLOCKS = 40


def _case(kernel: str, blocks: int, ctas: int, seed: int) -> dict:
    probe = load_script("resident_scatter_probe")
    gen = torch.Generator().manual_seed(seed)
    words = probe.SLOTS * probe.PER_PIECE * probe.CHUNK_WORDS
    staging = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64, generator=gen)
    layers = [
        torch.randint(-(2**62), 2**62, (GPU_BLOCKS * probe.ROW_WORDS,), dtype=torch.int64)
        for _ in range(probe.MLA.layers)
    ]
    dst_blocks = torch.randperm(GPU_BLOCKS, generator=gen)[:blocks]
    return {
        "kernel": kernel,
        "ctas": ctas,
        "staging": staging,
        "layers": layers,
        "dst_blocks": dst_blocks,
    }


@pytest.mark.parametrize(
    "name", ["pitched_dma_probe", "resident_scatter_probe", "background_issue_probe"]
)
def test_without_a_gpu_a_probe_stops_with_one_line(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    if name == "resident_scatter_probe":
        pytest.importorskip("triton", reason="the resident probe's kernels need Triton")
    script = load_script(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", [name])
    with pytest.raises(SystemExit, match=f"{name}: needs a CUDA GPU"):
        script.main()


@needs_triton
def test_the_resident_and_per_piece_scatters_copy_each_block_of_every_layer(tmp_path) -> None:
    probe = load_script("resident_scatter_probe")
    # 30 blocks: two whole pieces and a short third, each in its own slot.
    cases = {
        "resident": _case("resident", 30, 3, 1),
        "per-piece": _case("piece", 30, 5, 2),
    }
    originals = {name: [t.clone() for t in case["layers"]] for name, case in cases.items()}
    results = run_interpreted(_RUNNER, cases, tmp_path)
    for name, case in cases.items():
        blocks = case["dst_blocks"]
        chunks = case["staging"].view(-1, probe.CHUNK_WORDS)
        untouched = torch.ones(GPU_BLOCKS, dtype=torch.bool)
        untouched[blocks] = False
        for layer, (got, before) in enumerate(
            zip(results[name]["layers"], originals[name], strict=True)
        ):
            rows, old = got.view(GPU_BLOCKS, -1), before.view(GPU_BLOCKS, -1)
            for k, block in enumerate(blocks.tolist()):
                slot_row = (
                    k // probe.PER_PIECE % probe.SLOTS
                ) * probe.PER_PIECE + k % probe.PER_PIECE
                want = chunks[slot_row, layer * probe.ROW_WORDS : (layer + 1) * probe.ROW_WORDS]
                assert torch.equal(rows[block], want), (name, layer, block)
            assert torch.equal(rows[untouched], old[untouched]), (name, layer)
    # Every CTA marked every piece read.
    assert results["resident"]["done"].tolist() == [1] * (3 * 3)
