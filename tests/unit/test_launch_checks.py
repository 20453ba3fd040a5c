"""What ``kvcore launch`` reads in an engine's command line and environment, case by case
(in process; tests/unit/test_launch.py runs the command itself)."""

from __future__ import annotations

import json

import pytest

from kvcore.config import KVCoreConfig
from kvcore.engine_args import EngineArgs
from kvcore_sglang import launch_checks as sglang_checks
from kvcore_vllm import launch_checks as vllm_checks

OFF = KVCoreConfig(enable={"sglang", "vllm"}, transfers=False)
TRANSFERS = KVCoreConfig(enable={"sglang", "vllm"})


def test_engine_args_read_flags_as_the_engines_do():
    args = EngineArgs.of(
        [
            "serve",
            "m",
            "--kv_offloading_size",
            "4",
            "--tp=2",
            "--kv-transfer-config.kv_role",
            "kv_both",
            "--kv-transfer-config.extra_x=1",
            "--tp",
            "8",
        ]
    )
    assert args.command == "serve"
    assert args.has("--kv-offloading-size") and args.has("--tp")
    assert not args.has("--kv-offloading-backend")
    assert args.value("--kv-offloading-size") == "4"
    assert args.value("--tp") == "8"  # the last one counts
    assert args.value("--kv-offloading-backend") is None
    assert args.dotted("--kv-transfer-config") == [(["kv_role"], "kv_both"), (["extra_x"], "1")]
    assert not args.opaque
    assert EngineArgs.of(["--port"]).value("--port") is None
    assert EngineArgs.of(["--model-path", "m"]).command is None


@pytest.mark.parametrize(
    "args", [["serve", "--help"], ["serve", "-h"], ["--version"], ["--config", "x.yaml"]]
)
def test_help_version_and_config_files_make_the_arguments_opaque(args):
    assert EngineArgs.of(args).opaque


def sglang_warnings(args, env=None, config=OFF):
    return sglang_checks.idle_warnings(EngineArgs.of(args), env or {}, config)


def vllm_warnings(args, env=None, config=OFF):
    return vllm_checks.idle_warnings(EngineArgs.of(args), env or {}, config)


NO_HICACHE = (
    "SGLang would run without HiCache, so kvcore would have nothing to serve: "
    "add --enable-hierarchical-cache"
)


@pytest.mark.parametrize(
    ("args", "env", "config", "expected"),
    [
        (["--model-path", "m"], {}, OFF, [NO_HICACHE]),
        (["--model-path", "m", "--tp", "2"], {}, TRANSFERS, [NO_HICACHE]),
        (["--enable-hierarchical-cache"], {}, OFF, []),
        (["--enable-hicache"], {}, OFF, []),
        (["--enable_hierarchical_cache"], {}, OFF, []),
        (["--disaggregation-mode", "decode"], {}, OFF, []),
        (["--disaggregation-mode", "prefill"], {}, OFF, [NO_HICACHE]),
        (["--disaggregation-decode-enable-offload-kvcache"], {}, OFF, []),
        (["--config", "server.yaml"], {}, OFF, []),
        (["--help"], {}, OFF, []),
        (["--enable-hicache"], {"SGLANG_PLUGINS": ""}, OFF, []),
        (["--enable-hicache"], {"SGLANG_PLUGINS": "other, kvcore"}, OFF, []),
        (
            ["--enable-hicache"],
            {"SGLANG_PLUGINS": "other,kvcore_x"},
            OFF,
            ["SGLANG_PLUGINS='other,kvcore_x' leaves out kvcore's plugin: add kvcore to it"],
        ),
        (["--enable-hicache", "--hicache-mem-layout", "page_head"], {}, OFF, []),
        (
            ["--enable-hicache", "--hicache-mem-layout=page_head"],
            {},
            TRANSFERS,
            [
                "kvcore's transfers do not serve --hicache-mem-layout page_head, so SGLang "
                "copies its own way: use layer_first, page_first, page_first_direct"
            ],
        ),
        (
            ["--enable-hicache", "--hicache-io-backend", "kernel_ascend"],
            {},
            TRANSFERS,
            [
                "kvcore's transfers do not serve --hicache-io-backend kernel_ascend, so SGLang "
                "copies its own way: use direct or kernel"
            ],
        ),
        (
            [
                "--enable-hicache",
                "--hicache-mem-layout",
                "page_first_direct",
                "--hicache-io-backend",
                "direct",
            ],
            {},
            TRANSFERS,
            [],
        ),
    ],
)
def test_sglang(args, env, config, expected):
    assert sglang_warnings(args, env, config) == expected


NO_OFFLOADING = (
    "vLLM would run without CPU offloading, so kvcore would have nothing to serve: "
    "add --kv-offloading-size <GiB>"
)
LMCACHE = (
    "--kv-offloading-backend lmcache offloads through another connector, which kvcore does "
    "not serve: use --kv-offloading-backend native"
)
SIMPLE = (
    "VLLM_USE_SIMPLE_KV_OFFLOAD picks SimpleCPUOffloadConnector, which kvcore does not serve: "
    "unset it"
)


def transfer_config(connector: str, **extra: str) -> list[str]:
    config = {"kv_connector": connector, "kv_role": "kv_both"}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(config)]


# An offloading connector among others counts.
MULTI_CONNECTOR = json.dumps(
    {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector"},
                {"kv_connector": "OffloadingConnector"},
            ]
        },
    }
)


def tiering_message(name: str) -> str:
    return (
        f"--kv-transfer-config names spec_name {name!r}, which kvcore leaves alone: drop "
        "spec_name, or name KVCoreCPUOffloadingSpec"
    )


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["serve", "m"], {}, [NO_OFFLOADING]),
        (["serve", "m", "--kv-offloading-size", "64"], {}, []),
        (["serve", "m", "--kv_offloading_size=64", "--kv-offloading-backend", "native"], {}, []),
        (
            ["serve", "m", "--kv-offloading-size", "64", "--kv-offloading-backend=lmcache"],
            {},
            [LMCACHE],
        ),
        (
            ["serve", "m", "--kv-offloading-size", "64"],
            {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"},
            [SIMPLE],
        ),
        (["serve", "m", "--kv-offloading-size", "64"], {"VLLM_USE_SIMPLE_KV_OFFLOAD": "0"}, []),
        (["serve", "m", *transfer_config("OffloadingConnector")], {}, []),
        (["serve", "m", *transfer_config("NixlConnector")], {}, [NO_OFFLOADING]),
        (
            [
                "serve",
                "m",
                *transfer_config("OffloadingConnector", spec_name="TieringOffloadingSpec"),
            ],
            {},
            [tiering_message("TieringOffloadingSpec")],
        ),
        (
            [
                *["serve", "m", "--kv-offloading-size", "8"],
                *transfer_config("NixlConnector", spec_name="TieringOffloadingSpec"),
            ],
            {},
            [tiering_message("TieringOffloadingSpec")],
        ),
        (
            [
                "serve",
                "m",
                *transfer_config("OffloadingConnector", spec_name="KVCoreCPUOffloadingSpec"),
            ],
            {},
            [],
        ),
        (
            ["serve", "m", "--kv-transfer-config", MULTI_CONNECTOR],
            {},
            [],
        ),
        (["serve", "m", "--kv-transfer-config.kv_connector", "OffloadingConnector"], {}, []),
        (
            [
                "serve",
                "m",
                "--kv-transfer-config.kv_connector=OffloadingConnector",
                "--kv-transfer-config.kv_connector_extra_config.spec_name",
                "Mine",
            ],
            {},
            [tiering_message("Mine")],
        ),
        (["serve", "m", "--kv-transfer-config", "{not json"], {}, []),
        (["serve", "--config", "serve.yaml"], {}, []),
        (["serve", "m", "--help"], {}, []),
        (["chat", "--url", "http://x"], {}, []),
        ([], {}, []),
        (["serve", "m", "--kv-offloading-size", "8"], {"VLLM_PLUGINS": "kvcore,other"}, []),
        (
            ["chat"],
            {"VLLM_PLUGINS": "other, kvcore"},
            ["VLLM_PLUGINS='other, kvcore' leaves out kvcore's plugin: add kvcore to it"],
        ),
        (
            ["serve", "m"],
            {"VLLM_PLUGINS": ""},
            ["VLLM_PLUGINS='' leaves out kvcore's plugin: add kvcore to it", NO_OFFLOADING],
        ),
    ],
)
def test_vllm(args, env, expected):
    assert vllm_warnings(args, env) == expected


@pytest.mark.parametrize(
    ("env", "host_pool", "expected"),
    [
        ({"SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS": "8"}, True, True),
        ({"SGLANG_HUGEPAGE_SIZE": "2MB"}, True, True),
        ({"SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS": "0"}, True, False),
        ({"SGLANG_HUGEPAGE_SIZE": "2MB"}, False, False),
    ],
)
def test_sglangs_own_host_allocation_leaves_kvcores_host_pool_idle(env, host_pool, expected):
    config = KVCoreConfig(enable={"sglang"}, transfers=False, host_pool=host_pool)
    (name,) = env
    line = (
        f"{name} is set, so SGLang obtains its host pools its own way and KVCORE_HOST_POOL "
        f"does nothing: unset {name} for kvcore's"
    )
    assert sglang_warnings(["--enable-hicache"], env, config) == ([line] if expected else [])


@pytest.mark.parametrize(
    ("page_size", "dma_in_place", "warned"),
    [("1", True, True), ("16", True, False), (None, True, False), ("1", False, False)],
)
def test_one_token_pages_leave_sglangs_dma_in_place_idle(page_size, dma_in_place, warned):
    config = KVCoreConfig(enable={"sglang"}, sglang_dma_in_place=dma_in_place)
    args = ["--enable-hicache", *(["--page-size", page_size] if page_size else [])]
    expected = [sglang_checks.ONE_TOKEN_PAGES] if warned else []
    assert sglang_warnings(args, {}, config) == expected


@pytest.mark.parametrize(
    ("backend", "pin_first", "warned"),
    [
        ("direct", 1 << 30, True),
        ("kernel", 1 << 30, False),
        (None, 1 << 30, False),
        ("direct", 0, False),
    ],
)
def test_pinning_in_steps_with_sglangs_direct_backend_is_named(backend, pin_first, warned):
    config = KVCoreConfig(enable={"sglang"}, host_pool_pin_first=pin_first)
    args = ["--enable-hicache", *(["--hicache-io-backend", backend] if backend else [])]
    found = sglang_warnings(args, {}, config)
    assert (sglang_checks.PIN_FIRST_DIRECT in found) is warned
