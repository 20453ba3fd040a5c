"""kvcore.patching on a fake engine tree: generate, check, apply, revert, drift, the CLI."""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.cli import main
from kvcore.patching import apply as apply_module
from kvcore.patching import cli as patching_cli
from kvcore.patching.apply import FileState, PatchError, check
from kvcore.patching.generate import GenerateError, drift, generate, write_set
from kvcore.patching.patchset import DEFAULT_PATCHES_DIR, NoPatchSet, load_set
from kvcore.patching.spec import ADAPTER_SPECS, EngineSpec, PatchTarget
from kvcore.patching.tree import find_tree
from kvcore.patching.unified import apply_diff, make_diff, parse_diff

VERSION = "1.2.0"
HOOKS_MODULE = "fake_kvcore_hooks"
POOL_SOURCE = '''"""A pool."""\x0c
import functools


def locked(function):
    @functools.wraps(function)
    def wrapper(self, *args, **kwargs):
        self.calls.append("locked")
        return function(self, *args, **kwargs)

    return wrapper


class Pool:
    def __init__(self):
        self.calls = []

    @locked
    def alloc(self, n):\r
        return list(range(n))

    def free(self, slots):
        return len(slots)
'''
# No newline at the end, as some engine files are.
REGISTRY_SOURCE = 'class Factory:\n    _registry = {}\n\n\nFactory._registry["default"] = "stock"'
HOOKS_SOURCE = """CALLS = []


def hook(target, original):
    if not callable(original):
        return "kvcore"

    def hooked(*args, **kwargs):
        CALLS.append(target)
        return original(*args, **kwargs)

    hooked.kvcore_target = target
    return hooked
"""
TARGETS = (
    PatchTarget.from_dotted("fakeeng.pool.Pool.alloc"),
    PatchTarget.from_dotted("fakeeng.pool.Pool.free"),
    PatchTarget.from_dotted("fakeeng.registry.Factory._registry['default']"),
)
FILES = ("fakeeng/pool.py", "fakeeng/registry.py")


def function_fingerprint(source: str, qualname: str) -> str:
    class_name, name = qualname.split(".")
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    node = next(n for n in cls.body if getattr(n, "name", None) == name)
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()


RECORDED = {
    "fakeeng.pool.Pool.alloc": function_fingerprint(POOL_SOURCE, "Pool.alloc"),
    "fakeeng.pool.Pool.free": function_fingerprint(POOL_SOURCE, "Pool.free"),
}


def source_changes(version: str, root: Path) -> dict[str, str]:
    source = (root / "fakeeng/pool.py").read_text()
    return {
        target: "source changed"
        for target, expected in RECORDED.items()
        if function_fingerprint(source, target.removeprefix("fakeeng.pool.")) != expected
    }


SPEC = EngineSpec(
    engine="fakeeng",
    package="fakeeng",
    distribution="fakeeng",
    hook_module=HOOKS_MODULE,
    versions=(VERSION,),
    targets=lambda version: TARGETS,
    source_changes=source_changes,
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_tree(root: Path, version: str = VERSION) -> Path:
    package = root / "fakeeng"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (package / "pool.py").write_bytes(POOL_SOURCE.encode())
    (package / "registry.py").write_bytes(REGISTRY_SOURCE.encode())
    return root


@pytest.fixture
def tree_root(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "site")


@pytest.fixture
def patches_dir(tmp_path: Path, tree_root: Path) -> Path:
    directory = tmp_path / "patches"
    write_set(generate(SPEC, find_tree(SPEC, tree_root)), directory)
    return directory


@pytest.fixture
def fresh_import(tmp_path: Path) -> Iterator[Path]:
    """A directory for the hook module; the fake modules are forgotten afterwards."""
    hooks_dir = tmp_path / "hooks"
    hooks_dir.mkdir()
    saved_path = list(sys.path)
    yield hooks_dir
    sys.path[:] = saved_path
    for name in [n for n in sys.modules if n.split(".")[0] in ("fakeeng", HOOKS_MODULE)]:
        del sys.modules[name]
    importlib.invalidate_caches()


def apply_set(patches_dir: Path, root: Path, *, use_program: bool = False) -> list[str]:
    patch_set, directory = load_set(patches_dir, "fakeeng", VERSION)
    return apply_module.apply(patch_set, directory, find_tree(SPEC, root), use_program=use_program)


def revert_set(patches_dir: Path, root: Path, *, use_program: bool = False) -> list[str]:
    patch_set, directory = load_set(patches_dir, "fakeeng", VERSION)
    return apply_module.revert(patch_set, directory, find_tree(SPEC, root), use_program=use_program)


def states(patches_dir: Path, root: Path) -> dict[str, FileState]:
    patch_set, _ = load_set(patches_dir, "fakeeng", VERSION)
    return {r.file.path: r.state for r in check(patch_set, find_tree(SPEC, root))}


BACKENDS = [
    pytest.param(False, id="python"),
    pytest.param(
        True,
        id="patch-program",
        marks=pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch(1)"),
    ),
]


def test_generated_set_names_every_target_once(patches_dir):
    directory = patches_dir / "fakeeng" / VERSION
    assert sorted(p.name for p in directory.iterdir()) == [
        "fakeeng.pool.patch",
        "fakeeng.registry.patch",
        "manifest.json",
    ]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]] == list(FILES)
    pool_patch = (directory / "fakeeng.pool.patch").read_text()
    assert pool_patch.startswith("--- a/fakeeng/pool.py\n+++ b/fakeeng/pool.py\n")
    for target in TARGETS[:2]:
        line = f'+{target.expression} = _kvcore_hook("{target.target}", {target.expression})'
        assert pool_patch.count(line) == 1
    assert f"+    from {HOOKS_MODULE} import hook as _kvcore_hook\n" in pool_patch
    # Only added lines: the engine's own text is never edited.
    body = pool_patch.splitlines()[3:]
    assert not [line for line in body if line.startswith("-")]


@pytest.mark.parametrize("use_program", BACKENDS)
def test_apply_then_revert_restores_the_bytes(patches_dir, tree_root, use_program):
    before = {path: sha(tree_root / path) for path in FILES}
    other = sha(tree_root / "fakeeng/_version.py")
    assert apply_set(patches_dir, tree_root, use_program=use_program) == list(FILES)
    patch_set, _ = load_set(patches_dir, "fakeeng", VERSION)
    for file in patch_set.files:
        assert sha(tree_root / file.path) == file.patched_sha256 != before[file.path]
    assert set(states(patches_dir, tree_root).values()) == {FileState.APPLIED}
    assert apply_set(patches_dir, tree_root, use_program=use_program) == []  # already applied
    assert revert_set(patches_dir, tree_root, use_program=use_program) == list(FILES)
    assert {path: sha(tree_root / path) for path in FILES} == before
    assert sha(tree_root / "fakeeng/_version.py") == other
    assert revert_set(patches_dir, tree_root, use_program=use_program) == []
    assert not [p for p in tree_root.rglob("*") if "kvcore-" in p.name or p.suffix == ".orig"]


def test_both_backends_write_the_same_bytes(patches_dir, tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("needs patch(1)")
    by_program = write_tree(tmp_path / "by_program")
    in_python = write_tree(tmp_path / "in_python")
    apply_set(patches_dir, by_program, use_program=True)
    apply_set(patches_dir, in_python, use_program=False)
    for path in FILES:
        assert (by_program / path).read_bytes() == (in_python / path).read_bytes()


def test_applied_tree_imports_with_the_targets_hooked(patches_dir, tree_root, fresh_import):
    apply_set(patches_dir, tree_root)
    (fresh_import / f"{HOOKS_MODULE}.py").write_text(HOOKS_SOURCE)
    sys.path[:0] = [str(tree_root), str(fresh_import)]
    pool_module = importlib.import_module("fakeeng.pool")
    registry = importlib.import_module("fakeeng.registry")
    hooks = importlib.import_module(HOOKS_MODULE)
    pool = pool_module.Pool()
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.free([5, 6]) == 2
    assert hooks.CALLS == ["fakeeng.pool.Pool.alloc", "fakeeng.pool.Pool.free"]
    # The hook wraps the decorated method: the engine's own decorator still runs once.
    assert pool.calls == ["locked"]
    assert pool_module.Pool.alloc.kvcore_target == "fakeeng.pool.Pool.alloc"
    assert registry.Factory._registry["default"] == "kvcore"


def test_applied_tree_without_kvcore_runs_stock(patches_dir, tree_root, fresh_import):
    apply_set(patches_dir, tree_root)
    sys.path[:0] = [str(tree_root)]
    pool_module = importlib.import_module("fakeeng.pool")
    registry = importlib.import_module("fakeeng.registry")
    assert not hasattr(pool_module.Pool.alloc, "kvcore_target")
    assert pool_module.Pool().alloc(2) == [0, 1]
    assert registry.Factory._registry["default"] == "stock"


def test_check_reports_each_file(patches_dir, tree_root):
    assert states(patches_dir, tree_root) == dict.fromkeys(FILES, FileState.PRISTINE)
    registry = tree_root / "fakeeng/registry.py"
    registry.write_bytes(registry.read_bytes() + b"\n# a local edit\n")
    (tree_root / "fakeeng/pool.py").unlink()
    assert states(patches_dir, tree_root) == {
        "fakeeng/pool.py": FileState.MISSING,
        "fakeeng/registry.py": FileState.MODIFIED,
    }


def test_apply_refuses_a_tree_modified_elsewhere_and_changes_nothing(patches_dir, tree_root):
    registry = tree_root / "fakeeng/registry.py"
    registry.write_bytes(registry.read_bytes().replace(b"stock", b"local"))
    before = {path: sha(tree_root / path) for path in FILES}
    with pytest.raises(PatchError, match=r"fakeeng/registry.py: modified-elsewhere"):
        apply_set(patches_dir, tree_root)
    assert {path: sha(tree_root / path) for path in FILES} == before


def test_a_failed_write_puts_back_the_files_already_written(patches_dir, tree_root, monkeypatch):
    before = {path: sha(tree_root / path) for path in FILES}
    real_replace = apply_module.os.replace
    calls = []

    def failing_second_replace(source, destination):
        calls.append(destination)
        if len(calls) == 2:
            raise OSError("disk full")
        real_replace(source, destination)

    monkeypatch.setattr(apply_module.os, "replace", failing_second_replace)
    with pytest.raises(PatchError, match="disk full"):
        apply_set(patches_dir, tree_root)
    monkeypatch.undo()
    assert {path: sha(tree_root / path) for path in FILES} == before
    assert not [p for p in tree_root.rglob("*") if "kvcore-" in p.name]


def test_generate_names_a_changed_target_function(tree_root):
    pool = tree_root / "fakeeng/pool.py"
    pool.write_text(pool.read_text().replace("return len(slots)", "return 0"))
    with pytest.raises(GenerateError, match=r"fakeeng\.pool\.Pool\.free: source changed"):
        generate(SPEC, find_tree(SPEC, tree_root))


def test_generate_refuses_a_target_the_module_does_not_define(tree_root):
    missing = PatchTarget.from_dotted("fakeeng.pool.Pool.reset")
    spec = EngineSpec(**{**vars(SPEC), "targets": lambda version: (*TARGETS, missing)})
    with pytest.raises(GenerateError, match="Pool does not define reset"):
        generate(spec, find_tree(spec, tree_root))


def test_drift_check(patches_dir, tree_root):
    assert drift(generate(SPEC, find_tree(SPEC, tree_root)), patches_dir) == []
    # An upstream edit outside the targets changes the pristine bytes the set expects.
    registry = tree_root / "fakeeng/registry.py"
    registry.write_text("import os\n" + registry.read_text())
    problems = drift(generate(SPEC, find_tree(SPEC, tree_root)), patches_dir)
    assert len(problems) == 2
    assert any("fakeeng.registry.patch: differs" in p for p in problems)
    assert any("manifest.json: differs" in p for p in problems)


def test_unknown_version_is_refused_by_name(patches_dir, tmp_path):
    with pytest.raises(NoPatchSet, match=r"fakeeng 1\.3\.0 has no patch set .*fakeeng: 1\.2\.0"):
        load_set(patches_dir, "fakeeng", "1.3.0")
    with pytest.raises(GenerateError, match=r"fakeeng 1\.3\.0 has no fingerprints"):
        generate(SPEC, find_tree(SPEC, write_tree(tmp_path / "newer", "1.3.0")))


@pytest.fixture
def fake_engine_cli(monkeypatch):
    monkeypatch.setitem(ADAPTER_SPECS, "fakeeng", "unused")
    monkeypatch.setattr(patching_cli, "spec_for", lambda engine: SPEC)


def test_cli_round_trip(fake_engine_cli, patches_dir, tree_root, capsys):
    before = {path: sha(tree_root / path) for path in FILES}
    common = ["--engine", "fakeeng", "--target", str(tree_root), "--patches", str(patches_dir)]
    assert main(["patches", "check", *common]) == 0
    assert "fakeeng 1.2.0" in capsys.readouterr().out
    assert main(["patches", "apply", *common]) == 0
    assert main(["patches", "check", *common]) == 0
    out = capsys.readouterr().out
    assert out.count("applied") == 3  # the summary and both files
    assert main(["patches", "revert", *common, "--builtin"]) == 0
    assert {path: sha(tree_root / path) for path in FILES} == before
    assert main(["patches", "generate", *common, "--check"]) == 0
    capsys.readouterr()
    pool = tree_root / "fakeeng/pool.py"
    pool.write_text(pool.read_text().replace("list(range(n))", "list(range(n + 1))"))
    assert main(["patches", "generate", *common, "--check"]) == 1
    assert "fakeeng.pool.Pool.alloc: source changed" in capsys.readouterr().err


def test_cli_mixed_and_refused_states(fake_engine_cli, patches_dir, tree_root, capsys):
    common = ["--engine", "fakeeng", "--target", str(tree_root), "--patches", str(patches_dir)]
    registry = tree_root / "fakeeng/registry.py"
    registry.write_text(registry.read_text() + "\n")
    assert main(["patches", "check", *common]) == 1
    assert "mixed" in capsys.readouterr().out
    assert main(["patches", "apply", *common]) == 1
    assert "nothing changed" in capsys.readouterr().err
    assert main(["patches", "check", *common, "--version", "1.3.0"]) == 2
    assert "fakeeng 1.3.0 has no patch set" in capsys.readouterr().err


def test_cli_refuses_an_engine_release_with_no_patch_set(tmp_path, capsys):
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang-9.9.9.dist-info").mkdir()
    assert main(["patches", "apply", "--engine", "sglang", "--target", str(site)]) == 2
    assert "sglang 9.9.9 has no patch set" in capsys.readouterr().err


def test_committed_patch_sets_hook_exactly_their_manifest_targets(capsys):
    assert main(["patches", "list"]) == 0
    listed = capsys.readouterr().out
    for engine, module in ADAPTER_SPECS.items():
        spec = importlib.import_module(module).PATCH_SPEC
        for version in spec.versions:
            patch_set, directory = load_set(DEFAULT_PATCHES_DIR, engine, version)
            assert f"{version}  " in listed
            targets = {t.target: t for t in spec.targets(version)}
            assert {t for f in patch_set.files for t in f.targets} == set(targets)
            for file in patch_set.files:
                added = [
                    line[1:]
                    for line in (directory / file.patch).read_text().splitlines()
                    if line.startswith("+") and "= _kvcore_hook(" in line
                ]
                assert added == [
                    f"{targets[t].expression} = _kvcore_hook({json.dumps(t)}, "
                    f"{targets[t].expression})"
                    for t in file.targets
                ]


def test_find_tree_accepts_each_layout(tmp_path):
    site = write_tree(tmp_path / "site", "1.2.0+local")
    assert find_tree(SPEC, site) == find_tree(SPEC, site / "fakeeng")
    assert find_tree(SPEC, site).version == "1.2.0"  # the local label is not a release
    checkout = tmp_path / "checkout"
    shutil.copytree(site, checkout / "python")
    (checkout / "python/fakeeng/_version.py").unlink()
    with pytest.raises(LookupError, match="pass --version"):
        find_tree(SPEC, checkout)
    assert find_tree(SPEC, checkout, "1.2.0").root == checkout / "python"
    (checkout / "python/fakeeng-1.1.0.dist-info").mkdir()
    assert find_tree(SPEC, checkout).version == "1.1.0"
    with pytest.raises(LookupError, match="no fakeeng package"):
        find_tree(SPEC, tmp_path)


_LINE = st.text(alphabet="ab \t\x0c\r#", max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    old=st.lists(_LINE, max_size=30),
    new=st.lists(_LINE, max_size=30),
    old_end=st.booleans(),
    new_end=st.booleans(),
)
def test_diff_round_trip(old, new, old_end, new_end):
    old_text = "\n".join(old) + ("\n" if old_end and old else "")
    new_text = "\n".join(new) + ("\n" if new_end and new else "")
    diff = make_diff("a/f.py", "b/f.py", old_text, new_text)
    if old_text == new_text:
        assert diff == ""
        return
    [parsed] = parse_diff(diff)
    assert apply_diff(old_text, parsed) == new_text
    assert apply_diff(new_text, parsed, reverse=True) == old_text


def test_doctor_state_of_the_installed_engine(patches_dir, tree_root, monkeypatch):
    from kvcore.patching import status

    monkeypatch.setattr(status, "spec_for", lambda engine: SPEC)
    monkeypatch.setattr(status, "find_tree", lambda spec, target: find_tree(SPEC, tree_root))
    monkeypatch.setattr(status, "DEFAULT_PATCHES_DIR", patches_dir)
    assert status.installed_patch_state("fakeeng") == "pristine"
    apply_set(patches_dir, tree_root)
    assert status.installed_patch_state("fakeeng") == "applied"
    (tree_root / FILES[0]).write_text("# changed by hand\n")
    assert status.installed_patch_state("fakeeng").startswith("mixed: applied, ")
    monkeypatch.setattr(status, "DEFAULT_PATCHES_DIR", patches_dir / "elsewhere")
    assert status.installed_patch_state("fakeeng") == f"no patch set for fakeeng {VERSION}"
