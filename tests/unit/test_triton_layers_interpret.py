"""The layered Triton gather (one launch for many buffer pairs), run on CPU by Triton's
interpreter in a subprocess (interpreted.py).

Layouts: every pair in tensors of its own, and pairs that are interleaved views of one
region (vLLM's shared host region), on the source or the destination side.
"""

from __future__ import annotations

import random

import pytest
import torch
from interpreted import needs_triton, run_interpreted

pytestmark = needs_triton

_RUNNER = """
import sys
import torch
from kvcore.kernels.triton_layers import gather_layers_uva, layer_table

cases = torch.load(sys.argv[1])
results = []
for case in cases:
    srcs, dsts = case["srcs"], case["dsts"]
    try:
        table = layer_table(srcs, dsts)
        offsets = table.offsets.clone()[: case.get("offsets", len(table.offsets))]
        gather_layers_uva(table, case["src_idx"], case["dst_idx"], offsets, ctas=case["ctas"])
    except (TypeError, ValueError) as exc:
        results.append({"srcs": srcs, "dsts": dsts, "error": type(exc).__name__})
    else:
        results.append({"srcs": srcs, "dsts": dsts, "error": None})
torch.save(results, sys.argv[2])
"""

_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _side(
    layers: int, rows: int, words: int, dtype: torch.dtype, shared: bool, gen: torch.Generator
) -> list[torch.Tensor]:
    """``layers`` views of ``[rows, words]``: interleaved in one region, or one tensor each."""
    if not shared:
        return [_random((rows, words), dtype, gen) for _ in range(layers)]
    region = _random((rows * layers * words,), dtype, gen)
    return [
        region.as_strided((rows, words), (layers * words, 1), layer * words)
        for layer in range(layers)
    ]


def _layers_case(
    *,
    layers: int,
    words: int,
    dtype: torch.dtype,
    n: int,
    src_rows: int,
    dst_rows: int,
    seed: int,
    ctas: int = 4,
    shared_src: bool = False,
    shared_dst: bool = False,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "srcs": _side(layers, src_rows, words, dtype, shared_src, gen),
        "dsts": _side(layers, dst_rows, words, dtype, shared_dst, gen),
        # Source rows may repeat; destination rows are distinct so the result is defined.
        "src_idx": torch.randint(0, src_rows, (n,), generator=gen),
        "dst_idx": torch.randperm(dst_rows, generator=gen)[:n],
        "ctas": ctas,
    }


def _named_cases() -> dict[str, dict]:
    return {
        "shared_host_source_1152B_int16": _layers_case(
            layers=3, words=576, dtype=torch.int16, n=40, src_rows=60, dst_rows=50, seed=1,
            shared_src=True,
        ),
        "shared_host_destination_4KiB": _layers_case(
            layers=4, words=512, dtype=torch.int64, n=30, src_rows=40, dst_rows=45, seed=2,
            shared_dst=True, ctas=3,
        ),
        "separate_tensors_odd_bytes": _layers_case(
            layers=5, words=999, dtype=torch.uint8, n=25, src_rows=30, dst_rows=30, seed=3,
        ),
        "one_layer": _layers_case(
            layers=1, words=64, dtype=torch.int32, n=33, src_rows=50, dst_rows=40, seed=4,
        ),
        "one_cta_many_layers": _layers_case(
            layers=7, words=16, dtype=torch.int64, n=70, src_rows=90, dst_rows=80, seed=5,
            ctas=1, shared_src=True,
        ),
        "empty_index": _layers_case(
            layers=2, words=32, dtype=torch.int64, n=0, src_rows=8, dst_rows=8, seed=6,
        ),
    }  # fmt: skip


def _random_cases(count: int) -> dict[str, dict]:
    rng = random.Random(20261130)
    cases = {}
    for i in range(count):
        dtype = rng.choice(_WORD_DTYPES)
        dst_rows = rng.randint(1, 60)
        cases[f"random_{i}"] = _layers_case(
            layers=rng.randint(1, 6), words=rng.randint(1, 300), dtype=dtype,
            n=rng.randint(0, dst_rows), src_rows=rng.randint(1, 60), dst_rows=dst_rows,
            seed=100 + i, ctas=rng.randint(1, 9), shared_src=rng.random() < 0.5,
            shared_dst=rng.random() < 0.3,
        )  # fmt: skip
    return cases


def _invalid_cases() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(11)

    def base(**changes: object) -> dict:
        case = _layers_case(
            layers=2, words=8, dtype=torch.int64, n=5, src_rows=8, dst_rows=8, seed=11
        )
        case.update(changes)
        return case

    def rows(words: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return _random((8, words), dtype, gen)

    return {
        "pitches_differ": base(srcs=[rows(8), rows(12)[:, :8]]),
        "more_sources_than_destinations": base(srcs=[rows(8) for _ in range(3)]),
        "word_types_differ": base(
            srcs=[rows(8), rows(16, torch.int32)], dsts=[rows(8), rows(16, torch.int32)]
        ),
        "offsets_short": base(offsets=3),
        "index_lengths_differ": base(dst_idx=torch.arange(4)),
    }


EXPECTED_ERRORS = {
    "pitches_differ": "ValueError",
    "more_sources_than_destinations": "ValueError",
    "word_types_differ": "ValueError",
    "offsets_short": "ValueError",
    "index_lengths_differ": "ValueError",
}

CASES = {**_named_cases(), **_random_cases(16), **_invalid_cases()}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_interpreted(_RUNNER, CASES, tmp_path_factory.mktemp("triton_layers_interpret"))


def _reference(case: dict) -> list[torch.Tensor]:
    """Every destination after a per-index copy, pair by pair (the pairs never share rows)."""
    expected = []
    for src, dst in zip(case["srcs"], case["dsts"], strict=True):
        out = dst.clone()
        for s, d in zip(case["src_idx"].tolist(), case["dst_idx"].tolist(), strict=True):
            out[d] = src[s]
        expected.append(out)
    return expected


@pytest.mark.parametrize("name", [n for n in CASES if n not in EXPECTED_ERRORS])
def test_every_pair_matches_a_per_index_reference(interpreted: dict[str, dict], name: str):
    case, result = CASES[name], interpreted[name]
    assert result["error"] is None
    for got, expected in zip(result["dsts"], _reference(case), strict=True):
        # Rows outside dst_idx keep their random bytes; the others hold the source rows.
        assert torch.equal(got, expected)
    for got, source in zip(result["srcs"], case["srcs"], strict=True):
        assert torch.equal(got, source)


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_invalid_layer_tables_are_rejected(interpreted: dict[str, dict], name: str):
    result = interpreted[name]
    assert result["error"] == EXPECTED_ERRORS[name]
    for got, before in zip(result["dsts"], CASES[name]["dsts"], strict=True):
        assert torch.equal(got, before)


def test_shared_cases_really_interleave():
    srcs = CASES["shared_host_source_1152B_int16"]["srcs"]
    assert srcs[0].stride(0) == 3 * srcs[0].shape[1]
    assert srcs[1].data_ptr() - srcs[0].data_ptr() == srcs[0].shape[1] * 2


def test_a_launch_hook_is_seen_only_while_one_is_set():
    """The direct launch steps aside for a profiler's hook, and only for one: Triton 3.6
    holds its hooks in a chain that is never None, empty until a hook is added."""
    import triton

    from kvcore.kernels.triton_layers import launch_hooked

    chain = triton.knobs.runtime.launch_enter_hook
    assert not launch_hooked()

    def hook(metadata):
        return None

    chain.add(hook)
    try:
        assert launch_hooked()
    finally:
        chain.remove(hook)
    assert not launch_hooked()
