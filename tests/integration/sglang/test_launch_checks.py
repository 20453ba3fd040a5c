"""``kvcore launch sglang``'s checks against the installed SGLang's own argument parser:
the flags they look for exist, and HiCache is on exactly when kvcore does not warn."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("sglang.srt.server_args", reason="needs SGLang installed")

from sglang.srt.server_args import ServerArgs

from kvcore.config import KVCoreConfig
from kvcore.engine_args import EngineArgs
from kvcore_sglang import launch_checks
from kvcore_sglang.served_layouts import IO_BACKENDS, SERVED_LAYOUTS

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((action for action in parser._actions if flag in action.option_strings), None)


# Spellings a release may lack: 0.5.22 has no --enable-hicache alias.
NEWER_SPELLINGS = {"--enable-hicache"}


def test_the_flags_and_choices_kvcore_names_are_sglangs(parser):
    for flag in launch_checks.HICACHE_FLAGS:
        action = option(parser, flag)
        if action is None and flag in NEWER_SPELLINGS:
            continue
        assert action is not None and action.nargs == 0  # a switch
    assert set(SERVED_LAYOUTS) <= set(option(parser, "--hicache-mem-layout").choices)
    assert IO_BACKENDS.issubset(option(parser, "--hicache-io-backend").choices)
    assert "decode" in option(parser, "--disaggregation-mode").choices


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--enable-hierarchical-cache"],
        ["--enable-hicache", "--hicache-ratio", "2"],
        ["--hicache-ratio", "2", "--hicache-mem-layout", "layer_first"],
        ["--disaggregation-mode", "prefill"],
        ["--disaggregation-mode=decode"],
        ["--disaggregation-decode-enable-offload-kvcache"],
    ],
)
def test_no_hicache_warning_exactly_when_sglang_keeps_a_host_pool(parser, argv):
    missing = [flag for flag in argv if flag in NEWER_SPELLINGS and option(parser, flag) is None]
    if missing:
        pytest.skip(f"this SGLang has no {missing[0]}")
    args = parser.parse_args(["--model-path", "m", *argv])
    host_pool = (
        args.enable_hierarchical_cache
        or args.disaggregation_decode_enable_offload_kvcache
        or args.disaggregation_mode == "decode"
    )
    config = KVCoreConfig(enable={"sglang"})
    warnings = launch_checks.idle_warnings(EngineArgs.of(argv), {}, config)
    assert warnings == ([] if host_pool else [launch_checks.NO_HICACHE])
