"""A patch set on disk: ``patches/<engine>/<version>/`` with its ``manifest.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
# The package's sets/: in a checkout (and so in an editable install) a link to the
# repository's patches/, which `kvcore patches generate` writes; a wheel holds a copy.
DEFAULT_PATCHES_DIR = (Path(__file__).resolve().parent / "sets").resolve()


class NoPatchSet(LookupError):
    """The engine release has no patch set; the message names it and the ones there are."""


@dataclass(frozen=True)
class PatchedFile:
    """One engine file the patch set changes, with the bytes it expects before and after."""

    path: str  # relative to the directory that holds the engine's package
    patch: str  # the diff's file name in the patch set
    targets: tuple[str, ...]
    pristine_sha256: str
    patched_sha256: str


@dataclass(frozen=True)
class PatchSet:
    engine: str
    version: str
    files: tuple[PatchedFile, ...]

    def manifest_text(self) -> str:
        data = {
            "engine": self.engine,
            "version": self.version,
            "generated_by": f"kvcore patches generate --engine {self.engine}",
            "files": [
                {
                    "path": f.path,
                    "patch": f.patch,
                    "targets": list(f.targets),
                    "pristine_sha256": f.pristine_sha256,
                    "patched_sha256": f.patched_sha256,
                }
                for f in self.files
            ],
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_manifest(cls, text: str) -> PatchSet:
        data = json.loads(text)
        files = tuple(
            PatchedFile(
                f["path"],
                f["patch"],
                tuple(f["targets"]),
                f["pristine_sha256"],
                f["patched_sha256"],
            )
            for f in data["files"]
        )
        return cls(data["engine"], data["version"], files)


def set_dir(patches_dir: Path, engine: str, version: str) -> Path:
    return patches_dir / engine / version


def available_versions(patches_dir: Path, engine: str) -> list[str]:
    """Releases of ``engine`` with a patch set, oldest first."""
    engine_dir = patches_dir / engine
    if not engine_dir.is_dir():
        return []
    found = [d.name for d in engine_dir.iterdir() if (d / MANIFEST).is_file()]
    return sorted(found, key=_release_key)


def load_set(patches_dir: Path, engine: str, version: str) -> tuple[PatchSet, Path]:
    """The patch set of ``engine`` ``version`` and its directory; NoPatchSet when absent."""
    directory = set_dir(patches_dir, engine, version)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        have = ", ".join(available_versions(patches_dir, engine)) or "none"
        raise NoPatchSet(
            f"{engine} {version} has no patch set (patch sets for {engine}: {have}; "
            f"looked in {patches_dir})"
        )
    return PatchSet.from_manifest(manifest.read_text(encoding="utf-8")), directory


def _release_key(version: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in version.split("."))
