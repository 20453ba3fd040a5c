"""The timeline summary of scripts/staged_job_cost.py, on made-up profiler spans."""

from __future__ import annotations

from tests.support.scripts import load_script

staged_job_cost = load_script("staged_job_cost")


def test_a_jobs_time_splits_into_lead_dma_gaps_and_tail():
    job = (100.0, 900.0)
    # An index upload (2 µs) first, then three 80 µs DMAs with a 10 µs gap, and scatters
    # that end 15 µs after the last DMA.
    copies = [(150.0, 152.0), (200.0, 280.0), (280.0, 360.0), (370.0, 450.0)]
    kernels = [(285.0, 295.0), (455.0, 465.0)]
    parts = staged_job_cost.timeline_parts(job, copies, kernels)
    assert parts == {"lead_us": 100.0, "dma_busy_us": 240.0, "dma_gaps_us": 10.0, "tail_us": 15.0}


def test_a_job_without_copies_has_no_timeline():
    assert staged_job_cost.timeline_parts((0.0, 1.0), [], [(0.0, 1.0)]) is None
