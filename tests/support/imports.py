"""The project's modules and the imports each makes, read from source with ast (nothing is
imported), for the tests of the import structure."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Measuring code: the core suite shipped with kvcore, and the checkout's engine benches.
BENCH_PACKAGES = ("kvcore.bench", "benchmarks")


def is_bench(name: str) -> bool:
    return any(name == bench or name.startswith(bench + ".") for bench in BENCH_PACKAGES)


def is_module(name: str) -> bool:
    for base in (ROOT, ROOT / "integrations"):
        path = base.joinpath(*name.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


def product_modules() -> dict[str, Path]:
    """Dotted name -> file of every product module: kvcore's outside kvcore/bench and both
    adapters'."""
    roots = [
        (ROOT, ROOT / "kvcore"),
        (ROOT / "integrations", ROOT / "integrations" / "kvcore_sglang"),
        (ROOT / "integrations", ROOT / "integrations" / "kvcore_vllm"),
    ]
    modules = {}
    for base, package in roots:
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if not is_bench(name):
                modules[name] = path
    return modules


def imported_modules(
    module: str,
    source: str,
    wanted: Callable[[str], bool],
    *,
    is_package: bool = False,
    strings: bool = True,
) -> list[tuple[str, bool]]:
    """(module named, whether inside a function) for each import in ``source`` of ``module``
    of a module ``wanted`` accepts, and (``strings``) each string constant naming one, what
    ``importlib.import_module`` would load. ``from M import name`` names ``M.name`` where
    that is a module, else ``M``."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [
                f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base
                for alias in node.names
            ]
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        found.extend((name, in_function) for name in dict.fromkeys(names) if wanted(name))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(source), False)
    return found
