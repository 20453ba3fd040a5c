"""classes-gpu mode of ci/vllm_upstream (vLLM's GPU transfer tests against kvcore's handler)
and scripts/vllm_upstream_gpu.sh's staging, on stand-ins: no vLLM, no GPU."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import tarfile
from collections import Counter
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from ci.vllm_upstream import conftest, stage

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "vllm_upstream_gpu.sh"
GPU_TESTS = "tests/v1/kv_offload/cpu/test_gpu_worker.py"
ATTRIBUTES = ("_store_handler", "_load_handler", "_expedited_load_handler")


class StockHandler:
    def __init__(self) -> None:
        self.src_tensors = ["gpu"]
        self.dst_tensors = ["cpu"]
        self._transfers: list[SimpleNamespace] = []


class KVCoreHandler:
    """What the conftest's subclass relies on in kvcore's handler: ``_stock`` (a
    StockCopies) and ``_jobs``; even job ids are copied here, odd ones by stock."""

    def __init__(self, stock: StockHandler) -> None:
        self._stock = SimpleNamespace(
            handler=stock,
            src_tensors=stock.src_tensors,
            dst_tensors=stock.dst_tensors,
            layer_refs_per_group=[["ref"]],
        )
        self._jobs: list[SimpleNamespace] = []

    def transfer_async(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        job = SimpleNamespace(job_id=job_id)
        if job_id % 2:
            self._stock.handler._transfers.append(job)
        else:
            self._jobs.append(job)
        return True


class StockWorker:
    def __init__(self, kv_caches: Any = None) -> None:
        self._store_handler = StockHandler()
        self._load_handler = StockHandler()


def test_the_handler_shows_stocks_state_under_stocks_names_and_counts_who_copied() -> None:
    jobs: Counter[str] = Counter()
    cls = conftest.stock_named_handler(KVCoreHandler, "kv_cache_groups_data_refs", jobs)
    stock = StockHandler()
    handler = cls(stock)
    assert issubclass(cls, KVCoreHandler)
    assert handler.src_tensors is stock.src_tensors
    assert handler.dst_tensors is stock.dst_tensors
    assert handler.kv_cache_groups_data_refs == [["ref"]]
    for job_id in (1, 2, 4):
        assert handler.transfer_async(job_id, None, None)
    # In flight: the jobs kvcore queued and those it handed to stock.
    assert sorted(t.job_id for t in handler._transfers) == [1, 2, 4]
    assert jobs == {"kvcore": 2, "stock": 1}


def test_the_worker_gets_kvcores_handlers_under_stocks_name() -> None:
    kv_caches_seen = []

    def put_in_place(worker: Any, kv_caches: Any) -> list[str]:
        kv_caches_seen.append(kv_caches)
        for attribute in ("_store_handler", "_load_handler"):
            setattr(worker, attribute, KVCoreHandler(getattr(worker, attribute)))
        return ["_store_handler", "_load_handler"]

    cls = conftest.kvcore_worker(StockWorker, put_in_place, ATTRIBUTES, KVCoreHandler)
    worker = cls()
    kv_caches = object()
    cls(kv_caches)
    cls(kv_caches=kv_caches)
    # The worker's KV caches reach kvcore's step, as kvcore's spec passes them.
    assert kv_caches_seen == [None, kv_caches, kv_caches]
    assert cls.__name__ == "StockWorker" and isinstance(worker, StockWorker)
    assert isinstance(worker._store_handler, KVCoreHandler)
    assert isinstance(worker._load_handler, KVCoreHandler)


@pytest.mark.parametrize(
    ("replaced", "left"),
    [((), "_store_handler, _load_handler"), (("_store_handler",), "_load_handler")],
)
def test_a_worker_left_with_a_stock_handler_fails_to_build(
    replaced: tuple[str, ...], left: str
) -> None:
    def put_in_place(worker: Any, kv_caches: Any) -> list[str]:
        for attribute in replaced:
            setattr(worker, attribute, KVCoreHandler(getattr(worker, attribute)))
        return list(replaced)

    cls = conftest.kvcore_worker(StockWorker, put_in_place, ATTRIBUTES, KVCoreHandler)
    with pytest.raises(AssertionError, match=f"did not replace stock's {left}$"):
        cls()


def test_modules_that_bound_stocks_worker_are_named() -> None:
    kvcore_class = conftest.kvcore_worker(StockWorker, lambda worker, kv_caches: [], (), object)
    early, late, unrelated = (ModuleType(name) for name in ("early", "late", "unrelated"))
    early.CPUOffloadingWorker = StockWorker  # type: ignore[attr-defined]
    late.CPUOffloadingWorker = kvcore_class  # type: ignore[attr-defined]
    assert conftest.stock_workers_bound([early, late, unrelated], kvcore_class) == ["early"]


def test_gpu_differences_name_gpu_tests() -> None:
    differences = conftest.kvcore_differences(stage.GPU_DIFFERENCES.read_text(encoding="utf-8"))
    for node_id, reason in differences.items():
        assert node_id.startswith(GPU_TESTS + "::test_") and reason


def test_entry_points_are_found_where_kvcore_is_not_installed(tmp_path: Path) -> None:
    stage.install_entry_points(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "kvcore"
    (plugin,) = dist.entry_points.select(group="vllm.general_plugins")
    assert (plugin.name, plugin.value) == ("kvcore", "kvcore_vllm.plugin:register")


def _fake_sdist(cache: Path, version: str) -> None:
    """An sdist tarball in ci/run_vllm_upstream.sh's cache layout, with the GPU tests (which
    import a helper of the sdist's) and a test the GPU stage must leave out."""
    root = cache / "src" / f"vllm-{version}"
    files = {
        GPU_TESTS: "from tests.utils import helper\n",
        "tests/utils.py": "helper = 1\n",
        "tests/__init__.py": "",
        "tests/conftest.py": "import the_model_zoo\n",
        "tests/v1/__init__.py": "",
        "tests/v1/kv_offload/__init__.py": "",
        "tests/v1/kv_offload/cpu/test_manager.py": "",
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    sdist = cache / "sdists" / f"vllm-{version}" / f"vllm-{version}.tar.gz"
    sdist.parent.mkdir(parents=True)
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(root, arcname=f"vllm-{version}")


def _script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "UPSTREAM_TESTS_CACHE": str(tmp_path / "cache"),
        "VLLM_VERSION": "9.9.9",
        "STAGE_DIR": str(tmp_path / "staged"),
        "VSITE": str(tmp_path / "no-vsite"),
        "OUT": str(tmp_path / "out"),
    }
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_stage_carries_only_the_sdist_files_the_gpu_tests_need(tmp_path: Path) -> None:
    _fake_sdist(tmp_path / "cache", "9.9.9")
    staged = _script(tmp_path, "stage")
    assert staged.returncode == 0, staged.stderr
    root = tmp_path / "staged" / "vllm-9.9.9"
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    # The sdist's root conftest (vLLM's model zoo) is left behind; ours comes at run time.
    assert found == sorted(
        [GPU_TESTS, "tests/utils.py", "tests/__init__.py", "tests/v1/__init__.py",
         "tests/v1/kv_offload/__init__.py"]
    )  # fmt: skip
    # run stops before pytest where the device has no vLLM under VSITE.
    ran = _script(tmp_path, "run")
    assert ran.returncode == 1 and "no vLLM under" in ran.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_stage_and_run_refuse_without_their_inputs(tmp_path: Path) -> None:
    staged = _script(tmp_path, "stage")
    assert staged.returncode == 1 and "ci/run_vllm_upstream.sh" in staged.stderr
    ran = _script(tmp_path, "run")
    assert ran.returncode == 1 and "carry .vllm-upstream-gpu" in ran.stderr
    assert _script(tmp_path).returncode == 2
