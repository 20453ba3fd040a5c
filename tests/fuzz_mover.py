"""A randomized byte-identity fuzz of the mover's public API, one case per seed.

A seed fixes everything about a case: the dtype and row shape, how the host and device
indices are fragmented, the direction, which API is called (a single transfer, a plan
executed twice, a submission, a model's layers at once, a plan rebound to other buffers,
:func:`~kvcore.mover.plan_device_indexed`, a caller error), a forced path, the path policy
and the buffers' alignment. The data is random bytes; every buffer lives inside a larger
memory, a few elements in (which sets its alignment) and before a trailing guard. After
each call the whole of every memory must equal a reference made with plain indexing on
byte views: the copied rows, the rows not written (their prior random bytes), the guards
and the sources alike. A refusal is a pass only where it is documented (a forced path
the case cannot take, a row larger than the staging buffer, a caller error, the
contracts below), in its documented words, with nothing written or counted.

Contracts at the edges, each in a few cases drawn from a generator of their own (so that
adding one left every other seed's case as it was):

* The caller's index written in place after planning: a plan keeps int64 indices as
  they are and refuses (StalePlanError) to run or rebind, unless the engine's stock path
  runs; others it converted, and runs its own copy unchanged. The device side's index of
  plan_device_indexed is never written: the copy reads it when it runs, by design.
* Rows of no bytes: every call a no-op, still index-checked and counted (0 B).
* A destination of another dtype or row shape: a fallback the engine's stock path runs;
  without ``stock=`` a TypeError (a conversion) or ValueError (a broadcast or reshape).
* Layer pairs whose destinations share memory (an interleaved layout) take one submission
  only where the plan's destination rows can be read and do not meet there; else
  execute over the pairs refuses and submissions() gives one per pair, in order, the last write
  winning as in the engines' own loops. Some cases index such a destination directly, so
  that the pairs' writes meet.

Not generated: a device-side index out of its buffer, which plan_device_indexed
documents it does not check; pairs where one's destination is another's source.

``tests/unit/test_mover_fuzz.py`` runs it on the CPU (the "device" side another CPU
tensor, ``direction=`` given), ``tests/gpu/test_mover_fuzz_gpu.py`` on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from kvcore.direction import Direction
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed
from kvcore.planning.layers import LayerPairs, layer_pairs
from kvcore.planning.path_policy import (
    FALLBACK_REASONS,
    REGION_STAGED_PATHS,
    PathPolicy,
    TransferPath,
)
from kvcore.planning.plans import StalePlanError, TransferPlan, plan
from kvcore.planning.submissions import Submission, submissions
from kvcore.staging import StagingBuffers

H2D, D2H = Direction.H2D, Direction.D2H
SINGLE, STAGED, BATCHED, GATHER, FALLBACK = (
    TransferPath.SINGLE_COPY,
    TransferPath.STAGED,
    TransferPath.BATCHED_RUNS,
    TransferPath.GATHER,
    TransferPath.FALLBACK,
)
FP8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
DTYPES = (*FP8, torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8)
# Row sizes that engines use and sizes no word wider than a byte or two divides.
ODD_ROW_BYTES = (2, 3, 5, 6, 7, 10, 18, 30, 66, 130, 1026, 1030, 1152, 4098, 8196, 36866)
MAX_ROW_BYTES = 64 << 10
# On CUDA every row width (in words of each width) is a Triton specialization of the
# gather, compiled on first use: rows there come from this short menu.
CUDA_ROW_BYTES = (2, 3, 6, 1026, 1152, 4096, 36866, MAX_ROW_BYTES)
# Elements after each memory's last buffer: a write past a buffer's end shows there.
TAIL_ELEMENTS = 8

# How the rows of one side are laid out in its index.
PATTERNS = ("one_run", "few_runs", "pages", "scattered", "fragmented", "descending")
# Which API a case drives.
MODES = ("transfer", "execute", "submit", "layers", "submissions", "rebind", "invalid")
REBINDS = ("same", "longer", "retyped", "resized", "misaligned", "strided", "short")
# Caller errors an "invalid" case makes in one index; each must raise ValueError.
CORRUPTIONS = {
    "src_out_of_range": "outside",
    "dst_out_of_range": "outside",
    "src_negative": "outside",
    "dst_negative": "outside",
    "dst_duplicate": "duplicate",
    "length_mismatch": "entries",
}
TESTS = {
    "cpu": "tests/unit/test_mover_fuzz.py::test_mover_fuzz_case",
    "cuda": "tests/gpu/test_mover_fuzz_gpu.py::test_mover_fuzz_case_on_cuda",
}


def replay_command(seed: int, device: str) -> str:
    """One line that runs this case alone."""
    return (
        f"KVCORE_FUZZ_SEED={seed} PYTHONPATH=$PWD:$PWD/integrations "
        f"python3 -m pytest -q {TESTS[device]}"
    )


@dataclass(frozen=True)
class Case:
    """Everything a seed decides, before any tensor exists."""

    seed: int
    device: str
    direction: Direction
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    mode: str
    device_indexed: bool
    host_pattern: str
    device_pattern: str
    src_positions: tuple[int, ...]
    """Logical rows of the source side, in transfer order (repeats allowed)."""
    dst_positions: tuple[int, ...]
    src_pool: int
    """Logical rows each source buffer has (slots of an interleaved layout)."""
    dst_pool: int
    src_duplicates: bool
    index_dtype: torch.dtype
    strided_index: bool
    device_index_on_host: bool
    """plan_device_indexed with the device side's index on the CPU."""
    force: TransferPath | None
    policy: PathPolicy
    staging_capacity: int | None
    """A Mover whose staging buffer differs from the policy's; None: the policy's."""
    pairs: int
    """Buffer pairs: 1, 2 for a rebind (planned pair, rebound pair), the layers otherwise."""
    src_layout: str
    dst_layout: str
    chunk_rows: int
    """Rows per chunk of an interleaved layout."""
    extra_rows: tuple[int, ...]
    """Rows past the pool of each separate buffer after the first (the pairs need not be of
    one length)."""
    offsets: tuple[int, ...]
    """Leading guard elements of each memory, which set each buffer's alignment."""
    strided_rows: bool
    """The (first) pair's host buffer has padded rows: a strided_rows fallback."""
    rebind: str
    rebound_dtype: torch.dtype
    """The rebound pair's (with ``mixed_rows``, the last layer pair's) dtype and row shape:
    the planned pair's unless retyped or resized."""
    rebound_shape: tuple[int, ...]
    mixed_rows: bool
    """layers / submissions: the last pair's rows are of another size."""
    planned_pair: int
    """layers: the pair the plan is made for (engines plan one layer; any fits)."""
    corruption: str
    """invalid: the caller error in the indices (a key of CORRUPTIONS), else "-"."""
    repeat: bool
    """execute: the plan runs again over fresh destination bytes; rebind: the planned
    pair is executed before the rebound one."""
    layered_submissions: bool
    """submissions(): given the pairs' LayerPairs, or None."""
    dst_mismatch: str
    """transfer / execute / submit: "dtype" or "shape" where the destination's rows are of
    another dtype or row shape (a fallback that only the engine's stock path may run),
    else "-"."""
    dst_dtype: torch.dtype
    dst_row_shape: tuple[int, ...]
    """The destination's rows: the source's unless ``dst_mismatch``."""
    stale_index: str
    """execute / submit / layers / rebind: the caller's index (``src_idx`` or ``dst_idx``;
    the host side's for plan_device_indexed) written in place after planning, or "-"."""
    dst_rows_direct: bool
    """An interleaved destination indexed by its views' own rows, the slots of the other
    views included (not through :func:`row_map`): the pairs' writes may meet."""
    with_stock: bool
    direction_given: bool
    """transfer: ``direction=`` passed (always on the CPU; on CUDA the devices imply it)."""
    host_pinned: tuple[bool, ...] = field(default=())
    """Per host memory, on CUDA only."""

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * _element_size(self.dtype)

    @property
    def rows(self) -> int:
        return len(self.src_positions)

    def describe(self) -> str:
        force = "auto" if self.force is None else self.force.value
        planner = "plan_device_indexed" if self.device_indexed else "plan"
        parts = [
            f"{self.device} {self.direction.value} {self.mode}/{planner} force={force}",
            f"{str(self.dtype).removeprefix('torch.')}{list(self.row_shape)}={self.row_bytes}B",
            f"{self.rows} rows host={self.host_pattern} device={self.device_pattern}",
            f"src_dups={self.src_duplicates} index={str(self.index_dtype).removeprefix('torch.')}"
            f"{'/strided' if self.strided_index else ''}",
            f"pairs={self.pairs} layout={self.src_layout}->{self.dst_layout}",
            f"strided_rows={self.strided_rows} repeat={self.repeat}"
            f" layered={self.layered_submissions} dst_direct={self.dst_rows_direct}"
            f" stale={self.stale_index} dst_mismatch={self.dst_mismatch}"
            f"({str(self.dst_dtype).removeprefix('torch.')}{list(self.dst_row_shape)})"
            f" rebind={self.rebind}"
            f"({str(self.rebound_dtype).removeprefix('torch.')}{list(self.rebound_shape)})"
            f" mixed_rows={self.mixed_rows} planned_pair={self.planned_pair}"
            f" corruption={self.corruption}",
            f"stock={self.with_stock} direction_given={self.direction_given}",
            f"staging={self.staging_capacity} pinned={self.host_pinned}",
            f"policy={self.policy}",
        ]
        return ", ".join(parts)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# --- generating a case ---------------------------------------------------------------------


def generate_case(seed: int, device: str) -> Case:
    """The case for ``seed``: the same on every run and machine (``random.Random``)."""
    rnd = random.Random(seed)
    # A few CUDA cases move tens of MiB: enough for a staged copy in pieces
    # (PathPolicy.staged_pieces; no piece is under 8 MiB).
    large = device == "cuda" and rnd.random() < 0.02
    direction = rnd.choice((H2D, D2H))
    dtype = rnd.choice(DTYPES)
    row_shape = _row_shape(rnd, dtype, device, large)
    row_size = math.prod(row_shape) * _element_size(dtype)
    # Caller errors cost little and need few cases.
    mode = rnd.choices(MODES, weights=[2 if m != "invalid" else 1 for m in MODES])[0]
    device_indexed = rnd.random() < 0.25
    pairs = {"rebind": 2}.get(mode, rnd.randint(1, 8) if mode in ("layers", "submissions") else 1)
    # Bytes a side's buffers may take in all.
    budget, most_rows = 1 << 20, 384
    if device == "cuda":
        budget, most_rows = (192 << 20, 8192) if large else (4 << 20, 1024)
    budget //= 2 * pairs
    most_rows = max(1, min(most_rows, budget // (3 * row_size)))
    rows = rnd.randint(most_rows // 2, most_rows) if large else _transfer_rows(rnd, most_rows)

    host_pattern = rnd.choice(PATTERNS)
    device_pattern = rnd.choice((*PATTERNS, "paired", "paired"))
    host, host_pool = _positions(rnd, host_pattern, rows, most_rows)
    if device_pattern == "paired":
        # The host's runs at another place: paired runs, the batched and single copies.
        shift = rnd.randint(0, 8)
        device_rows = [p - min(host, default=0) + shift for p in host]
        device_pool = max(device_rows, default=-1) + 1 + rnd.randint(0, 8)
    else:
        device_rows, device_pool = _positions(rnd, device_pattern, rows, most_rows)
    page_in = direction is H2D
    src, dst = (host, device_rows) if page_in else (device_rows, host)
    src_pool, dst_pool = (host_pool, device_pool) if page_in else (device_pool, host_pool)
    src_duplicates = rows > 1 and rnd.random() < 0.15
    if src_duplicates:
        src = _with_repeats(rnd, src)

    layered = mode in ("layers", "submissions") and pairs > 1
    mixed_rows = layered and rnd.random() < 0.1
    layouts = ["separate", "stacked", "interleaved"] if layered and not mixed_rows else ["separate"]
    src_layout, dst_layout = rnd.choice(layouts), rnd.choice(layouts)
    chunk_rows = rnd.choice((1, 2, 4, 16, 64))
    largest = max(
        int(row_map(max(1, pool), layout, chunk_rows, pairs)[-1])
        for pool, layout in ((src_pool, src_layout), (dst_pool, dst_layout))
    )
    index_dtype = _index_dtype(rnd, largest) if mode != "invalid" else torch.int64
    force = _force(rnd)
    policy = _policy(rnd, row_size)
    staging_capacity = None
    if rnd.random() < 0.1:
        staging_capacity = max(1, rnd.choice((row_size - 1, row_size, 3 * row_size + 1)))
    rebind = rnd.choice(REBINDS) if mode == "rebind" else "-"
    rebound_dtype, rebound_shape = _rebound_layout(
        rnd, "resized" if mixed_rows else rebind, dtype, row_shape, device
    )
    corruption = "-"
    if mode == "invalid":
        corruption = _corruption(rnd, direction, device_indexed, rows)
    host_memories = pairs if "separate" in (src_layout, dst_layout) else 1
    host_pinned: tuple[bool, ...] = ()
    if device == "cuda":
        pinning = rnd.choice(("all", "all", "none", "mixed"))
        host_pinned = tuple(
            pinning == "all" or (pinning == "mixed" and rnd.random() < 0.5)
            for _ in range(2 * host_memories)
        )
    case = Case(
        seed=seed,
        device=device,
        direction=direction,
        dtype=dtype,
        row_shape=row_shape,
        mode=mode,
        device_indexed=device_indexed and mode != "transfer",
        host_pattern=host_pattern,
        device_pattern=device_pattern,
        src_positions=tuple(src),
        dst_positions=tuple(dst),
        src_pool=src_pool,
        dst_pool=dst_pool,
        src_duplicates=src_duplicates,
        index_dtype=index_dtype,
        strided_index=rnd.random() < 0.1,
        device_index_on_host=rnd.random() < 0.3,
        force=force,
        policy=policy,
        staging_capacity=staging_capacity,
        pairs=pairs,
        src_layout=src_layout,
        dst_layout=dst_layout,
        chunk_rows=chunk_rows,
        extra_rows=tuple(
            rnd.randint(5, 40) if rebind == "longer" else rnd.choice((0, 0, 1, 3))
            for _ in range(pairs - 1)
        ),
        offsets=tuple(rnd.randint(0, 9) for _ in range(2 * pairs)),
        strided_rows=rnd.random() < 0.06,
        rebind=rebind,
        rebound_dtype=rebound_dtype,
        rebound_shape=rebound_shape,
        repeat=mode in ("execute", "rebind") and rnd.random() < 0.5,
        layered_submissions=rnd.random() < 0.7,
        dst_mismatch="-",
        dst_dtype=dtype,
        dst_row_shape=row_shape,
        stale_index=_stale_index(seed, mode, device_indexed and mode != "transfer", direction),
        dst_rows_direct=_dst_rows_direct(seed, mode, pairs, dst_layout),
        mixed_rows=mixed_rows,
        planned_pair=rnd.randrange(pairs) if mode == "layers" else 0,
        corruption=corruption,
        with_stock=mode in ("transfer", "execute") and rnd.random() < 0.5,
        direction_given=device == "cpu" or rnd.random() < 0.5,
        host_pinned=host_pinned,
    )
    return _with_dst_mismatch(_with_rows_of_no_bytes(case))


# Row shapes of no bytes: a transfer that moves nothing (and still checks its indices).
NO_BYTES_SHAPES = ((0,), (0, 8), (4, 0), (2, 0, 3))


def _with_rows_of_no_bytes(case: Case) -> Case:
    """``case``, or in a few cases the same with rows of no bytes. Decided after the rest
    (which sized the buffers for the row drawn) and by a generator of its own, so that
    every other choice of a seed stays as it was."""
    rnd = random.Random(f"{case.seed}/no_bytes")
    # A rebind changes the row on purpose; padded rows of no bytes would be contiguous.
    if case.mode == "rebind" or rnd.random() >= 0.04:
        return case
    shape = rnd.choice(NO_BYTES_SHAPES)
    return dataclasses.replace(
        case,
        row_shape=shape,
        dst_row_shape=shape,
        rebound_dtype=case.dtype,
        rebound_shape=shape,
        mixed_rows=False,
        strided_rows=False,
    )


def _with_dst_mismatch(case: Case) -> Case:
    """``case``, or in a few single-pair cases the same with a destination of another
    dtype (of as many elements a row) or row shape (one more dim: a reshape or a
    broadcast). From a generator of its own, as :func:`_with_rows_of_no_bytes`."""
    rnd = random.Random(f"{case.seed}/dst_mismatch")
    if case.mode not in ("transfer", "execute", "submit") or rnd.random() >= 0.06:
        return case
    if rnd.random() < 0.5:
        other = rnd.choice([d for d in DTYPES if d != case.dtype])
        return dataclasses.replace(case, dst_mismatch="dtype", dst_dtype=other)
    shape = (rnd.choice((1, 2)), *case.row_shape)
    return dataclasses.replace(case, dst_mismatch="shape", dst_row_shape=shape)


def _stale_index(seed: int, mode: str, device_indexed: bool, direction: Direction) -> str:
    """Which index of the case is written after planning, from a generator of its own."""
    rnd = random.Random(f"{seed}/stale_index")
    if mode not in ("execute", "submit", "layers", "rebind") or rnd.random() >= 0.15:
        return "-"
    if device_indexed:
        # The device side's index is never read, so not watched: the copy reads it.
        return "src_idx" if direction is H2D else "dst_idx"
    return rnd.choice(("src_idx", "dst_idx"))


def _dst_rows_direct(seed: int, mode: str, pairs: int, dst_layout: str) -> bool:
    """Whether a layered case's interleaved destination is indexed directly. Drawn from a
    generator of its own, so that every other choice of a seed stays as it was."""
    if mode not in ("layers", "submissions") or pairs < 2 or dst_layout != "interleaved":
        return False
    return random.Random(f"{seed}/dst_rows_direct").random() < 0.5


def _row_shape(rnd: random.Random, dtype: torch.dtype, device: str, large: bool) -> tuple[int, ...]:
    size = _element_size(dtype)
    if large:
        target = rnd.choice(CUDA_ROW_BYTES[-3:])
    elif device == "cuda":
        target = rnd.choice(CUDA_ROW_BYTES)
    elif rnd.random() < 0.4:
        target = rnd.choice(ODD_ROW_BYTES)
    else:
        target = round(2 ** rnd.uniform(1, math.log2(MAX_ROW_BYTES)))
    elements = max(1, min(target, MAX_ROW_BYTES) // size)
    if elements * size < 2:
        elements = 2
    if elements == 1 and rnd.random() < 0.5:
        return ()  # a 1-D tensor: a row is one element
    # Split the row into up to three dims, as KV layouts do ([heads, dim], [2, heads, dim]).
    shape = []
    rest = elements
    for _ in range(rnd.randint(0, 2)):
        divisors = [d for d in range(2, min(rest, 64) + 1) if rest % d == 0]
        if not divisors:
            break
        d = rnd.choice(divisors)
        shape.append(d)
        rest //= d
    shape.append(rest)
    rnd.shuffle(shape)
    return tuple(shape)


def _rebound_layout(
    rnd: random.Random, rebind: str, dtype: torch.dtype, shape: tuple[int, ...], device: str
) -> tuple[torch.dtype, tuple[int, ...]]:
    """A rebind to another dtype of the same row size (the plan is kept), or to another
    row size (the plan is made again)."""
    row_size = math.prod(shape) * _element_size(dtype)
    if rebind == "retyped":
        others = [d for d in DTYPES if d != dtype and row_size % _element_size(d) == 0]
        other = rnd.choice(others)
        return other, (row_size // _element_size(other),)
    if rebind == "resized":
        # Half or twice the row (a smaller neighbour on the CUDA menu): the pools were
        # sized for the planned row, so the rebound one stays within the budget's reach.
        elements = math.prod(shape)
        if device == "cuda":
            smaller = [b for b in CUDA_ROW_BYTES if b < row_size and b >= _element_size(dtype)]
            if smaller:
                return dtype, (smaller[-1] // _element_size(dtype),)
        elif elements > 1 and rnd.random() < 0.5:
            return dtype, (elements // 2,)
        return dtype, (*shape, 2)
    return dtype, shape


def _corruption(rnd: random.Random, direction: Direction, device_indexed: bool, rows: int) -> str:
    """A caller error for an "invalid" case: one the planner can see (a device-side index
    of plan_device_indexed is never read, so only its host side is corrupted)."""
    kinds = list(CORRUPTIONS)
    if device_indexed:
        host = "src" if direction is H2D else "dst"
        kinds = [k for k in kinds if k.startswith(host) or k == "length_mismatch"]
    if rows < 2:
        kinds = [k for k in kinds if k != "dst_duplicate"]
    if rows < 1:
        kinds = ["length_mismatch"]
    return rnd.choice(kinds)


def _transfer_rows(rnd: random.Random, most: int) -> int:
    pick = rnd.random()
    if pick < 0.03:
        return 0
    if pick < 0.1:
        return 1
    if pick < 0.5:
        return rnd.randint(1, min(16, most))
    return rnd.randint(1, most)


def _positions(rnd: random.Random, pattern: str, n: int, most: int) -> tuple[list[int], int]:
    """``n`` distinct rows laid out as ``pattern``, and the rows the buffer needs."""
    slack = rnd.choice((0, 0, 1, 3, 17))
    if n == 0:
        return [], slack  # an empty transfer may have empty buffers
    if pattern in ("one_run", "descending"):
        start = rnd.randint(0, 2 * slack + 4)
        rows = list(range(start, start + n))
        return (rows[::-1] if pattern == "descending" else rows), start + n + slack
    if pattern == "pages":
        page = rnd.randint(1, min(256, max(1, most)))
        pages = -(-n // page)
        total = pages + rnd.randint(0, pages + 2)
        chosen = rnd.sample(range(total), pages)
        rows = [p * page + j for p in chosen for j in range(page)][:n]
        return rows, total * page
    if pattern == "scattered":
        pool = n + rnd.randint(0, 2 * n + 4)
        return rnd.sample(range(pool), n), pool
    count = rnd.randint(2, min(8, n)) if n > 1 else 1
    if pattern == "fragmented":
        count = 1 + round(rnd.random() * (n - 1))
    cuts = sorted(rnd.sample(range(1, n), count - 1))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    runs, position = [], 0
    for length in lengths:
        position += rnd.choice((0, 1, 1, 5, 64))
        runs.append(list(range(position, position + length)))
        position += length
    if rnd.random() < 0.7:
        rnd.shuffle(runs)
    return [row for run in runs for row in run], position + slack


def _with_repeats(rnd: random.Random, rows: list[int]) -> list[int]:
    """Some entries of a source index replaced by others: rows read more than once."""
    out = list(rows)
    for k in rnd.sample(range(len(out)), rnd.randint(1, len(out))):
        out[k] = rnd.choice(rows)
    return out


def _index_dtype(rnd: random.Random, largest: int) -> torch.dtype:
    fits = [torch.int64, torch.int64, torch.int32]
    fits += [torch.int16] if largest < 2**15 else []
    fits += [torch.uint8] if largest < 2**8 else []
    fits += [torch.int8] if largest < 2**7 else []
    return rnd.choice(fits)


def _force(rnd: random.Random) -> TransferPath | None:
    if rnd.random() < 0.5:
        return None
    return rnd.choice((SINGLE, STAGED, BATCHED, GATHER, FALLBACK))


def _policy(rnd: random.Random, row_size: int) -> PathPolicy:
    if rnd.random() < 0.25:
        return PathPolicy()
    return PathPolicy(
        staging_bytes=row_size * rnd.choice((1, 2, 3, 7, 16, 64, 4096)) + rnd.randrange(row_size),
        long_run_bytes=row_size * rnd.randint(1, 64),
        gather_ctas=rnd.randint(1, 8),
        gather_ctas_to_host=rnd.randint(1, 8),
        max_dma_runs=rnd.randint(1, 16),
        max_batched_runs=rnd.randint(1, 256),
        staged_pieces=rnd.randint(1, 4),
        stage_regions=rnd.choice(("off", "gather", "all")),
    )


# --- building the buffers --------------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    """A row tensor inside one of the world's memories, and where its bytes lie there."""

    tensor: torch.Tensor
    memory: int
    byte_offset: int
    rows: int
    pitch: int
    """Bytes from one row to the next (more than a row where rows are padded)."""
    row_bytes: int

    @property
    def padded(self) -> bool:
        """Rows with a gap between them: not dense, unless there is one row (torch then
        calls the tensor contiguous, and so may kvcore)."""
        return self.pitch != self.row_bytes and self.rows > 1

    def rows_in(self, memory_bytes: np.ndarray) -> np.ndarray:
        """``[rows, row_bytes]`` view of this buffer in a byte copy of its memory."""
        return as_strided(
            memory_bytes[self.byte_offset :], (self.rows, self.row_bytes), (self.pitch, 1)
        )

    def rows_of(self, memory: torch.Tensor) -> torch.Tensor:
        """``[rows, row_bytes]`` uint8 view of this buffer in its memory itself."""
        return memory.view(torch.uint8).as_strided(
            (self.rows, self.row_bytes), (self.pitch, 1), self.byte_offset
        )


@dataclass
class World:
    """The case's memories (1-D tensors with guards), the buffers in them, and what every
    memory must hold: a byte copy updated by plain indexing after each call.

    The harness's own work is numpy: torch's CPU ops on bytes cost far more per call, and
    the reference had better not share code with what it checks.
    """

    case: Case
    rng: np.random.Generator
    memories: list[torch.Tensor] = field(default_factory=list)
    expected: list[np.ndarray] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)

    def _random_bytes(self, count: int) -> np.ndarray:
        return np.frombuffer(bytearray(self.rng.bytes(count)), dtype=np.uint8)

    def memory(self, role: str, dtype: torch.dtype, elements: int, *, host: bool) -> int:
        """A new memory of random bytes with ``elements`` and a trailing guard; returns its
        number."""
        data = self._random_bytes((elements + TAIL_ELEMENTS) * _element_size(dtype))
        memory = torch.from_numpy(data.copy()).view(dtype)
        if not host and self.case.device != "cpu":
            memory = memory.to(self.case.device)
        elif host and self.case.host_pinned and self._pinned_next():
            memory = memory.pin_memory()
        self.memories.append(memory)
        self.expected.append(data)
        self.roles.append(role)
        return len(self.memories) - 1

    def _pinned_next(self) -> bool:
        host_count = sum(1 for role in self.roles if role.startswith("host"))
        pins = self.case.host_pinned
        return pins[host_count % len(pins)]

    def refill(self, number: int) -> None:
        """New random bytes in a memory, in place."""
        memory = self.memories[number]
        fresh = self._random_bytes(memory.numel() * memory.element_size())
        memory.view(torch.uint8).copy_(torch.from_numpy(fresh.copy()))
        self.expected[number] = fresh

    def apply(self, src: Buffer, dst: Buffer, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
        """The reference: ``dst[dst_rows] = src[src_rows]`` with plain indexing, on bytes."""
        rows = src.rows_in(self.expected[src.memory])[src_rows]
        dst.rows_in(self.expected[dst.memory])[dst_rows] = rows

    def stock_copy(
        self, src: Buffer, dst: Buffer, src_rows: np.ndarray, dst_rows: np.ndarray
    ) -> None:
        """An engine's stock path: the same copy on the real memories."""
        src_bytes = src.rows_of(self.memories[src.memory])
        dst_bytes = dst.rows_of(self.memories[dst.memory])
        rows = src_bytes[torch.from_numpy(src_rows).to(src_bytes.device)]
        dst_bytes[torch.from_numpy(dst_rows).to(dst_bytes.device)] = rows.to(dst_bytes.device)

    def mismatches(self) -> list[str]:
        """What differs from the reference, memory by memory."""
        if self.case.device == "cuda":
            torch.cuda.synchronize()
        found = []
        for number, (memory, expected) in enumerate(zip(self.memories, self.expected, strict=True)):
            actual = memory.view(torch.uint8).cpu().numpy()
            if not np.array_equal(actual, expected):
                wrong = np.flatnonzero(actual != expected)
                found.append(
                    f"memory {number} ({self.roles[number]}): {wrong.size} of "
                    f"{expected.size} bytes differ, first at byte {int(wrong[0])}"
                )
        return found


@dataclass(frozen=True)
class Side:
    """One side's buffers (one per pair) and its logical rows mapped onto buffer rows."""

    buffers: tuple[Buffer, ...]
    row_map: np.ndarray
    """Buffer row of each logical row: the identity, or an interleaved layout's slots."""


def row_map(pool: int, layout: str, chunk_rows: int, pairs: int) -> np.ndarray:
    """The buffer row of each of ``pool`` logical rows: in an interleaved layout (vLLM's
    shared host region) a view's own rows are chunks ``pairs`` chunks apart, the chunks
    between them other views' rows."""
    logical = np.arange(pool)
    if layout != "interleaved":
        return logical
    chunk = max(1, min(chunk_rows, pool))
    return logical // chunk * (pairs * chunk) + logical % chunk


def build_side(
    world: World,
    role: str,
    *,
    host: bool,
    pool: int,
    layout: str,
    padded_first: bool,
    short: int | None = None,
) -> Side:
    """``case.pairs`` buffers of ``pool`` logical rows, laid out as ``layout``; ``short``:
    the rows of the second buffer, fewer than the transfer needs."""
    case = world.case
    pairs = case.pairs
    shapes = [case.dst_row_shape if role.endswith("dst") else case.row_shape] * pairs
    dtypes = [case.dst_dtype if role.endswith("dst") else case.dtype] * pairs
    if case.mode == "rebind" or case.mixed_rows:
        shapes[-1], dtypes[-1] = case.rebound_shape, case.rebound_dtype
    offsets = case.offsets[:pairs] if role.endswith("src") else case.offsets[pairs : 2 * pairs]
    if layout == "separate":
        lengths = [pool, *(pool + extra for extra in case.extra_rows[: pairs - 1])]
        if short is not None:
            lengths[1] = short
        buffers = []
        for i in range(pairs):
            offset = offsets[i] + (1 + i if case.rebind == "misaligned" and i else 0)
            padded = (padded_first and i == 0) or (case.rebind == "strided" and i == 1 and host)
            buffers.append(
                _own_buffer(world, role, dtypes[i], shapes[i], lengths[i], offset, padded)
            )
        return Side(tuple(buffers), row_map(pool, layout, case.chunk_rows, pairs))
    elements = math.prod(case.row_shape)
    if layout == "stacked":
        view_rows, step, memory_rows = pool, pool, pool * pairs
    else:
        chunk = max(1, min(case.chunk_rows, pool))
        chunks = -(-pool // chunk)
        view_rows, step = max(0, (chunks - 1) * pairs * chunk + chunk), chunk
        memory_rows = chunks * pairs * chunk
    offset = offsets[0]
    number = world.memory(role, case.dtype, offset + memory_rows * elements, host=host)
    memory = world.memories[number]
    size = _element_size(case.dtype)
    buffers = []
    for i in range(pairs):
        begin = offset + i * step * elements
        tensor = memory[begin : begin + view_rows * elements].view(view_rows, *case.row_shape)
        buffers.append(
            Buffer(tensor, number, begin * size, view_rows, elements * size, elements * size)
        )
    return Side(tuple(buffers), row_map(pool, layout, case.chunk_rows, pairs))


def _own_buffer(
    world: World,
    role: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    rows: int,
    offset: int,
    padded: bool,
) -> Buffer:
    elements = math.prod(shape)
    pitch = elements + (1 + offset % 3 if padded else 0)
    number = world.memory(role, dtype, offset + rows * pitch, host=role.startswith("host"))
    memory = world.memories[number]
    rows_2d = memory[offset : offset + rows * pitch].view(rows, pitch)
    tensor = rows_2d[:, :elements].view(rows, *shape) if shape else rows_2d[:, 0]
    size = _element_size(dtype)
    return Buffer(tensor, number, offset * size, rows, pitch * size, elements * size)


# --- running a case ---------------------------------------------------------------------------


class CaseFailure(AssertionError):
    """A case that broke: its seed, a replay command, the case and what went wrong."""


def run_case(seed: int, device: str) -> None:
    """Generate the case for ``seed`` and check every call it makes; raises CaseFailure."""
    case = generate_case(seed, device)
    try:
        _Run(case).run()
    except Exception as failure:
        if isinstance(failure, CaseFailure):
            raise
        raise CaseFailure(_report(case, f"{type(failure).__name__}: {failure}")) from failure


def _report(case: Case, problem: str) -> str:
    return (
        f"mover fuzz case seed={case.seed} failed: {problem}\n"
        f"  replay: {replay_command(case.seed, case.device)}\n"
        f"  case: {case.describe()}"
    )


class _Run:
    """One case: its buffers, indices, mover and the accounting it must show."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.world = World(case, np.random.default_rng(case.seed))
        page_in = case.direction is H2D
        padded = case.strided_rows
        src_role, dst_role = ("host src", "device dst") if page_in else ("device src", "host dst")
        # A rebound host buffer one row shorter than the transfer reaches.
        host_positions = case.src_positions if page_in else case.dst_positions
        short = None
        if case.rebind == "short" and host_positions:
            short = max(host_positions)
        self.src = build_side(
            self.world,
            src_role,
            host=page_in,
            pool=case.src_pool,
            layout=case.src_layout,
            padded_first=padded and page_in and case.src_layout == "separate",
            short=short if page_in else None,
        )
        self.dst = build_side(
            self.world,
            dst_role,
            host=not page_in,
            pool=case.dst_pool,
            layout=case.dst_layout,
            padded_first=padded and not page_in and case.dst_layout == "separate",
            short=None if page_in else short,
        )
        self.src_rows = self.src.row_map[np.array(case.src_positions, dtype=np.int64)]
        dst_positions = np.array(case.dst_positions, dtype=np.int64)
        self.dst_rows = dst_positions if case.dst_rows_direct else self.dst.row_map[dst_positions]
        self.metrics = Metrics()
        staging = None
        if case.staging_capacity is not None:
            staging = StagingBuffers(case.staging_capacity)
        self.mover = Mover(case.policy, metrics=self.metrics, staging=staging)
        self.transfers: dict[tuple[str, str], list[int]] = {}
        self.fallbacks: dict[str, int] = {}
        self.stock_calls = 0
        self.planned_indices: tuple[torch.Tensor, torch.Tensor] | None = None

    # Indices as the caller passes them.

    def _host_style(self, rows: np.ndarray) -> torch.Tensor:
        """A CPU index in the case's dtype, optionally a strided view."""
        index = torch.from_numpy(rows.copy()).to(self.case.index_dtype)
        if self.case.strided_index:
            spread = torch.zeros(2 * index.numel(), dtype=index.dtype)
            spread[0::2] = index
            spread[1::2] = index.flip(0)
            index = spread[0::2]
        return index

    def _device_style(self, rows: np.ndarray) -> torch.Tensor:
        index = self._host_style(rows)
        if self.case.device == "cpu" or self.case.device_index_on_host:
            return index
        return index.to(self.case.device)

    def _indices(
        self, src_rows: np.ndarray | None = None, dst_rows: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The case's indices (or others) as the caller passes them."""
        src_rows = self.src_rows if src_rows is None else src_rows
        dst_rows = self.dst_rows if dst_rows is None else dst_rows
        if not self.case.device_indexed:
            return self._host_style(src_rows), self._host_style(dst_rows)
        if self.case.direction is H2D:
            return self._host_style(src_rows), self._device_style(dst_rows)
        return self._device_style(src_rows), self._host_style(dst_rows)

    # What the planner must do.

    def _refusal(self, pair: int) -> str | None:
        """The documented ValueError that planning this case must raise, or None."""
        case = self.case
        if self._fallback_reason(pair) is not None:
            return None
        row_size = self.src.buffers[pair].row_bytes
        if case.device_indexed and case.force in (SINGLE, BATCHED):
            return "needs the device side's runs"
        if case.force is STAGED and row_size > case.policy.staging_bytes:
            return "does not fit the .* staging buffer"
        if case.force is SINGLE and paired_run_count(self.src_rows, self.dst_rows) > 1:
            return "force=single_copy needs at most one paired run"
        return None

    def _fallback_reason(self, pair: int) -> str | None:
        mismatch = {"dtype": "dtype_mismatch", "shape": "row_shape_mismatch"}
        if self.case.dst_mismatch in mismatch:
            return mismatch[self.case.dst_mismatch]
        if self.src.buffers[pair].padded or self.dst.buffers[pair].padded:
            return "strided_rows"
        return "forced" if self.case.force is FALLBACK else None

    def _plan(self, pair: int) -> TransferPlan | None:
        """The plan for ``pair``; None where the planner refused as documented."""
        case = self.case
        src, dst = self.src.buffers[pair].tensor, self.dst.buffers[pair].tensor
        src_idx, dst_idx = self._indices()
        self.planned_indices = (src_idx, dst_idx)
        planner = plan_device_indexed if case.device_indexed else plan
        refusal = self._refusal(pair)
        try:
            chosen = planner(
                src,
                dst,
                src_idx,
                dst_idx,
                direction=case.direction,
                policy=case.policy,
                force=case.force,
            )
        except ValueError as error:
            if refusal is None or not re.search(refusal, str(error)):
                raise
            self._check("after the planner refused")
            return None
        if refusal is not None:
            raise CaseFailure(_report(case, f"the planner accepted what it must refuse: {refusal}"))
        self._check_plan(chosen, self._fallback_reason(pair))
        return chosen

    def _check_plan(self, chosen: TransferPlan, reason: str | None) -> None:
        case = self.case
        problems = []
        if chosen.reason != reason:
            problems.append(f"reason {chosen.reason!r}, expected {reason!r}")
        if (chosen.path is FALLBACK) != (reason is not None):
            problems.append(f"path {chosen.path.value} with reason {chosen.reason!r}")
        if reason is None and case.force is not None and chosen.path is not case.force:
            problems.append(f"forced {case.force.value} but planned {chosen.path.value}")
        if case.device_indexed and reason is None and chosen.path not in (STAGED, GATHER):
            problems.append(f"a device-indexed plan took {chosen.path.value}")
        if chosen.path is SINGLE and chosen.runs.count > 1:
            problems.append(f"single_copy over {chosen.runs.count} paired runs")
        if chosen.rows != case.rows or chosen.nbytes != case.rows * chosen.row_bytes:
            problems.append(f"plan counts {chosen.rows} rows / {chosen.nbytes} B")
        if problems:
            raise CaseFailure(_report(case, "; ".join(problems)))

    # Executing and checking.

    def _staging_refuses(self, chosen: TransferPlan) -> bool:
        capacity = self.case.staging_capacity
        return (
            chosen.path is STAGED
            and capacity is not None
            and chosen.rows > 0
            and capacity < chosen.row_bytes
        )

    def _write_index_after_planning(self) -> bool:
        """Write the case's ``stale_index`` in place, reversed; whether the plan must refuse
        to run now. A plan keeps int64 indices as the caller's tensors, and watches them;
        others it converted, so it reads its own copy, which no caller write reaches."""
        if self.case.stale_index == "-" or self.planned_indices is None:
            return False
        src_idx, dst_idx = self.planned_indices
        index = src_idx if self.case.stale_index == "src_idx" else dst_idx
        index.copy_(index.flip(0))
        return self.case.index_dtype == torch.int64

    def _expect_stale(self, call: Callable[[], object]) -> None:
        message = rf"{self.case.stale_index} was written in place after planning"
        self._expect_refusal(message, call, StalePlanError)

    def _stock(self, pair: int) -> Callable[[], None] | None:
        """The case's stand-in for the engine's stock path over ``pair``, or None. Between
        rows of other dtypes or shapes it only counts: how an engine converts is no part
        of the mover, and the mover itself must write nothing there."""
        if not self.case.with_stock:
            return None

        def stock() -> None:
            self.stock_calls += 1
            if self.case.dst_mismatch == "-":
                self.world.stock_copy(
                    self.src.buffers[pair], self.dst.buffers[pair], self.src_rows, self.dst_rows
                )

        return stock

    def _mismatch_refusal(self) -> tuple[type[Exception], str]:
        """What a fallback between rows of other dtypes or shapes raises without stock=."""
        src, dst = self.src.buffers[0].tensor, self.dst.buffers[0].tensor
        if self.case.dst_mismatch == "dtype":
            words = f"rows of {src.dtype} cannot move into rows of {dst.dtype} unchanged"
            return TypeError, re.escape(words)
        words = (
            f"rows of shape {tuple(src.shape[1:])} cannot move into rows of shape "
            f"{tuple(dst.shape[1:])} unchanged"
        )
        return ValueError, re.escape(words)

    def _applied_pairs(self, pair: int) -> list[int]:
        """The pairs whose copy the reference applies after ``pair`` was moved."""
        return [] if self.case.dst_mismatch != "-" else [pair]

    def _execute(
        self, chosen: TransferPlan, pair: int, *, submit: bool = False, stale: bool = False
    ) -> None:
        """Execute ``chosen`` over ``pair`` (``submit``: as an engine's submission, with no
        stock path; else with the pair's stock path, if any) and check;
        ``stale``: the plan's index was written since planning."""
        stock = self._stock(pair)
        calls_before = self.stock_calls
        if stale and (stock is None or chosen.path is not FALLBACK):
            # Only the engine's stock path may run: it reads the engine's own indices.
            if submit:
                self._expect_stale(functools.partial(self.mover.execute, chosen))
            else:
                self._expect_stale(lambda: self.mover.execute(chosen, stock=stock))
            return
        if self.case.dst_mismatch != "-" and stock is None:
            error, message = self._mismatch_refusal()
            if submit:
                call = functools.partial(self.mover.execute, chosen)
                self._expect_refusal(message, call, error)
            else:
                self._expect_refusal(message, lambda: self.mover.execute(chosen), error)
            return
        if self._staging_refuses(chosen):
            self._expect_refusal(
                "does not fit the .* staging buffer",
                lambda: self.mover.execute(chosen, stock=stock),
            )
            return
        if submit:
            self.mover.execute(chosen)
        else:
            self.mover.execute(chosen, stock=stock)
        ran_stock = self.stock_calls - calls_before
        if ran_stock != (1 if stock is not None and chosen.path is FALLBACK else 0):
            raise CaseFailure(_report(self.case, f"stock ran {ran_stock} times on {chosen.path}"))
        self._expect_applied(self._applied_pairs(pair), chosen, chosen.nbytes)

    def _expect_applied(
        self,
        pairs: list[int],
        chosen: TransferPlan,
        nbytes: int,
        layers: LayerPairs | None = None,
    ) -> None:
        for pair in pairs:
            self.world.apply(
                self.src.buffers[pair], self.dst.buffers[pair], self.src_rows, self.dst_rows
            )
        path = STAGED if self._staged_by_region(chosen, layers) else chosen.path
        key = (chosen.direction.value, path.value)
        count, total = self.transfers.get(key, [0, 0])
        self.transfers[key] = [count + 1, total + nbytes]
        if chosen.reason is not None:
            self.fallbacks[chosen.reason] = self.fallbacks.get(chosen.reason, 0) + 1
        self._check(f"after {chosen.describe()}")

    def _staged_by_region(self, chosen: TransferPlan, layers: LayerPairs | None) -> bool:
        """Whether the mover stages this page-in by region (``PathPolicy.stage_regions``): the
        pairs' sources one host region, each host run of the plan one page of every pair
        (a span), a span within the staging buffer."""
        region = None if layers is None else layers.src_region
        if layers is None or region is None or chosen.direction is not Direction.H2D:
            return False
        if chosen.path not in REGION_STAGED_PATHS[self.mover.policy.stage_regions]:
            return False
        span_bytes = len(layers) * region.spacing * layers.row_bytes
        lengths = chosen.host_runs.lengths.tolist()
        whole_pages = bool(lengths) and all(n == region.spacing for n in lengths)
        return whole_pages and span_bytes <= self.mover.staging.capacity_bytes

    def _expect_refusal(
        self, message: str, call: Callable[[], object], error: type[Exception] = ValueError
    ) -> None:
        try:
            call()
        except error as raised:
            if not re.search(message, str(raised)):
                raise
        else:
            raise CaseFailure(_report(self.case, f"no {error.__name__} matching {message!r}"))
        self._check("after a refused call")

    def _check(self, when: str) -> None:
        wrong = self.world.mismatches()
        if wrong:
            raise CaseFailure(_report(self.case, f"bytes differ {when}: " + "; ".join(wrong)))

    def _check_accounting(self) -> None:
        snapshot = self.metrics.snapshot()
        got = {(t["direction"], t["path"]): [t["count"], t["bytes"]] for t in snapshot["transfers"]}
        fallbacks = {k: v for k, v in snapshot["fallbacks"].items() if k in FALLBACK_REASONS}
        if got != self.transfers or fallbacks != self.fallbacks:
            raise CaseFailure(
                _report(
                    self.case,
                    f"metrics {got} {fallbacks}, expected {self.transfers} {self.fallbacks}",
                )
            )
        degraded = set(snapshot["fallbacks"]) - set(FALLBACK_REASONS)
        if self.case.device == "cpu" and degraded:
            raise CaseFailure(_report(self.case, f"degraded paths on the CPU: {degraded}"))

    # The modes.

    def run(self) -> None:
        self._check("before any call")
        getattr(self, f"_mode_{self.case.mode}")()
        self._check_accounting()

    def _mode_transfer(self) -> None:
        case = self.case
        src, dst = self.src.buffers[0].tensor, self.dst.buffers[0].tensor
        src_idx, dst_idx = self._indices()
        refusal = self._refusal(0)
        stock = self._stock(0)
        direction = case.direction if case.direction_given else None

        def transfer() -> TransferPlan:
            return self.mover.transfer(
                src, dst, src_idx, dst_idx, direction=direction, stock=stock, force=case.force
            )

        if refusal is not None:
            self._expect_refusal(refusal, transfer)
            return
        if case.dst_mismatch != "-" and stock is None:
            error, message = self._mismatch_refusal()
            self._expect_refusal(message, transfer, error)
            return
        probe = plan(src, dst, src_idx, dst_idx, direction=case.direction, policy=case.policy,
                     force=case.force)  # fmt: skip
        if self._staging_refuses(probe):
            self._expect_refusal("does not fit the .* staging buffer", transfer)
            return
        chosen = transfer()
        self._check_plan(chosen, self._fallback_reason(0))
        ran = self.stock_calls
        if ran != (1 if stock is not None and chosen.path is FALLBACK else 0):
            raise CaseFailure(_report(case, f"stock ran {ran} times on {chosen.path}"))
        self._expect_applied(self._applied_pairs(0), chosen, chosen.nbytes)

    def _mode_execute(self) -> None:
        chosen = self._plan(0)
        if chosen is None:
            return
        if self.case.repeat:
            self._execute(chosen, 0)
            # The same plan again over fresh destination bytes: what it set up the first
            # time must still address the same buffers.
            self.world.refill(self.dst.buffers[0].memory)
        self._execute(chosen, 0, stale=self._write_index_after_planning())

    def _mode_submit(self) -> None:
        chosen = self._plan(0)
        if chosen is not None:
            self._execute(chosen, 0, submit=True, stale=self._write_index_after_planning())

    def _pairs_reason(self) -> str | None:
        """What layer_pairs must say of the case's pairs."""
        buffers = (*self.src.buffers, *self.dst.buffers)
        if any(buffer.padded for buffer in buffers):
            return "strided_rows"
        return "row_shape_mismatch" if self.case.mixed_rows else None

    def _check_layer_pairs(self, pairs: LayerPairs) -> None:
        """layer_pairs' verdict on the case's pairs: its reason, and whether it saw
        destinations sharing memory."""
        if pairs.reason != self._pairs_reason():
            raise CaseFailure(_report(self.case, f"layer_pairs reason {pairs.reason!r}"))
        if pairs.reason is None and bool(pairs.shared_dsts) != self._dsts_share_memory():
            raise CaseFailure(_report(self.case, f"layer_pairs shared_dsts {pairs.shared_dsts!r}"))

    def _dsts_share_memory(self) -> bool:
        """Whether two destinations' bytes meet (the views of an interleaved layout)."""
        extents = sorted(
            (b.memory, b.byte_offset, b.byte_offset + (b.rows - 1) * b.pitch + b.row_bytes)
            for b in self.dst.buffers
            if b.rows and b.row_bytes
        )
        # Where two extents meet, one meets the extent that starts next after it.
        return any(a[0] == b[0] and b[1] < a[2] for a, b in itertools.pairwise(extents))

    def _writes_meet(self) -> bool:
        """Whether the destination rows, written into every destination, write a byte twice."""
        starts, ends = [], []
        for buffer in self.dst.buffers:
            # Memories apart by far more than any holds: one number line for all of them.
            first = (buffer.memory << 40) + buffer.byte_offset + self.dst_rows * buffer.pitch
            starts.append(first)
            ends.append(first + buffer.row_bytes)
        start, end = np.concatenate(starts), np.concatenate(ends)
        order = np.argsort(start, kind="stable")
        return bool((start[order][1:] < end[order][:-1]).any())

    def _one_submission_refusal(self, chosen: TransferPlan, pairs: LayerPairs) -> str | None:
        """The documented words of execute's refusal of ``chosen`` over ``pairs``
        (made for the case's pairs), or None where it must take them in one submission."""
        if chosen.reason is not None:
            return rf"the plan falls back \({chosen.reason}\); run the stock path"
        if pairs.reason is not None:
            return (
                rf"the pairs cannot move in one submission \({pairs.reason}\); "
                "rebind the plan to each"
            )
        if not self._dsts_share_memory():
            return None
        if self.case.device_indexed and self.case.direction is H2D:
            # The destination rows are the opaque device index: nothing to check them by.
            return (
                "the pairs' destinations share memory and the plan's destination rows are "
                "on the device, unread"
            )
        if self._writes_meet():
            return (
                "the plan's destination rows meet in the memory the pairs' destinations "
                "share: one submission would write a byte twice"
            )
        return None

    def _mode_layers(self) -> None:
        chosen = self._plan(self.case.planned_pair)
        if chosen is None:
            return
        srcs = [buffer.tensor for buffer in self.src.buffers]
        dsts = [buffer.tensor for buffer in self.dst.buffers]
        pairs = layer_pairs(srcs, dsts)
        self._check_layer_pairs(pairs)
        if self._write_index_after_planning():
            self._expect_stale(lambda: self.mover.execute(chosen, pairs))
            return
        refusal = self._one_submission_refusal(chosen, pairs)
        if refusal is not None:
            self._expect_refusal(refusal, lambda: self.mover.execute(chosen, pairs))
            return
        if self._staging_refuses(chosen):
            self._expect_refusal(
                "does not fit the .* staging buffer",
                lambda: self.mover.execute(chosen, pairs),
            )
            return
        self.mover.execute(chosen, pairs)
        self._expect_applied(
            list(range(self.case.pairs)), chosen, chosen.nbytes * len(pairs), pairs
        )

    def _mode_submissions(self) -> None:
        case = self.case
        chosen = self._plan(0)
        if chosen is None:
            return
        buffers = [
            (s.tensor, d.tensor) for s, d in zip(self.src.buffers, self.dst.buffers, strict=True)
        ]
        layered = None
        if case.layered_submissions:
            layered = layer_pairs(*zip(*buffers, strict=True))
            self._check_layer_pairs(layered)
        work = submissions(chosen, buffers, layered)
        if chosen.reason is not None:
            if work != chosen.reason:
                raise CaseFailure(_report(case, f"submissions gave {work!r}, not the reason"))
            return
        if isinstance(work, str):
            raise CaseFailure(_report(case, f"submissions fell back: {work}"))
        # One submission for all pairs where execute over them takes them, else the pairs
        # one by one in their order (where their writes meet, the last one wins).
        one = layered is not None and self._one_submission_refusal(chosen, layered) is None
        expected_count = 1 if one else case.pairs
        if len(work) != expected_count:
            raise CaseFailure(_report(case, f"{len(work)} submissions, not {expected_count}"))
        if not one and [self._pair_of(each) for each in work] != list(range(case.pairs)):
            raise CaseFailure(_report(case, "submissions not one per pair, in order"))
        if one and work[0].pairs is not layered:
            raise CaseFailure(_report(case, "one submission, not over the pairs given"))
        for each in work:
            pairs = list(range(case.pairs)) if each.pairs is not None else [self._pair_of(each)]
            if self._staging_refuses(each.plan):
                self._expect_refusal(
                    "does not fit the .* staging buffer",
                    functools.partial(self.mover.execute, each.plan, each.pairs),
                )
                return
            self.mover.execute(each.plan, each.pairs)
            self._expect_applied(pairs, each.plan, each.plan.nbytes * len(pairs), each.pairs)

    def _pair_of(self, work: Submission) -> int:
        for pair, (s, d) in enumerate(zip(self.src.buffers, self.dst.buffers, strict=True)):
            if work.plan.src is s.tensor and work.plan.dst is d.tensor:
                return pair
        raise CaseFailure(_report(self.case, "a submission over buffers of no pair"))

    def _mode_rebind(self) -> None:
        case = self.case
        chosen = self._plan(0)
        if chosen is None:
            return
        if case.repeat:
            self._execute(chosen, 0)
        src, dst = self.src.buffers[1].tensor, self.dst.buffers[1].tensor
        if self._write_index_after_planning():
            self._expect_stale(lambda: chosen.rebind(src, dst))
            return
        if case.rebind == "short" and case.rows:
            self._expect_refusal("outside", lambda: chosen.rebind(src, dst))
            return
        rebound = chosen.rebind(src, dst)
        same_layout = ("same", "longer", "retyped", "misaligned", "short")
        kept = chosen.reason is None and case.rebind in same_layout
        replanned = (
            rebound.path is not chosen.path
            or rebound.paired_runs_found is not chosen.paired_runs_found
            or rebound.host_runs_found is not chosen.host_runs_found
        )
        if kept and replanned:
            raise CaseFailure(_report(case, f"rebind planned again: {rebound.describe()}"))
        reason = (
            "strided_rows" if self.src.buffers[1].padded or self.dst.buffers[1].padded else None
        )
        if rebound.reason != reason:
            raise CaseFailure(_report(case, f"rebound reason {rebound.reason!r}"))
        if rebound.row_bytes != self.src.buffers[1].row_bytes:
            raise CaseFailure(_report(case, f"rebound rows of {rebound.row_bytes} B"))
        self._execute(rebound, 1)

    def _mode_invalid(self) -> None:
        """A caller error in one index: planning raises ValueError, and nothing moves."""
        case = self.case
        pick = random.Random(f"{case.seed}/corruption")
        src_rows, dst_rows = self.src_rows.copy(), self.dst_rows.copy()
        kind = case.corruption
        rows = src_rows if kind.startswith("src") else dst_rows
        side = self.src if kind.startswith("src") else self.dst
        at = pick.randrange(case.rows) if case.rows else 0
        if kind.endswith("out_of_range"):
            rows[at] = side.buffers[0].rows + pick.randint(0, 5)
        elif kind.endswith("negative"):
            rows[at] = -pick.randint(1, 5)
        elif kind == "dst_duplicate":
            rows[at] = rows[(at + pick.randint(1, case.rows - 1)) % case.rows]
        else:
            src_rows = np.append(src_rows, src_rows[:1] if case.rows else [0])
        src_idx, dst_idx = self._indices(src_rows, dst_rows)
        planner = plan_device_indexed if case.device_indexed else plan
        src, dst = self.src.buffers[0].tensor, self.dst.buffers[0].tensor

        def planned() -> TransferPlan:
            return planner(src, dst, src_idx, dst_idx, direction=case.direction, force=case.force)

        self._expect_refusal(CORRUPTIONS[kind], planned)


def paired_run_count(src_rows: np.ndarray, dst_rows: np.ndarray) -> int:
    """Runs that step by one on both sides at once, counted independently of kvcore."""
    if src_rows.size == 0:
        return 0
    breaks = (np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)
    return 1 + int(breaks.sum())


def fuzz_seeds(default_cases: int) -> list[int]:
    """The seeds to run: ``KVCORE_FUZZ_SEED`` alone (a replay), else ``KVCORE_FUZZ_CASES``
    of them (``default_cases`` unless set) from 0."""
    replay = os.environ.get("KVCORE_FUZZ_SEED")
    if replay:
        return [int(replay)]
    return list(range(int(os.environ.get("KVCORE_FUZZ_CASES", default_cases))))
