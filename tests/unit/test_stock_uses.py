"""tests.support.stock_uses on an engine tree and adapter written here: no engine needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.stock_uses import EngineSource, StockUse, stock_uses

ENGINE_FILES = {
    "eng/__init__.py": "",
    "eng/base.py": """
import abc


class Base(abc.ABC):
    def __init__(self, size):
        self.size = size

    def shutdown(self):
        pass

    def reset(self):
        pass


def describe(pool):
    return str(pool)
""",
    "eng/ops.py": """
def fast_copy(src, dst):
    pass


def slow_copy(src, dst):
    pass


def pick_copy(fast):
    return fast_copy if fast else slow_copy
""",
    "eng/pool/__init__.py": "from .impl import Pool as Pool\n",
    "eng/pool/impl.py": """
from eng import base
from eng.ops import pick_copy


class Pool(base.Base):
    def __init__(self, size, fast):
        super().__init__(size)
        self._copy = pick_copy(fast)
        self._fill = self._fill_fast if fast else self._fill_slow
        self.blocks = list(range(size))

    def _fill_fast(self, n):
        pass

    def _fill_slow(self, n):
        pass

    def alloc(self, n):
        return self.blocks[:n]

    def reset(self):
        self.blocks.clear()


class Record:
    def __init__(self, i):
        self.i = i
""",
}

ADAPTER = """
from eng.base import describe
from eng.pool import Pool
from eng.pool.impl import Record


class OurPool(Pool):
    def __init__(self, size):
        super().__init__(size, fast=True)

    def alloc(self, n):
        return [Record(i) for i in range(n)]

    def ours(self):
        return self.size


def run(stock, mine):
    stock._fill(4)
    stock._copy(1, 2)
    stock.shutdown()
    mine.__len__()
    describe(stock)
    return stock.blocks
"""


@pytest.fixture
def engine(tmp_path: Path) -> EngineSource:
    for relative, text in ENGINE_FILES.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return EngineSource(tmp_path, "eng")


def uses(engine: EngineSource, source: str, classes: tuple[str, ...] = ()) -> set[tuple[str, str]]:
    found = stock_uses({"ours.adapter": source}, engine, classes)
    return {(use.target, use.how) for use in found}


def test_every_kind_of_use_is_found(engine):
    assert uses(engine, ADAPTER) == {
        ("eng.pool.impl.Pool.__init__", "overrides"),
        ("eng.pool.impl.Pool.__init__", "calls through super()"),
        ("eng.pool.impl.Pool.alloc", "overrides"),
        ("eng.pool.impl.Record.__init__", "constructs"),
        ("eng.base.describe", "calls"),
        ("eng.base.Base.shutdown", "calls"),
        # _fill and _copy are bound on the instance: where, and to what.
        ("eng.pool.impl.Pool.__init__", "calls ._fill, bound here"),
        ("eng.pool.impl.Pool._fill_fast", "calls ._fill, bound to it"),
        ("eng.pool.impl.Pool._fill_slow", "calls ._fill, bound to it"),
        ("eng.pool.impl.Pool.__init__", "calls ._copy, bound here"),
        ("eng.ops.pick_copy", "calls ._copy, bound to it"),
    }


def test_uses_carry_their_site(engine):
    found = stock_uses({"ours.adapter": ADAPTER}, engine, ())
    line = ADAPTER.splitlines().index("    describe(stock)") + 1
    assert StockUse("eng.base.describe", f"ours.adapter:{line}", "calls") in found
    assert found == sorted(found)


def test_a_call_by_name_reaches_the_given_classes_through_their_bases(engine):
    source = "def run(pool):\n    pool.reset()\n    pool.shutdown()\n    pool.alloc(1)\n"
    assert uses(engine, source) == set()  # no engine class known to this module
    assert uses(engine, source, ("eng.pool.impl.Pool",)) == {
        ("eng.pool.impl.Pool.reset", "calls"),  # the subclass's, not Base's
        ("eng.base.Base.shutdown", "calls"),
        ("eng.pool.impl.Pool.alloc", "calls"),
    }
    assert uses(engine, source, ("eng.base.Base",)) == {
        ("eng.base.Base.reset", "calls"),
        ("eng.base.Base.shutdown", "calls"),
    }


def test_data_attributes_dunders_and_other_names_are_not_uses(engine):
    source = (
        "def run(pool):\n"
        "    pool.blocks.append(1)\n"  # append: no engine method of that name
        "    pool.__init__(3)\n"
        "    return pool.size, pool.blocks\n"
    )
    assert uses(engine, source, ("eng.pool.impl.Pool",)) == set()


def test_names_from_outside_the_engine_are_ignored(engine):
    source = (
        "import abc\nfrom collections import OrderedDict\n\n\n"
        "class Mine(abc.ABC):\n    def reset(self):\n        return OrderedDict()\n"
    )
    assert uses(engine, source, ("eng.pool.impl.Pool",)) == set()


def test_engine_imports_are_followed_to_their_definition(engine):
    assert engine.resolve("eng.pool", "Pool") == "eng.pool.impl.Pool"
    assert engine.resolve("eng.pool.impl", "pick_copy") == "eng.ops.pick_copy"
    assert engine.resolve("eng.pool.impl", "abc") is None
    lineage = [c.name for c in engine.lineage("eng.pool.impl.Pool")]
    assert lineage == ["eng.pool.impl.Pool", "eng.base.Base"]
