"""The SGLang host layouts and io backends whose transfers kvcore's hooks serve.

Only the standard library is imported: ``kvcore launch`` reads these names to warn
before the engine starts, and must not pay for torch.
"""

from __future__ import annotations

# Layout -> io backends whose stock transfer the hooks reproduce. SGLang itself
# accepts no other pair (its transfer methods raise ValueError for them).
SERVED_LAYOUTS: dict[str, frozenset[str]] = {
    "layer_first": frozenset({"kernel", "direct"}),
    "page_first": frozenset({"kernel"}),
    "page_first_direct": frozenset({"direct"}),
}
IO_BACKENDS = frozenset({"kernel", "direct"})


def layout_reason(layout: str, io_backend: str) -> str | None:
    """Why a (layout, io backend) pair runs stock, or None when kvcore serves it."""
    if io_backend not in IO_BACKENDS:
        return "sglang_io_backend"
    backends = SERVED_LAYOUTS.get(layout)
    if backends is None:
        return f"sglang_layout_{layout}"
    if io_backend not in backends:
        return "sglang_layout_io_backend"
    return None
