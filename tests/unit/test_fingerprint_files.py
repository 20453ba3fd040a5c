"""The version guards' fingerprints are data: one JSON file per tested release."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvcore_sglang
import kvcore_vllm
from kvcore import fingerprint
from kvcore_sglang import guard as sglang_guard
from kvcore_vllm import guard as vllm_guard


@pytest.mark.parametrize(
    ("package", "guard", "supported"),
    [
        ("kvcore_sglang", sglang_guard, kvcore_sglang.SUPPORTED_VERSIONS),
        ("kvcore_vllm", vllm_guard, kvcore_vllm.SUPPORTED_VERSIONS),
    ],
)
def test_each_tested_release_is_one_file_and_nothing_else(package, guard, supported):
    folder = Path(__import__(package).__file__).parent / "fingerprints"
    files = sorted(folder.glob("*.json"), key=lambda f: fingerprint.release_key(f.stem))
    assert [f.stem for f in files] == list(guard.FINGERPRINTS) == list(supported)
    for file in files:
        table = guard.FINGERPRINTS[file.stem]
        # The file is exactly what the guard's main prints for a release.
        assert file.read_text(encoding="utf-8") == fingerprint.release_file(table)
        assert all(len(value) == 64 for value in table.values())


def test_vllm_tables_hold_exactly_each_releases_targets():
    for release, table in vllm_guard.FINGERPRINTS.items():
        assert list(table) == [t.qualname for t in vllm_guard.targets_for(release)]


def test_releases_sort_as_numbers_and_a_broken_file_names_itself(tmp_path, monkeypatch):
    package = tmp_path / "fake_adapter"
    (package / "fingerprints").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for release in ("0.10.0", "0.9.1"):
        (package / "fingerprints" / f"{release}.json").write_text(json.dumps({"a.B.c": "0" * 64}))
    (package / "fingerprints" / "README.txt").write_text("not a table")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(fingerprint.recorded_releases("fake_adapter")) == ["0.9.1", "0.10.0"]
    (package / "fingerprints" / "0.11.0.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"fake_adapter/fingerprints/0\.11\.0\.json"):
        fingerprint.recorded_releases("fake_adapter")
    (package / "fingerprints" / "0.11.0.json").write_text(json.dumps(["a.B.c"]))
    with pytest.raises(ValueError, match="is not target -> fingerprint"):
        fingerprint.recorded_releases("fake_adapter")


@pytest.mark.parametrize(("guard", "argv"), [(vllm_guard, ["0.34.0"]), (sglang_guard, [])])
def test_a_guard_main_over_a_tree_without_the_engine_says_so_in_one_line(
    guard, argv, tmp_path, capsys
):
    assert guard.main([*argv, str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot read" in err and "\n" not in err
