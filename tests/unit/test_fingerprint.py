"""kvcore.fingerprint on source trees written here: no engine needed."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from kvcore.fingerprint import (
    SourceNotFound,
    drift,
    fingerprint_source,
    fingerprint_target,
    locate,
    normalised_source,
    package_root,
)

POOL = '''"""A pool."""

import functools


def helper(x):
    return x + 1


class Pool:
    size = 4

    @functools.cache
    def alloc(self, n):
        # why, on its own line
        if n > self.size:  # why, after code
            return None

        return helper(n)

    def free(self, i):
        return i
'''


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return write_tree(
        tmp_path,
        {"eng/__init__.py": "def top():\n    return 1\n", "eng/pool.py": POOL},
    )


def test_normalised_source_is_the_dedented_definition_without_comments_or_blank_lines():
    assert normalised_source(POOL, "Pool.alloc") == (
        "@functools.cache\n"
        "def alloc(self, n):\n"
        "    if n > self.size:\n"
        "        return None\n"
        "    return helper(n)\n"
    )
    assert normalised_source(POOL, "helper") == "def helper(x):\n    return x + 1\n"


def test_the_algorithm_is_pinned():
    # The adapters' recorded tables depend on these exact bytes being hashed.
    expected = hashlib.sha256(b"def helper(x):\n    return x + 1\n").hexdigest()
    assert fingerprint_source(POOL, "helper") == expected


def test_layout_and_comments_do_not_change_a_fingerprint():
    original = fingerprint_source(POOL, "Pool.alloc")
    reflowed = POOL.replace(
        "        if n > self.size:", "\n        # more\n        if n > self.size:   "
    )
    nested = "class Outer:\n" + "".join(
        f"    {line}\n" if line else "\n" for line in POOL.split("\n")
    )
    assert reflowed != POOL
    assert fingerprint_source(reflowed, "Pool.alloc") == original
    assert fingerprint_source(nested, "Outer.Pool.alloc") == original


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("return helper(n)", "return helper(n + 1)"),  # code
        ("    @functools.cache\n", ""),  # a decorator
        # Block structure: the return moves out of the if.
        (
            "            return None\n\n        return",
            "            return None\n            return",
        ),
    ],
    ids=["code", "decorator", "indentation"],
)
def test_code_changes_change_a_fingerprint(old, new):
    edited = POOL.replace(old, new)
    assert edited != POOL
    assert fingerprint_source(edited, "Pool.alloc") != fingerprint_source(POOL, "Pool.alloc")


def test_the_last_definition_wins_as_at_run_time():
    twice = POOL + "\n\ndef helper(x):\n    return x + 2\n"
    assert normalised_source(twice, "helper") == "def helper(x):\n    return x + 2\n"


def test_a_missing_definition_names_the_part_that_is_missing():
    with pytest.raises(SourceNotFound, match=r"^Pool\.grow is not defined$"):
        normalised_source(POOL, "Pool.grow")
    with pytest.raises(KeyError):  # callers that catch a KeyError keep working
        normalised_source(POOL, "Tank.alloc")


def test_locate_takes_the_longest_module_prefix(tree):
    assert locate("eng.pool.Pool.alloc", tree) == (tree / "eng/pool.py", "Pool.alloc")
    assert locate("eng.pool.helper", tree) == (tree / "eng/pool.py", "helper")
    assert locate("eng.top", tree) == (tree / "eng/__init__.py", "top")
    with pytest.raises(SourceNotFound, match=r"no module of other\.Pool\.alloc"):
        locate("other.Pool.alloc", tree)


def test_fingerprint_target_reads_the_tree(tree):
    assert fingerprint_target("eng.pool.Pool.alloc", tree) == fingerprint_source(POOL, "Pool.alloc")


def test_drift_says_by_target_what_differs(tree):
    recorded = {
        "eng.pool.Pool.alloc": fingerprint_source(POOL, "Pool.alloc"),
        "eng.pool.Pool.free": "f" * 64,
        "eng.pool.Pool.grow": "a" * 64,
        "eng.gone.Pool.alloc": "b" * 64,
    }
    assert drift(recorded, tree) == {
        "eng.pool.Pool.free": (
            f"source changed (fingerprint {fingerprint_source(POOL, 'Pool.free')[:12]}, "
            "recorded ffffffffffff)"
        ),
        "eng.pool.Pool.grow": (
            "cannot read its source: SourceNotFound: "
            f"Pool.grow is not defined in {tree / 'eng/pool.py'}"
        ),
        # No eng/gone.py: the package's __init__ is where the name would be.
        "eng.gone.Pool.alloc": (
            f"cannot read its source: SourceNotFound: gone is not defined in "
            f"{tree / 'eng/__init__.py'}"
        ),
    }
    asked = ["eng.pool.Pool.alloc", "eng.pool.helper"]
    assert drift(recorded, tree, targets=asked) == {"eng.pool.helper": "no fingerprint recorded"}
    assert drift({"eng.pool.Pool.alloc": recorded["eng.pool.Pool.alloc"]}, tree) == {}


def test_unparsable_source_is_reported_not_raised(tree):
    (tree / "eng/pool.py").write_text("class Pool:\n    def alloc(self\n", encoding="utf-8")
    reasons = drift({"eng.pool.Pool.alloc": "0" * 64}, tree)
    assert reasons["eng.pool.Pool.alloc"].startswith("cannot read its source: SyntaxError")


def test_the_installed_tree_is_found_without_importing_it(tree, monkeypatch):
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.delitem(sys.modules, "eng", raising=False)
    assert package_root("eng") == tree
    assert "eng" not in sys.modules
    assert fingerprint_target("eng.pool.Pool.free") == fingerprint_source(POOL, "Pool.free")
    assert drift({"eng.pool.Pool.free": "0" * 64})["eng.pool.Pool.free"].startswith(
        "source changed"
    )
    with pytest.raises(SourceNotFound, match="no_such_engine is not installed"):
        package_root("no_such_engine")


def test_an_imported_package_is_read_from_its_own_files(tree, tmp_path, monkeypatch):
    # Another copy first on the path: the imported module's files are the ones it runs.
    other = write_tree(tmp_path / "other", {"eng/__init__.py": "", "eng/pool.py": "X = 1\n"})
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.delitem(sys.modules, "eng", raising=False)
    import eng  # noqa: F401

    monkeypatch.syspath_prepend(str(other))
    try:
        assert package_root("eng") == tree
    finally:
        del sys.modules["eng"]
    assert package_root("eng") == other
