"""Which SGLang release's job builders a transfer hook plans with.

Which host layer and device buffer a call copies differs between SGLang releases
(0.5.22 maps layers through the device pool's layer sharding, 0.5.23 through the slot
maps its pools keep): each hook plans with the builders of the release whose recorded
fingerprint (:mod:`kvcore_sglang.guard`) the installed method's source has
(:data:`kvcore_sglang.pool_jobs.MHA_JOBS` and the like); a source none was written for
runs stock (:data:`SOURCE_UNKNOWN`).
"""

from __future__ import annotations

import functools

from . import guard
from .pool_jobs import PoolJobs

SOURCE_UNKNOWN = "sglang_source_unknown"


@functools.cache
def _installed_fingerprint(target: str) -> str | None:
    """The fingerprint of ``target``'s installed source (read once), None if unreadable."""
    try:
        return guard.fingerprint_target(target)
    except (ImportError, AttributeError, KeyError, OSError, SyntaxError):
        return None


class ReleaseJobs:
    """Which release's builders each hooked target plans with, as one adapter found them."""

    def __init__(self) -> None:
        # Target -> (the recorded fingerprints and the builders it was looked up in, what
        # was found).
        self._found: dict[
            str, tuple[dict[str, dict[str, str]], dict[str, PoolJobs], PoolJobs | None]
        ] = {}

    def jobs_for(self, target: str, by_release: dict[str, PoolJobs]) -> PoolJobs | None:
        """The builders of the release whose recorded fingerprint of ``target`` the
        installed source has; None when no release's does. Found once per target (every
        request's first call asks), again only where the recorded fingerprints or the
        builders are others."""
        recorded = guard.FINGERPRINTS
        found = self._found.get(target)
        if found is not None and found[0] is recorded and found[1] is by_release:
            return found[2]
        jobs = _release_jobs(target, by_release, recorded)
        self._found[target] = (recorded, by_release, jobs)
        return jobs

    def __len__(self) -> int:
        return len(self._found)


def _release_jobs(
    target: str, by_release: dict[str, PoolJobs], recorded: dict[str, dict[str, str]]
) -> PoolJobs | None:
    installed = _installed_fingerprint(target)
    if installed is None:
        return None
    for release, jobs in by_release.items():
        if recorded.get(release, {}).get(target) == installed:
            return jobs
    return None
