"""Root conftest for vLLM's offload tests, staged by ci/run_vllm_upstream.sh.

It stands in for the sdist's own root conftest, which imports vLLM's whole model zoo:
it provides only the fixtures the offload tests use, registers their markers, and
loads vLLM's general plugins the way every vLLM process does. ``UPSTREAM_TESTS_MODE``
says which spec vLLM's default offloading name must resolve to: vLLM's own in stock
mode, kvcore's in plugin, patched and classes mode; any other state stops the run before a
test. With kvcore's spec, the tests in ``kvcore_differences.txt`` (beside this file) are
strict xfails: they check vLLM's own class by identity.

In classes mode, vLLM's tests also meet kvcore's classes under stock's names: the CPU
manager module's ``CPUOffloadingManager`` is kvcore's manager before any test module
imports it, so vLLM's manager tests drive kvcore's chunk pool. What kvcore does
differently by design is listed, with why, in ``kvcore_class_differences.txt``; those
tests are strict xfails there.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

EXPECTED_SPEC = {
    "stock": "vllm.",
    "plugin": "kvcore_vllm.spec.",
    "patched": "kvcore_vllm.spec.",
    "classes": "kvcore_vllm.spec.",
}
DEFAULT_SPEC_NAME = "CPUOffloadingSpec"
DIFFERENCES = Path(__file__).with_name("kvcore_differences.txt")
CLASS_DIFFERENCES = Path(__file__).with_name("kvcore_class_differences.txt")
MARKERS = (
    "cpu_test: runs on CPU (vLLM's own marker)",
    "skip_global_cleanup: vLLM's marker for tests that need no distributed cleanup",
)

_SPEC_KEY = pytest.StashKey[str]()
_KVCORE_KEY = pytest.StashKey[bool]()
_CLASSES_KEY = pytest.StashKey[bool]()
# How many times vLLM's factory resolved the default spec name during the run.
_resolutions = {"count": 0}


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    mode = os.environ.get("UPSTREAM_TESTS_MODE", "")
    if mode not in EXPECTED_SPEC:
        raise pytest.UsageError(
            f"UPSTREAM_TESTS_MODE must be one of {', '.join(EXPECTED_SPEC)}, not {mode!r}"
        )
    spec_cls = _load_plugins()
    spec_name = f"{spec_cls.__module__}.{spec_cls.__qualname__}"
    if not spec_name.startswith(EXPECTED_SPEC[mode]):
        raise pytest.UsageError(
            f"{mode} mode, but vLLM's {DEFAULT_SPEC_NAME} resolves to {spec_name}"
        )
    config.stash[_SPEC_KEY] = f"{mode} mode: {DEFAULT_SPEC_NAME} -> {spec_name}"
    config.stash[_KVCORE_KEY] = mode != "stock"
    config.stash[_CLASSES_KEY] = mode == "classes"
    if mode == "classes":
        config.stash[_SPEC_KEY] += f"; {_put_kvcore_classes_in_place()}"


def _put_kvcore_classes_in_place() -> str:
    """kvcore's manager under the name of vLLM's, before test modules import it."""
    from vllm.v1.kv_offload.cpu import manager

    from kvcore_vllm.manager import KVCoreCPUOffloadingManager

    manager.CPUOffloadingManager = KVCoreCPUOffloadingManager  # type: ignore[misc]
    return "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager -> kvcore's manager"


def _load_plugins() -> type:
    """Load vLLM's general plugins and count default-spec resolutions; the resolved class."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    load_general_plugins()
    loader = OffloadingSpecFactory._registry[DEFAULT_SPEC_NAME]

    def counting_loader() -> type:
        _resolutions["count"] += 1
        return loader()

    OffloadingSpecFactory._registry[DEFAULT_SPEC_NAME] = counting_loader
    return loader()


def kvcore_differences(text: str) -> dict[str, str]:
    """Node id (its parametrised cases too) -> reason, from ``NODE_ID  reason`` lines."""
    differences: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            node_id, _, reason = line.strip().partition(" ")
            differences[node_id] = reason.strip()
    return differences


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.stash[_KVCORE_KEY]:
        return
    differences = kvcore_differences(DIFFERENCES.read_text(encoding="utf-8"))
    if config.stash[_CLASSES_KEY]:
        differences |= kvcore_differences(CLASS_DIFFERENCES.read_text(encoding="utf-8"))
    for item in items:
        for prefix, reason in differences.items():
            if item.nodeid == prefix or item.nodeid.startswith(prefix + "["):
                item.add_marker(pytest.mark.xfail(reason=f"kvcore: {reason}", strict=True))


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvcore: {config.stash[_SPEC_KEY]}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(
        f"kvcore: {terminalreporter.config.stash[_SPEC_KEY]}; "
        f"resolved {_resolutions['count']} times during the run"
    )
    # Threads a test left running compete with the timing-sensitive tests that follow.
    alive = Counter(
        re.sub(r"\d+", "N", thread.name)
        for thread in threading.enumerate()
        if thread is not threading.main_thread()
    )
    listed = ", ".join(f"{name} x{count}" for name, count in sorted(alive.items()))
    terminalreporter.write_line(f"kvcore: threads alive at the end: {listed or 'none'}")


@pytest.fixture()
def default_vllm_config() -> Iterator[object]:
    """A default VllmConfig made current, for code that reads get_current_vllm_config()."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let vLLM's records reach the root logger, where caplog listens."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    # vLLM re-applies its logging config when an engine starts; keep propagation on there too.
    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(
    temporary_enable_log_propagate: None, caplog: pytest.LogCaptureFixture
) -> Iterator[pytest.LogCaptureFixture]:
    """caplog that sees vLLM's INFO records."""
    with caplog.at_level(logging.INFO):
        yield caplog
