"""The vLLM handler's serve-or-pass thresholds, each with the measurements behind it.

:class:`kvcore_vllm.transfers.KVCoreOffloadingHandler` reads them per job;
:func:`kvcore.planning.serve_rule.describe` lists them beside SGLang's rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VLLMRules:
    """The vLLM handler's thresholds (:class:`kvcore_vllm.transfers.KVCoreOffloadingHandler`)."""

    min_pages_per_submission: int = 512
    """A job with fewer pages per submission it would need stays with stock's one batched
    copy: kvcore's submission costs a few hundred microseconds of host time, stock's driver
    ~0.5-1 us a page. H200 A/Bs: kvcore lost at 32-256 pages a submission and won from
    512 (4 KiB to 64 KiB pages); jobs of 32 and 256 pages (of 256 KiB and 2 MiB) ran at
    0.88-0.99x of stock on kvcore's paths, 0.98-1.03x left to stock."""
    large_page_bytes: int = 64 << 10
    """Pages from this size on take the two rules below."""
    min_large_pages_per_submission: int = 2048
    """The same threshold for large pages, where stock's batched DMA is near the link: in
    vLLM 0.25.1 serving an 8B-shaped model on the H200 (64 KiB pages, 32 layers), reloads of
    512 tokens (1024 pages) took 1.10x stock's device time through kvcore, 1024 tokens
    (2048 pages) 0.85x, 2048 and more 0.73-0.85x. Checked again with the staged ring,
    both copies drawn inside one live process: reloads of 832 and 1088 pages were
    resolvably slower through kvcore (about 3 ms against 2.1 and 2.6), 1344 pages level."""
    stock_stores_from_page_bytes: int | None = 1 << 20
    """Stores of pages this large stay stock (None: kvcore may take any store). Judged
    beside the model's compute (:data:`LARGE_PAGE_EVIDENCE`, vLLM 0.33's handler on an
    H100): over one KV tensor of 1 MiB blocks, kvcore's stores ran 0.97-1.01x stock's speed
    from 8k tokens and slower below; per-layer pages of 64 KiB, where stock's stores were
    kept until then, went 1.10-1.25x stock's speed by DMA into place from 2048 pages (level
    at 32k tokens), the other batch's forward as fast as beside stock's."""
    stock_kernel_loads: bool = True
    """Loads over a single KV tensor (cross-layer layout) that are not one run per group
    stay with vLLM's Triton kernel, which vLLM picks for blocks under 28 KiB. Judged beside
    the model's compute (:data:`KERNEL_LOAD_EVIDENCE`, vLLM 0.33's handler on an H100, blocks
    of 24 KiB): kvcore's own copy ran 0.58-0.94x the kernel's speed, the other batch's
    forward no faster beside it."""

    stock_scattered_loads_from_page_bytes: int | None = 1 << 20
    """Loads over a single KV tensor (cross-layer layout) of pages this large stay with
    stock's batched DMA unless they are one run per group (None: no such rule). Each page
    is one long DMA there, near the link: in vLLM 0.25.1's engine-shaped sweep on the H200,
    kvcore's gather moved scattered 4096-page loads of 1 MiB pages at 0.94x stock's speed
    (it did not copy those of 1.1 MiB pages: unaligned rows); one-run loads (a single DMA)
    at 1.02x."""

    stock_gathered_stores_from_page_bytes: int | None = 16 << 10
    """Stores of pages from this size (None: no such rule) but shorter than the store
    handler's DMA-in-place runs, which kvcore would copy with its gather kernel, stay stock.
    By default those runs start at 16 KiB, so only an operator's thresholds leave such pages
    to the gather. Judged beside the model's compute (:data:`GATHER_EVIDENCE`, vLLM 0.33
    per-layer MLA blocks of 18 KiB on an H100): stock's stores left another batch's forward at
    its time alone, the gather's slowed it 1.01-1.25x (most beside decode-256 and prefill
    batches). Loads of such
    pages are kvcore's: the gather took 0.66-0.86x of stock's time beside compute, and the
    forward beside it 0.86-1.03x its time beside stock's load (vLLM's Triton kernel for MLA
    slowed that forward 1.12-1.40x); from a shared CPU region they now go staged by region
    (:data:`kvcore.planning.path_policy.REGION_STAGING_EVIDENCE`). Smaller pages were not
    measured beside compute."""

    def min_pages(self, page_bytes: int) -> int:
        """Pages a submission must cover, on average, for pages of ``page_bytes``."""
        if page_bytes >= self.large_page_bytes:
            return self.min_large_pages_per_submission
        return self.min_pages_per_submission

    def scattered_load_passes(self, page_bytes: int) -> bool:
        """Whether scattered loads over one KV tensor of pages of ``page_bytes`` stay stock."""
        limit = self.stock_scattered_loads_from_page_bytes
        return limit is not None and page_bytes >= limit

    def gathered_store_passes(self, page_bytes: int, dma_from_bytes: int) -> bool:
        """Whether a store of pages of ``page_bytes`` stays stock because kvcore, copying
        runs of ``dma_from_bytes`` and more by DMA into place, would gather it."""
        limit = self.stock_gathered_stores_from_page_bytes
        return limit is not None and limit <= page_bytes < dma_from_bytes

    def store_passes(self, page_bytes: int) -> bool:
        """Whether stores of pages of ``page_bytes`` stay with stock at any size."""
        limit = self.stock_stores_from_page_bytes
        return limit is not None and page_bytes >= limit


GATHER_EVIDENCE = (
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rerun-mla.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rerun-mla-b.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rerun-stores-mla.json",
)
"""The beside-compute runs :attr:`VLLMRules.stock_gathered_stores_from_page_bytes` is judged
from."""

STORE_DMA_EVIDENCE = (
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rerun-mla-dma.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-store-dma-1.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-store-dma-2.json",
)
"""The beside-compute runs of MLA's 18 KiB blocks by DMA into place that
:data:`kvcore.planning.path_policy.VLLM_STORE_DMA_IN_PLACE_RUN_BYTES` is judged from."""

LARGE_PAGE_EVIDENCE = (
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rule-rows.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rule-rows-small.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rule-rows-scattered.json",
)
"""The beside-compute runs the rows for pages of 64 KiB and more are judged from: stores of
large pages (:attr:`VLLMRules.stock_stores_from_page_bytes`), the pages a submission needs
(``few_pages``, both sizes) and scattered loads of 1 MiB blocks."""

KERNEL_LOAD_EVIDENCE = (
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rule-row-17.json",
    "docs/bench/h100-beside-compute-vllm-2026-12-06-rule-row-17-early-pass.json",
)
"""The beside-compute runs :attr:`VLLMRules.stock_kernel_loads` is judged from: before and
after such loads passed from their first and last GPU ids (two machines)."""

VLLM_RULES = VLLMRules()


_BOTH_LAYOUTS = "per-layer or cross-layer"
_ONE_TENSOR = "cross-layer (one KV tensor)"


def _vllm_row(
    op: str, layout: str, page_sizes: str, serves: str, reason: str, evidence: str, **more: object
) -> dict[str, object]:
    return {
        "engine": "vllm",
        "pool": "-",
        "op": op,
        "io_backend": "-",
        "layout": layout,
        "page_sizes": page_sizes,
        "serves": serves,
        "reason": reason,
        "evidence": evidence,
        **more,
    }


def _size(nbytes: int) -> str:
    """``nbytes`` in whole MiB where it is one, else in KiB."""
    if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB"


def describe_vllm() -> list[dict[str, object]]:
    """:data:`VLLM_RULES` as plain rows (``kvcore doctor``'s table), in the order the handler
    asks them."""
    rows = []
    large = _size(VLLM_RULES.large_page_bytes)
    gathered_from = VLLM_RULES.stock_gathered_stores_from_page_bytes
    if gathered_from is not None:
        rows.append(
            _vllm_row(
                "store",
                _BOTH_LAYOUTS,
                f">= {_size(gathered_from)}, under the DMA-in-place runs",
                "never",
                "stock_gather_beside_compute",
                "beside compute, kvcore's gathered stores slowed another batch's forward "
                "1.01-1.25x against stock's, which left it at its time alone (MLA 18 KiB "
                "blocks, H100)",
                cited=list(GATHER_EVIDENCE),
            )
        )
    stores_from = VLLM_RULES.stock_stores_from_page_bytes
    if stores_from is not None:
        rows.append(
            _vllm_row(
                "store",
                _BOTH_LAYOUTS,
                f">= {_size(stores_from)}",
                "never",
                "stock_store_large_pages",
                "beside compute, kvcore's stores of 1 MiB blocks ran 0.97-1.01x stock's speed "
                "from 8k tokens (64 KiB pages: 1.10-1.25x from 2048 pages, served; H100)",
                cited=list(LARGE_PAGE_EVIDENCE),
            )
        )
    rows += [
        _vllm_row(
            "store/load",
            _BOTH_LAYOUTS,
            f"< {large}",
            f">= {VLLM_RULES.min_pages_per_submission} pages per submission",
            "few_pages",
            "beside compute, 256-page jobs of 32 KiB pages ran 0.82-0.96x stock's speed on "
            "kvcore's own paths, 1024-page ones 1.20-1.36x (H100); H200 A/B: 0.88-0.99x "
            "at 32-256 pages",
            cited=list(LARGE_PAGE_EVIDENCE),
        ),
        _vllm_row(
            "store/load",
            _BOTH_LAYOUTS,
            f">= {large}",
            f">= {VLLM_RULES.min_large_pages_per_submission} pages per submission",
            "few_pages",
            "beside compute, 256-page jobs of 64 KiB pages ran 0.81-0.93x stock's speed on "
            "kvcore's own paths, 2048-page ones 1.17-1.29x (H100); live vLLM 0.25.1: "
            "1024-page reloads 1.10x stock's time",
            cited=list(LARGE_PAGE_EVIDENCE),
        ),
    ]
    if VLLM_RULES.stock_kernel_loads:
        rows.append(
            _vllm_row(
                "load",
                _ONE_TENSOR,
                "< 28 KiB",
                "only one run per group",
                "stock_kernel_load",
                "beside compute, scattered 24 KiB blocks: kvcore's own copy 0.58-0.94x the "
                "speed of vLLM's Triton load kernel (H100)",
                cited=list(KERNEL_LOAD_EVIDENCE),
            )
        )
    scattered_from = VLLM_RULES.stock_scattered_loads_from_page_bytes
    if scattered_from is not None:
        rows.append(
            _vllm_row(
                "load",
                _ONE_TENSOR,
                f">= {_size(scattered_from)}",
                "only one run per group",
                "stock_dma_large_pages",
                "beside compute, scattered 1 MiB blocks: stock's DMA 1.04-1.05x the link, "
                "kvcore's own 1.00-1.01x its speed (H100); vLLM 0.25.1 sweep: 0.94-1.00x",
                cited=list(LARGE_PAGE_EVIDENCE),
            )
        )
    return rows
