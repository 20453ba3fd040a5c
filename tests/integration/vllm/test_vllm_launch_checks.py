"""``kvcore launch vllm``'s checks against the installed vLLM: its own parser reads the
arguments and its own config code picks the connector, and kvcore warns exactly when that
connector is not the offloading one with a spec kvcore serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import vllm.platforms
import vllm.plugins
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvcore.config import KVCoreConfig
from kvcore.engine_args import EngineArgs
from kvcore_vllm import launch_checks, plugin
from kvcore_vllm.plugin import DEFAULT_SPEC_NAME, SPEC_NAME

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def plugins_stay_here() -> Iterator[None]:
    """vLLM 0.25's argument parsing loads the general plugins, kvcore's among them (under
    KVCORE_ENABLE=vllm in the plugin lane): what they change ends with this module."""
    with pytest.MonkeyPatch.context() as patch, plugin.INSTALLATION.set_aside():
        patch.setattr(vllm.plugins, "plugins_loaded", vllm.plugins.plugins_loaded)
        patch.setattr(OffloadingSpecFactory, "_registry", dict(OffloadingSpecFactory._registry))
        yield


@pytest.fixture(scope="module")
def parser() -> Iterator[FlexibleArgumentParser]:
    with pytest.MonkeyPatch.context() as patch:
        # vLLM's parser loads the general plugins: kvcore's must stay inactive here (as in a
        # lane that enables it for the whole run), or it would register its offloading spec
        # for every later test of the process.
        patch.delenv("KVCORE_ENABLE", raising=False)
        # Parsing builds device and transfer configs, which ask the platform for a device:
        # lend one where none was detected (no GPU here).
        if not vllm.platforms.current_platform.device_type:
            patch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
        yield AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def connector_config(parser: FlexibleArgumentParser, argv: list[str]) -> object:
    """The KV transfer config vLLM would build from ``argv``, by vLLM's own code."""
    args = parser.parse_args(["--model", "m", *argv])
    holder = SimpleNamespace(
        cache_config=SimpleNamespace(
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_backend=args.kv_offloading_backend,
        ),
        kv_transfer_config=args.kv_transfer_config,
    )
    VllmConfig._post_init_kv_transfer_config(holder)
    return holder.kv_transfer_config


def kvcore_serves(config: object) -> bool:
    if config is None or config.kv_connector != launch_checks.CONNECTOR:
        return False
    spec = config.kv_connector_extra_config.get("spec_name", DEFAULT_SPEC_NAME)
    return spec in (DEFAULT_SPEC_NAME, SPEC_NAME)


def transfer(connector: str, **extra: str) -> list[str]:
    config = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        ([], {}),
        (["--kv-offloading-size", "4"], {}),
        (["--kv_offloading_size=4", "--kv-offloading-backend", "lmcache"], {}),
        (["--kv-offloading-size", "4"], {"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"}),
        (transfer("OffloadingConnector"), {}),
        (transfer("OffloadingConnector", spec_name=SPEC_NAME), {}),
        (transfer("OffloadingConnector", spec_name="TieringOffloadingSpec"), {}),
        (transfer("NixlConnector"), {}),
        (["--kv-offloading-size", "4", *transfer("NixlConnector")], {}),
        (["--kv-offloading-size", "4", *transfer("NixlConnector", spec_name="Mine")], {}),
        (
            [
                *transfer("NixlConnector"),
                *["--kv-transfer-config.kv_connector", "OffloadingConnector"],
                "--kv-transfer-config.kv_role=kv_both",
            ],
            {},
        ),
    ],
)
def test_warns_exactly_when_vllm_would_not_build_kvcores_spec(parser, monkeypatch, argv, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    serves = kvcore_serves(connector_config(parser, argv))
    config = KVCoreConfig(enable={"vllm"})
    warnings = launch_checks.idle_warnings(EngineArgs.of(["serve", "m", *argv]), env, config)
    assert (warnings == []) is serves
    assert len(warnings) <= 1


@pytest.mark.parametrize(
    "argv", [[], ["-tp", "2"], ["--pipeline-parallel-size", "2"], ["-dp", "2"]]
)
def test_pin_first_is_no_reason_to_warn_with_one_gpu_or_several(argv):
    args = EngineArgs.of(["serve", "m", "--kv-offloading-size", "4", *argv])
    config = KVCoreConfig(enable={"vllm"}, host_pool_pin_first=2 << 30)
    assert launch_checks.idle_warnings(args, {}, config) == []
