"""What the SGLang sweep (:mod:`benchmarks.sglang.sweep`) runs: its options and their defaults.

:class:`SweepOptions` holds the request sizes, model kinds and layer counts, layouts and
io backends, host fragmentation levels, ops and repeats of a sweep; :func:`options_for`
reads them from ``kvcore bench --engine sglang --sweep``'s arguments, and
:func:`repeats_for` is how many timed requests a cell of a given size gets. Apart from the
cells and the sides so that they read options without importing the sweep that runs them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

import torch

# Model-like layer counts: a Llama-8B-shaped MHA model, a DeepSeek-shaped MLA model.
LAYERS = {"mha": 32, "mla": 61}
# (layout, io backend, page sizes) as SGLang runs them.
LAYOUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("layer_first", "kernel", (64, 1)),
    ("layer_first", "direct", (64, 1)),
    ("page_first", "kernel", (64, 1)),
    ("page_first_direct", "direct", (64,)),
)
TOKENS = (256, 1024, 4096, 16384, 65536)
HOST_LEVELS = ("0%", "100%")
OPS = ("load", "backup")


@dataclass(frozen=True)
class SweepOptions:
    tokens: tuple[int, ...] = TOKENS
    kinds: tuple[str, ...] = ("mha", "mla")
    layers: dict[str, int] | None = None
    layouts: tuple[tuple[str, str, tuple[int, ...]], ...] = LAYOUTS
    host_levels: tuple[str, ...] = HOST_LEVELS
    ops: tuple[str, ...] = OPS
    repeats: int = 5
    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    serve_rule: bool = True
    seed: int = 4321
    gemm: bool = False
    """Also time a batch of bf16 GEMMs on a compute stream while each side's request runs
    (cells of 4096 tokens and more, CUDA only): what a reload costs the model."""
    with_own: bool = True
    """With the rule on, also time kvcore with it off (``extra["own_ms"]``)."""
    partial_json: str | None = None
    """Where to write the rows so far after every pool, so a run cut short keeps them."""

    def layer_count(self, kind: str) -> int:
        return (self.layers or LAYERS)[kind]


def repeats_for(repeats: int, tokens: int, device: torch.device) -> int:
    """Timed requests of a cell of ``tokens`` tokens for ``repeats`` asked: requests past
    32k tokens are long enough that fewer settle the median; on a GPU, requests of a few
    milliseconds (2k tokens and fewer) vary by several percent from one to the next, so
    they get four times as many, which costs little beside the longer cells."""
    if tokens >= 32768:
        return max(2, repeats - 2)
    return repeats * 4 if tokens <= 2048 and device.type == "cuda" else repeats


def options_for(args: argparse.Namespace) -> SweepOptions:
    cuda = torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu"
    opts = SweepOptions(device=torch.device("cuda" if cuda else "cpu"))
    if getattr(args, "quick", False) or not cuda:
        opts = replace(
            opts,
            tokens=(256, 1024) if cuda else (128, 256),
            layers={"mha": 4, "mla": 4},
            repeats=2,
        )
    if getattr(args, "tokens", 0):
        opts = replace(opts, tokens=(int(args.tokens),))
    if getattr(args, "rows", None):
        opts = replace(opts, kinds=tuple(args.rows.split(",")))
    if getattr(args, "host_levels", None):
        opts = replace(opts, host_levels=tuple(args.host_levels.split(",")))
    if getattr(args, "sizes", None):
        opts = replace(opts, tokens=tuple(int(size) for size in args.sizes.split(",")))
    if getattr(args, "repeats", 0):
        opts = replace(opts, repeats=int(args.repeats))
    if getattr(args, "layouts", None):
        wanted = set(args.layouts.split(","))
        opts = replace(opts, layouts=tuple(x for x in LAYOUTS if f"{x[0]}/{x[1]}" in wanted))
    if getattr(args, "no_rule", False):
        opts = replace(opts, serve_rule=False)
    if getattr(args, "gemm", False):
        opts = replace(opts, gemm=True)
    if getattr(args, "json", None):
        opts = replace(opts, partial_json=args.json)
    return opts
