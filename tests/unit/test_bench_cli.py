"""`kvcore bench` end to end, as a user runs it: one small measured CPU run in a subprocess,
then the same report printed again from its JSON (with --full, with --plot)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcore.bench import report as bench_report
from kvcore.bench import suite

REPO = Path(__file__).resolve().parents[2]


def kvcore_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "integrations")])}
    return subprocess.run(
        [sys.executable, "-m", "kvcore", "bench", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


class Run:
    def __init__(self, stdout: str, report: dict[str, Any], plot: Path) -> None:
        self.stdout = stdout
        self.report = report
        self.plot = plot


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One quick CPU run, kept small: two row kinds and two host layouts of 512 rows, and a
    small allocator churn."""
    out = tmp_path_factory.mktemp("bench")
    report, plot = out / "report.json", out / "bench.png"
    done = kvcore_bench(
        "--quick",
        "--device",
        "cpu",
        "--tokens",
        "512",
        "--rows",
        "mla-1152B,mha-4KiB",
        "--host-levels",
        "0%,50%",
        "--allocator-slots",
        "16384",
        "--allocator-ops",
        "200",
        "--no-progress",
        "--json",
        str(report),
        "--plot",
        str(plot),
    )
    assert done.returncode == 0, done.stderr
    return Run(done.stdout, json.loads(report.read_text()), plot)


def test_the_summary_comes_first_with_one_line_per_row_kind_and_direction(measured: Run) -> None:
    lines = measured.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("summary:"))
    header = lines[start + 1]
    for column in ("planner's path", "ceiling GB/s min / med / max", "kvcore / ceiling"):
        assert column in header
    assert "kvcore / best stock" in header
    body = lines[start + 2 : start + 6]
    assert [line.split()[:2] for line in body] == [
        ["mla-1152B", "h2d"],
        ["mla-1152B", "d2h"],
        ["mha-4KiB", "h2d"],
        ["mha-4KiB", "d2h"],
    ]
    summary = {(s["row_kind"], s["direction"]): s for s in measured.report["summary"]}
    for line in body:
        entry = summary[tuple(line.split()[:2])]
        # Each line shows the same figures as the JSON: the paths, the ceiling's spread.
        for path, count in entry["auto_paths"].items():
            assert f"{path} x{count}" in line
        ceiling = entry["ceiling_gbps"]
        assert f"{ceiling['min']:.1f} / {ceiling['median']:.1f} / {ceiling['max']:.1f}" in line
        assert entry["scenarios"] == 4
        assert line.rstrip().endswith("yes")
    # Without --full, no per-path row is printed.
    assert "every path of every scenario:" not in measured.stdout
    assert not any(line.startswith("mla-1152B/") for line in lines)


def test_the_legend_explains_every_summary_column(measured: Run) -> None:
    lines = measured.stdout.splitlines()
    legend = lines[lines.index("legend:") :]
    labels = {
        line.split("  ")[1] for line in legend[1:] if line.startswith("  ") and line[2] != " "
    }
    assert {
        "rows",
        "dir",
        "ceiling",
        "min / med / max",
        "planner's path",
        "kvcore / ceiling",
        "kvcore / best stock",
        "noise",
        "ok",
        "--full",
    } <= labels
    # The legend is the last thing printed.
    assert lines.index("legend:") > max(
        i for i, line in enumerate(lines) if line.startswith("allocator churn")
    )


def test_a_cpu_run_is_flagged_noisy_and_rows_over_the_ceiling_are_noise(measured: Run) -> None:
    report = measured.report
    assert report["noise"]["noisy"] is True
    assert measured.stdout.splitlines()[1].startswith("NOISY: timed on the CPU")
    over = [r for r in report["results"] if bench_report.is_noise(r)]
    assert report["noise"]["rows_over_ceiling"] == len(over)
    assert sum(s["noise_rows"] for s in report["summary"]) == len(
        [r for r in over if bench_report.grid_key(r["scenario"])]
    )
    for ceiling in (r for r in report["results"] if r["kind"] == "ceiling"):
        # The ceiling's repeats are kept, and its figure is their median.
        assert len(ceiling["repeats_gbps"]) == 3
        assert ceiling["gbps"] == pytest.approx(sorted(ceiling["repeats_gbps"])[1])


def test_full_prints_every_result_row_with_room_for_every_label(
    measured: Run, tmp_path: Path
) -> None:
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(measured.report))
    done = kvcore_bench("--from-json", str(saved), "--full")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("every path of every scenario:")
    header, rows = lines[start + 1], lines[start + 2 : start + 2 + len(measured.report["results"])]
    path_column = header.index("path")
    for row, result in zip(rows, measured.report["results"], strict=True):
        # Every label fits its column: the path always starts where its header does.
        assert row.startswith(result["scenario"])
        assert row[path_column:].startswith(result["path"])
        # Both directions at once may pass one way's ceiling on a duplex link: never noise.
        one_way = "+" not in result["scenario"].split("/")[1]
        noise = result["kind"] != "ceiling" and one_way and result["share_of_ceiling"] > 1.05
        assert ("~" in row) == noise
    assert "queued us" in header and "queued us" in done.stdout.split("legend:")[1]
    assert "--full" not in done.stdout.split("legend:")[1]


def test_plot_is_a_png_of_a_readable_size(measured: Run) -> None:
    data = measured.plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 1600 and 500 <= height <= 1200


def test_an_old_report_without_the_new_keys_still_prints(measured: Run) -> None:
    old = {k: v for k, v in measured.report.items() if k not in ("summary", "noise")}
    old["results"] = [
        {k: v for k, v in r.items() if k != "repeats_gbps"} for r in measured.report["results"]
    ]
    printed = suite.format_table(old)
    assert "summary:" in printed and "legend:" in printed
    # Without the repeats, the ceiling's spread is over the layouts' medians.
    first = old["results"][0]
    assert first["kind"] == "ceiling"
    assert bench_report.summarize(old)[0]["ceiling_gbps"]["min"] <= first["gbps"]
