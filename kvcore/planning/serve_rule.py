"""Serve or pass: for each engine call, whether kvcore's copy or the engine's stock copy is faster.

Every input of the rule is in :data:`SGLANG_RULES` and
:data:`kvcore.planning.vllm_rule.VLLM_RULES`, each entry
naming the engine-shaped sweep cells it was read from (docs/performance.md, "Evidence behind
the serve-or-pass rule"). An adapter asks :func:`sglang_decision` (or reads the vLLM
thresholds) once per request, before it plans anything, so a call that passes costs stock's
time plus a lookup.
``KVCORE_SERVE_RULE=0`` turns the rule off (kvcore serves every call it can copy exactly),
which is how the sweep measures kvcore's own paths against stock to set these entries.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from kvcore.planning.rule_evidence import (
    BACKUP_EVIDENCE,
    BESIDE_COMPUTE_EVIDENCE,
    RING_EVIDENCE,
    RING_EVIDENCE_H100,
)
from kvcore.planning.vllm_rule import describe_vllm

ANY = "*"

SERVE = None
"""What a decision returns when kvcore serves the call (a pass returns its reason)."""

DENSE_HOST_REASON = "stock_dense_host"
"""The reason a row that does not serve dense host slots (``dense_host=False``) gives."""


@dataclass(frozen=True)
class SGLangRule:
    """When kvcore serves one kind of SGLang host-pool call.

    ``op``, ``io_backend``, ``layout`` match exactly or :data:`ANY`; ``page_sizes`` is the
    inclusive range of page sizes the entry covers. kvcore serves a call of at least
    ``min_tokens`` tokens; None means never (stock is as fast or faster at every size).
    """

    op: str
    io_backend: str
    layout: str
    page_sizes: tuple[int, int]
    min_tokens: int | None
    reason: str
    """Why the rule passes (the metrics label), or why it serves."""
    evidence: str
    """The measurements behind the entry."""
    dense_host: bool = True
    """False: kvcore passes when the request's host slots are few long runs (what its
    planner moves by DMA), where stock's copy runs as well as kvcore's, unless
    ``dense_min_tokens`` serves it (the adapter checks once it has the slots)."""
    dense_min_tokens: int | None = None
    """Requests whose host slots are few long runs are served from this many tokens,
    whatever ``min_tokens`` says: kvcore moves them by DMA and holds no SMs, where stock's
    kernel takes SMs from the model for a copy no faster."""
    pool: str = ANY
    """The host pool's kind (``mha``, ``mla``, ``dsa``), or :data:`ANY`: rows of one size
    move at other speeds on stock's kernels (MLA's 1152 B against MHA's 2 KiB)."""
    cited: tuple[str, ...] = ()
    """The benchmark JSON files (under docs/bench/) the entry was decided from; a test holds
    the entry to them."""

    @property
    def never(self) -> bool:
        """Whether the row passes every call, whatever its size and host slots."""
        return self.min_tokens is None and self.dense_min_tokens is None

    @property
    def reads_host_runs(self) -> bool:
        """Whether a served call's host slots still decide (:meth:`host_decision`)."""
        return not self.dense_host or self.dense_min_tokens is not None

    @property
    def serves_from(self) -> int | None:
        """The fewest tokens a call this row may serve has (host slots aside); None: never."""
        lowest, dense = self.min_tokens, self.dense_min_tokens
        if dense is not None and (lowest is None or dense < lowest):
            lowest = dense
        return lowest

    def decision(self, tokens: int) -> str | None:
        """:data:`SERVE` for a call of ``tokens`` tokens this row may serve (where it
        :attr:`reads_host_runs`, :meth:`host_decision` has the last word), else its reason."""
        lowest = self.serves_from
        return SERVE if lowest is not None and tokens >= lowest else self.reason

    def host_decision(self, tokens: int, few_host_runs: bool) -> str | None:
        """:data:`SERVE` or the reason to pass, for a call whose host slots are few long
        runs (``few_host_runs``) or not."""
        if few_host_runs:
            if self.dense_min_tokens is not None and tokens >= self.dense_min_tokens:
                return SERVE
            if not self.dense_host:
                return DENSE_HOST_REASON
        return SERVE if self.min_tokens is not None and tokens >= self.min_tokens else self.reason

    def matches(
        self, op: str, io_backend: str, layout: str, page_size: int, pool: str = ""
    ) -> bool:
        return (
            self.op in (ANY, op)
            and self.io_backend in (ANY, io_backend)
            and self.layout in (ANY, layout)
            and self.page_sizes[0] <= page_size <= self.page_sizes[1]
            and self.pool in (ANY, pool)
        )


_ALL_PAGES = (1, 1 << 30)

_PAGED = (2, 1 << 30)
_TOKEN_PAGES = (1, 1)


def _token_backup(evidence: str, pool: str = ANY, dense_from_32k: bool = False) -> SGLangRule:
    """Token-granular ``layer_first`` backups (of ``pool``): served from 16k tokens on
    scattered host slots; on few long host runs only where ``dense_from_32k``, from 32k (by
    DMA), as the backup runs beside a forward show (:data:`BACKUP_EVIDENCE`)."""
    return SGLangRule(
        "backup",
        "kernel",
        "layer_first",
        _TOKEN_PAGES,
        16384,
        "stock_kernel_small_backup",
        evidence,
        dense_host=False,
        dense_min_tokens=32768 if dense_from_32k else None,
        pool=pool,
        cited=BACKUP_EVIDENCE if dense_from_32k else (),
    )


_BESIDE_COMPUTE = (
    BESIDE_COMPUTE_EVIDENCE,
    "docs/bench/h200-beside-compute-sglang-2026-12-04.json",
    "docs/bench/h200-beside-compute-sglang-2026-12-04-b.json",
    *RING_EVIDENCE,
)

# First match wins, so specific entries come before general ones.
SGLANG_RULES: tuple[SGLangRule, ...] = (
    SGLangRule(
        "load",
        "kernel",
        "layer_first",
        _TOKEN_PAGES,
        32768,
        "stock_kernel_small_mla_load",
        "token-granular MLA layer_first reloads. On few long host runs (the layer ring: DMA, "
        "then a high-priority scatter), beside compute: at 32k tokens kvcore's reload "
        "42.6-45.2 ms against stock's 67.2-127.4 (link 41.6) and the hit's decode-64 forward "
        "done at 43.8 ms against 69.0; at 8k faster alone and beside other batches (11.7 "
        "against 26.5 ms beside a prefill) but the hit's decode-64 forward done at 28.4 ms "
        f"against 26.9 ({BESIDE_COMPUTE_EVIDENCE}, mla/.../p1; the 2026-12-04 runs alike). "
        "Scattered host slots take the gather (4 CTAs), 1.14-1.19x alone, served from 32k "
        "(H200 engine sweeps, 2026-12-03)",
        dense_min_tokens=32768,
        pool="mla",
        cited=_BESIDE_COMPUTE,
    ),
    SGLangRule(
        "load",
        "kernel",
        "layer_first",
        _ALL_PAGES,
        None,
        "stock_kernel_near_link",
        "MHA layer_first reloads on few long host runs, beside compute (the layer ring, one "
        "scatter launch a layer): at 8k, page 64, reloads 21.1-21.6 ms against stock's "
        "30.0-30.2 beside another batch's prefill (link 19.4), that prefill 21.7-22.6 ms "
        "against 24.3-24.5 (alone 21.7-21.9), the hit's own prefill done at 98.5-100.8 against "
        "98.9-100.4; at 4k 10.8 against 16.2, the hit's prefill 98.0 against 97.5; page 1 "
        "alike; at 32k 81.6-81.7 against 105.1-106.2 (link 77.7), the hit's prefill 100.5-100.6 "
        f"against 111.0-111.8 ({', '.join(RING_EVIDENCE)}). Served from 4k: on an H100 at 1k "
        "and 2k the hit's own decode-64 forward was done at 12.7-13.4 ms against stock's "
        "10.6-11.3, its prefill 1.4-3.7% later; page 16 at 8k and 32k won as page 64 does "
        f"({', '.join(RING_EVIDENCE_H100)}). Scattered host slots stay stock's: kvcore's "
        "gather is no faster",
        dense_min_tokens=4096,
        pool="mha",
        cited=(*RING_EVIDENCE, *RING_EVIDENCE_H100),
    ),
    SGLangRule(
        "load",
        "kernel",
        "layer_first",
        _PAGED,
        None,
        "stock_kernel_near_link",
        "paged MLA layer_first reloads on few long host runs, beside compute at 32k tokens "
        "(the layer ring): page 64 reloads 42.5-47.2 ms against stock's 47.5-114.1 (link "
        "41.6); at 4k and 8k faster too, but the hit's decode-64 done later than with stock's "
        f"(29.8 against 29.0 ms at 8k, 28.6 against 27.6 at 4k; {RING_EVIDENCE[2]}; "
        f"{BESIDE_COMPUTE_EVIDENCE} and the 2026-12-04 runs alike). Scattered host slots stay "
        "stock's: kvcore's gather is no faster",
        dense_min_tokens=32768,
        pool="mla",
        cited=_BESIDE_COMPUTE,
    ),
    SGLangRule(
        "load",
        "kernel",
        ANY,
        _ALL_PAGES,
        None,
        "stock_kernel_near_link",
        "SGLang's JIT load kernel moves paged reloads at 50-51 GB/s from 4k tokens up, for "
        "19-26 us of host time a layer; kvcore's own loads 0.97-1.20x from 8k tokens (H200 "
        "engine sweep, 2026-12-04; the 1.20x a scattered 32k token-granular page_first MHA "
        "load, idle GPU). The layer_first rows above serve few long host runs (MHA from 4k "
        "tokens, MLA from 32k)",
    ),
    SGLangRule(
        "backup",
        "kernel",
        "layer_first",
        _PAGED,
        None,
        "stock_kernel_near_link",
        "paged MHA layer_first backups: on few long host runs kvcore's DMA ran 1.00x stock's "
        "wall-clock at 32k tokens and left a concurrent GEMM 93% of its throughput, stock's "
        "kernel 56%; 0.90x at 8k. Scattered, kvcore's gather is no faster and holds as many "
        "SMs (H200 engine sweep with a GEMM beside it). Beside a forward at 32k, the forward "
        f"took 1.03-1.04x its time alone, 1.44-1.70x beside stock's ({BACKUP_EVIDENCE[0]}); "
        "spanning four times the copy, 1.01-1.02x against 1.12-1.16x, the backup 1.02-1.16x "
        f"stock's ({BACKUP_EVIDENCE[1]}); at 8k kvcore's backup took up to 2.3x stock's time",
        dense_min_tokens=32768,
        pool="mha",
        cited=BACKUP_EVIDENCE,
    ),
    SGLangRule(
        "backup",
        "kernel",
        "layer_first",
        _PAGED,
        None,
        "stock_kernel_near_link",
        "paged layer_first backups: stock's kernel at 51-53 GB/s; kvcore's own 0.15-0.87x "
        "below 16k tokens, 0.97-1.01x above (H200 engine sweep)",
    ),
    _token_backup(
        "token-granular MHA layer_first backups: scattered host slots as below; on few long "
        "host runs kvcore's DMA ran 1.00x stock at 32k tokens and left a concurrent GEMM 93% "
        "of its throughput, stock's kernel 69% (0.94x at 8k; H200 engine sweep with a GEMM). "
        "Beside a forward at 32k, the forward took 1.03-1.05x its time alone, 1.11-1.35x "
        f"beside stock's ({BACKUP_EVIDENCE[0]}); spanning four times the copy, 1.01x against "
        f"1.03-1.08x, the backup 0.81-1.08x stock's ({BACKUP_EVIDENCE[1]}); at 8k kvcore's "
        "backup took up to 2.2x stock's",
        pool="mha",
        dense_from_32k=True,
    ),
    _token_backup(
        "token-granular MLA layer_first backups: scattered host slots as below; on few long "
        "host runs, beside a forward at 32k, kvcore's DMA backup took 0.82-1.04x stock's "
        "time and the forward no longer than beside stock's, in both runs "
        f"({', '.join(BACKUP_EVIDENCE)}); at 8k kvcore's backup took up to 3.9x stock's",
        pool="mla",
        dense_from_32k=True,
    ),
    _token_backup(
        "token-granular layer_first backups: stock's kernel drops to 26-42 GB/s on scattered "
        "host slots from 16k tokens (kvcore 1.23-1.86x); below, and on one dense host span "
        "(0.95-1.02x), stock is as fast",
    ),
    SGLangRule(
        "backup",
        "kernel",
        "page_first",
        _TOKEN_PAGES,
        1024,
        "stock_page_first_backup_slow",
        "token-granular page_first backups: stock at 16-20 GB/s, kvcore 1.35-3.0x from 1k "
        "tokens; at 256, MLA's short rows keep stock ahead (0.71-0.81x; H200 engine sweep)",
    ),
    SGLangRule(
        "backup",
        "kernel",
        "page_first",
        _PAGED,
        None,
        "stock_kernel_near_link",
        "paged page_first backups: stock's staged write-back at 46-54 GB/s; kvcore's own "
        "0.51-0.94x (H200 engine sweep)",
    ),
    SGLangRule(
        ANY,
        "direct",
        ANY,
        _TOKEN_PAGES,
        0,
        "stock_direct_per_token",
        "the direct backend at page size 1 issues one copy per token run per layer "
        "(kvcore 134-575x those copies issued one by one, against a stand-in of stock's loop)",
    ),
    SGLangRule(
        ANY,
        "direct",
        ANY,
        _PAGED,
        4096,
        "stock_direct_small_request",
        "the direct backend issues one copy per page run per layer: cheap for a few pages, "
        "short of the link for many (kvcore 3.5-12.2x a stand-in of its copies from 4k tokens; "
        "below, stock's C++ loop costs less host time than kvcore's request)",
    ),
    SGLangRule(
        ANY,
        ANY,
        ANY,
        _ALL_PAGES,
        2048,
        "small_request",
        "below ~2k tokens a request's copy is shorter than kvcore's first-call planning",
    ),
)


@functools.lru_cache(maxsize=4096)
def _sglang_rule(
    op: str, io_backend: str, layout: str, page_size: int, pool: str
) -> SGLangRule | None:
    return next(
        (r for r in SGLANG_RULES if r.matches(op, io_backend, layout, page_size, pool)), None
    )


def sglang_rule(
    op: str, io_backend: str, layout: str, page_size: int, *, pool: str = ""
) -> SGLangRule | None:
    """The row that decides this kind of SGLang call (the first that matches), or None
    where none does (kvcore serves). An adapter looks it up once per call and asks it
    everything after: :meth:`SGLangRule.decision`, ``min_tokens``, ``dense_host``."""
    return _sglang_rule(op, io_backend, layout, page_size, pool)


def sglang_decision(
    op: str,
    io_backend: str,
    layout: str,
    page_size: int,
    tokens: int,
    *,
    pool: str = "",
    enabled: bool = True,
) -> str | None:
    """None when kvcore serves this SGLang call, else the reason it passes to stock.
    ``pool`` is the host pool's kind; "" (unknown) meets only the rows for any pool."""
    if not enabled:
        return SERVE
    rule = _sglang_rule(op, io_backend, layout, page_size, pool)
    return SERVE if rule is None else rule.decision(tokens)


def _page_range(low: int, high: int) -> str:
    if high >= 1 << 30:
        return f"{low}+"
    return str(low) if low == high else f"{low}-{high}"


def _serves(rule: SGLangRule) -> str:
    if rule.never:
        return "never"
    parts = []
    if rule.min_tokens is not None:
        size = "always" if rule.min_tokens == 0 else f">= {rule.min_tokens} tokens"
        parts.append(size if rule.dense_host else f"{size}, scattered host slots")
    if rule.dense_min_tokens is not None:
        parts.append(f">= {rule.dense_min_tokens} tokens on few long host runs (DMA)")
    return "; ".join(parts)


def describe(rules: Iterable[SGLangRule] = SGLANG_RULES) -> list[dict[str, object]]:
    """The rule as plain rows, for ``kvcore doctor`` and the docs."""
    rows: list[dict[str, object]] = []
    for rule in rules:
        low, high = rule.page_sizes
        rows.append(
            {
                "engine": "sglang",
                "pool": rule.pool,
                "op": rule.op,
                "io_backend": rule.io_backend,
                "layout": rule.layout,
                "page_sizes": _page_range(low, high),
                "serves": _serves(rule),
                "reason": rule.reason,
                "evidence": rule.evidence,
                "cited": list(rule.cited),
            }
        )
    return rows + describe_vllm()
