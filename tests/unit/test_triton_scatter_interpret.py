"""The layer ring's scatter (one staging slot's rows of one or two pairs to their device
rows, one launch), run on CPU by Triton's interpreter in a subprocess (interpreted.py):
its JIT path, which every shape's first launch takes on a GPU too."""

from __future__ import annotations

import random

import pytest
import torch
from interpreted import needs_triton, run_interpreted

pytestmark = needs_triton

_RUNNER = """
import sys
import torch
from kvcore.kernels.triton_scatter import SlotScatter

cases = torch.load(sys.argv[1])
results = []
for case in cases:
    staging, wholes = case["staging"], case["wholes"]
    dsts = [whole[:, : case["words"]] for whole in wholes]
    slot = [
        staging[offset : offset + case["n"] * case["row_bytes"]].view(dsts[0].dtype).view(
            case["n"], dsts[0].shape[1]
        )
        for offset in case["offsets"]
    ]
    launched = SlotScatter(case["ctas"])(None, 0, slot, dsts, case["dst_idx"])
    results.append({"staging": staging, "wholes": wholes, "launched": launched})
torch.save(results, sys.argv[2])
"""


def _random_bytes(count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)


def _case(
    *,
    pairs: int,
    words: int,
    dtype: torch.dtype,
    n: int,
    dst_rows: int,
    seed: int,
    ctas: int = 4,
    spare_words: int = 0,
    pair_gap: int = 0,
) -> dict:
    """A staging buffer holding ``n`` rows of every pair, ``pair_gap`` bytes apart beyond
    the rows, and destinations of ``dst_rows`` rows, wider than the rows by
    ``spare_words`` (a pitch past the row)."""
    gen = torch.Generator().manual_seed(seed)
    row_bytes = words * dtype.itemsize
    pair_bytes = n * row_bytes + pair_gap
    wholes = [
        _random_bytes(dst_rows * (words + spare_words) * dtype.itemsize, gen)
        .view(dtype)
        .view(dst_rows, words + spare_words)
        for _ in range(pairs)
    ]
    return {
        "staging": _random_bytes(max(1, pairs * pair_bytes), gen),
        "offsets": [pair * pair_bytes for pair in range(pairs)],
        "row_bytes": row_bytes,
        "n": n,
        "wholes": wholes,
        "words": words,
        "dst_idx": torch.randperm(dst_rows, generator=gen)[:n],
        "ctas": ctas,
    }


def _cases() -> dict[str, dict]:
    cases = {
        "k_and_v_1152B_int16_pitched": _case(
            pairs=2, words=576, dtype=torch.int16, n=40, dst_rows=50, seed=1, spare_words=64
        ),
        "mla_one_pair_4KiB": _case(
            pairs=1, words=512, dtype=torch.int64, n=30, dst_rows=45, seed=2, ctas=3
        ),
        "one_cta_many_tiles": _case(
            pairs=2, words=16, dtype=torch.int64, n=70, dst_rows=80, seed=3, ctas=1
        ),
        "one_row": _case(pairs=2, words=32, dtype=torch.int32, n=1, dst_rows=9, seed=4),
    }
    rng = random.Random(20261205)
    for i in range(10):
        dtype = rng.choice((torch.int64, torch.int32, torch.int16))
        words = rng.choice((8, 16, 64, 72, 144)) * 8 // dtype.itemsize
        dst_rows = rng.randint(1, 60)
        cases[f"random_{i}"] = _case(
            pairs=rng.randint(1, 2), words=words, dtype=dtype, n=rng.randint(1, dst_rows),
            dst_rows=dst_rows, seed=100 + i, ctas=rng.randint(1, 9),
            spare_words=rng.choice((0, 16 // dtype.itemsize)),
        )  # fmt: skip
    return cases


def _refused() -> dict[str, dict]:
    pitched = _case(pairs=2, words=64, dtype=torch.int64, n=8, dst_rows=9, seed=7)
    pitched["wholes"][1] = pitched["wholes"][1].repeat(1, 2)
    return {
        "three_pairs": _case(pairs=3, words=64, dtype=torch.int64, n=8, dst_rows=9, seed=5),
        # The second pair's rows start 8 bytes past a 16-byte boundary.
        "second_pair_off_16_bytes": _case(
            pairs=2, words=64, dtype=torch.int64, n=8, dst_rows=9, seed=6, pair_gap=8
        ),
        "pitches_differ": pitched,
        "no_rows": _case(pairs=2, words=64, dtype=torch.int64, n=0, dst_rows=9, seed=8),
    }


CASES = _cases()
REFUSED = _refused()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_interpreted(
        _RUNNER, {**CASES, **REFUSED}, tmp_path_factory.mktemp("triton_scatter_interpret")
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_pairs_slot_rows_land_on_its_destination_rows_and_nothing_else(interpreted, name):
    case, result = CASES[name], interpreted[name]
    assert result["launched"]
    n, row_bytes = case["n"], case["row_bytes"]
    for pair, (got, before) in enumerate(zip(result["wholes"], case["wholes"], strict=True)):
        offset = case["offsets"][pair]
        staged = case["staging"][offset : offset + n * row_bytes].view(before.dtype)
        expected = before.clone()
        expected[case["dst_idx"], : case["words"]] = staged.view(n, case["words"])
        # Rows outside dst_idx keep their random bytes, and so do the pitch's spare words.
        assert torch.equal(got, expected)
    assert torch.equal(result["staging"], case["staging"])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_call_the_kernel_cannot_take_is_refused_with_nothing_written(interpreted, name):
    result = interpreted[name]
    assert not result["launched"]
    for got, before in zip(result["wholes"], REFUSED[name]["wholes"], strict=True):
        assert torch.equal(got, before)
    assert torch.equal(result["staging"], REFUSED[name]["staging"])
