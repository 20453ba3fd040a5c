"""benchmarks.attribute_swap: stand-ins for a block, every attribute put back after."""

from __future__ import annotations

import types

import pytest

from benchmarks.attribute_swap import swapped_attributes


class _Base:
    def inherited(self) -> str:
        return "base"


class _Child(_Base):
    own = "child"


def test_own_inherited_and_absent_attributes_come_back_as_they_were() -> None:
    module = types.ModuleType("stand_in_target")
    module.present = 1  # type: ignore[attr-defined]
    with swapped_attributes() as swap:
        swap(_Child, "own", "swapped")
        swap(_Child, "inherited", lambda self: "swapped")
        swap(module, "present", 2)
        swap(module, "absent", 3)
        # A second swap of one name still restores what was there before the first.
        swap(module, "present", 4)
        assert _Child.own == "swapped" and _Child().inherited() == "swapped"
        assert module.present == 4 and module.absent == 3  # type: ignore[attr-defined]
    assert _Child.own == "child"
    assert "inherited" not in vars(_Child) and _Child().inherited() == "base"
    assert module.present == 1  # type: ignore[attr-defined]
    assert not hasattr(module, "absent")


def test_a_failing_block_still_puts_everything_back() -> None:
    module = types.ModuleType("stand_in_target")
    module.present = 1  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="inside"), swapped_attributes() as swap:
        swap(module, "present", 2)
        swap(module, "absent", 3)
        raise RuntimeError("inside")
    assert module.present == 1 and not hasattr(module, "absent")  # type: ignore[attr-defined]
