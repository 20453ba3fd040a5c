"""Would a scatter kernel that stays resident for the whole staged load keep an MLA reload at
the link beside a prefill? Today's ring launches one scatter a piece; beside a prefill each
launch waits for the prefill's kernels to free SMs, and the last pieces' scatters end
1.8-2.4 ms after the last DMA (docs/bench/h100-region-tail-2026-12-07.json).

The resident arm launches one kernel of a few CTAs before the DMAs. The copy stream marks
each piece landed with ``cuStreamWriteValue32`` after its DMA; the kernel's CTAs wait for
that mark, scatter their share of the piece, then mark it read; before a slot is filled
again the copy stream waits on those marks with ``cuStreamWaitValue32``. So no launch waits
for SMs after the first, and the host issues no kernel or event a piece. The ring arm is
today's shape with the same tile copy: a launch a piece on a top-priority stream, ordered
by events. Both write vLLM-shaped MLA pages (61 layer tensors of 18 KiB blocks) from
vLLM-shaped host chunk rows; ``plain`` is one copy of the same bytes (the link).

    python3 scripts/resident_scatter_probe.py [--sizes 8192,32768] [--ctas 4,8,16]
        [--compute none,decode-256,prefill-4096] [--requests 5] [--forward-order before,after]
        [--json out.json]

``--forward-order after`` queues the other forward after the load's copies, in the engine's
order, where the handler's bench queues it; ``before`` (the default) ahead of them.

Measuring code only; needs CUDA and Triton.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

# The measuring code is in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.beside_rows import LINK_GBPS
from benchmarks.model_forward import measured_forward
from benchmarks.probe_shape import (
    GPU_BLOCKS,
    MLA,
    chunks_landed,
    probe_device,
    probe_parser,
    write_probe_json,
)
from kvcore.kernels.cudart import stream_calls
from kvcore.kernels.triton_layers import LayeredLaunch, layer_table
from kvcore.streams import highest_priority

WORD = 8
ROW_WORDS = MLA.row_bytes // WORD  # 2304 = 2048 + 256, the kernel's two loads
CHUNK_WORDS = MLA.chunk_bytes // WORD
SLOTS = 8
PER_PIECE = (16 << 20) // MLA.chunk_bytes  # blocks a piece: pieces of at most 16 MiB
RING_CTAS = 64
ROW_WORDS_2K = 2048 // WORD  # the rows vLLM's region gives: gcd of a page and a chunk row
BLOCK_ROWS = MLA.row_bytes // 2048
CHUNK_ROWS = MLA.chunk_bytes // 2048
# The kernels spell these out (Triton folds literals, not module constants).
assert (PER_PIECE, ROW_WORDS, CHUNK_WORDS) == (14, 2304, 140800)


@triton.jit
def _copy_tiles(staging, dst0, layer_offsets, dst_blocks, first, blocks, slot_base, pid, nprog):
    low = tl.arange(0, 2048)
    high = 2048 + tl.arange(0, 256)
    # While loops, not range(): Triton 3.6's interpreter takes no tensor bound.
    tile = pid
    while tile < blocks * 61:
        block = tile // 61
        layer = tile % 61
        src = staging + (slot_base + block) * 140800 + layer * 2304
        dst = dst0 + tl.load(layer_offsets + layer) + tl.load(dst_blocks + first + block) * 2304
        tl.store(dst + low, tl.load(src + low, cache_modifier=".cg"))
        tl.store(dst + high, tl.load(src + high, cache_modifier=".cg"))
        tile += nprog


@triton.jit
def _resident_scatter(staging, dst0, layer_offsets, dst_blocks, ready, done, total_blocks, pieces):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    piece = 0
    while piece < pieces:
        landed = tl.atomic_add(ready + piece, 0, sem="acquire")
        while landed == 0:
            landed = tl.atomic_add(ready + piece, 0, sem="acquire")
        first = piece * 14
        blocks = tl.minimum(14, total_blocks - first)
        _copy_tiles(
            staging, dst0, layer_offsets, dst_blocks, first, blocks, (piece % 8) * 14, pid, nprog
        )
        tl.debug_barrier()
        tl.atomic_xchg(done + piece * nprog + pid, 1, sem="release")
        piece += 1


@triton.jit
def _piece_scatter(staging, dst0, layer_offsets, dst_blocks, first, blocks, slot_base):
    _copy_tiles(
        staging,
        dst0,
        layer_offsets,
        dst_blocks,
        first,
        blocks,
        slot_base,
        tl.program_id(0),
        tl.num_programs(0),
    )


class StreamMemOps:
    """``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` (the v2 entry points)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = lib.cuStreamWriteValue32_v2
        self._wait = lib.cuStreamWaitValue32_v2
        for call in (self._write, self._wait):
            call.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
            call.restype = ctypes.c_int

    def write(self, stream: int, address: int, value: int) -> None:
        code = self._write(stream, address, value, 0)
        if code:
            raise RuntimeError(f"cuStreamWriteValue32 failed: CUresult {code}")

    def wait_at_least(self, stream: int, address: int, value: int) -> None:
        code = self._wait(stream, address, value, 0)  # CU_STREAM_WAIT_VALUE_GEQ
        if code:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {code}")


def stream_mem_ops() -> StreamMemOps | None:
    try:
        return StreamMemOps()
    except (AttributeError, OSError) as error:
        print(f"no stream memory operations ({error}): the resident arms are left out", flush=True)
        return None


class Setup:
    """Host chunk rows, staging ring, 61 layer tensors and the streams, for one size."""

    def __init__(self, blocks: int, device: torch.device) -> None:
        self.blocks = blocks
        self.device = device
        self.host = torch.empty(blocks * MLA.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.host.view(torch.int32).random_()
        self.layers = [
            torch.zeros(GPU_BLOCKS * MLA.row_bytes, dtype=torch.uint8, device=device)
            for _ in range(MLA.layers)
        ]
        base = self.layers[0].data_ptr()
        self.layer_offsets = torch.tensor(
            [(t.data_ptr() - base) // WORD for t in self.layers], dtype=torch.int64, device=device
        )
        self.staging = torch.empty(
            SLOTS * PER_PIECE * MLA.chunk_bytes, dtype=torch.uint8, device=device
        )
        self.pieces = -(-blocks // PER_PIECE)
        self.whole: torch.Tensor | None = None
        self.row_launch: LayeredLaunch | None = None
        self.keep: tuple[torch.Tensor, ...] = ()
        self.dma = torch.cuda.Stream(device)
        self.scatter = torch.cuda.Stream(device, priority=highest_priority())
        calls = stream_calls()
        assert calls is not None, "no CUDA runtime loaded"
        self.calls = calls
        self.mem_ops = stream_mem_ops()
        self.freed = [calls.event() for _ in range(SLOTS)]
        self.filled = [calls.event() for _ in range(SLOTS)]

    def piece_copy(self, piece: int) -> tuple[int, int, int]:
        first = piece * PER_PIECE
        blocks = min(PER_PIECE, self.blocks - first)
        dst = self.staging.data_ptr() + (piece % SLOTS) * PER_PIECE * MLA.chunk_bytes
        return dst, self.host.data_ptr() + first * MLA.chunk_bytes, blocks * MLA.chunk_bytes

    def args(self, dst_blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        staging = self.staging.view(torch.int64)
        return staging, self.layers[0].view(torch.int64), self.layer_offsets, dst_blocks

    def plain(self, dst_blocks: torch.Tensor) -> None:
        if self.whole is None:
            self.whole = torch.empty_like(self.host, device=self.device)
        with torch.cuda.stream(self.dma):
            self.whole.copy_(self.host, non_blocking=True)
        self.scatter.wait_stream(self.dma)

    def ring(self, dst_blocks: torch.Tensor) -> None:
        """Today's ring with whole-block tiles."""
        args = self.args(dst_blocks)

        def scatter(piece: int, first: int, blocks: int) -> None:
            grid = (min(RING_CTAS, blocks * MLA.layers),)
            slot_base = (piece % SLOTS) * PER_PIECE
            _piece_scatter[grid](*args, first, blocks, slot_base, num_warps=8)

        self._ring(scatter)

    def ring_rows(self, dst_blocks: torch.Tensor) -> None:
        """Today's ring with kvcore's own scatter: the layered gather over 2 KiB rows (the
        rows vLLM's host region gives a page-in), an index pair a row."""
        launch = self._row_launch()
        rows = torch.arange(BLOCK_ROWS, device=self.device)
        block = torch.arange(self.blocks, device=self.device)
        within = (block // PER_PIECE % SLOTS) * PER_PIECE + block % PER_PIECE
        src_idx = (within[:, None] * CHUNK_ROWS + rows).reshape(-1)
        dst_idx = (dst_blocks[:, None] * BLOCK_ROWS + rows).reshape(-1)

        def scatter(piece: int, first: int, blocks: int) -> None:
            launch.rows_between(src_idx, dst_idx, first * BLOCK_ROWS, (first + blocks) * BLOCK_ROWS)

        self._ring(scatter)

    def _row_launch(self) -> LayeredLaunch:
        if self.row_launch is None:
            staged = self.staging.view(torch.int64).view(-1, ROW_WORDS_2K)
            length = staged.shape[0] - (MLA.layers - 1) * BLOCK_ROWS
            srcs = [staged[i * BLOCK_ROWS : i * BLOCK_ROWS + length] for i in range(MLA.layers)]
            dsts = [t.view(torch.int64).view(-1, ROW_WORDS_2K) for t in self.layers]
            table = layer_table(srcs, dsts)
            self.row_launch = LayeredLaunch(table, table.offsets.to(self.device), RING_CTAS)
        return self.row_launch

    def _ring(self, scatter: Callable[[int, int, int], None]) -> None:
        calls, dma, raw = self.calls, self.dma.cuda_stream, self.scatter.cuda_stream
        self.dma.wait_stream(torch.cuda.current_stream())
        self.scatter.wait_stream(torch.cuda.current_stream())
        for piece in range(min(SLOTS, self.pieces)):
            calls.copy(*self.piece_copy(piece), dma)
            calls.record(self.filled[piece % SLOTS], dma)
        for piece in range(self.pieces):
            slot = piece % SLOTS
            calls.wait(raw, self.filled[slot])
            first = piece * PER_PIECE
            with torch.cuda.stream(self.scatter):
                scatter(piece, first, min(PER_PIECE, self.blocks - first))
            later = piece + SLOTS
            if later < self.pieces:
                calls.record(self.freed[slot], raw)
                calls.wait(dma, self.freed[slot])
                calls.copy(*self.piece_copy(later), dma)
                calls.record(self.filled[slot], dma)

    def resident(self, ctas: int) -> Callable[[torch.Tensor], None]:
        def load(dst_blocks: torch.Tensor) -> None:
            ready = torch.zeros(self.pieces, dtype=torch.int32, device=self.device)
            done = torch.zeros(self.pieces * ctas, dtype=torch.int32, device=self.device)
            self.dma.wait_stream(torch.cuda.current_stream())
            self.scatter.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.scatter):
                _resident_scatter[(ctas,)](
                    *self.args(dst_blocks), ready, done, self.blocks, self.pieces, num_warps=8
                )
            calls, dma = self.calls, self.dma.cuda_stream
            ops = self.mem_ops
            assert ops is not None
            try:
                for piece in range(self.pieces):
                    if piece >= SLOTS:
                        for cta in range(ctas):
                            ops.wait_at_least(
                                dma, done.data_ptr() + 4 * ((piece - SLOTS) * ctas + cta), 1
                            )
                    calls.copy(*self.piece_copy(piece), dma)
                    ops.write(dma, ready.data_ptr() + 4 * piece, 1)
            except BaseException:
                # The kernel waits for every piece's mark: release it before anything else.
                ready.fill_(1)
                raise
            # The tensors must outlive the kernel: the scatter stream is synchronised after.
            self.keep = (ready, done)

        return load


def main() -> None:
    parser = probe_parser()
    parser.add_argument("--ctas", default="4,8,16")
    parser.add_argument("--compute", default="none,decode-256,prefill-4096")
    parser.add_argument(
        "--forward-order",
        default="before",
        help="before,after: queue the other forward before the load's copies or after them "
        "(as vLLM's engine does: its connector submits, then the step's forward is queued)",
    )
    args = parser.parse_args()
    device = probe_device("resident_scatter_probe")
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "rows": []}
    rows: list[dict[str, object]] = report["rows"]  # type: ignore[assignment]
    for tokens in (int(s) for s in args.sizes.split(",")):
        setup = Setup(tokens // 16, device)
        link_ms = setup.blocks * MLA.layers * MLA.row_bytes / LINK_GBPS / 1e6
        arms: dict[str, Callable[[torch.Tensor], None]] = {
            "plain": setup.plain,
            "ring": setup.ring,
            "ring-rows": setup.ring_rows,
        }
        if setup.mem_ops is not None:
            for ctas in (int(c) for c in args.ctas.split(",") if c):
                arms[f"resident-{ctas}"] = setup.resident(ctas)
        for compute in args.compute.split(","):
            forward = None if compute == "none" else measured_forward("mla", compute, 61, device)
            if forward is not None:
                forward.size_for(link_ms * 1.3)
            orders = args.forward_order.split(",") if forward is not None else ["before"]
            for order in orders:
                for name, arm in arms.items():
                    rows.append(
                        _cell(
                            setup,
                            name,
                            arm,
                            forward,
                            tokens,
                            compute,
                            link_ms,
                            args.requests,
                            order,
                        )
                    )
        del setup
        torch.cuda.empty_cache()
    write_probe_json(args.json, report)


def _cell(
    setup: Setup,
    name: str,
    arm: Callable[[torch.Tensor], None],
    forward: object,
    tokens: int,
    compute: str,
    link_ms: float,
    requests: int,
    order: str = "before",
) -> dict[str, object]:
    times: list[float] = []
    holds: list[float] = []
    alone: list[float] = []
    beside: list[float] = []
    identical = True
    for _ in range(requests + 1):
        dst_blocks = torch.randperm(GPU_BLOCKS, device=setup.device)[: setup.blocks]
        torch.cuda.synchronize()
        if forward is not None:
            a0, a1 = forward.replay()  # type: ignore[attr-defined]
            a1.synchronize()
            alone.append(a0.elapsed_time(a1))
            if order == "before":
                f0, f1 = forward.replay()  # type: ignore[attr-defined]
        start = time.perf_counter()
        arm(dst_blocks)
        held = time.perf_counter() - start
        if forward is not None and order == "after":
            f0, f1 = forward.replay()  # type: ignore[attr-defined]
        setup.scatter.synchronize()
        setup.dma.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        holds.append(held * 1e3)
        if forward is not None:
            f1.synchronize()
            beside.append(f0.elapsed_time(f1))
        if name != "plain":
            identical &= chunks_landed(MLA, setup.host, setup.layers, dst_blocks)
    row: dict[str, object] = {
        "arm": name,
        "tokens": tokens,
        "compute": compute,
        "forward_order": order if forward is not None else None,
        "link_ms": link_ms,
        "reload_ms": (reload_ms := statistics.median(times[1:])),
        "reload_ms_all": times[1:],
        "host_ms": statistics.median(holds[1:]),
        "forward_alone_ms": statistics.median(alone[1:]) if alone else None,
        "forward_with_ms": statistics.median(beside[1:]) if beside else None,
        "identical": identical if name != "plain" else None,
    }
    slowed = ""
    if alone:
        slowed = f" forward {statistics.median(beside[1:]) / statistics.median(alone[1:]):.3f}x"
    print(
        f"{tokens} {compute} {name} (forward {order}): {row['reload_ms']:.2f} ms "
        f"({reload_ms / link_ms:.2f}x link) host {row['host_ms']:.2f} ms{slowed} "
        f"identical={row['identical']}",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
