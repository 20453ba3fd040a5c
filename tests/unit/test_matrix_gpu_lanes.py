"""GPU lanes: a run of scripts/vllm_upstream_gpu.sh read, stored and shown in docs/compat.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci.matrix.__main__ import main
from ci.matrix.gpu_lanes import (
    GpuLaneError,
    GpuLaneRun,
    load_runs,
    read_run,
    record_path,
    render_gpu_lanes,
    splice_gpu_lanes,
)

_REASONS = "{'few_pages': 20, 'internal_error:RuntimeError': 1}"
_LOG = f"""entry points: /tmp/x/site/kvcore-0.1.0.dist-info
name, driver_version, memory.total [MiB]
NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB
torch 2.11.0+cu130 vllm 0.25.1 cuda True
=== stock: UPSTREAM_TESTS_MODE=stock KVCORE_ENABLE=
24 passed in 3.97s
=== kvcore-rule: UPSTREAM_TESTS_MODE=classes-gpu KVCORE_ENABLE=vllm
kvcore: jobs copied by kvcore 3, handed to stock 21; reasons: {_REASONS}
23 passed, 1 failed
=== kvcore-norule: UPSTREAM_TESTS_MODE=classes-gpu KVCORE_ENABLE=vllm
kvcore: jobs copied by kvcore 24, handed to stock 0; reasons: none
pytest status: stock 0, kvcore (rule on) 1, kvcore (rule off) 0
"""


def _junit(passed: int, failed: int = 0, skipped: int = 0) -> str:
    cases = [f'<testcase classname="t" name="ok{i}"/>' for i in range(passed)]
    cases += [f'<testcase classname="t" name="bad{i}"><failure/></testcase>' for i in range(failed)]
    cases += [
        f'<testcase classname="t" name="skip{i}"><skipped/></testcase>' for i in range(skipped)
    ]
    return f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>"


def _run_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "upstream"
    folder.mkdir()
    (folder / "upstream-gpu.log").write_text(_LOG)
    (folder / "junit-stock.xml").write_text(_junit(24))
    (folder / "junit-kvcore-rule.xml").write_text(_junit(23, failed=1))
    (folder / "junit-kvcore-norule.xml").write_text(_junit(22, skipped=2))
    return folder


def test_a_run_folder_gives_the_release_the_device_and_each_pass(tmp_path: Path) -> None:
    run = read_run(_run_folder(tmp_path), "2026-12-05", "bash scripts/vllm_upstream_gpu.sh run")
    assert (run.engine, run.version, run.device) == ("vllm", "0.25.1", "NVIDIA H100 80GB HBM3")
    stock, rule_on, rule_off = run.passes
    assert (stock.passed, stock.failed, stock.jobs_by_kvcore) == (24, 0, None)
    assert (rule_on.passed, rule_on.failed, rule_on.jobs_by_kvcore, rule_on.jobs_to_stock) == (
        23,
        1,
        3,
        21,
    )
    assert rule_on.stock_reasons == {"few_pages": 20, "internal_error:RuntimeError": 1}
    assert (rule_off.skipped, rule_off.jobs_by_kvcore, rule_off.stock_reasons) == (2, 24, {})
    assert GpuLaneRun.from_json(run.to_json()) == run


def test_a_pass_that_did_not_finish_is_named(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    (folder / "junit-kvcore-norule.xml").unlink()
    with pytest.raises(GpuLaneError, match=r"junit-kvcore-norule\.xml"):
        read_run(folder, "2026-12-05", "x")
    with pytest.raises(GpuLaneError, match=r"upstream-gpu\.log"):
        read_run(tmp_path, "2026-12-05", "x")


def test_the_section_shows_every_pass_and_replaces_itself(tmp_path: Path) -> None:
    run = read_run(_run_folder(tmp_path), "2026-12-05", "x")
    lines = render_gpu_lanes([run])
    assert sum(line.startswith("| vllm | 0.25.1 |") for line in lines) == 3
    assert any(
        "3 by kvcore, 21 to stock (few_pages 20, internal_error:RuntimeError 1)" in line
        for line in lines
    )
    assert render_gpu_lanes([]) == []
    compat = "# Engine compatibility\n\n| table |\n\n## Adapter line coverage, by lane\n\n| cov |\n"
    once = splice_gpu_lanes(compat, [run])
    assert once.index("## GPU lanes") < once.index("## Adapter line coverage")
    assert once.startswith("# Engine compatibility\n\n| table |\n") and once.endswith("| cov |\n")
    assert splice_gpu_lanes(once, [run]) == once
    assert splice_gpu_lanes(once, []).count("## GPU lanes") == 0


def test_gpu_record_stores_the_run_and_rewrites_only_the_gpu_section(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path)
    compat = tmp_path / "compat.md"
    compat.write_text("# Engine compatibility\n\n| kept row |\n")
    stored = tmp_path / "gpu_lanes"
    argv = ["--compat", str(compat), "--gpu-lanes", str(stored), "gpu-record", str(folder)]
    assert main([*argv, "--date", "2026-12-05"]) == 0
    [run] = load_runs(stored)
    assert record_path(stored, run).name == "vllm-0.25.1-2026-12-05-nvidia-h100-80gb-hbm3.json"
    text = compat.read_text()
    assert "| kept row |" in text and "| classes-gpu, rule off | 22 | 0 | 2 |" in text


def test_gpu_record_of_a_wrong_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--compat", str(tmp_path / "c.md"), "--gpu-lanes", str(tmp_path / "g")]
    assert main([*argv, "gpu-record", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "upstream-gpu.log" in err
