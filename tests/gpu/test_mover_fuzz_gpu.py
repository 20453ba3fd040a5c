"""The mover fuzz (tests/fuzz_mover.py) on CUDA: the device side on the GPU, the host side
pinned or pageable as each case says, every path through the CUDA kernels (batched copies,
the Triton UVA gather, staged copies through device staging).

KVCORE_FUZZ_CASES=N runs N cases; KVCORE_FUZZ_SEED=S replays case S alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.fuzz_mover import fuzz_seeds, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = 2000


@pytest.mark.parametrize("seed", fuzz_seeds(CASES), ids=lambda seed: f"seed{seed}")
def test_mover_fuzz_case_on_cuda(seed: int) -> None:
    run_case(seed, "cuda")
