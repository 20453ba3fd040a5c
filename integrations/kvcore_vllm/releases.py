"""How the supported vLLM releases differ in the code kvcore's subclasses touch, as data.

vLLM 0.32 and 0.33 call a unit of the CPU tier a chunk; 0.25 calls it a block: the same
pool (a bump counter, then a LIFO free list), the same manager methods and the same
status record under other names. The guard's targets, the manager's overrides and the
spec's reads are written with 0.33's names, and :class:`ReleaseShape` maps each to the
name a release gives it.

0.25's transfer handler fills its copy descriptors inside ``transfer_async`` and has no
fill method: for the jobs kvcore's handler leaves to stock it fills them with the
module's own pointer function instead (:mod:`kvcore_vllm.stock_copies`), and the guard
asks for that function and ``transfer_async`` rather than the fill methods.

0.34's handler holds no GPU tensors: the connector resolves a job's GPU blocks to device
pointers (``DevicePointers``) and ``transfer_async`` takes those and the CPU spec. kvcore's
handler then takes the GPU tensors from the worker's ``CanonicalKVCaches`` and reads the
blocks back from the pointers (:mod:`kvcore_vllm.device_pointers`). 0.34 also reports a
failed copy as ``success=False`` instead of raising, and so does kvcore's handler there.

Only the standard library is imported here: the guard imports this module.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvcore.engine_status import release_of


@dataclass(frozen=True)
class ReleaseShape:
    """One release's names for what kvcore touches, and how its handler fills descriptors."""

    renames: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """0.33's name -> this release's, for functions, classes and attributes."""
    fills_in_transfer_async: bool = False
    """The transfer handler fills its copy descriptors inline, with no fill method."""
    device_pointers: bool = False
    """``transfer_async(job_id, device_pointers, cpu_spec)``, no GPU tensors in the handler."""
    reports_failed_transfers: bool = False
    """A copy that fails is reported as ``success=False``, with the CUDA error cleared."""
    worker_pins_each_tensor: bool = False
    """The spec builds its worker with no region, and the worker allocates each KV tensor's
    host copy with torch's pinned allocator (:mod:`kvcore_vllm.host_region`)."""

    def name(self, current: str) -> str:
        """This release's name for what 0.33 calls ``current``."""
        return self.renames.get(current, current)

    def qualname(self, current: str) -> str:
        """``current`` (``Class.method`` as 0.33 spells it) in this release's names."""
        return ".".join(self.name(part) for part in current.split("."))


CURRENT = ReleaseShape()

# 0.25's names for the chunk pool (manager), its status record, the spec's pool size and
# the transfer handler's block geometry; tests read the pool size and the LRU policy's
# records too.
BLOCK_NAMES = MappingProxyType(
    {
        "_num_chunks": "_num_blocks",
        "chunks": "blocks",
        "_get_num_free_chunks": "_get_num_free_blocks",
        "_allocate_chunks": "_allocate_blocks",
        "_free_chunk": "_free_block",
        "_num_allocated_chunks": "_num_allocated_blocks",
        "ChunkStatus": "BlockStatus",
        "chunk_id": "block_id",
        "num_chunks": "num_blocks",
        "blocks_per_chunk": "block_size_factor",
        "src_blocks_per_chunk": "src_block_size_factor",
        "dst_blocks_per_chunk": "dst_block_size_factor",
        "layer_refs_per_group": "kv_cache_groups_data_refs",
    }
)

SHAPES: Mapping[str, ReleaseShape] = MappingProxyType(
    {
        "0.25.1": ReleaseShape(
            renames=BLOCK_NAMES,
            fills_in_transfer_async=True,
            worker_pins_each_tensor=True,
        ),
        "0.34.0": ReleaseShape(device_pointers=True, reports_failed_transfers=True),
    }
)


def shape_of(release: str) -> ReleaseShape:
    """The shape of ``release`` (a release string, no local label); 0.33's by default."""
    return SHAPES.get(release, CURRENT)


def installed_shape() -> ReleaseShape:
    """The shape of the vLLM installed for this interpreter."""
    return shape_of(release_of(importlib.metadata.version("vllm")))
