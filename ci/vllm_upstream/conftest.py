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

classes-gpu mode (scripts/vllm_upstream_gpu.sh, on a GPU) is classes mode with the worker
too: ``CPUOffloadingWorker`` in vLLM's worker module is stock's worker with its handlers
replaced the way kvcore's spec replaces them (``KVCORE_TRANSFERS=0`` is refused), so vLLM's
own transfer tests copy through kvcore's handler. Those tests read stock's handler state
(its tensors, layer references and in-flight transfers): kvcore's handler shows them under
stock's names, read from the very objects it copies with. A collected module that bound
stock's worker, or a worker left with a stock handler, stops the run; with the serve rule
off, so does a run in which kvcore copied no job itself. Differences by design are listed
in ``kvcore_gpu_differences.txt`` (strict xfails in that mode only).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

EXPECTED_SPEC = {
    "stock": "vllm.",
    "plugin": "kvcore_vllm.spec.",
    "patched": "kvcore_vllm.spec.",
    "classes": "kvcore_vllm.spec.",
    "classes-gpu": "kvcore_vllm.spec.",
}
DEFAULT_SPEC_NAME = "CPUOffloadingSpec"
DIFFERENCES = Path(__file__).with_name("kvcore_differences.txt")
CLASS_DIFFERENCES = Path(__file__).with_name("kvcore_class_differences.txt")
GPU_DIFFERENCES = Path(__file__).with_name("kvcore_gpu_differences.txt")
WORKER_NAME = "CPUOffloadingWorker"
MARKERS = (
    "cpu_test: runs on CPU (vLLM's own marker)",
    "skip_global_cleanup: vLLM's marker for tests that need no distributed cleanup",
)

_SPEC_KEY = pytest.StashKey[str]()
_KVCORE_KEY = pytest.StashKey[bool]()
_CLASSES_KEY = pytest.StashKey[bool]()
_GPU_KEY = pytest.StashKey[bool]()
# How many times vLLM's factory resolved the default spec name during the run.
_resolutions = {"count": 0}
# classes-gpu mode: jobs kvcore's handlers copied themselves ("kvcore") or handed to stock's.
_jobs: Counter[str] = Counter()


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    mode = os.environ.get("UPSTREAM_TESTS_MODE", "")
    if mode not in EXPECTED_SPEC:
        raise pytest.UsageError(
            f"UPSTREAM_TESTS_MODE must be one of {', '.join(EXPECTED_SPEC)}, not {mode!r}"
        )
    _build_cpu_configs_without_triton()
    spec_cls = _load_plugins()
    spec_name = f"{spec_cls.__module__}.{spec_cls.__qualname__}"
    if not spec_name.startswith(EXPECTED_SPEC[mode]):
        raise pytest.UsageError(
            f"{mode} mode, but vLLM's {DEFAULT_SPEC_NAME} resolves to {spec_name}"
        )
    config.stash[_SPEC_KEY] = f"{mode} mode: {DEFAULT_SPEC_NAME} -> {spec_name}"
    config.stash[_KVCORE_KEY] = mode != "stock"
    config.stash[_CLASSES_KEY] = mode in ("classes", "classes-gpu")
    config.stash[_GPU_KEY] = mode == "classes-gpu"
    if config.stash[_CLASSES_KEY]:
        config.stash[_SPEC_KEY] += f"; {_put_kvcore_classes_in_place()}"
    if config.stash[_GPU_KEY]:
        config.stash[_SPEC_KEY] += f"; {_put_kvcore_worker_in_place()}"


def _build_cpu_configs_without_triton() -> None:
    """From 0.34 vLLM's x86 CPU platform refuses to configure an engine without
    triton-cpu, which no package index carries for these lanes. The offload tests build
    configs and run no Triton kernel, so the check alone is told Triton is there, in every
    mode (stock's lane included); nothing else sees a changed ``HAS_TRITON``."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_with_triton(cls: type, vllm_config: Any) -> None:
        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    cpu.CpuPlatform.check_and_update_config = classmethod(check_with_triton)  # type: ignore[assignment]


def _put_kvcore_classes_in_place() -> str:
    """kvcore's manager under the name of vLLM's, before test modules import it."""
    from vllm.v1.kv_offload.cpu import manager

    from kvcore_vllm.manager import KVCoreCPUOffloadingManager

    manager.CPUOffloadingManager = KVCoreCPUOffloadingManager  # type: ignore[misc]
    return "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager -> kvcore's manager"


def _put_kvcore_worker_in_place() -> str:
    """Workers built from vLLM's worker module get kvcore's handlers, before test modules
    import it; install_handlers then builds handlers that show stock's state."""
    from vllm.v1.kv_offload.cpu import gpu_worker

    from kvcore.config import KVCoreConfig
    from kvcore_vllm import handler_install
    from kvcore_vllm.releases import installed_shape
    from kvcore_vllm.spec import put_handlers_in_place

    config = KVCoreConfig.from_env()
    if not config.transfers:
        raise pytest.UsageError(
            "classes-gpu mode needs kvcore's transfers: KVCORE_TRANSFERS=0 leaves the stock "
            "handlers in place"
        )
    handler = stock_named_handler(
        handler_install.KVCoreOffloadingHandler,
        installed_shape().name("layer_refs_per_group"),
        _jobs,
    )
    handler_install.KVCoreOffloadingHandler = handler  # type: ignore[misc]
    gpu_worker.CPUOffloadingWorker = kvcore_worker(  # type: ignore[misc]
        gpu_worker.CPUOffloadingWorker,
        put_handlers_in_place,
        handler_install.HANDLER_ATTRIBUTES,
        handler,
    )
    return (
        f"vllm.v1.kv_offload.cpu.gpu_worker.{WORKER_NAME} -> stock's with kvcore's handlers "
        f"(serve rule {'on' if config.serve_rule else 'off'})"
    )


def stock_named_handler(
    kvcore_handler: type[Any], layer_refs_name: str, jobs: Counter[str]
) -> type[Any]:
    """kvcore's handler class, showing what vLLM's tests read off stock's handler under
    stock's names, and counting in ``jobs`` who copied each job it was given.

    The tensors and layer references are the stock handler's own objects, which kvcore's
    handler copies with; the in-flight transfers are kvcore's queued jobs and those it
    handed to stock (both have ``job_id``), so "job 1 is in flight" means what it means
    for stock.
    """

    def layer_refs(self: Any) -> list[list[Any]]:
        refs: list[list[Any]] = self._stock.layer_refs_per_group
        return refs

    def transfer_async(self: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        queued = len(self._jobs)
        accepted: bool = kvcore_handler.transfer_async(self, job_id, src_spec, dst_spec)
        # kvcore's handler queues exactly the jobs it copies itself.
        jobs["kvcore" if len(self._jobs) > queued else "stock"] += 1
        return accepted

    namespace: dict[str, Any] = {
        "__doc__": stock_named_handler.__doc__,
        "src_tensors": property(lambda self: self._stock.src_tensors),
        "dst_tensors": property(lambda self: self._stock.dst_tensors),
        layer_refs_name: property(layer_refs),
        "_transfers": property(lambda self: [*self._jobs, *self._stock.handler._transfers]),
        "transfer_async": transfer_async,
    }
    return type(f"StockNamed{kvcore_handler.__name__}", (kvcore_handler,), namespace)


def kvcore_worker(
    stock_worker: type[Any],
    put_in_place: Callable[[Any, Any], list[str]],
    handler_attributes: Iterable[str],
    kvcore_handler: type[Any],
) -> type[Any]:
    """``stock_worker`` whose construction ends with ``put_in_place`` (kvcore's spec's own
    step), and fails unless every handler the worker holds is then ``kvcore_handler``: a
    warm-up that refused, or handlers on another device, must not pass as kvcore's."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock_worker.__init__(self, *args, **kwargs)
        # The worker's first argument is its KV caches (kvcore's spec passes them on too).
        put_in_place(self, kwargs.get("kv_caches", args[0] if args else None))
        left = [
            attribute
            for attribute in handler_attributes
            if getattr(self, attribute, None) is not None
            and not isinstance(getattr(self, attribute), kvcore_handler)
        ]
        if left:
            raise AssertionError(f"kvcore's handlers did not replace stock's {', '.join(left)}")

    return type(stock_worker.__name__, (stock_worker,), {"__init__": __init__})


def stock_workers_bound(modules: Iterable[Any], kvcore_class: type[Any]) -> list[str]:
    """The modules that bound a worker class other than ``kvcore_class`` (stock's, imported
    before the swap)."""
    return sorted(
        {
            module.__name__
            for module in modules
            if getattr(module, WORKER_NAME, kvcore_class) is not kvcore_class
        }
    )


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
    if config.stash[_GPU_KEY]:
        from vllm.v1.kv_offload.cpu import gpu_worker

        modules = {item.module for item in items if isinstance(item, pytest.Function)}
        early = stock_workers_bound(modules, gpu_worker.CPUOffloadingWorker)
        if early:
            raise pytest.UsageError(
                f"classes-gpu mode, but {', '.join(early)} bound stock's {WORKER_NAME}"
            )
    differences = kvcore_differences(DIFFERENCES.read_text(encoding="utf-8"))
    if config.stash[_CLASSES_KEY]:
        differences |= kvcore_differences(CLASS_DIFFERENCES.read_text(encoding="utf-8"))
    if config.stash[_GPU_KEY]:
        differences |= kvcore_differences(GPU_DIFFERENCES.read_text(encoding="utf-8"))
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
    if terminalreporter.config.stash[_GPU_KEY]:
        from kvcore.metrics import METRICS

        terminalreporter.write_line(
            f"kvcore: jobs copied by kvcore {_jobs['kvcore']}, handed to stock "
            f"{_jobs['stock']}; reasons: {METRICS.snapshot()['fallbacks'] or 'none'}"
        )
        from kvcore_vllm.transfers import INTERNAL_ERRORS

        for reason, message in INTERNAL_ERRORS.seen().items():
            terminalreporter.write_line(f"kvcore: {reason}, first seen: {message}")
        if _copied_nothing(terminalreporter.config):
            terminalreporter.write_line(
                "kvcore: FAILED: the serve rule is off, yet kvcore copied no job itself"
            )


def _copied_nothing(config: pytest.Config) -> bool:
    """classes-gpu mode with the serve rule off, and every job went to stock: only
    correctness can send a job there, so the tests passed without kvcore's own copies."""
    if not config.stash.get(_GPU_KEY, False) or _jobs["kvcore"] or not _jobs["stock"]:
        return False
    from kvcore.config import KVCoreConfig

    return not KVCoreConfig.from_env().serve_rule


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.OK and _copied_nothing(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
