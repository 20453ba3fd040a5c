"""NUMA placement of host buffers: the node of a GPU, and memory and threads bound to it.

A pinned buffer on the GPU's own NUMA node is read and written by the GPU's DMA
engines without crossing the socket interconnect. :func:`placement_for` says
where a buffer should go; :func:`bind_memory` sets the policy of an mmap'd range
before its first touch, and the pre-fault threads run on the node's CPUs
(:func:`restrict_thread_to`), so the pages are allocated there. Placement is a
performance hint: where the kernel or a container refuses it, kvcore warns and
carries on with the default policy.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SYSFS = Path("/sys")
"""Where sysfs is read from (tests point it at a fake tree)."""

# mbind(2) modes, from <linux/mempolicy.h>.
MPOL_PREFERRED = 1
MPOL_BIND = 2

# mbind is not in libc's exported wrappers everywhere, so it goes through syscall(2).
_MBIND_SYSCALL = {"x86_64": 237, "amd64": 237, "aarch64": 235, "arm64": 235, "ppc64le": 259}

_CPULIST_PART = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")


class NumaError(ValueError):
    """A placement that cannot be honoured, such as a node this host does not have."""


def parse_cpulist(text: str) -> tuple[int, ...]:
    """CPU (or node) numbers from a sysfs list such as ``0-3,8-11:2,16`` (empty: none)."""
    numbers: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        match = _CPULIST_PART.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"not a CPU list: {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        stride = int(match.group(3)) if match.group(3) is not None else 1
        if last < first or stride < 1:
            raise ValueError(f"not a CPU list: {text!r}")
        numbers.update(range(first, last + 1, stride))
    return tuple(sorted(numbers))


def online_nodes() -> tuple[int, ...]:
    """The NUMA nodes of this host; ``(0,)`` where the kernel reports none."""
    node_dir = SYSFS / "devices" / "system" / "node"
    try:
        nodes = parse_cpulist((node_dir / "online").read_text())
    except FileNotFoundError:
        nodes = tuple(
            sorted(int(p.name[4:]) for p in node_dir.glob("node*") if p.name[4:].isdigit())
        )
    return nodes or (0,)


def node_count() -> int:
    return len(online_nodes())


def node_cpus(node: int) -> tuple[int, ...]:
    """The CPUs of ``node``; empty for a node without CPUs (memory-only, e.g. CXL)."""
    path = SYSFS / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        return parse_cpulist(path.read_text())
    except FileNotFoundError:
        raise NumaError(f"NUMA node {node} does not exist ({path} is missing)") from None


def pci_numa_node(bus_id: str) -> int | None:
    """The node a PCI device is attached to; None when the firmware does not say (-1)."""
    path = SYSFS / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return node if node >= 0 else None


def cuda_pci_bus_id(device: torch.device | int | None = None) -> str | None:
    """``dddd:bb:dd.0`` of a CUDA device, from its properties; None when torch does not say."""
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None in ids:
        return None
    domain, bus, slot = ids
    return f"{domain:04x}:{bus:02x}:{slot:02x}.0"


def cuda_numa_node(device: torch.device | int | None = None) -> int | None:
    """The NUMA node of a CUDA device; None without CUDA or where the host does not say."""
    if not torch.cuda.is_available():
        return None
    bus_id = cuda_pci_bus_id(device)
    return None if bus_id is None else pci_numa_node(bus_id)


MAX_NODE = 1023


def parse_setting(text: str) -> str | int:
    """A placement setting written as text: ``off``, ``auto`` or a node number."""
    word = text.strip().lower()
    if word in ("off", "auto"):
        return word
    if not re.fullmatch(r"[0-9]+", word) or int(word) > MAX_NODE:
        raise NumaError(
            f"{text!r} is not a NUMA setting; allowed: off, auto (the node of the buffer's GPU) "
            f"or a node number from 0 to {MAX_NODE}"
        )
    return int(word)


def resolve_node(setting: str | int, device: torch.device | int | None = None) -> int | None:
    """The node a setting asks for: None for ``off``, the device's node for ``auto``."""
    if setting == "off":
        return None
    if setting == "auto":
        node = cuda_numa_node(device)
        if node is None:
            logger.info("NUMA placement auto: no NUMA node known for the GPU; default placement")
        return node
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return setting
    raise NumaError(f"NUMA setting must be 'off', 'auto' or a node number, not {setting!r}")


@dataclass(frozen=True)
class Placement:
    """Where one buffer goes: its node and the CPUs that may pre-fault it."""

    node: int
    cpus: tuple[int, ...]


_single_node_logged = False


def placement_for(node: int | None) -> Placement | None:
    """The placement for ``node``; None when there is nothing to place (no node, one node).

    On a single-node host every placement is a no-op, said once at info level.
    """
    global _single_node_logged
    if node is None:
        return None
    nodes = online_nodes()
    if len(nodes) == 1:
        if not _single_node_logged:
            logger.info("NUMA placement asked for, but this host has one NUMA node: nothing to do")
            _single_node_logged = True
        return None
    if node not in nodes:
        raise NumaError(
            f"NUMA node {node} is not online on this host; online: {', '.join(map(str, nodes))}"
        )
    usable = set(os.sched_getaffinity(0))
    cpus = tuple(cpu for cpu in node_cpus(node) if cpu in usable)
    if not cpus:
        logger.warning(
            "NUMA node %d has no CPU this process may run on; pre-faulting from anywhere "
            "(the memory policy still places the pages)",
            node,
        )
    return Placement(node, cpus)


def current_gpu_placement() -> Placement | None:
    """The placement of the GPU this process drives now (the engines set the device before
    they build host pools); None without CUDA, on one node, or where the node is unknown
    or offline (said at info level: the default policy places the pages)."""
    if not torch.cuda.is_available():
        return None
    try:
        return placement_for(cuda_numa_node(torch.cuda.current_device()))
    except NumaError as exc:
        logger.info("host memory placed by the default policy (%s)", exc)
        return None


def _syscall() -> Callable[..., int]:
    return ctypes.CDLL(None, use_errno=True).syscall


def bind_memory(address: int, nbytes: int, node: int, *, mode: int = MPOL_PREFERRED) -> bool:
    """Set the memory policy of ``[address, address + nbytes)`` to ``node``; True if set.

    Must run before the pages are first touched: mbind without MPOL_MF_MOVE only
    places pages faulted afterwards. ``mode`` is MPOL_PREFERRED (fall back to
    other nodes when ``node`` is full) or MPOL_BIND (fail instead). Refusals that
    come from the host rather than from kvcore (no NUMA support, a seccomp profile
    without CAP_SYS_NICE, a cpuset without the node) log a warning and return False.
    """
    number = _MBIND_SYSCALL.get(platform.machine().lower())
    if number is None:
        logger.warning("NUMA binding is not supported on %s; default placement", platform.machine())
        return False
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    # The kernel reads maxnode - 1 bits (a historical off-by-one every caller allows for).
    result = _syscall()(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(mode),
        mask,
        ctypes.c_ulong(words * bits + 1),
        ctypes.c_uint(0),
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    why = {
        errno.ENOSYS: "the kernel has no NUMA support",
        errno.EPERM: "not permitted (a container seccomp profile needs CAP_SYS_NICE for mbind)",
        errno.EINVAL: "refused (is the node outside this process's cpuset?)",
    }.get(code)
    if why is None:
        raise OSError(code, f"mbind to NUMA node {node} failed: {os.strerror(code)}")
    logger.warning("binding host memory to NUMA node %d: %s; default placement", node, why)
    return False


def restrict_thread_to(cpus: Collection[int]) -> None:
    """Run the calling thread (only) on ``cpus``; a no-op for an empty set.

    A refusal (CPUs gone offline, a cpuset changed since) leaves the thread where it
    was: placement is a hint, and a pre-fault thread must never fail for it.
    """
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("cannot run a pre-fault thread on CPUs %s: %s", sorted(cpus), exc)


def pages_by_node(
    address: int, nbytes: int, numa_maps: Path = Path("/proc/self/numa_maps")
) -> dict[int, int]:
    """Resident pages of ``[address, address + nbytes)`` per node, from ``numa_maps``.

    Counts whole mappings that start inside the range (a bound range is its own mapping).
    """
    counts: dict[int, int] = {}
    for line in _read_lines(numa_maps):
        fields = line.split()
        if not fields or not address <= int(fields[0], 16) < address + nbytes:
            continue
        for field in fields[2:]:
            match = re.fullmatch(r"N(\d+)=(\d+)", field)
            if match is not None:
                node = int(match.group(1))
                counts[node] = counts.get(node, 0) + int(match.group(2))
    return counts


def _read_lines(path: Path) -> Iterable[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return ()
