"""The Triton row gather's logic, run on CPU through Triton's interpreter (in a subprocess:
see interpreted.py); the assertions run here against a plain per-index reference."""

from __future__ import annotations

import random

import pytest
import torch
from interpreted import needs_triton, run_interpreted

pytestmark = needs_triton

_RUNNER = """
import sys
import torch
from kvcore.kernels.triton_rows import gather_rows_uva

cases = torch.load(sys.argv[1])
results = []
for case in cases:
    dst = case["dst"]
    src = case["src"]
    kwargs = case["kwargs"]
    try:
        gather_rows_uva(src, case["src_idx"], dst, case["dst_idx"], **kwargs)
    except (TypeError, ValueError) as exc:
        results.append({"dst": dst, "src": src, "error": type(exc).__name__})
    else:
        results.append({"dst": dst, "src": src, "error": None})
torch.save(results, sys.argv[2])
"""

_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _random_rows(rows: int, words: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (rows, words * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def _gather_case(
    *,
    row_bytes: int,
    dtype: torch.dtype,
    n: int,
    src_rows: int,
    dst_rows: int,
    seed: int,
    pitch_extra: int = 0,
    **kwargs: int,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    words = row_bytes // dtype.itemsize
    src_full = _random_rows(src_rows, words + pitch_extra, dtype, gen)
    dst_full = _random_rows(dst_rows, words + pitch_extra, dtype, gen)
    return {
        "src": src_full[:, :words],
        "dst": dst_full[:, :words],
        # Source rows may repeat; destination rows are distinct so the result is defined.
        "src_idx": torch.randint(0, src_rows, (n,), generator=gen),
        "dst_idx": torch.randperm(dst_rows, generator=gen)[:n],
        "kwargs": kwargs,
    }


def _named_cases() -> dict[str, dict]:
    return {
        "mla_1152B_int16": _gather_case(
            row_bytes=1152, dtype=torch.int16, n=150, src_rows=400, dst_rows=300, seed=1, ctas=3
        ),
        "mha_4KiB_uint8": _gather_case(
            row_bytes=4096, dtype=torch.uint8, n=70, src_rows=200, dst_rows=120, seed=2, ctas=8
        ),
        "odd_999B_uint8_masked_columns": _gather_case(
            row_bytes=999, dtype=torch.uint8, n=61, src_rows=100, dst_rows=90, seed=3, ctas=2
        ),
        "1000B_int64_masked_columns": _gather_case(
            row_bytes=1000, dtype=torch.int64, n=33, src_rows=80, dst_rows=64, seed=4, ctas=4
        ),
        "40KiB_rows_column_loop": _gather_case(
            row_bytes=40 * 1024, dtype=torch.int32, n=9, src_rows=20, dst_rows=16, seed=5, ctas=2
        ),
        "pitched_views_1152B": _gather_case(
            row_bytes=1152, dtype=torch.int16, n=40, src_rows=90, dst_rows=70, seed=6,
            pitch_extra=8, ctas=2,
        ),
        "pitch_breaks_widening": _gather_case(
            row_bytes=1152, dtype=torch.int16, n=40, src_rows=90, dst_rows=70, seed=7,
            pitch_extra=1, ctas=3,
        ),
        "explicit_tile_tail": _gather_case(
            row_bytes=256, dtype=torch.int32, n=37, src_rows=64, dst_rows=64, seed=8,
            ctas=5, rows_per_iter=4, num_warps=2,
        ),
        "one_cta_many_tiles": _gather_case(
            row_bytes=64, dtype=torch.int64, n=200, src_rows=300, dst_rows=256, seed=9,
            ctas=1, rows_per_iter=8,
        ),
        "narrow_block_column_loop_1152B": _gather_case(
            row_bytes=1152, dtype=torch.int64, n=50, src_rows=90, dst_rows=70, seed=12,
            ctas=3, rows_per_iter=16, block_words=16,
        ),
        "empty_index": _gather_case(
            row_bytes=128, dtype=torch.int64, n=0, src_rows=10, dst_rows=10, seed=10
        ),
    }  # fmt: skip


def _random_cases(count: int) -> dict[str, dict]:
    rng = random.Random(20240611)
    cases = {}
    for i in range(count):
        dtype = rng.choice(_WORD_DTYPES)
        words = rng.randint(1, 700)
        src_rows = rng.randint(1, 120)
        dst_rows = rng.randint(1, 120)
        n = rng.randint(0, dst_rows)
        kwargs = {"ctas": rng.randint(1, 9)}
        if rng.random() < 0.5:
            kwargs["rows_per_iter"] = rng.choice((1, 2, 4, 16, 64))
        cases[f"random_{i}"] = _gather_case(
            row_bytes=words * dtype.itemsize, dtype=dtype, n=n, src_rows=src_rows,
            dst_rows=dst_rows, seed=100 + i, pitch_extra=rng.choice((0, 0, 1, 3)), **kwargs,
        )  # fmt: skip
    return cases


def _invalid_cases() -> dict[str, dict]:
    base = _gather_case(row_bytes=64, dtype=torch.int64, n=5, src_rows=8, dst_rows=8, seed=11)

    def variant(**changes: object) -> dict:
        # Clone: torch.save refuses one storage viewed as two dtypes across the saved cases.
        return {
            **base,
            **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in changes.items()},
        }

    return {
        "dtype_mismatch": variant(dst=base["dst"].clone().view(torch.int32)),
        "width_mismatch": variant(dst=torch.zeros(8, 4, dtype=torch.int64)),
        "index_length_mismatch": variant(dst_idx=base["dst_idx"][:4]),
        "index_int32": variant(src_idx=base["src_idx"].to(torch.int32)),
        "index_2d": variant(src_idx=base["src_idx"].view(5, 1)),
        "float_rows": variant(
            src=base["src"].clone().view(torch.float64), dst=base["dst"].clone().view(torch.float64)
        ),
        "one_d_rows": variant(src=base["src"].reshape(-1), dst=base["dst"].reshape(-1)),
        "zero_ctas": variant(kwargs={"ctas": 0}),
        "rows_per_iter_not_pow2": variant(kwargs={"rows_per_iter": 3}),
        "block_words_not_pow2": variant(kwargs={"block_words": 12}),
    }


EXPECTED_ERRORS = {
    "dtype_mismatch": "TypeError",
    "width_mismatch": "ValueError",
    "index_length_mismatch": "ValueError",
    "index_int32": "TypeError",
    "index_2d": "ValueError",
    "float_rows": "TypeError",
    "one_d_rows": "ValueError",
    "zero_ctas": "ValueError",
    "rows_per_iter_not_pow2": "ValueError",
    "block_words_not_pow2": "ValueError",
}

CASES = {**_named_cases(), **_random_cases(40), **_invalid_cases()}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_interpreted(_RUNNER, CASES, tmp_path_factory.mktemp("triton_interpret"))


def _reference(case: dict) -> torch.Tensor:
    expected = case["dst"].clone()
    for s, d in zip(case["src_idx"].tolist(), case["dst_idx"].tolist(), strict=True):
        expected[d] = case["src"][s]
    return expected


@pytest.mark.parametrize("name", [n for n in CASES if n not in EXPECTED_ERRORS])
def test_gather_matches_per_index_reference(interpreted: dict[str, dict], name: str) -> None:
    case, result = CASES[name], interpreted[name]
    assert result["error"] is None
    expected = _reference(case)
    # Untouched destination rows keep their random poison; touched rows hold the source rows.
    assert torch.equal(result["dst"], expected)
    assert torch.equal(result["src"], case["src"])
    touched = torch.zeros(case["dst"].shape[0], dtype=torch.bool)
    touched[case["dst_idx"]] = True
    assert torch.equal(result["dst"][~touched], case["dst"][~touched])


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_invalid_arguments_are_rejected(interpreted: dict[str, dict], name: str) -> None:
    result = interpreted[name]
    assert result["error"] == EXPECTED_ERRORS[name]
    assert torch.equal(result["dst"], CASES[name]["dst"])


def test_pitched_case_really_has_a_pitch() -> None:
    src = CASES["pitched_views_1152B"]["src"]
    assert src.stride(0) > src.shape[1]
    assert CASES["pitch_breaks_widening"]["src"].stride(0) * 2 % 8 != 0


def test_default_tile_sizes() -> None:
    triton_tile = pytest.importorskip("kvcore.kernels.triton_tile")
    assert triton_tile.default_tile(144, 8) == (64, 256)  # 1152 B rows as int64 words
    assert triton_tile.default_tile(512, 8) == (16, 512)  # 4 KiB rows
    assert triton_tile.default_tile(2048, 8) == (4, 2048)  # 16 KiB rows
    assert triton_tile.default_tile(5120, 8) == (2, 4096)  # 40 KiB rows: two column blocks
    assert triton_tile.default_tile(1, 8) == (1024, 1)  # tiny rows: row count capped


_REUSE_RUNNER = """
import sys
import torch
from kvcore.kernels.triton_rows import row_gather

results = []
for case in torch.load(sys.argv[1]):
    gather = row_gather(case["src"], case["dst"])
    outputs = []
    for src_idx, dst_idx in case["indices"]:
        gather(src_idx, dst_idx, ctas=3)
        outputs.append(case["dst"].clone())
    results.append({"outputs": outputs})
torch.save(results, sys.argv[2])
"""


def test_a_row_gather_set_up_once_serves_each_new_pair_of_indices(tmp_path) -> None:
    gen = torch.Generator().manual_seed(21)
    src = _random_rows(90, 576, torch.int16, gen)
    dst = _random_rows(70, 576, torch.int16, gen)
    indices = [
        (torch.randint(0, 90, (n,), generator=gen), torch.randperm(70, generator=gen)[:n])
        for n in (50, 13, 0, 70)
    ]
    case = {"src": src, "dst": dst, "indices": indices}
    outputs = run_interpreted(_REUSE_RUNNER, {"reuse": case}, tmp_path)["reuse"]["outputs"]
    expected = dst.clone()
    for (src_idx, dst_idx), output in zip(indices, outputs, strict=True):
        expected[dst_idx] = src[src_idx]
        assert torch.equal(output, expected)
