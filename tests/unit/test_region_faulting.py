"""kvcore_vllm.region_faulting on a stand-in for vLLM's region module: kvcore faults the
mapping in first, then hands back the module's own function, and puts it back after."""

from __future__ import annotations

import mmap
from types import SimpleNamespace
from typing import Any

import pytest

from kvcore.host_mapping import mapping_address
from kvcore_vllm import region_faulting
from tests.support.resident import resident_pages


def _module() -> Any:
    asked: list[mmap.mmap] = []

    def own(mapping: mmap.mmap) -> Any:
        asked.append(mapping)
        return "vllm's populate function"

    return SimpleNamespace(_get_populate_write_fn=own, asked=asked)


def _resident(mapping: mmap.mmap) -> int:
    return resident_pages(mapping_address(mapping), len(mapping))[0]


def test_the_mapping_is_faulted_in_before_vllms_function_is_handed_back():
    module = _module()
    own = module._get_populate_write_fn
    failures: list[Exception] = []
    mapping = mmap.mmap(-1, 29 * mmap.PAGESIZE)
    assert _resident(mapping) == 0
    with region_faulting.faulted_by_every_cpu(module, None, failures.append):
        assert module._get_populate_write_fn(mapping) == "vllm's populate function"
    assert _resident(mapping) == 29 and mapping[:] == bytes(len(mapping))
    assert module.asked == [mapping] and failures == []
    assert module._get_populate_write_fn is own
    mapping.close()  # kvcore kept no export of it


def test_a_failure_is_reported_and_vllms_function_still_handed_back(monkeypatch):
    module = _module()
    own = module._get_populate_write_fn
    failures: list[Exception] = []

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(region_faulting, "fault_in", refused)
    mapping = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    with region_faulting.faulted_by_every_cpu(module, None, failures.append):
        assert module._get_populate_write_fn(mapping) == "vllm's populate function"
    assert [type(f) for f in failures] == [OSError] and _resident(mapping) == 0
    assert module._get_populate_write_fn is own
    mapping.close()


def test_the_module_gets_its_function_back_when_the_block_raises():
    module = _module()
    own = module._get_populate_write_fn
    with pytest.raises(RuntimeError), region_faulting.faulted_by_every_cpu(module, None, print):
        raise RuntimeError("vLLM's worker failed")
    assert module._get_populate_write_fn is own
