"""Whether kvcore serves an SGLang transfer or passes it to stock, and how each is counted.

A call's row of the serve-or-pass rule (:mod:`kvcore.planning.serve_rule`) is found from its op and
io backend and the pool's kind, layout and page size; the row passes a request by its
size, some rows also by how scattered its host slots are. A failure inside kvcore sends
its call to stock too, counted by its own reason.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvcore.internal_errors import InternalErrors
from kvcore.mover import Mover
from kvcore.planning import serve_rule
from kvcore.planning.host_run import HostRunFound, one_host_run
from kvcore.planning.path_policy import PathPolicy
from kvcore.runs import run_count_up_to

from .served_pools import DSA_POOL, MHA_POOL, MLA_POOL, class_name

# The pool classes kvcore serves, by the kind the rule's rows name.
_POOL_KINDS = {MHA_POOL: "mha", MLA_POOL: "mla", DSA_POOL: "dsa"}


def _pool_kind(pool: Any) -> str:
    """The rule's name for the pool's kind; "" for any other class (rows for any pool)."""
    return _POOL_KINDS.get(class_name(pool), "")


def call_rule(rule_on: bool, op: str, pool: Any, io_backend: str) -> serve_rule.SGLangRule | None:
    """The rule's row for this call, looked up once per call: None where the rule is off,
    the pool lacks a layout or page size (the checks that follow say why such a pool runs
    stock), or no row matches (kvcore serves). ``rule_on``: the adapter's
    ``KVCORE_SERVE_RULE``."""
    if not rule_on:
        return None
    layout, page_size = getattr(pool, "layout", None), getattr(pool, "page_size", None)
    if not isinstance(layout, str) or not isinstance(page_size, int):
        return None
    return serve_rule.sglang_rule(op, io_backend, layout, page_size, pool=_pool_kind(pool))


def pass_limit(rule_on: bool, op: str, pool: Any, io_backend: str) -> tuple[int, str]:
    """(the fewest tokens the rule's row for the pool's ``op`` with ``io_backend`` may serve,
    its reason to pass below that): what a pool's binding for passing calls keeps
    (:mod:`~kvcore_sglang.stock_binding`); ``(0, "")`` where the hook must decide every call
    (the rule is off, or no row matches)."""
    row = call_rule(rule_on, op, pool, io_backend)
    if row is None:
        return 0, ""
    lowest = row.serves_from
    return (sys.maxsize if lowest is None else lowest), row.reason


def host_runs_pass(
    rule: serve_rule.SGLangRule | None, tokens: int, host: torch.Tensor, policy: PathPolicy
) -> tuple[str | None, HostRunFound | None]:
    """Why the call's ``rule`` passes a request with these host slots (on the CPU), or
    None: few long runs are what kvcore's planner moves by DMA, holding no SMs, and what
    stock's kernel copies fastest; the same slots in another order are as scattered as
    any (a permutation of one span, for one). With it, for a request it serves whose
    slots are one run, that run for the plan (its ends say its bounds: no second read)."""
    if rule is None or not rule.reads_host_runs:
        return None, None
    limit = policy.max_dma_runs
    count = run_count_up_to(host, limit)
    reason = rule.host_decision(tokens, count <= limit)
    if reason is not None or count != 1 or host.numel() < 2:
        return reason, None
    try:
        return None, one_host_run(host)
    except ValueError:
        return None, None  # a negative slot: the plan refuses the request, as it always did


def count_of(indices: Any) -> int:
    """Entries of an index tensor wherever it lives (no device read), 0 for anything else."""
    return int(indices.numel()) if isinstance(indices, torch.Tensor) else 0


def count_pass(chosen_mover: Mover, reason: str) -> None:
    if chosen_mover.metrics is not None:
        chosen_mover.metrics.record_fallback(reason)


def count_serve(chosen_mover: Mover) -> None:
    """A request kvcore serves (passes are counted by
    :func:`~kvcore_sglang.hook_mover.count_request_pass`)."""
    if chosen_mover.metrics is not None:
        chosen_mover.metrics.record_decision("serve", "rule_serves")


def internal_error(errors: InternalErrors, chosen_mover: Mover, exc: Exception) -> str:
    """The reason a failure inside kvcore sends its call to stock (counted in
    ``chosen_mover``'s metrics, logged by ``errors``); a CUDA error is re-raised
    (:mod:`kvcore.internal_errors`)."""
    reason = errors.reason(exc)
    count_pass(chosen_mover, reason)
    return reason
