"""Stage vLLM's offload tests from an unpacked sdist into a scratch directory.

Only the selected test directories (or files) are copied, plus the sdist's ``tests`` modules they
import (followed transitively), the ``__init__.py`` of every package on the way and
the ``conftest.py`` files between them and the root. The sdist's root conftest is
replaced by ours (it imports vLLM's whole model zoo), and an offline Hugging Face cache
entry for ``facebook/opt-125m`` is built from the config we ship beside this file.
With ``--entry-points SITE``, SITE gets a metadata-only ``kvcore`` distribution holding
the entry points of the repository's pyproject.toml: where kvcore runs from a checkout on
PYTHONPATH rather than installed (the GPU machine), vLLM still finds its plugin there.
With ``--sdist-only``, only the sdist's files are copied (DEST is then an sdist subset that
stages the same selection again, with this checkout's conftest, where the sdist is not).

    python stage.py SDIST_ROOT DEST [--entry-points SITE] [--sdist-only] [SELECTED...]
"""

from __future__ import annotations

import argparse
import ast
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SELECTED = ("tests/v1/kv_offload", "tests/v1/kv_connector/unit/offloading_connector")
HERE = Path(__file__).resolve().parent
OUR_CONFTEST = HERE / "conftest.py"
# Read by our conftest from beside itself.
KVCORE_DIFFERENCES = HERE / "kvcore_differences.txt"
CLASS_DIFFERENCES = HERE / "kvcore_class_differences.txt"
GPU_DIFFERENCES = HERE / "kvcore_gpu_differences.txt"
OPT_CONFIG = HERE / "opt-125m" / "config.json"
HF_MODEL = "facebook/opt-125m"
# Any fixed 40-hex name: the offline cache only needs refs/main to point at it.
HF_REVISION = "0" * 40
PYPROJECT = HERE.parents[1] / "pyproject.toml"


def module_file(root: Path, module: str) -> Path | None:
    """The file of ``module`` (dotted, under ``root``), or None if the sdist lacks it."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_test_modules(path: Path, root: Path) -> set[str]:
    """Dotted names under ``tests`` that ``path`` imports, relative imports resolved."""
    package = path.relative_to(root).parent.parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            found.add(base)
            # ``from pkg import mod`` may name a submodule rather than an attribute.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "tests" or name.startswith("tests.")}


def closure(root: Path, selected: Iterable[str] = SELECTED) -> set[Path]:
    """Every sdist file the selected directories (or files) need, relative to ``root``."""
    wanted: set[Path] = set()
    queue: list[Path] = []
    for directory in selected:
        top = root / directory
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        if not files:
            raise SystemExit(f"{directory} is not in the sdist at {root}")
        wanted.update(files)
        queue.extend(p for p in files if p.suffix == ".py")
    while queue:
        path = queue.pop()
        for ancestor in _package_helpers(path, root):
            if ancestor not in wanted:
                wanted.add(ancestor)
                queue.append(ancestor)
        for module in imported_test_modules(path, root):
            found = module_file(root, module)
            if found is not None and found not in wanted:
                wanted.add(found)
                queue.append(found)
    return {p.relative_to(root) for p in wanted}


def _package_helpers(path: Path, root: Path) -> Iterable[Path]:
    directory = path.parent
    while directory != root:
        yield from (
            candidate
            for candidate in (directory / "__init__.py", directory / "conftest.py")
            if candidate.is_file() and candidate != root / "tests" / "conftest.py"
        )
        directory = directory.parent


def install_hf_cache(hub: Path) -> None:
    """A Hugging Face hub cache holding only our config.json for ``facebook/opt-125m``."""
    entry = hub / ("models--" + HF_MODEL.replace("/", "--"))
    snapshot = entry / "snapshots" / HF_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(OPT_CONFIG, snapshot / "config.json")
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(HF_REVISION, encoding="utf-8")


def install_entry_points(site: Path, pyproject: Path = PYPROJECT) -> Path:
    """A metadata-only distribution in ``site`` with ``pyproject``'s name, version and entry
    points: importlib.metadata finds them on sys.path, importing the code from elsewhere."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    info = site / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n",
        encoding="utf-8",
    )
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
            for group, points in groups.items()
        ),
        encoding="utf-8",
    )
    return info


def copy_closure(sdist_root: Path, dest: Path, selected: Iterable[str] = SELECTED) -> list[Path]:
    """The sdist files the selection needs, copied to the same places under ``dest``."""
    files = sorted(closure(sdist_root, selected))
    for relative in files:
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sdist_root / relative, target)
    return files


def stage(sdist_root: Path, dest: Path, selected: Iterable[str] = SELECTED) -> list[Path]:
    files = copy_closure(sdist_root, dest, selected)
    shutil.copyfile(OUR_CONFTEST, dest / "conftest.py")
    for differences in (KVCORE_DIFFERENCES, CLASS_DIFFERENCES, GPU_DIFFERENCES):
        shutil.copyfile(differences, dest / differences.name)
    install_hf_cache(dest / "hf" / "hub")
    return files


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist_root", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--entry-points", type=Path, metavar="SITE")
    parser.add_argument("--sdist-only", action="store_true")
    parser.add_argument("selected", nargs="*", default=list(SELECTED))
    args = parser.parse_args(argv)
    selected = tuple(args.selected)
    copy = copy_closure if args.sdist_only else stage
    files = copy(args.sdist_root, args.dest, selected)
    helpers = [str(p) for p in files if not str(p).startswith(selected)]
    print(f"staged {len(files)} files; helpers from the sdist: {', '.join(helpers)}")
    if args.entry_points is not None:
        print(f"entry points: {install_entry_points(args.entry_points)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
