"""KVCoreConfig: every kvcore setting, read from ``KVCORE_*`` variables or ``--kvcore-*`` flags.

Engines start their workers as separate processes. Environment variables reach all
of them, so the variables are the configuration and flags are only another way of
writing them (``kvcore launch`` turns flags into variables before starting the engine).
This module imports nothing but the standard library: adapters read it at plugin-load
time, before the engine has decided anything about CUDA.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvcore.config_values import (
    BOOLEAN,
    ENGINE_SET,
    ENGINES,
    FALSE_WORDS,
    LOG_LEVEL,
    REGION_STAGING,
    SHARE,
    SIZE_SYNTAX,
    STAGING_MAX_BYTES,
    TRUE_WORDS,
    ConfigError,
    KiB,
    MiB,
    ValueKind,
    _integer,
    _size,
)

ENV_PREFIX = "KVCORE_"
FLAG_PREFIX = "--kvcore-"

logger = logging.getLogger(__name__)


def _setting(default: Any, kind: ValueKind, help: str) -> Any:
    return field(default=default, metadata={"kind": kind, "help": help})


def _ctas(default: int, help: str) -> Any:
    """A setting of how many thread blocks one of kvcore's kernels runs on: every such
    count takes the same range."""
    return _setting(default, _integer(1, 1024), help)


@dataclass(frozen=True)
class KVCoreConfig:
    """Every kvcore setting. Values are checked (and text parsed) on construction."""

    enable: frozenset[str] = _setting(
        frozenset(), ENGINE_SET, "engines kvcore patches; it patches nothing unless named here"
    )
    staging_bytes: int = _setting(
        256 * MiB,
        _size(1, STAGING_MAX_BYTES, "it is device memory, on every device: no GPU holds that"),
        "device staging buffer, per device, for scattered device-side rows",
    )
    long_run_bytes: int = _setting(
        256 * KiB,
        _size(1),
        "average run size from which one DMA per run beats staging or the gather kernel",
    )
    max_batched_runs: int = _setting(
        256,
        _integer(1, 1 << 20),
        "most runs one layer's copy takes as DMA straight into place (one cudaMemcpyBatchAsync "
        "descriptor each); past it the staged copy or the gather costs less host time",
    )
    sglang_dma_in_place: bool = _setting(
        False,
        BOOLEAN,
        "SGLang's kernel-backend transfers of paged layer_first pools: read each request's "
        "device indices back when SGLang moves them (one small device-to-host copy a "
        "request, as SGLang's direct backend makes), so that requests under 32k tokens whose "
        "pages hold 128 KiB or more of a layer go by DMA straight into place, no kernel on any "
        "stream, where kvcore serves them; 0 plans around the device indices unread",
    )
    gather_ctas: int = _ctas(
        8,
        "thread blocks of the UVA gather kernel where it writes device rows (loads): SMs "
        "taken from the model while a load runs",
    )
    gather_ctas_to_host: int = _ctas(
        4,
        "thread blocks of the UVA gather kernel where it writes host rows (backups, "
        "stores): SMs taken from the model while a backup runs",
    )
    gather_ctas_short_rows: int = _ctas(
        4,
        "thread blocks of the UVA gather kernel where it writes device rows shorter than 2 "
        "KiB (token-granular MLA loads): as fast as on 8 and fewer SMs taken from the model",
    )
    ring_scatter_ctas: int = _ctas(
        64,
        "thread blocks of the layer ring's scatter (SGLang reloads staged a layer at a time: "
        "DMA into a slot, then this scatter into the pages) and of region staging's "
        "(KVCORE_STAGE_REGIONS): SMs taken from the model while it runs",
    )
    staged_pieces: int = _setting(
        1,
        _integer(1, 16),
        "pieces of a staged copy; more than 1 overlaps each piece's scatter with the next "
        "one's DMA (~1% more throughput, ~4x the host time to submit)",
    )
    stage_regions: str = _setting(
        "gather",
        REGION_STAGING,
        "vLLM's loads from its shared CPU region (one chunk holds every KV tensor's page of a "
        "block): copy whole chunks by DMA into the staging buffer, then scatter each page "
        "to its tensor from device memory. gather: in place of the gather kernel (pages too "
        "small for one DMA each, as MLA's); all: in place of one DMA a page too (the load "
        "nearer the link, the forward beside it slower); off: neither",
    )
    begin_region_loads: bool = _setting(
        False,
        BOOLEAN,
        "vLLM's loads staged by region (KVCORE_STAGE_REGIONS) begin before the handler plans "
        "them: the first chunks' DMAs run during the planning, which checks them before any "
        "page is written (off until measured on a GPU)",
    )
    address_ring: bool = _setting(
        True,
        BOOLEAN,
        "vLLM's loads staged by region issue each piece's copies, waits and records as one "
        "CUDA runtime call each, not through torch's streams and events, whose host time "
        "holds transfer_async, and so the engine's next forward, several times longer",
    )
    background_issue: bool = _setting(
        False,
        BOOLEAN,
        "kvcore's vLLM handlers issue each job's copies from a thread of their own, so "
        "transfer_async returns once the job is planned and the engine queues its next forward "
        "at once (an MHA load's DMAs otherwise hold it 9-35 ms at 8k-32k tokens); the running "
        "batch's steps then run beside the load, which itself takes longer (an MHA hit's up to "
        "about 1.3x beside decode steps); off until measured live",
    )
    high_priority_loads: bool = _setting(
        True,
        BOOLEAN,
        "kvcore's vLLM load handler runs on streams of the highest CUDA priority: a staged "
        "load's scatters take SMs first as a prefill's kernels free them, so its ring of "
        "DMAs is not held back (the forward beside it up to ~2% slower)",
    )
    metrics: bool = _setting(True, BOOLEAN, "collect transfer metrics (Prometheus when installed)")
    transfers: bool = _setting(
        True,
        BOOLEAN,
        "route the engines' host<->device copies through kvcore's mover, each call put to "
        "the serve-or-pass rule; 0 keeps every copy the engine's own",
    )
    host_pool: bool = _setting(
        True,
        BOOLEAN,
        "map the engine's host tier where the engine's own allocation rounds it up or faults "
        "it in on one thread (vLLM 0.25.1's CPU tier, a one-GPU vLLM 0.32+'s shared "
        "region, SGLang's default HiCache host allocator): the exact size, faulted in by "
        "every usable CPU, on the GPU's NUMA node; 0 keeps the engine's own allocation",
    )
    host_pool_pin_first: int = _setting(
        0,
        _size(0, 1 << 50, "more host memory than any machine holds"),
        "SGLang's MHA and MLA host pools (layer_first, page_first) and vLLM's shared CPU "
        "tier (0.33 on, whose pages are then also faulted in step by step): pin "
        "this much before the engine starts and the rest on a background thread, handing "
        "out only pinned slots (in SGLang a call whose slots run "
        "across two steps' registrations is copied one registration at a time; use SGLang's "
        "kernel io backend with it); 0 pins the whole pool before the engine starts, as the "
        "engines do",
    )
    serve_rule: bool = _setting(
        True,
        BOOLEAN,
        "pass each engine call to the engine's stock copy where that is faster "
        "(kvcore.planning.serve_rule); 0 makes kvcore serve every call it can copy exactly",
    )
    stock_share: float = _setting(
        0.0,
        SHARE,
        "share of the reloads kvcore would serve (vLLM load jobs, SGLang load-backs) that go "
        "to the engine's own copy instead, drawn per reload (vLLM logs each load): an A/B of "
        "the two copies inside one engine process; 0 outside such a measurement",
    )
    log_level: str = _setting("INFO", LOG_LEVEL, "level of the 'kvcore' logger")

    def __post_init__(self) -> None:
        values = _parse_all((s, getattr(self, s.name), None) for s in SETTINGS)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KVCoreConfig:
        """Settings from ``KVCORE_*`` variables; an empty variable counts as unset."""
        env = os.environ if environ is None else environ
        values = _parse_all((s, env[s.env], s.env) for s in SETTINGS if env.get(s.env, ""))
        _warn_unknown_variables(env)
        return cls(**values)

    @classmethod
    def from_args(
        cls, argv: Sequence[str], environ: Mapping[str, str] | None = None
    ) -> tuple[KVCoreConfig, list[str]]:
        """Settings from the environment, overridden by ``--kvcore-*`` flags in ``argv``.

        Flags are ``--kvcore-x=v`` or ``--kvcore-x v``; a boolean flag alone means true.
        Scanning stops at ``--``. Returns the config and every other argument, in order.
        """
        overrides, remaining, problems = _scan_flags(argv)
        try:
            config = cls.from_env(environ)
        except ConfigError as exc:
            problems += exc.problems
        if problems:
            raise ConfigError(*problems)
        return replace(config, **overrides), remaining

    def to_env(self) -> dict[str, str]:
        """Every setting as a ``KVCORE_*`` variable; ``from_env`` reads back an equal config."""
        return {s.env: s.kind.render(getattr(self, s.name)) for s in SETTINGS}

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value, JSON-ready (engines as a sorted list)."""
        values = {s.name: getattr(self, s.name) for s in SETTINGS}
        values["enable"] = sorted(self.enable)
        return values

    def enabled_for(self, engine: str) -> bool:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
        return engine in self.enable

    def configure_logging(self) -> None:
        """Apply ``log_level`` to the 'kvcore' logger (and so to every kvcore module), and
        give it a handler where nothing would print its records below warnings."""
        log = logging.getLogger("kvcore")
        log.setLevel(self.log_level)
        if not log.handlers and not logging.getLogger().handlers:
            # Engines configure their own loggers, not the root: without a handler Python
            # prints warnings and errors only, and kvcore's activation line would be lost.
            handler = _UntilRootPrints()
            handler.setFormatter(
                logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S")
            )
            log.addHandler(handler)


class _UntilRootPrints(logging.StreamHandler):  # type: ignore[type-arg]
    """kvcore's own handler, silent once the root logger has a handler: a process may
    configure the root after kvcore did (vLLM's engine core does), and the record, which
    still propagates, must not print twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


@dataclass(frozen=True)
class Setting:
    """One field of KVCoreConfig with its variable, flag, default and help."""

    name: str
    kind: ValueKind
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return FLAG_PREFIX + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.kind is BOOLEAN

    def parse(self, value: object, source: str | None = None) -> Any:
        """The checked value; ConfigError names ``source`` (the variable or flag), the value and
        what is allowed."""
        try:
            return self.kind.parse(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{source or self.name}={value!r}: {exc}; allowed: {self.kind.allowed}"
                f"; {self._fix(source)}"
            ) from None

    def _fix(self, source: str | None) -> str:
        if source == self.env:
            return f"set one, or unset {self.env} for the default ({self.default_text()})"
        return f"the default is {self.default_text()}"

    def default_text(self) -> str:
        return self.kind.render(self.default)


def _parse_all(values: Iterable[tuple[Setting, object, str | None]]) -> dict[str, Any]:
    """Name -> checked value of each (setting, value, source); one ConfigError naming every
    bad one, so that fixing them takes one round, not one per setting."""
    parsed: dict[str, Any] = {}
    problems: list[str] = []
    for setting, value, source in values:
        try:
            parsed[setting.name] = setting.parse(value, source)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(*problems)
    return parsed


SETTINGS: tuple[Setting, ...] = tuple(
    Setting(f.name, f.metadata["kind"], f.default, f.metadata["help"]) for f in fields(KVCoreConfig)
)
_BY_FLAG = {s.flag: s for s in SETTINGS}
_BY_ENV = {s.env: s for s in SETTINGS}


def _scan_flags(argv: Sequence[str]) -> tuple[dict[str, Any], list[str], tuple[str, ...]]:
    """(checked overrides, the other arguments, a problem per bad flag)."""
    overrides: dict[str, Any] = {}
    remaining: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            remaining.extend(argv[i:])
            break
        if not arg.startswith(FLAG_PREFIX):
            remaining.append(arg)
            i += 1
            continue
        flag, has_value, text = arg.partition("=")
        setting = _BY_FLAG.get(flag)
        if setting is None:
            problems.append(_unknown_message("flag", flag, list(_BY_FLAG)))
            i += 1
            continue
        following = argv[i + 1] if i + 1 < len(argv) else None
        if has_value:
            i += 1
        elif setting.is_bool:
            # A bare boolean flag means true; a following 1/0/yes/no... is its value.
            if following is not None and following.strip().lower() in TRUE_WORDS | FALSE_WORDS:
                text = following
                i += 2
            else:
                text = "1"
                i += 1
        elif following is None or following.startswith("--"):
            problems.append(f"{flag} needs a value; allowed: {setting.kind.allowed}")
            i += 1
            continue
        else:
            text = following
            i += 2
        try:
            overrides[setting.name] = setting.parse(text, flag)
        except ConfigError as exc:
            problems += exc.problems
    return overrides, remaining, tuple(problems)


def flag_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """Setting name -> checked value of each ``--kvcore-*`` flag in ``argv`` (scanned as
    :meth:`KVCoreConfig.from_args` scans it): what the flags alone say."""
    overrides, _, problems = _scan_flags(argv)
    if problems:
        raise ConfigError(*problems)
    return overrides


def _unknown_message(what: str, name: str, known: list[str]) -> str:
    guess = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {guess[0]}?)" if guess else ""
    return f"unknown kvcore {what} {name}{hint}; known: {', '.join(known)}"


# Messages already logged by this process: engines read the environment in every
# process, some several times, and one line each says all there is to say.
_reported: set[str] = set()


def _report_once(level: int, message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        logger.log(level, message)


# Settings kvcore once accepted and never acted on, and why they went.
RETIRED: dict[str, str] = {
    "KVCORE_PINNED_BYTES": (
        "kvcore copies through the engines' own host pools and keeps no pinned memory of "
        "its own to cap"
    ),
    "KVCORE_MAX_INFLIGHT_BYTES": (
        "the engines bound what they queue (SGLang one request's layers, vLLM its jobs); "
        "kvcore adds no queue of its own"
    ),
    **dict.fromkeys(
        ("KVCORE_PREFAULT_THREADS", "KVCORE_REGISTER_CHUNK_BYTES", "KVCORE_NUMA"),
        "kvcore allocates no host memory of its own to pre-fault, register or place",
    ),
}


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    # A misspelt variable would otherwise be ignored without a word.
    for name in env:
        if name in RETIRED:
            _report_once(
                logging.WARNING, f"{name} is no longer a kvcore setting ({RETIRED[name]}); ignored"
            )
        elif name.startswith(ENV_PREFIX) and name not in _BY_ENV:
            unknown = _unknown_message("variable", name, list(_BY_ENV))
            _report_once(logging.WARNING, f"{unknown}; it is ignored")


def engine_config(engine: str, environ: Mapping[str, str] | None = None) -> KVCoreConfig | None:
    """The configuration for code running inside ``engine`` (a name for people, e.g. "vLLM").

    None when a variable is bad, after one logged line per bad variable (once per process)
    that names it, its value and the fix, and says the engine runs stock: inside an engine a
    traceback would bury that among the engine's own logs, and the engine must carry on.
    """
    try:
        return KVCoreConfig.from_env(environ)
    except ConfigError as exc:
        for problem in exc.problems:
            _report_once(logging.ERROR, f"kvcore: {problem}; {engine} runs stock")
        return None


SYNTAX_NOTES: tuple[str, ...] = (
    f"Sizes: {SIZE_SYNTAX}.",
    f"Booleans: {BOOLEAN.allowed}; a boolean flag alone means true.",
    f"Engines: {ENGINE_SET.allowed}.",
    "An empty variable counts as unset; flags override variables.",
)


def settings_markdown() -> str:
    """The settings as a Markdown table with notes on syntax, for docs/operations.md."""
    lines = ["| variable | flag | default | accepts | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        lines.append(
            f"| `{s.env}` | `{s.flag}` | `{s.default_text()}` | {s.kind.summary} | {s.help} |"
        )
    lines.append("")
    lines.extend(f"- {note}" for note in SYNTAX_NOTES)
    return "\n".join(lines) + "\n"


def settings_help() -> str:
    """The settings as plain text, for ``--help`` output."""
    lines = []
    for s in SETTINGS:
        value = "" if s.is_bool else " VALUE"
        lines.append(f"  {s.flag}{value}  [{s.env}; {s.kind.summary}; default {s.default_text()}]")
        lines.append(f"      {s.help}")
    lines.append("")
    lines.extend(SYNTAX_NOTES)
    return "\n".join(lines) + "\n"
