"""How the supported vLLM releases differ in the code kvcore's subclasses touch, as data.

vLLM 0.32 and 0.33 call a unit of the CPU tier a chunk; 0.25 calls it a block: the same
pool (a bump counter, then a LIFO free list), the same manager methods and the same
status record under other names. The guard's targets, the manager's overrides and the
spec's reads are written with 0.33's names, and :class:`ReleaseShape` maps each to the
name a release gives it.

0.25's transfer handler fills its copy descriptors inside ``transfer_async``: there is
no fill method kvcore's handler could run, on its own stream and in its own job order,
for the jobs it leaves to stock. So on 0.25 the handlers stay stock and the guard does
not ask for their code.

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
    """One release's names for what kvcore touches, and what it leaves stock."""

    renames: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """0.33's name -> this release's, for functions, classes and attributes."""
    stock_transfers: str | None = None
    """Why the worker's transfer handlers stay stock on this release; None: kvcore's."""

    def name(self, current: str) -> str:
        """This release's name for what 0.33 calls ``current``."""
        return self.renames.get(current, current)

    def qualname(self, current: str) -> str:
        """``current`` (``Class.method`` as 0.33 spells it) in this release's names."""
        return ".".join(self.name(part) for part in current.split("."))


CURRENT = ReleaseShape()

# 0.25's names for the chunk pool (manager), its status record and the spec's pool size;
# tests read the pool size and the LRU policy's records too.
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
    }
)

SHAPES: Mapping[str, ReleaseShape] = MappingProxyType(
    {
        "0.25.1": ReleaseShape(
            renames=BLOCK_NAMES,
            stock_transfers=(
                "vLLM 0.25's handler fills its copy descriptors inside transfer_async, so "
                "the jobs kvcore leaves to stock could not run stock's code in kvcore's "
                "job order"
            ),
        ),
    }
)


def shape_of(release: str) -> ReleaseShape:
    """The shape of ``release`` (a release string, no local label); 0.33's by default."""
    return SHAPES.get(release, CURRENT)


def installed_shape() -> ReleaseShape:
    """The shape of the vLLM installed for this interpreter."""
    return shape_of(release_of(importlib.metadata.version("vllm")))
