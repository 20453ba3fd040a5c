"""Measuring code stays apart from product code: no product module imports kvcore.bench or
the checkout's benchmarks package, and the wheel carries only the core suite.

Product modules are kvcore's outside kvcore/bench and both adapters'. The one way in is
``kvcore.cli`` reaching ``kvcore.bench.cli`` from inside a function, when ``bench`` is
the command. Imports are read from the source (ast), so a module that is never imported in
a test is checked too; a module name in a string (``importlib.import_module``) counts.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support.imports import ROOT, imported_modules, is_bench, product_modules

# (importing module, imported module) -> why it may; each must stay inside a function.
LAZY_ENTRY = {("kvcore.cli", "kvcore.bench.cli"): "`kvcore bench` dispatches to it"}


def bench_imports(module: str, source: str, *, is_package: bool = False) -> list[tuple[str, bool]]:
    """(kvcore.bench module named, whether inside a function) for each import of one, and
    each string constant naming one, in ``source`` of ``module``."""
    return imported_modules(module, source, is_bench, is_package=is_package)


def test_no_product_module_imports_the_bench_package() -> None:
    modules = product_modules()
    # The walk covers the core and both adapters, and leaves the bench package out.
    assert {"kvcore.mover", "kvcore.cli", "kvcore_sglang.transfers", "kvcore_vllm.transfers"} <= (
        set(modules)
    )
    offences = []
    entries_seen = set()
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        for imported, in_function in bench_imports(
            name, source, is_package=path.name == "__init__.py"
        ):
            if (name, imported) in LAZY_ENTRY and in_function:
                entries_seen.add((name, imported))
            else:
                offences.append(f"{name} imports {imported}")
    assert offences == []
    # The allowed entry is still how `kvcore bench` is reached, so it outlives no caller.
    assert entries_seen == set(LAZY_ENTRY)


def test_the_walk_finds_every_kind_of_bench_import() -> None:
    source = """
import kvcore.bench.suite
from kvcore import bench
from kvcore.bench.report import summarize
from ..bench import churn
import importlib
importlib.import_module("benchmarks.vllm.sweep")
import kvcore.benchmarks_elsewhere
from kvcore import mover
def run():
    from kvcore.bench import cli
"""
    found = bench_imports("kvcore.patching.cli", source)
    assert found == [
        ("kvcore.bench.suite", False),
        ("kvcore.bench", False),
        ("kvcore.bench.report", False),
        ("kvcore.bench.churn", False),
        ("benchmarks.vllm.sweep", False),
        ("kvcore.bench.cli", True),
    ]


def test_the_wheel_carries_the_core_suite_and_no_engine_bench() -> None:
    import tomllib

    packaging = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found = packaging["tool"]["setuptools"]["packages"]["find"]
    assert not any("benchmarks".startswith(p.rstrip("*")) for p in found["include"])
    engine_benches = {p.name for p in (ROOT / "kvcore" / "bench").iterdir() if p.is_dir()}
    assert engine_benches - {"__pycache__"} == set()


def test_the_bench_imports_no_engine_until_one_is_asked_for() -> None:
    # The suite and the dispatcher load without SGLang, vLLM or their adapters.
    code = (
        "import sys\n"
        "import kvcore.bench.cli, kvcore.bench.suite, benchmarks.sglang, benchmarks.vllm\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'sglang', 'vllm', 'kvcore_sglang', 'kvcore_vllm'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"
