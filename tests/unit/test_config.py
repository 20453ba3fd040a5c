from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import SETTINGS, KVCoreConfig, settings_help, settings_markdown
from kvcore.config_values import ENGINES, STAGING_MAX_BYTES, ConfigError, format_size, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# One non-default value per field, as text and as the parsed value.
NON_DEFAULTS: dict[str, tuple[str, object]] = {
    "enable": ("sglang", frozenset({"sglang"})),
    "staging_bytes": ("512MiB", 512 * MiB),
    "long_run_bytes": ("1MiB", MiB),
    "max_batched_runs": ("4096", 4096),
    "sglang_dma_in_place": ("yes", True),
    "gather_ctas": ("16", 16),
    "gather_ctas_to_host": ("2", 2),
    "gather_ctas_short_rows": ("6", 6),
    "ring_scatter_ctas": ("16", 16),
    "staged_pieces": ("2", 2),
    "stage_regions": ("ALL", "all"),
    "begin_region_loads": ("on", True),
    "address_ring": ("no", False),
    "background_issue": ("yes", True),
    "high_priority_loads": ("off", False),
    "metrics": ("false", False),
    "transfers": ("off", False),
    "host_pool": ("no", False),
    "host_pool_pin_first": ("8GiB", 8 << 30),
    "serve_rule": ("0", False),
    "stock_share": ("0.25", 0.25),
    "log_level": ("debug", "DEBUG"),
}

# One value per field that must be refused, with a fragment of what is allowed.
BAD_VALUES: dict[str, tuple[str, str]] = {
    "enable": ("sglang,tgi", "comma list of sglang, vllm"),
    "staging_bytes": ("0", "at least 1"),
    "long_run_bytes": ("-4k", "KiB"),
    "max_batched_runs": ("0", "from 1 to 1048576"),
    "gather_ctas": ("1025", "from 1 to 1024"),
    "gather_ctas_to_host": ("0", "from 1 to 1024"),
    "gather_ctas_short_rows": ("2000", "from 1 to 1024"),
    "ring_scatter_ctas": ("0", "from 1 to 1024"),
    "staged_pieces": ("17", "from 1 to 16"),
    "stage_regions": ("staged", "off (or 0), gather, or all (or 1)"),
    "begin_region_loads": ("early", "yes/no"),
    "address_ring": ("fast", "yes/no"),
    "background_issue": ("later", "yes/no"),
    "high_priority_loads": ("urgent", "yes/no"),
    "metrics": ("maybe", "yes/no"),
    "transfers": ("sometimes", "yes/no"),
    "host_pool": ("half", "yes/no"),
    "host_pool_pin_first": ("-1G", "GiB"),
    "sglang_dma_in_place": ("sometimes", "yes/no"),
    "serve_rule": ("when faster", "yes/no"),
    "stock_share": ("1.5", "from 0 to 1"),
    "log_level": ("LOUD", "WARNING"),
}

BY_NAME = {s.name: s for s in SETTINGS}


def test_tables_cover_every_field():
    names = {f.name for f in dataclasses.fields(KVCoreConfig)}
    assert set(BY_NAME) == names
    assert set(NON_DEFAULTS) == names
    assert set(BAD_VALUES) == names


def test_defaults():
    config = KVCoreConfig()
    assert config == KVCoreConfig.from_env({})
    assert config.enable == frozenset()
    assert config.staging_bytes == 256 * MiB
    assert config.long_run_bytes == 256 * KiB
    assert config.gather_ctas == 8
    assert config.metrics is True
    assert config.log_level == "INFO"


def test_names_follow_the_field():
    assert BY_NAME["long_run_bytes"].env == "KVCORE_LONG_RUN_BYTES"
    assert BY_NAME["long_run_bytes"].flag == "--kvcore-long-run-bytes"


@pytest.mark.parametrize("name", sorted(NON_DEFAULTS))
def test_every_field_from_env(name):
    text, expected = NON_DEFAULTS[name]
    config = KVCoreConfig.from_env({BY_NAME[name].env: text})
    assert getattr(config, name) == expected
    others = {n for n in BY_NAME if n != name}
    assert all(getattr(config, n) == BY_NAME[n].default for n in others)


@pytest.mark.parametrize("name", sorted(NON_DEFAULTS))
@pytest.mark.parametrize("joined", [True, False])
def test_every_field_from_flags(name, joined):
    text, expected = NON_DEFAULTS[name]
    flag = BY_NAME[name].flag
    argv = [f"{flag}={text}"] if joined else [flag, text]
    config, remaining = KVCoreConfig.from_args(argv, environ={})
    assert getattr(config, name) == expected
    assert remaining == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("1B", 1),
        ("4k", 4 * KiB),
        ("4K", 4 * KiB),
        ("4KiB", 4 * KiB),
        ("4kb", 4000),
        (".5k", 512),
        ("512MiB", 512 * MiB),
        ("512 MiB", 512 * MiB),
        (" 3m ", 3 * MiB),
        ("7MB", 7_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("1.5GB", 1_500_000_000),
        ("64GiB", 64 * GiB),
        ("64g", 64 * GiB),
        ("2T", 2 * TiB),
        ("2TB", 2_000_000_000_000),
        ("2tib", 2 * TiB),
    ],
)
def test_size_units(text, expected):
    assert parse_size(text) == expected
    if expected:  # a run takes a byte at least; the staging buffer has a maximum besides
        assert KVCoreConfig.from_env({"KVCORE_LONG_RUN_BYTES": text}).long_run_bytes == expected


@pytest.mark.parametrize(
    "text", ["1.5", "0.1k", "k", "12XB", "1e9", "1 2k", "-1", "1,024", "½k", "٣k"]
)
def test_bad_sizes(text):
    with pytest.raises(ConfigError, match="KVCORE_STAGING_BYTES"):
        KVCoreConfig.from_env({"KVCORE_STAGING_BYTES": text})


def test_sizes_accept_ints_and_strings_in_code():
    assert KVCoreConfig(staging_bytes="1GiB").staging_bytes == GiB
    assert KVCoreConfig(staging_bytes=12345).staging_bytes == 12345
    with pytest.raises(ConfigError, match="staging_bytes"):
        KVCoreConfig(staging_bytes=True)
    with pytest.raises(ConfigError, match="staging_bytes"):
        KVCoreConfig(staging_bytes=1.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(w, True) for w in ("1", "true", "True", "YES", "on", " On ")]
    + [(w, False) for w in ("0", "false", "FALSE", "no", "off", "Off")],
)
def test_bools(text, expected):
    assert KVCoreConfig.from_env({"KVCORE_METRICS": text}).metrics is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", set()),
        ("false", set()),
        ("off", set()),
        ("1", {"sglang", "vllm"}),
        ("true", {"sglang", "vllm"}),
        ("all", {"sglang", "vllm"}),
        ("ALL", {"sglang", "vllm"}),
        ("sglang", {"sglang"}),
        ("vllm", {"vllm"}),
        ("vllm, SGLang", {"sglang", "vllm"}),
        ("sglang,", {"sglang"}),
    ],
)
def test_enable(text, expected):
    config = KVCoreConfig.from_env({"KVCORE_ENABLE": text})
    assert config.enable == expected
    for engine in ENGINES:
        assert config.enabled_for(engine) is (engine in expected)


def test_enabled_for_refuses_unknown_engines():
    with pytest.raises(ValueError, match="tgi"):
        KVCoreConfig(enable="1").enabled_for("tgi")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("gather_ctas", "1"),
        ("gather_ctas", "1024"),
        ("staged_pieces", "1"),
        ("staged_pieces", "16"),
        ("staging_bytes", "1"),
        ("long_run_bytes", "1"),
    ],
)
def test_range_edges_accepted(name, text):
    assert getattr(KVCoreConfig.from_env({BY_NAME[name].env: text}), name) == int(text)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("gather_ctas", "0"),
        ("gather_ctas", "2.5"),
        ("gather_ctas", "eight"),
        ("gather_ctas", "٣"),
        ("staged_pieces", "17"),
        ("staged_pieces", "-1"),
        ("long_run_bytes", "0"),
        ("staging_bytes", "0"),
    ],
)
def test_range_edges_refused(name, text):
    with pytest.raises(ConfigError, match=BY_NAME[name].env):
        KVCoreConfig.from_env({BY_NAME[name].env: text})


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_value_messages_name_variable_value_and_allowed(name):
    text, allowed = BAD_VALUES[name]
    setting = BY_NAME[name]
    with pytest.raises(ConfigError) as env_error:
        KVCoreConfig.from_env({setting.env: text})
    with pytest.raises(ConfigError) as flag_error:
        KVCoreConfig.from_args([f"{setting.flag}={text}"], environ={})
    for error, source in ((env_error, setting.env), (flag_error, setting.flag)):
        message = str(error.value)
        assert source in message
        assert repr(text) in message
        assert allowed in message
    default = setting.default_text()
    assert str(env_error.value).endswith(
        f"; set one, or unset {setting.env} for the default ({default})"
    )
    assert str(flag_error.value).endswith(f"; the default is {default}")


def test_empty_variable_counts_as_unset():
    env = {s.env: "" for s in SETTINGS}
    assert KVCoreConfig.from_env(env) == KVCoreConfig()


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "12")
    assert KVCoreConfig.from_env().gather_ctas == 12
    assert KVCoreConfig.from_args([])[0].gather_ctas == 12


def test_unknown_variable_is_warned_about_once_per_process(caplog):
    # No other test may misspell this variable: the warning is given once per process.
    env = {"KVCORE_STAGING_BYTE": "1GiB", "OTHER_THING": "1"}
    with caplog.at_level(logging.WARNING, logger="kvcore.config"):
        config = KVCoreConfig.from_env(env)
        assert KVCoreConfig.from_args([], environ=env)[0] == config
    assert config == KVCoreConfig()
    assert len(caplog.records) == 1
    assert "KVCORE_STAGING_BYTE " in caplog.text
    assert "did you mean KVCORE_STAGING_BYTES" in caplog.text
    assert "OTHER_THING" not in caplog.text


def test_flags_override_env_and_env_fills_the_rest():
    env = {"KVCORE_STAGING_BYTES": "1GiB", "KVCORE_GATHER_CTAS": "4", "KVCORE_ENABLE": "vllm"}
    config, _ = KVCoreConfig.from_args(["--kvcore-staging-bytes", "2GiB"], environ=env)
    assert config.staging_bytes == 2 * GiB
    assert config.gather_ctas == 4
    assert config.enable == {"vllm"}


def test_last_flag_wins():
    config, _ = KVCoreConfig.from_args(
        ["--kvcore-gather-ctas=2", "--kvcore-gather-ctas", "3"], environ={}
    )
    assert config.gather_ctas == 3


def test_remaining_argv_is_preserved_in_order():
    argv = [
        "--model-path",
        "/m",
        "--kvcore-staging-bytes",
        "64MiB",
        "--tp",
        "2",
        "-x",
        "--kvcore-metrics",
        "model.bin",
        "--kvcore-log-level=info",
        "--kvcore",
        "--",
        "--kvcore-gather-ctas",
        "99",
        "--kvcore-no-such-flag",
    ]
    config, remaining = KVCoreConfig.from_args(argv, environ={"KVCORE_METRICS": "0"})
    assert remaining == [
        "--model-path",
        "/m",
        "--tp",
        "2",
        "-x",
        "model.bin",
        "--kvcore",
        "--",
        "--kvcore-gather-ctas",
        "99",
        "--kvcore-no-such-flag",
    ]
    assert config.staging_bytes == 64 * MiB
    assert config.metrics is True
    assert config.log_level == "INFO"
    assert config.gather_ctas == 8


@pytest.mark.parametrize(
    ("argv", "metrics", "remaining"),
    [
        (["--kvcore-metrics"], True, []),
        (["--kvcore-metrics", "0"], False, []),
        (["--kvcore-metrics", "Off", "x"], False, ["x"]),
        (["--kvcore-metrics", "yes"], True, []),
        (["--kvcore-metrics=no", "1"], False, ["1"]),
        (["--kvcore-metrics", "--port", "0"], True, ["--port", "0"]),
    ],
)
def test_bool_flags(argv, metrics, remaining):
    config, rest = KVCoreConfig.from_args(argv, environ={"KVCORE_METRICS": "0" if metrics else "1"})
    assert config.metrics is metrics
    assert rest == remaining


def test_unknown_flag_lists_the_known_ones():
    with pytest.raises(ConfigError) as error:
        KVCoreConfig.from_args(["--kvcore-staging-byte", "1G"], environ={})
    message = str(error.value)
    assert "--kvcore-staging-byte " in message
    assert "did you mean --kvcore-staging-bytes" in message
    for setting in SETTINGS:
        assert setting.flag in message


@pytest.mark.parametrize(
    "argv",
    [
        ["--kvcore-gather-ctas"],
        ["--kvcore-gather-ctas", "--", "8"],
        ["--kvcore-gather-ctas", "--tp"],
    ],
)
def test_flag_without_value(argv):
    with pytest.raises(ConfigError, match="--kvcore-gather-ctas needs a value"):
        KVCoreConfig.from_args(argv, environ={})


def test_config_is_frozen_and_checked():
    config = KVCoreConfig(enable={"vllm"})
    assert isinstance(config.enable, frozenset)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gather_ctas = 3  # type: ignore[misc]
    with pytest.raises(ConfigError, match="gather_ctas"):
        KVCoreConfig(gather_ctas=0)
    with pytest.raises(ConfigError, match="tgi"):
        KVCoreConfig(enable=["sglang", "tgi"])


@pytest.mark.parametrize("text", ["nan", "-0.1", "half", "inf"])
def test_a_stock_share_is_a_number_from_0_to_1(text):
    with pytest.raises(ConfigError, match="KVCORE_STOCK_SHARE"):
        KVCoreConfig.from_env({"KVCORE_STOCK_SHARE": text})
    assert KVCoreConfig.from_env({"KVCORE_STOCK_SHARE": "1"}).stock_share == 1.0


def test_to_env_of_defaults():
    assert KVCoreConfig().to_env() == {
        "KVCORE_ENABLE": "0",
        "KVCORE_STAGING_BYTES": "256MiB",
        "KVCORE_LONG_RUN_BYTES": "256KiB",
        "KVCORE_MAX_BATCHED_RUNS": "256",
        "KVCORE_SGLANG_DMA_IN_PLACE": "0",
        "KVCORE_GATHER_CTAS": "8",
        "KVCORE_GATHER_CTAS_TO_HOST": "4",
        "KVCORE_GATHER_CTAS_SHORT_ROWS": "4",
        "KVCORE_RING_SCATTER_CTAS": "64",
        "KVCORE_STAGED_PIECES": "1",
        "KVCORE_STAGE_REGIONS": "gather",
        "KVCORE_BEGIN_REGION_LOADS": "0",
        "KVCORE_ADDRESS_RING": "1",
        "KVCORE_BACKGROUND_ISSUE": "0",
        "KVCORE_HIGH_PRIORITY_LOADS": "1",
        "KVCORE_METRICS": "1",
        "KVCORE_TRANSFERS": "1",
        "KVCORE_HOST_POOL": "1",
        "KVCORE_HOST_POOL_PIN_FIRST": "0",
        "KVCORE_SERVE_RULE": "1",
        "KVCORE_STOCK_SHARE": "0.0",
        "KVCORE_LOG_LEVEL": "INFO",
    }


sizes = st.one_of(
    st.integers(0, 1 << 50),
    st.builds(
        lambda n, unit: n * unit, st.integers(0, 1 << 20), st.sampled_from([KiB, MiB, GiB, TiB])
    ),
)
configs = st.builds(
    KVCoreConfig,
    enable=st.frozensets(st.sampled_from(ENGINES)),
    staging_bytes=sizes.map(lambda n: min(n + 1, STAGING_MAX_BYTES)),
    long_run_bytes=sizes.map(lambda n: n + 1),
    gather_ctas=st.integers(1, 1024),
    gather_ctas_to_host=st.integers(1, 1024),
    staged_pieces=st.integers(1, 16),
    stage_regions=st.sampled_from(["off", "gather", "all"]),
    metrics=st.booleans(),
    stock_share=st.floats(0.0, 1.0),
    log_level=st.sampled_from(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]),
)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_to_env_round_trips(config):
    env = config.to_env()
    assert set(env) == {s.env for s in SETTINGS}
    assert all(isinstance(v, str) and v for v in env.values())
    assert KVCoreConfig.from_env(env) == config
    flags = [arg for s in SETTINGS for arg in (s.flag, env[s.env])]
    assert KVCoreConfig.from_args(flags, environ={}) == (config, [])
    assert json.loads(json.dumps(config.to_dict()))["enable"] == sorted(config.enable)


@settings(max_examples=200, deadline=None)
@given(sizes)
def test_format_size_is_exact_and_shortest(nbytes):
    text = format_size(nbytes)
    assert parse_size(text) == nbytes
    number = re.match(r"\d+", text)
    assert number is not None
    if nbytes and nbytes % KiB == 0:
        # The largest unit that divides: one step up would not be whole.
        assert int(number.group()) % 1024 != 0 or text.endswith("TiB")
    else:
        assert text == str(nbytes)


def test_settings_table_renders_every_field():
    table = settings_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(SETTINGS)
    for row, setting in zip(rows, SETTINGS, strict=True):
        assert row.count("|") == 6
        assert f"`{setting.env}`" in row
        assert f"`{setting.flag}`" in row
        assert f"`{setting.default_text()}`" in row
        assert setting.help in row
    assert "`256MiB`" in table
    assert "1.5GB" in table
    help_text = settings_help()
    for setting in SETTINGS:
        assert setting.flag in help_text and setting.env in help_text
        assert setting.help


def test_log_level_is_applied_to_the_kvcore_logger():
    logger = logging.getLogger("kvcore")
    before = logger.level
    try:
        KVCoreConfig.from_env({"KVCORE_LOG_LEVEL": "DEBUG"}).configure_logging()
        assert logging.getLogger("kvcore.mover").getEffectiveLevel() == logging.DEBUG
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize(
    "name",
    [
        "KVCORE_PINNED_BYTES",
        "KVCORE_MAX_INFLIGHT_BYTES",
        "KVCORE_PREFAULT_THREADS",
        "KVCORE_REGISTER_CHUNK_BYTES",
        "KVCORE_NUMA",
    ],
)
def test_a_retired_setting_is_named_as_such_and_ignored(name, caplog, monkeypatch):
    from kvcore import config as config_module

    monkeypatch.setattr(config_module, "_reported", set())
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        config = KVCoreConfig.from_env({name: "1GiB"})
    assert config == KVCoreConfig()
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"{name} is no longer a kvcore setting" in m for m in messages), messages
    assert not any("unknown kvcore variable" in m for m in messages)


def test_logging_gets_a_handler_only_where_nothing_would_print_info():
    """In an engine process nothing configures the root logger, and Python alone prints
    only warnings: kvcore's own handler shows its info lines, once each, however often
    logging is configured; where the root has a handler, kvcore adds none; where the root
    gets one later (vLLM's engine core), each line still prints once, through the root."""
    script = (
        "import logging, sys\n"
        "from kvcore.config import KVCoreConfig\n"
        "if sys.argv[1] == 'rooted': logging.basicConfig(format='root %(message)s')\n"
        "for _ in range(3): KVCoreConfig().configure_logging()\n"
        "if sys.argv[1] == 'rooted later': logging.basicConfig(format='root %(message)s')\n"
        "logging.getLogger('kvcore.x').info('kvcore: hello')\n"
        "print(len(logging.getLogger('kvcore').handlers))\n"
    )
    lone, rooted, rooted_later = (
        subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60
        )
        for mode in ("lone", "rooted", "rooted later")
    )
    assert lone.stdout == "1\n" and lone.stderr.count("kvcore: hello") == 1
    assert lone.stderr.startswith("INFO ")
    # The engine's root handler prints it, once.
    assert rooted.stdout == "0\n" and rooted.stderr == "root kvcore: hello\n"
    assert rooted_later.stdout == "1\n" and rooted_later.stderr == "root kvcore: hello\n"


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", "off"), ("no", "off"), ("1", "all"), ("on", "all"), (" Gather ", "gather")],
)
def test_region_staging_takes_its_names_and_the_boolean_words(text, value):
    assert KVCoreConfig.from_env({"KVCORE_STAGE_REGIONS": text}).stage_regions == value
