from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest

import kvcore_sglang
import kvcore_vllm
from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus, probe_engine

STATUS_KEYS = {
    "engine",
    "distribution",
    "installed",
    "version",
    "supported",
    "supported_versions",
    "enabled",
    "patched_targets",
    "skipped_targets",
    "would_patch",
    "target_groups",
    "groups_off",
    "settings",
    "plugin_applied",
    "guard_seconds",
}


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """Installs distribution metadata for "fakeengine" at a chosen version; importing the
    package itself fails, so a probe that imported it would be caught."""
    monkeypatch.syspath_prepend(str(tmp_path))
    package = tmp_path / "fakeengine"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('the engine was imported')\n")

    def install(version: str) -> None:
        info = tmp_path / f"fakeengine-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: fakeengine\nVersion: {version}\n"
        )

    return install


def test_not_installed():
    status = probe_engine("tgi", "kvcore-no-such-distribution", ["1.0"], enabled=True)
    assert status.to_dict() == {
        "engine": "tgi",
        "distribution": "kvcore-no-such-distribution",
        "installed": False,
        "version": None,
        "supported": False,
        "supported_versions": ["1.0"],
        "enabled": True,
        "patched_targets": [],
        "skipped_targets": [],
        "would_patch": [],
        "target_groups": {},
        "groups_off": {},
        "settings": {},
        "plugin_applied": False,
        "guard_seconds": None,
    }
    assert not status.active
    assert status.summary() == "not installed"


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.32.0+cu128", True),
        ("0.32.1", False),
        ("0.32", False),
        ("0.32.0.post1", False),
        ("0.32.0.dev7+g1234", False),
        ("0.31.0", False),
    ],
)
def test_version_match_by_exact_release(fake_engine, version, supported):
    fake_engine(version)
    status = probe_engine("fake", "fakeengine", ("0.32.0", "0.33.0"), enabled=True)
    assert status.installed
    assert status.version == version
    assert status.supported is supported
    assert status.supported_versions == ["0.32.0", "0.33.0"]
    assert status.active is supported
    assert "fakeengine" not in sys.modules


def test_summaries(fake_engine):
    fake_engine("2.0")
    unsupported = probe_engine("fake", "fakeengine", ["1.0", "1.1"], enabled=True)
    assert unsupported.summary() == "2.0, not a tested version (tested: 1.0, 1.1); runs stock"
    disabled = probe_engine("fake", "fakeengine", ["2.0"], enabled=False)
    assert not disabled.active
    assert disabled.summary() == "2.0, supported, not enabled (KVCORE_ENABLE); runs stock"
    active = probe_engine("fake", "fakeengine", ["2.0"], enabled=True)
    active.would_patch += ["Pool.load", "Pool.store"]
    active.skip("Pool.backup", "fingerprint changed")
    assert active.summary() == "2.0, supported, enabled: would patch 2, 1 skipped"
    active.plugin_applied = True
    active.patched_targets.append("Pool.load")
    assert active.summary() == "2.0, supported, enabled: 1 patched in this process, 1 skipped"


def test_to_dict_is_a_json_ready_copy():
    status = EngineStatus("e", "d", True, "1.0", True, ["1.0"], True, ["a.b"])
    status.skip("c.d", "missing")
    status.skip("e.f", "changed", "group")
    data = status.to_dict()
    assert set(data) == STATUS_KEYS
    assert data["skipped_targets"] == [
        {"target": "c.d", "reason": "missing"},
        {"target": "e.f", "reason": "changed", "group": "group"},
    ]
    assert json.loads(json.dumps(data)) == data
    data["patched_targets"].append("x")
    data["skipped_targets"][0]["reason"] = "changed"
    assert status.patched_targets == ["a.b"]
    assert status.skipped_targets[0] == {"target": "c.d", "reason": "missing"}


@pytest.mark.parametrize(
    ("adapter", "engine", "versions"),
    [
        (kvcore_sglang, "sglang", ("0.5.22", "0.5.23")),
        (kvcore_vllm, "vllm", ("0.25.1", "0.32.0", "0.33.0", "0.34.0")),
    ],
)
def test_adapter_status(adapter, engine, versions, monkeypatch):
    assert engine == adapter.ENGINE
    assert engine == adapter.DISTRIBUTION
    assert versions == adapter.SUPPORTED_VERSIONS
    version = installed_version(engine)

    status = adapter.status(KVCoreConfig(enable={engine}))
    assert status.engine == engine
    assert status.enabled
    assert status.installed is (version is not None)
    assert status.version == version
    assert status.supported_versions == list(versions)
    assert status.patched_targets == []

    assert not adapter.status(KVCoreConfig()).enabled
    other = next(e for e in ("sglang", "vllm") if e != engine)
    monkeypatch.setenv("KVCORE_ENABLE", other)
    assert not adapter.status().enabled
    monkeypatch.setenv("KVCORE_ENABLE", f"{other},{engine}")
    assert adapter.status().enabled


def test_adapters_and_cli_import_only_kvcore_and_the_standard_library():
    heavy = ("torch", "numpy", "sglang", "vllm", "triton")
    script = textwrap.dedent(
        f"""
        import sys
        import kvcore_sglang, kvcore_vllm, kvcore.cli
        from kvcore.config import KVCoreConfig
        kvcore_sglang.status(); kvcore_vllm.status()
        enabled = KVCoreConfig(enable={{"sglang", "vllm"}}, transfers=True)
        kvcore_sglang.status(enabled); kvcore_vllm.status(enabled)
        print([m for m in sys.modules if m.split(".")[0] in {heavy!r}])
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
