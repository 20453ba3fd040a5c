"""The compatibility-matrix runner's pure logic: lanes, results, docs/compat.md, staging."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ci.matrix.__main__ import lane_is_red
from ci.matrix.lanes import Lane, MatrixError, load_matrix, parse_matrix
from ci.matrix.render import render_compat, status_text
from ci.matrix.results import (
    LaneResult,
    Suite,
    also_failing_on_stock,
    grouped,
    load_all,
    parse_junit,
    save,
)
from ci.matrix.runner import (
    LaneError,
    integration_env,
    lane_env,
    parse_index_versions,
    point_kvcore_at,
)
from ci.vllm_upstream import stage

REPO = Path(__file__).resolve().parents[2]


def _engine(versions: list[str]) -> dict[str, object]:
    return {
        "versions": versions,
        "install": "ci/install_x.sh",
        "version_env": "X_VERSION",
        "integration_tests": "tests/integration/x",
    }


def test_repo_matrix_expands_every_engine_version_and_mode_plus_drift() -> None:
    matrix = load_matrix(REPO / "ci" / "matrix.toml")
    names = [lane.name for lane in matrix.lanes()]
    # vLLM ships tests its classes mode runs against kvcore's classes; SGLang ships none.
    expected = [
        f"{engine}-{version}-{mode}"
        for engine, versions, modes in (
            ("sglang", ("0.5.22", "0.5.23"), ("stock", "plugin", "patched")),
            (
                "vllm",
                ("0.25.1", "0.32.0", "0.33.0", "0.34.0"),
                ("stock", "plugin", "patched", "classes"),
            ),
        )
        for version in versions
        for mode in modes
    ]
    assert sorted(names) == sorted([*expected, "sglang-drift", "vllm-drift"])
    assert names.index("sglang-drift") < names.index("vllm-0.25.1-stock")
    assert matrix.engines["vllm"].upstream_tests == "ci/run_vllm_upstream.sh"
    assert matrix.engines["sglang"].upstream_tests == ""
    for engine in matrix.engines.values():
        assert (REPO / engine.install).is_file()
        assert (REPO / engine.integration_tests).is_dir()


def test_stock_and_plugin_share_a_venv_patched_has_its_own() -> None:
    stock, plugin, patched = (
        Lane("vllm", mode, "0.33.0") for mode in ("stock", "plugin", "patched")
    )
    assert stock.venv_name("0.33.0") == plugin.venv_name("0.33.0") == "vllm-0.33.0"
    assert patched.venv_name("0.33.0") == "vllm-0.33.0-patched"
    assert Lane("vllm", "drift").name == "vllm-drift"


def test_select_by_name_glob_and_all() -> None:
    matrix = parse_matrix({"engines": {"a": _engine(["1.0", "2.0"]), "b": _engine(["3.0"])}})
    assert len(matrix.lanes()) == 3 * 3 + 2
    assert [lane.name for lane in matrix.select(["a-2.0-plugin"])] == ["a-2.0-plugin"]
    assert [lane.name for lane in matrix.select(["b-*", "a-1.0-stock"])] == [
        "a-1.0-stock",
        "b-3.0-stock",
        "b-3.0-plugin",
        "b-3.0-patched",
        "b-drift",
    ]
    assert matrix.select([], everything=True) == matrix.lanes()
    with pytest.raises(MatrixError, match="no lane matches 'a-9"):
        matrix.select(["a-9.0-stock"])
    with pytest.raises(MatrixError, match="--all"):
        matrix.select([])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"modes": ["stock", "turbo"], "engines": {"a": _engine(["1"])}}, "modes"),
        ({"engines": {"a": {**_engine(["1"]), "modes": ["fast"]}}}, "engines.a\\] modes"),
        ({"engines": {"a": {**_engine(["1"]), "modes": []}}}, "engines.a\\] modes"),
        ({"engines": {}}, "no \\[engines"),
        ({"engines": {"a": {"versions": ["1"]}}}, "engines.a"),
        ({"engines": {"a": _engine(["1", "1"])}}, "distinct"),
    ],
)
def test_bad_matrix_is_refused(data: dict[str, object], message: str) -> None:
    with pytest.raises(MatrixError, match=message):
        parse_matrix(data)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.a.test_x" name="test_ok[1]" time="0.1"/>
<testcase classname="tests.a.test_x" name="test_ok[2]" time="0.1"/>
<testcase classname="tests.a.test_x" name="test_bad[1]"><failure message="x">1</failure></testcase>
<testcase classname="tests.a.test_x" name="test_bad[2]"><failure>2</failure></testcase>
<testcase classname="tests.a.test_y" name="test_err"><error message="setup">e</error></testcase>
<testcase classname="tests.a.test_y" name="test_skip"><skipped message="no gpu"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_and_names_failures_and_errors() -> None:
    suite = parse_junit("up", JUNIT)
    assert (suite.passed, suite.failed, suite.skipped) == (2, 3, 1)
    assert suite.failed_ids == (
        "tests.a.test_x::test_bad[1]",
        "tests.a.test_x::test_bad[2]",
        "tests.a.test_y::test_err",
    )
    assert grouped(set(suite.failed_ids)) == [
        ("tests.a.test_x::test_bad", 2),
        ("tests.a.test_y::test_err", 1),
    ]


def _result(lane: Lane, failed: tuple[str, ...] = (), **kwargs: object) -> LaneResult:
    suite = Suite("up", passed=10, failed=len(failed), skipped=2, failed_ids=failed)
    fields: dict[str, object] = {"status": "failed" if failed else "ok", "minutes": 1.25}
    fields.update(kwargs)
    return LaneResult(lane.name, lane.engine, lane.mode, lane.version, suites=[suite], **fields)  # type: ignore[arg-type]


def test_results_round_trip_and_stock_overlap(tmp_path: Path) -> None:
    stock = _result(Lane("e", "stock", "1"), ("t::a", "t::b"))
    plugin = _result(Lane("e", "plugin", "1"), ("t::b", "t::c"))
    drift = LaneResult("e-drift", "e", "drift", "2", "ok", 0.5, changed_targets={"m.C.f": "x"})
    for result in (stock, plugin, drift):
        save(result, tmp_path)
    loaded = load_all(tmp_path)
    assert loaded == {"e-1-stock": stock, "e-1-plugin": plugin, "e-drift": drift}
    assert also_failing_on_stock(plugin, stock) == {"up:t::b"}
    assert also_failing_on_stock(stock, stock) == set()
    assert also_failing_on_stock(plugin, None) == set()
    assert load_all(tmp_path / "absent") == {}


def test_red_lanes_are_errors_new_failures_and_drift() -> None:
    stock_lane, plugin_lane = Lane("e", "stock", "1"), Lane("e", "plugin", "1")
    stock = _result(stock_lane, ("t::a",))
    results = {stock.lane: stock}
    assert lane_is_red(stock_lane, stock, results)
    assert not lane_is_red(plugin_lane, _result(plugin_lane, ("t::a",)), results)
    assert lane_is_red(plugin_lane, _result(plugin_lane, ("t::a", "t::new")), results)
    assert lane_is_red(plugin_lane, _result(plugin_lane, status="error", message="m"), results)
    drift_lane = Lane("e", "drift")
    clean = LaneResult("e-drift", "e", "drift", "2", "ok", 0.1)
    assert not lane_is_red(drift_lane, clean, results)
    clean.changed_targets = {"m.C.f": "source changed"}
    assert lane_is_red(drift_lane, clean, results)
    # A newer release kvcore does not support is red even where no target changed.
    untested = LaneResult("e-drift", "e", "drift", "3", "ok", 0.1, unsupported_newest=True)
    assert lane_is_red(drift_lane, untested, results)
    assert status_text(untested) == "**UNSUPPORTED newest release**: 0 target(s) changed"


def test_render_compat_rows_counts_and_details() -> None:
    lanes = [Lane("e", mode, "1") for mode in ("stock", "plugin", "patched")]
    lanes += [Lane("e", "drift"), Lane("f", "stock", "9")]
    results = {
        "e-1-stock": _result(lanes[0], ("t::a[1]", "t::a[2]")),
        "e-1-plugin": _result(lanes[1], ("t::a[1]", "t::a[2]", "t::z")),
        "e-1-patched": _result(lanes[2], status="error", message="no such | command"),
        "e-drift": LaneResult(
            "e-drift",
            "e",
            "drift",
            "3",
            "ok",
            0.2,
            message="3 is not a tested release",
            changed_targets={"m.C.f": "source changed"},
        ),
    }
    text = render_compat(lanes, results)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| Engine | Version | Mode |")
    assert rows[1] == "| e | 1 | stock | failed | 10 | 2 | 2 | - | 1.2 |"
    assert rows[2] == "| e | 1 | plugin | failed | 10 | 3 | 2 | 2 | 1.2 |"
    assert rows[3] == "| e | 1 | patched | error: no such \\| command | 10 | 0 | 2 | 0 | 1.2 |"
    assert rows[4] == "| e | 3 | drift | drift: 1 target(s) changed | - | - | - | - | 0.2 |"
    assert rows[5] == "| f | 9 | stock | not run | - | - | - | - | - |"
    assert "fails on stock too: `up:t::a` (2 cases)" in text
    assert "**fails only here**: `up:t::z`" in text
    assert "- 3 is not a tested release\n- changed: `m.C.f`: source changed" in text
    assert "do not edit by hand" in text


def test_lane_env_enables_kvcore_only_in_plugin_mode() -> None:
    base = {"PATH": "/bin", "KVCORE_ENABLE": "sglang,vllm"}
    assert lane_env("vllm", "plugin", base) == {"PATH": "/bin", "KVCORE_ENABLE": "vllm"}
    for mode in ("stock", "patched", "drift"):
        assert lane_env("vllm", mode, base) == {"PATH": "/bin"}


def test_integration_tests_turn_a_patched_build_off() -> None:
    base = {"PATH": "/bin", "KVCORE_ENABLE": "all"}
    assert integration_env("sglang", "patched", base) == {"PATH": "/bin", "KVCORE_ENABLE": "0"}
    assert integration_env("sglang", "plugin", base) == lane_env("sglang", "plugin", base)
    assert integration_env("sglang", "stock", base) == {"PATH": "/bin"}


def test_parse_index_versions() -> None:
    out = "WARNING: x\nvllm (0.34.1)\nAvailable versions: 0.34.1, 0.33.0\n"
    assert parse_index_versions("vllm", out) == "0.34.1"
    with pytest.raises(LaneError, match="gave no version"):
        parse_index_versions("vllm", "ERROR: No matching distribution found for vllm\n")


def _write(root: Path, relative: str, text: str = "") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_stage_copies_selected_dirs_and_their_import_closure(tmp_path: Path) -> None:
    sdist = tmp_path / "sdist"
    _write(sdist, "tests/__init__.py")
    _write(sdist, "tests/conftest.py", "import model_zoo\n")
    _write(sdist, "tests/v1/__init__.py")
    _write(sdist, "tests/v1/kv_offload/conftest.py", "from .helpers import x\n")
    _write(sdist, "tests/v1/kv_offload/helpers.py", "x = 1\n")
    _write(sdist, "tests/v1/kv_offload/data.sh", "echo\n")
    _write(sdist, "tests/v1/kv_connector/__init__.py")
    _write(sdist, "tests/v1/kv_connector/unit/__init__.py")
    _write(sdist, "tests/v1/kv_connector/unit/conftest.py")
    _write(sdist, "tests/v1/kv_connector/unit/utils.py", "from tests.utils_ import deep\n")
    _write(sdist, "tests/v1/kv_connector/unit/unrelated.py", "import tests.v1.other\n")
    _write(sdist, "tests/utils_/__init__.py", "from . import deep\n")
    _write(sdist, "tests/utils_/deep.py", "import os\n")
    _write(sdist, "tests/v1/other.py")
    _write(
        sdist,
        "tests/v1/kv_connector/unit/offloading_connector/test_a.py",
        "from tests.v1.kv_connector.unit.utils import y\nfrom ..unit import utils\n",
    )
    dest = tmp_path / "run"
    staged = {str(p) for p in stage.stage(sdist, dest)}
    assert staged == {
        "tests/__init__.py",
        "tests/v1/__init__.py",
        "tests/v1/kv_offload/conftest.py",
        "tests/v1/kv_offload/helpers.py",
        "tests/v1/kv_offload/data.sh",
        "tests/v1/kv_connector/__init__.py",
        "tests/v1/kv_connector/unit/__init__.py",
        "tests/v1/kv_connector/unit/conftest.py",
        "tests/v1/kv_connector/unit/utils.py",
        "tests/utils_/__init__.py",
        "tests/utils_/deep.py",
        "tests/v1/kv_connector/unit/offloading_connector/test_a.py",
    }
    assert not (dest / "tests" / "conftest.py").exists()
    assert (dest / "conftest.py").read_bytes() == stage.OUR_CONFTEST.read_bytes()
    snapshot = dest / "hf/hub/models--facebook--opt-125m/snapshots" / stage.HF_REVISION
    assert (snapshot / "config.json").read_bytes() == stage.OPT_CONFIG.read_bytes()
    assert (dest / "hf/hub/models--facebook--opt-125m/refs/main").read_text() == stage.HF_REVISION


def test_stage_refuses_an_sdist_without_the_selected_tests(tmp_path: Path) -> None:
    _write(tmp_path, "tests/v1/kv_offload/test_x.py")
    with pytest.raises(SystemExit, match="offloading_connector"):
        stage.closure(tmp_path)


def test_kvcore_differences_and_deselections_name_staged_tests() -> None:
    from ci.vllm_upstream import conftest

    text = "# why\n\nt/a.py::test_x  checks identity\nt/b.py::test_y[  needs a GPU\n"
    assert conftest.kvcore_differences(text) == {
        "t/a.py::test_x": "checks identity",
        "t/b.py::test_y[": "needs a GPU",
    }
    differences = conftest.kvcore_differences(stage.KVCORE_DIFFERENCES.read_text())
    deselected = conftest.kvcore_differences((stage.HERE / "deselect.txt").read_text())
    per_release = conftest.kvcore_differences((stage.HERE / "deselect-0.25.1.txt").read_text())
    assert len(differences) == 4 and len(deselected) == 5 and len(per_release) == 37
    assert not set(per_release) & set(deselected)
    for node_id, reason in [*differences.items(), *deselected.items(), *per_release.items()]:
        assert node_id.startswith(stage.SELECTED) and "::test_" in node_id and reason


def _fake_venv(
    tmp_path: Path, kvcore_checkout: Path, adapters_checkout: Path | None = None
) -> tuple[Path, Path]:
    """A venv whose python says kvcore lives in ``kvcore_checkout`` (its adapters in
    ``adapters_checkout``, the same by default) and logs pip calls."""
    venv, calls = tmp_path / "venv", tmp_path / "pip-calls.txt"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    adapters = adapters_checkout or kvcore_checkout
    python.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-c" ]; then echo {kvcore_checkout}; '
        f"echo {adapters}/integrations; echo {adapters}/integrations; exit 0; fi\n"
        f'echo "$@" >> {calls}\n'
    )
    python.chmod(0o755)
    return venv, calls


def test_a_reused_venv_is_pointed_at_this_checkouts_kvcore(tmp_path: Path) -> None:
    elsewhere = tmp_path / "other-clone"
    venv, calls = _fake_venv(tmp_path, elsewhere)
    point_kvcore_at(venv, REPO, log=None)
    assert calls.read_text().split() == [
        "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps", "-e", str(REPO)
    ]  # fmt: skip


def test_a_venv_whose_adapters_come_from_another_checkout_is_pointed_here(
    tmp_path: Path,
) -> None:
    venv, calls = _fake_venv(tmp_path, REPO, tmp_path / "old-worktree")
    point_kvcore_at(venv, REPO, log=None)
    assert calls.read_text().split()[-2:] == ["-e", str(REPO)]


def test_a_venv_whose_checkout_is_gone_is_pointed_here(tmp_path: Path) -> None:
    venv, calls = tmp_path / "venv", tmp_path / "pip-calls.txt"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    # The editable install maps kvcore to a folder that no longer exists: the import fails.
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then echo "ModuleNotFoundError: No module named kvcore" >&2; '
        "exit 1; fi\n"
        f'echo "$@" >> {calls}\n'
    )
    python.chmod(0o755)
    point_kvcore_at(venv, REPO, log=None)
    assert calls.read_text().split()[-2:] == ["-e", str(REPO)]


def test_a_venv_already_on_this_checkout_is_left_alone(tmp_path: Path) -> None:
    venv, calls = _fake_venv(tmp_path, REPO)
    point_kvcore_at(venv, REPO, log=None)
    assert not calls.exists()


def test_an_engines_own_modes_replace_the_matrix_modes_for_its_lanes() -> None:
    matrix = parse_matrix(
        {
            "engines": {
                "a": {**_engine(["1"]), "modes": ["stock", "classes"]},
                "b": _engine(["2"]),
            }
        }
    )
    assert [lane.name for lane in matrix.lanes()] == [
        "a-1-stock",
        "a-1-classes",
        "a-drift",
        "b-2-stock",
        "b-2-plugin",
        "b-2-patched",
        "b-drift",
    ]
    # Classes lanes enable kvcore as plugin lanes do, and share their venv.
    assert lane_env("a", "classes", {})["KVCORE_ENABLE"] == "a"
    assert integration_env("a", "classes", {})["KVCORE_ENABLE"] == "a"
    assert Lane("a", "classes", "1").venv_name("1") == "a-1"
