"""scripts/pack_out.sh: a device call's $OUT cut down to its JSON files and one archive."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pack_out.sh"


def _pack(out: Path) -> subprocess.CompletedProcess[str]:
    env = {"OUT": str(out), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)


def test_logs_go_into_one_archive_and_the_json_stays(tmp_path: Path) -> None:
    for suite in ("a", "b", "c"):
        (tmp_path / suite).mkdir()
        (tmp_path / suite / "beside.json").write_text('{"rows": []}')
        (tmp_path / suite / "beside.log").write_text(f"log of {suite}\n")
        (tmp_path / suite / "env.txt").write_text("H100\n")
    result = _pack(tmp_path)
    assert result.returncode == 0, result.stderr
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["a/beside.json", "b/beside.json", "c/beside.json", "rest.tar.gz"]
    with tarfile.open(tmp_path / "rest.tar.gz") as archive:
        names = sorted(archive.getnames())
        assert names == [f"./{s}/{f}" for s in "abc" for f in ("beside.log", "env.txt")]
        member = archive.extractfile("./b/beside.log")
        assert member is not None and member.read() == b"log of b\n"


def test_more_json_files_than_a_call_brings_back_go_into_the_archive_too(tmp_path: Path) -> None:
    for suite in ("c8", "c16"):
        (tmp_path / suite).mkdir()
        (tmp_path / suite / "beside.json").write_text(f'{{"suite": "{suite}"}}')
    (tmp_path / "fs").mkdir()
    for i in range(6):
        (tmp_path / "fs" / f"r{i}.json").write_text(f'{{"i": {i}}}')
        (tmp_path / "fs" / f"r{i}.log").write_text(f"log {i}\n")
    result = _pack(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "8 JSON files" in result.stderr
    left = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert left == [tmp_path / "rest.tar.gz"]
    with tarfile.open(tmp_path / "rest.tar.gz") as archive:
        names = sorted(archive.getnames())
        assert len(names) == 14 and "./fs/r5.json" in names and "./c16/beside.json" in names
        member = archive.extractfile("./fs/r3.json")
        assert member is not None and member.read() == b'{"i": 3}'


def test_eight_json_files_and_no_logs_come_back_as_they_are(tmp_path: Path) -> None:
    for i in range(8):
        (tmp_path / f"r{i}.json").write_text("{}")
    result = _pack(tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r{i}.json" for i in range(8)]
