"""``kvcore doctor --json`` in its own process against the installed SGLang: what the
adapter's hooks would patch is the guard's target table, found without importing SGLang,
and a drifted fingerprint is reported by function name."""

from __future__ import annotations

import textwrap

import pytest

from kvcore_sglang import guard
from tests.support.doctor import engine_entry, run_doctor

pytestmark = pytest.mark.sglang

ALLOC = f"{guard.HOST_KV_CACHE}.alloc"


@pytest.mark.parametrize(
    ("transfers", "host_pool", "pin_first"),
    [("0", "0", "0"), ("0", "1", "0"), ("1", "0", "0"), ("1", "1", "0"), ("1", "1", "4GiB")],
)
def test_doctor_would_patch_the_guard_table(transfers, host_pool, pin_first):
    result = run_doctor(
        ["-m", "kvcore", "doctor", "--json"],
        KVCORE_ENABLE="sglang",
        KVCORE_TRANSFERS=transfers,
        KVCORE_HOST_POOL=host_pool,
        KVCORE_HOST_POOL_PIN_FIRST=pin_first,
    )
    assert result.returncode == 0, result.stderr
    entry = engine_entry(result.stdout, "sglang")
    groups = dict(guard.TARGET_GROUPS)
    off: set[str] = set()
    for switched, on in (
        (guard.TRANSFER_GROUPS, transfers == "1"),
        (guard.HOST_MEMORY_GROUPS, host_pool == "1"),
        (guard.PINNING_GROUPS, pin_first != "0"),
    ):
        if on:
            groups.update(switched)
        else:
            off.update(switched)
    expected = [target for targets in groups.values() for target in targets]
    assert entry["would_patch"] and entry["would_patch"] == expected
    assert entry["skipped_targets"] == []
    assert entry["patched_targets"] == [] and entry["plugin_applied"] is False
    shown = {"transfers": transfers == "1", "serve_rule": True, "host_pool": host_pool == "1"}
    if pin_first != "0":
        shown["host_pool_pin_first"] = 4 << 30
    assert entry["settings"] == shown
    assert set(entry["groups_off"]) == off


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
    result = run_doctor(
        ["-c", script], KVCORE_ENABLE="sglang", KVCORE_TRANSFERS="0", KVCORE_HOST_POOL="0"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]"
    entry = engine_entry(result.stdout, "sglang")
    skipped = {s["target"]: s for s in entry["skipped_targets"]}
    assert set(skipped) == set(guard.ALLOCATOR_TARGETS)
    assert skipped[ALLOC]["reason"].startswith("source changed")
    assert skipped[ALLOC]["group"] == guard.ALLOCATOR_GROUP
    assert all(ALLOC in s["reason"] for t, s in skipped.items() if t != ALLOC)
    assert entry["would_patch"] == []
