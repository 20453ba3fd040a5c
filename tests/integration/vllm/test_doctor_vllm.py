"""``kvcore doctor --json`` in its own process against the installed vLLM: what the
adapter would patch is its spec group, found without importing vLLM, and a drifted
fingerprint is reported by function name."""

from __future__ import annotations

import importlib.metadata
import textwrap

import pytest

from kvcore.engine_status import release_of
from kvcore_vllm import guard, plugin
from tests.support.doctor import engine_entry, run_doctor

pytestmark = pytest.mark.vllm

PREPARE_STORE = "CPUOffloadingManager.prepare_store"


def test_doctor_would_patch_the_spec_group():
    result = run_doctor(["-m", "kvcore", "doctor", "--json"], KVCORE_ENABLE="vllm")
    assert result.returncode == 0, result.stderr
    entry = engine_entry(result.stdout, "vllm")
    release = release_of(importlib.metadata.version("vllm"))
    overridden = [t.name for t in guard.targets_for(release) if t.overridden]
    assert entry["would_patch"] == [plugin.REGISTRY_TARGET, *overridden]
    assert entry["target_groups"] == {plugin.SPEC_GROUP: entry["would_patch"]}
    assert entry["skipped_targets"] == []
    assert entry["patched_targets"] == [] and entry["plugin_applied"] is False


def test_doctor_names_a_drifted_function_and_imports_no_vllm():
    script = textwrap.dedent(
        f"""
        import sys
        from kvcore.cli import main
        from kvcore_vllm import guard
        for table in guard.FINGERPRINTS.values():
            table[{PREPARE_STORE!r}] = "0" * 64
        code = main(["doctor"])
        print(sorted(m for m in sys.modules if m.split(".")[0] == "vllm"), file=sys.stderr)
        sys.exit(code)
        """
    )
    result = run_doctor(["-c", script], KVCORE_ENABLE="vllm")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]"
    group_line = next(
        line.strip() for line in result.stdout.splitlines() if plugin.SPEC_GROUP in line
    )
    assert group_line.startswith(f"{plugin.SPEC_GROUP} (7 targets): would patch 0; skipped 1: ")
    assert f"{PREPARE_STORE}: source changed" in group_line


def test_doctor_shows_a_stock_share_with_its_value():
    result = run_doctor(["-m", "kvcore", "doctor"], KVCORE_ENABLE="vllm", KVCORE_STOCK_SHARE="0.25")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("vllm "))
    assert line.endswith("; transfers on, serve rule on, host pool on, stock share 0.25")
