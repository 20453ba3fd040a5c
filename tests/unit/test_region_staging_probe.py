"""scripts/region_staging_probe.py: its staged load's index arithmetic on the CPU (the
scatter in torch ops standing in for the layered launch), and its arguments."""

from __future__ import annotations

import pytest
import torch
from interpreted import needs_triton, run_interpreted

from tests.support.scripts import load_script

probe = load_script("region_staging_probe")


def test_a_request_is_cut_into_pieces_of_whole_chunks_that_fit_the_staging_buffer():
    assert probe.pieces(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert probe.pieces(3, 3) == [(0, 3)]
    with pytest.raises(ValueError, match="at least one chunk"):
        probe.pieces(3, 0)


@pytest.mark.parametrize("staging_chunks", [1, 2, 5])
def test_the_staged_load_writes_each_tensors_page_to_its_block_and_nothing_else(staging_chunks):
    shape = probe.RegionShape(tensors=3, page_bytes=64, forward_kind="mla", model_layers=3)
    region = probe.Region(shape, chunks=9, gpu_blocks=12, device=torch.device("cpu"))
    poison = torch.tensor(-7, dtype=torch.int64)
    for gpu in region.gpus:
        gpu.fill_(poison)
    host_before = region.host.clone()
    staging = torch.empty(staging_chunks * shape.tensors, 8, dtype=torch.int64)
    positions = torch.arange(staging_chunks) * shape.tensors
    gpu_ids = torch.randperm(12, generator=torch.Generator().manual_seed(3))[:5]
    scatter = probe.reference_scatter(staging, region.gpus)
    probe.load_staged(region, 2, gpu_ids, staging, positions, scatter)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[gpu_ids] = False
    for t, gpu in enumerate(region.gpus):
        assert torch.equal(gpu[gpu_ids], region.expected(2, gpu_ids, t))
        assert bool((gpu[untouched] == poison).all())
    assert torch.equal(region.host, host_before)
    # Pages of other tensors and chunks differ, so a wrong offset could not pass.
    assert not torch.equal(region.expected(2, gpu_ids, 0), region.expected(2, gpu_ids, 1))
    assert not torch.equal(region.expected(2, gpu_ids, 0), region.expected(3, gpu_ids, 0))


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--kinds", "gqa"], "--kinds"),
        (["--tokens", "abc"], "--tokens"),
        (["--tokens", "100"], "--tokens"),
        (["--compute", "decode-9"], "--compute"),
        (["--repeats", "0"], "--repeats"),
        (["--json", "/no/such/folder/x.json"], "--json"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(capsys, argv, names):
    with pytest.raises(SystemExit) as stopped:
        probe.main(argv)
    assert stopped.value.code == 2
    assert names in capsys.readouterr().err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without CUDA"
)
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert probe.main(["--tokens", "16"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


_RUNNER = """
import sys
import torch
from tests.support.scripts import load_script

probe = load_script("region_staging_probe")
results = []
for case in torch.load(sys.argv[1]):
    shape = probe.RegionShape(case["tensors"], 64, "mla", case["tensors"])
    region = probe.Region(shape, chunks=9, gpu_blocks=12, device=torch.device("cpu"))
    for gpu in region.gpus:
        gpu.fill_(-7)
    staging = torch.empty(case["staging_chunks"] * shape.tensors, 8, dtype=torch.int64)
    positions = torch.arange(case["staging_chunks"]) * shape.tensors
    scatter = probe.layered_scatter(staging, region.gpus, ctas=2)
    probe.load_staged(region, 2, case["gpu_ids"], staging, positions, scatter)
    expected = [region.expected(2, case["gpu_ids"], t) for t in range(shape.tensors)]
    results.append({"gpus": region.gpus, "expected": expected})
torch.save(results, sys.argv[2])
"""


@needs_triton
def test_the_layered_launch_scatters_staged_pages_as_the_torch_ops_do(tmp_path):
    """The probe's scatter through kvcore's layered gather kernel (Triton's interpreter):
    each tensor's page of each staged chunk lands in its block, the other blocks keep their
    poison."""
    gen = torch.Generator().manual_seed(5)
    cases = {
        f"{tensors}x{chunks}": {
            "tensors": tensors,
            "staging_chunks": chunks,
            "gpu_ids": torch.randperm(12, generator=gen)[:5],
        }
        for tensors, chunks in ((3, 2), (2, 5))
    }
    results = run_interpreted(_RUNNER, cases, tmp_path)
    for name, case in cases.items():
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[case["gpu_ids"]] = False
        got = results[name]
        for gpu, expected in zip(got["gpus"], got["expected"], strict=True):
            assert torch.equal(gpu[case["gpu_ids"]], expected), name
            assert bool((gpu[untouched] == -7).all()), name
