"""benchmarks.phase_timer: inclusive time in named functions while switched on, and every
attribute put back afterwards."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator

import pytest

from benchmarks import phase_timer


class Base:
    def inherited(self) -> str:
        return "base"


class Child(Base):
    def own(self, pause: float) -> float:
        time.sleep(pause)
        return pause

    @staticmethod
    def static() -> None:
        return None


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    """A module whose function calls another of its own through the module."""
    made = types.ModuleType("phase_timer_subject")

    def inner(pause: float) -> float:
        time.sleep(pause)
        return pause

    def outer(pause: float) -> float:
        return made.inner(pause) + made.inner(pause)

    made.inner, made.outer = inner, outer  # type: ignore[attr-defined]
    sys.modules[made.__name__] = made
    yield made
    del sys.modules[made.__name__]


def test_times_are_inclusive_counted_only_while_on_and_the_functions_come_back(
    module: types.ModuleType,
) -> None:
    inner, outer = module.inner, module.outer
    targets = ("phase_timer_subject:outer", "phase_timer_subject:inner")
    with phase_timer.timing(targets) as times:
        assert module.outer(0.001) == 0.002  # off: not counted
        times.on = True
        assert module.outer(0.002) == 0.004
        times.on = False
    assert times.calls == {"phase_timer_subject:outer": 1, "phase_timer_subject:inner": 2}
    # inner ran twice inside outer: outer's time holds both.
    assert times.seconds["phase_timer_subject:inner"] >= 0.004
    assert times.seconds["phase_timer_subject:outer"] >= times.seconds["phase_timer_subject:inner"]
    assert module.inner is inner and module.outer is outer
    table = times.table(2, (*targets, "phase_timer_subject:never"))
    lines = table.splitlines()
    assert lines[1].split()[1:] == ["0.5", "phase_timer_subject:outer"]
    assert lines[2].split()[1:] == ["1.0", "phase_timer_subject:inner"]
    assert lines[3].split() == ["0.0", "0.0", "phase_timer_subject:never"]


def test_methods_own_and_inherited_are_timed_and_restored() -> None:
    target = f"{__name__}:Child"
    with phase_timer.timing((f"{target}.own", f"{target}.inherited")) as times:
        times.on = True
        assert Child().own(0.0) == 0.0
        assert Child().inherited() == "base"
    assert times.calls == {f"{target}.own": 1, f"{target}.inherited": 1}
    assert "inherited" not in vars(Child)  # taken from Base again, not left on Child
    assert vars(Child)["own"] is Child.own and Child().inherited() == "base"


def test_a_failing_call_is_still_timed_and_bad_targets_say_why(
    module: types.ModuleType,
) -> None:
    def fails(pause: float) -> float:
        raise RuntimeError("inside")

    module.inner = fails
    with phase_timer.timing(("phase_timer_subject:inner",)) as times:
        times.on = True
        with pytest.raises(RuntimeError, match="inside"):
            module.outer(0.0)
    assert times.calls == {"phase_timer_subject:inner": 1}
    bad = {
        "module:attribute": ("phase_timer_subject",),
        "has no missing": ("phase_timer_subject:missing",),
        # A bad target after a good one leaves the good one restored.
        "static": ("phase_timer_subject:outer", f"{__name__}:Child.static"),
    }
    for says, targets in bad.items():
        with pytest.raises(ValueError, match=says), phase_timer.timing(targets):
            pass
    assert module.inner is fails and not hasattr(module.outer, "__wrapped__")
