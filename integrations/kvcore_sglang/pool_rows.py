"""The rows of an SGLang host pool's buffer, as kvcore's jobs copy them."""

from __future__ import annotations

from typing import Any

import torch

# Host layouts whose buffer's last two dimensions are one token's row of one layer (heads x
# head dim, or 1 x the MLA row), the rows kvcore's jobs copy.
_TOKEN_ROW_LAYOUTS = frozenset({"layer_first", "page_first", "page_first_direct"})


def pool_row_bytes(pool: Any) -> int | None:
    """Bytes of one token's row of one layer in ``pool``'s host buffer; None where its
    layout has no such row (or the buffer is not built yet)."""
    buffer = getattr(pool, "kv_buffer", None)
    if getattr(pool, "layout", None) not in _TOKEN_ROW_LAYOUTS:
        return None
    if not isinstance(buffer, torch.Tensor) or buffer.dim() < 3:
        return None
    return int(buffer.shape[-2] * buffer.shape[-1] * buffer.element_size())
