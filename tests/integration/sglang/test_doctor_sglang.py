"""``kvcore doctor --json`` in its own process against the installed SGLang: what the
adapter's hooks would patch is the guard's target table, found without importing SGLang,
and a drifted fingerprint is reported by function name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcore_sglang import guard

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[3]
ALLOC = f"{guard.HOST_KV_CACHE}.alloc"


def run_doctor(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    variables = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    variables.update(env, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'integrations'}")
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=variables, timeout=120
    )


def sglang_entry(stdout: str) -> dict:
    report = json.loads(stdout)
    return next(e for e in report["engines"] if e["engine"] == "sglang")


@pytest.mark.parametrize("transfers", ["0", "1"])
def test_doctor_would_patch_the_guard_table(transfers):
    result = run_doctor(
        ["-m", "kvcore", "doctor", "--json"], KVCORE_ENABLE="sglang", KVCORE_TRANSFERS=transfers
    )
    assert result.returncode == 0, result.stderr
    entry = sglang_entry(result.stdout)
    groups = dict(guard.TARGET_GROUPS)
    if transfers == "1":
        groups.update(guard.TRANSFER_GROUPS)
    expected = [target for targets in groups.values() for target in targets]
    assert entry["would_patch"] and entry["would_patch"] == expected
    assert entry["skipped_targets"] == []
    assert entry["patched_targets"] == [] and entry["plugin_applied"] is False
    assert entry["settings"] == {"transfers": transfers == "1", "serve_rule": True}
    assert set(entry["groups_off"]) == (set() if transfers == "1" else set(guard.TRANSFER_GROUPS))


def test_doctor_names_a_drifted_function_and_imports_no_sglang():
    script = textwrap.dedent(
        f"""
        import sys
        from kvcore.cli import main
        from kvcore_sglang import guard
        for table in guard.FINGERPRINTS.values():
            table[{ALLOC!r}] = "0" * 64
        code = main(["doctor", "--json"])
        print(sorted(m for m in sys.modules if m.split(".")[0] == "sglang"), file=sys.stderr)
        sys.exit(code)
        """
    )
    result = run_doctor(["-c", script], KVCORE_ENABLE="sglang")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]"
    entry = sglang_entry(result.stdout)
    skipped = {s["target"]: s for s in entry["skipped_targets"]}
    assert set(skipped) == set(guard.ALLOCATOR_TARGETS)
    assert skipped[ALLOC]["reason"].startswith("source changed")
    assert skipped[ALLOC]["group"] == guard.ALLOCATOR_GROUP
    assert all(ALLOC in s["reason"] for t, s in skipped.items() if t != ALLOC)
    assert entry["would_patch"] == []
