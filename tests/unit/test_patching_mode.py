"""Patched mode: whether a patched engine build runs kvcore's hooks, read from the environment."""

from __future__ import annotations

import logging

import pytest

from kvcore.patching.mode import patched_mode_enabled


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, True),  # a patched build is on by default
        ({"KVCORE_ENABLE": ""}, True),
        ({"KVCORE_ENABLE": "sglang"}, True),
        ({"KVCORE_ENABLE": "sglang,vllm"}, True),
        ({"KVCORE_ENABLE": "1"}, True),
        ({"KVCORE_ENABLE": "vllm"}, False),  # names another engine only
        ({"KVCORE_ENABLE": "0"}, False),
    ],
)
def test_on_unless_kvcore_enable_leaves_the_engine_out(environ, on):
    assert patched_mode_enabled("SGLang", "sglang", environ) is on


def test_a_bad_setting_turns_it_off_and_says_which(caplog):
    environ = {"KVCORE_ENABLE": "sglang", "KVCORE_STAGING_BYTES": "lots"}
    with caplog.at_level(logging.WARNING):
        assert patched_mode_enabled("SGLang", "sglang", environ) is False
    assert "KVCORE_STAGING_BYTES" in caplog.text


def test_both_adapters_use_this_rule():
    pytest.importorskip("torch")
    from kvcore_sglang import patched as sglang_patched
    from kvcore_vllm import patched as vllm_patched

    environ = {"KVCORE_ENABLE": "vllm"}
    assert sglang_patched.patched_mode_enabled(environ) is False
    assert vllm_patched.patched_mode_enabled(environ) is True
