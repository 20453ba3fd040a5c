"""GPU lanes: engine tests that need a GPU, run on the lent machine and recorded here.

CI has no GPU, so these lanes never run in ``.ci/run``. ``scripts/vllm_upstream_gpu.sh
run`` leaves, under its ``$OUT``, one JUnit report per pass (stock, kvcore with the serve
rule on, kvcore with it off) and a log whose ``kvcore: jobs copied by kvcore N, handed to
stock M; reasons: {...}`` line says which handler did each job. ``record`` reduces them to
one JSON file per run in ``ci/gpu_lanes/``, and docs/compat.md shows every stored run.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ci.matrix.results import parse_junit

# The passes scripts/vllm_upstream_gpu.sh runs: its JUnit file stem and its log heading.
PASSES = (
    ("stock", "junit-stock", "stock"),
    ("classes-gpu, rule on", "junit-kvcore-rule", "kvcore-rule"),
    ("classes-gpu, rule off", "junit-kvcore-norule", "kvcore-norule"),
)
TESTS = "tests/v1/kv_offload/cpu/test_gpu_worker.py"
_HEADING = re.compile(r"^=== (\S+):", re.MULTILINE)
_VERSIONS = re.compile(r"^torch \S+ vllm (\S+) cuda", re.MULTILINE)
_DEVICE = re.compile(r"^name, driver_version, memory\.total.*\n([^,\n]+),", re.MULTILINE)
_JOBS = re.compile(
    r"kvcore: jobs copied by kvcore (\d+), handed to stock (\d+); reasons: (none|\{.*\})"
)


class GpuLaneError(ValueError):
    """A run folder or a stored record that cannot be read as a GPU lane."""


@dataclass(frozen=True)
class GpuPass:
    """One pytest pass of a GPU lane and, for kvcore's passes, who copied the jobs."""

    mode: str
    passed: int
    failed: int
    skipped: int
    jobs_by_kvcore: int | None = None
    jobs_to_stock: int | None = None
    stock_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuLaneRun:
    """One recorded run of a GPU lane on a named device."""

    engine: str
    version: str
    tests: str
    device: str
    date: str
    command: str
    passes: tuple[GpuPass, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> GpuLaneRun:
        data = json.loads(text)
        try:
            passes = tuple(GpuPass(**item) for item in data.pop("passes"))
            return cls(**data, passes=passes)
        except (KeyError, TypeError) as exc:
            raise GpuLaneError(f"not a GPU lane record: {exc}") from None


def _log_sections(log: str) -> dict[str, str]:
    """The log's text under each ``=== name:`` heading."""
    heads = list(_HEADING.finditer(log))
    ends = [h.start() for h in heads[1:]] + [len(log)]
    return {h.group(1): log[h.end() : end] for h, end in zip(heads, ends, strict=True)}


def _jobs(section: str) -> tuple[int | None, int | None, dict[str, int]]:
    found = _JOBS.search(section)
    if found is None:
        return None, None, {}
    reasons = {} if found.group(3) == "none" else ast.literal_eval(found.group(3))
    return int(found.group(1)), int(found.group(2)), dict(reasons)


def read_run(folder: Path, date: str, command: str) -> GpuLaneRun:
    """A run of vLLM's GPU-worker lane from the script's output folder: the release and the
    device as its log names them, and each pass."""
    log_path = folder / "upstream-gpu.log"
    if not log_path.is_file():
        raise GpuLaneError(f"no {log_path.name} in {folder}: pass the script's $OUT folder")
    log = log_path.read_text(encoding="utf-8", errors="replace")
    version, device = _VERSIONS.search(log), _DEVICE.search(log)
    if version is None or device is None:
        raise GpuLaneError(f"{log_path} names no vLLM release or no device")
    passes = _passes(folder, _log_sections(log))
    return GpuLaneRun(
        "vllm", version.group(1), TESTS, device.group(1).strip(), date, command, passes
    )


def _passes(folder: Path, sections: dict[str, str]) -> tuple[GpuPass, ...]:
    """Each pass of the folder: its JUnit counts, and the jobs its log section counts."""
    passes = []
    for mode, stem, heading in PASSES:
        junit = folder / f"{stem}.xml"
        if not junit.is_file():
            raise GpuLaneError(f"no {junit.name} in {folder}: that pass did not finish")
        suite = parse_junit(mode, junit.read_text(encoding="utf-8"))
        by_kvcore, to_stock, reasons = _jobs(sections.get(heading, ""))
        passes.append(
            GpuPass(mode, suite.passed, suite.failed, suite.skipped, by_kvcore, to_stock, reasons)
        )
    return tuple(passes)


def load_runs(directory: Path) -> list[GpuLaneRun]:
    """Every stored run, oldest first."""
    if not directory.is_dir():
        return []
    runs = [GpuLaneRun.from_json(p.read_text(encoding="utf-8")) for p in directory.glob("*.json")]
    return sorted(runs, key=lambda run: (run.date, run.engine, run.version))


def record_path(directory: Path, run: GpuLaneRun) -> Path:
    device = re.sub(r"[^a-z0-9]+", "-", run.device.lower()).strip("-")
    return directory / f"{run.engine}-{run.version}-{run.date}-{device}.json"


GPU_HEADER = """
## GPU lanes

Run on the lent GPU machine, not in CI, and recorded in `ci/gpu_lanes/` with
`python -m ci.matrix gpu-record`. vLLM's `tests/v1/kv_offload/cpu/test_gpu_worker.py` from the
release's sdist (`scripts/vllm_upstream_gpu.sh`): against stock's handler, then with
kvcore's handlers under stock's worker (`classes-gpu`), serve rule on and off. "Jobs"
says who copied each transfer job kvcore's handlers were given.
"""

_GPU_COLUMNS = (
    "Engine",
    "Version",
    "Device",
    "Date",
    "Pass",
    "Passed",
    "Failed",
    "Skipped",
    "Jobs",
)


def _jobs_text(one: GpuPass) -> str:
    if one.jobs_by_kvcore is None:
        return "-"
    reasons = ", ".join(f"{name} {count}" for name, count in sorted(one.stock_reasons.items()))
    to_stock = f"{one.jobs_to_stock} to stock" + (f" ({reasons})" if reasons else "")
    return f"{one.jobs_by_kvcore} by kvcore, {to_stock}"


def render_gpu_lanes(runs: Sequence[GpuLaneRun]) -> list[str]:
    """The GPU section's lines: a row per pass of every stored run, else nothing."""
    if not runs:
        return []
    lines = [GPU_HEADER, "| " + " | ".join(_GPU_COLUMNS) + " |", "|" + "---|" * len(_GPU_COLUMNS)]
    for run in runs:
        for one in run.passes:
            cells = (
                run.engine,
                run.version,
                run.device,
                run.date,
                one.mode,
                str(one.passed),
                str(one.failed),
                str(one.skipped),
                _jobs_text(one),
            )
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def splice_gpu_lanes(compat: str, runs: Sequence[GpuLaneRun]) -> str:
    """``compat`` (a rendered docs/compat.md) with its GPU section replaced by ``runs``':
    the CPU lanes' results stay as rendered, wherever their stored results live."""
    start = compat.find(GPU_HEADER.strip())
    if start >= 0:
        following = compat.find("\n## ", start + 1)
        compat = compat[:start].rstrip("\n") + "\n" + (compat[following:] if following >= 0 else "")
    section = "\n".join(render_gpu_lanes(runs))
    anchor = compat.find("\n## Adapter line coverage")
    if anchor < 0:
        return compat.rstrip("\n") + "\n" + section + "\n"
    return compat[:anchor] + "\n" + section + "\n" + compat[anchor:]
