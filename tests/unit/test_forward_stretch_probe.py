"""scripts/forward_stretch_probe.py: its cells, arithmetic and page runs, and its refusal
without a GPU."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.scripts import SCRIPTS, load_script

probe = load_script("forward_stretch_probe")
ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'integrations'}"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "forward_stretch_probe.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_help_exits_0_and_names_the_options():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    options = ("--kind", "--load", "--copy-mib", "--extra-streams", "--stream-gaps", "--host")
    for option in (*options, "--one-call"):
        assert option in done.stdout


def test_without_cuda_it_exits_2_with_one_line_and_no_traceback():
    done = _run("--repeats", "1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("forward_stretch_probe: needs a CUDA device")
    assert "CUDA_VISIBLE_DEVICES=''" in lines[0]
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_main_refuses_in_process_before_writing_json(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert probe.main(["--json", str(out)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--stream-gaps", "0"],
        ["--extra-streams", "-1"],
        ["--layers", "0"],
        ["--load", "x"],
        ["--host", "pageable"],
    ],
)
def test_bad_arguments_are_usage_errors(args):
    with pytest.raises(SystemExit) as exit_info:
        probe.main(args)
    assert exit_info.value.code == 2


def test_cells_put_each_setups_alone_cells_before_its_pairings():
    cells = probe.build_cells([0, 40], [1, 8])
    per_setup = len(probe.COPIES) + len(probe.MODES)
    per_setup += len(probe.MODES) * len(probe.COPIES) * len(probe.ORDERS)
    assert len(cells) == 4 * per_setup
    assert len({cell.name for cell in cells}) == len(cells)
    seen_alone: set[tuple[int, int, str]] = set()
    for cell in cells:
        key = (cell.extra, cell.gap)
        if len(cell.parts()) == 1:
            seen_alone.add((*key, cell.mode or cell.copy))
        else:
            assert (*key, cell.mode) in seen_alone and (*key, cell.copy) in seen_alone
    setups = [(c.extra, c.gap) for c in cells]
    assert setups == sorted(setups, key=[(0, 1), (0, 8), (40, 1), (40, 8)].index)


def test_parts_follow_the_order():
    cell = probe.Cell
    assert cell(None, "batched", None, 0, 1).parts() == ["copy"]
    assert cell("graph", None, None, 0, 1).parts() == ["forward"]
    assert cell("eager", "one-copy", "copy-first", 0, 1).parts() == ["copy", "forward"]
    assert cell("eager", "one-copy", "forward-first", 0, 1).parts() == ["forward", "copy"]
    named = cell("graph", "batched", "copy-first", 40, 8).name
    assert named == "graph+batched/copy-first/extra=40/gap=8"


def test_stretch_and_span():
    assert probe.stretch(23.7, 13.1) == pytest.approx(10.6)
    assert probe.stretch(12.0, 13.0) == pytest.approx(-1.0)
    assert probe.stretch(None, 13.0) is None
    assert probe.stretch(13.0, None) is None
    # Overlapped: the larger window; one after the other: the sum; offsets may be negative.
    assert probe.span([(0.0, 9.7), (0.1, 13.2)]) == pytest.approx(13.2)
    assert probe.span([(0.0, 9.7), (9.7, 22.8)]) == pytest.approx(22.8)
    assert probe.span([(0.0, 5.0), (-2.0, 1.0)]) == pytest.approx(7.0)


def test_parse_ints():
    assert probe.parse_ints("0,40") == (0, 40)
    assert probe.parse_ints(" 1, 8 ,32,") == (1, 8, 32)
    with pytest.raises(argparse.ArgumentTypeError):
        probe.parse_ints("1,x")


def test_page_runs_cover_every_page_once_in_layer_calls():
    page = probe.PAGE_BYTES
    host, device, pages, layers = 1 << 40, 1 << 44, 100, 32
    runs = probe.page_runs(host, device, pages * page + 5, layers, seed=3)
    assert len(runs) == layers
    dsts, srcs, sizes = (np.concatenate(parts) for parts in zip(*runs, strict=True))
    assert all(a.dtype == np.uint64 and a.flags.c_contiguous for run in runs for a in run)
    assert (sizes == page).all()
    assert (srcs == host + np.arange(pages, dtype=np.uint64) * page).all()
    offsets = np.sort((dsts - np.uint64(device)) // np.uint64(page))
    assert (offsets == np.arange(pages)).all()
    assert not ((dsts - np.uint64(device)) // np.uint64(page) == np.arange(pages)).all()
    assert [len(r[0]) for r in probe.page_runs(host, device, 3 * page, layers)] == [1, 1, 1]
    with pytest.raises(ValueError):
        probe.page_runs(host, device, page - 1, layers)


def test_one_call_runs_hold_every_layers_pages_in_layer_order():
    page = probe.PAGE_BYTES
    runs = probe.page_runs(1 << 40, 1 << 44, 64 * page, 8, seed=1)
    ((dsts, srcs, sizes),) = probe.one_call_runs(runs)
    assert (dsts == np.concatenate([r[0] for r in runs])).all()
    assert (srcs == np.concatenate([r[1] for r in runs])).all()
    assert len(sizes) == 64 and (sizes == page).all()
    assert all(a.dtype == np.uint64 and a.flags.c_contiguous for a in (dsts, srcs, sizes))
