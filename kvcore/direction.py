"""Which way a transfer goes."""

from __future__ import annotations

from enum import Enum


class Direction(str, Enum):
    """Host-to-device is a reload (page-in); device-to-host is a backup (page-out)."""

    H2D = "h2d"
    D2H = "d2h"
