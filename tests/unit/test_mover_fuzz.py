"""The mover fuzz (tests/fuzz_mover.py) on the CPU: the "device" side is another CPU
tensor and the direction is given, so every path runs through the reference kernels.

KVCORE_FUZZ_CASES=N runs N cases; KVCORE_FUZZ_SEED=S replays case S alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvcore.kernels import REFERENCE
from kvcore.runs import PairedRuns, Runs
from tests.fuzz_mover import CaseFailure, fuzz_seeds, run_case

# A few seconds in all on one CI core.
CASES = 500


# Seeds that once found kvcore bugs, run on every CI run: 27483 and 36870 gave layer_pairs
# a buffer of no rows whose dim-0 stride no word size divides (torch calls it contiguous).
REGRESSION_SEEDS = (27483, 36870)


@pytest.mark.parametrize(
    "seed",
    sorted({*fuzz_seeds(CASES), *REGRESSION_SEEDS}),
    ids=lambda seed: f"seed{seed}",
)
def test_mover_fuzz_case(seed: int) -> None:
    run_case(seed, "cpu")


def _drops_the_last_row(
    src_words: torch.Tensor, dst_words: torch.Tensor
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    gather = REFERENCE.prepare_gather(src_words, dst_words)
    return lambda src_idx, dst_idx: gather(src_idx[:-1], dst_idx[:-1])


def _writes_one_row_more(
    src_words: torch.Tensor, dst_words: torch.Tensor, runs: PairedRuns
) -> None:
    REFERENCE.copy_runs(src_words, dst_words, runs)
    if runs.count:
        end = int(runs.dst_starts[-1] + runs.lengths[-1])
        if end < dst_words.shape[0]:
            dst_words[end] = src_words[int(runs.src_starts[-1])]


def _touches_the_source(
    src_words: torch.Tensor,
    src_idx: torch.Tensor,
    staging: torch.Tensor,
    dst_words: torch.Tensor,
    host_runs: Runs,
) -> None:
    REFERENCE.stage_out(src_words, src_idx, staging, dst_words, host_runs)
    if src_idx.numel():
        src_words[int(src_idx[0])] += 1


# Each break reaches every call of its op: the reference's ops over several pairs call its
# one-pair ops directly, not the set's, so they are left out and the mover runs the broken
# op once per pair instead.
BROKEN = {
    "gather_drops_a_row": dataclasses.replace(
        REFERENCE, prepare_gather=_drops_the_last_row, prepare_rows=None, gather_prepared=None
    ),
    "copy_runs_writes_past_a_run": dataclasses.replace(
        REFERENCE, copy_runs=_writes_one_row_more, copy_runs_layers=None
    ),
    "stage_out_writes_the_source": dataclasses.replace(REFERENCE, stage_out=_touches_the_source),
}


@pytest.mark.parametrize("broken", BROKEN.values(), ids=BROKEN.keys())
def test_the_fuzz_notices_a_broken_kernel_and_names_its_seed(swap_kernels, broken):
    swap_kernels("cpu", broken)
    for seed in range(100):
        try:
            run_case(seed, "cpu")
        except CaseFailure as failure:
            message = str(failure)
            assert f"seed={seed} " in message and f"KVCORE_FUZZ_SEED={seed} " in message
            assert "bytes differ" in message
            return
    pytest.fail("100 cases ran on a broken kernel set without noticing")
