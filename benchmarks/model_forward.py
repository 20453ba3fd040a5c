"""A model-shaped forward to run beside a reload: the GEMMs and element-wise kernels of one
decoder layer, repeated for the model's layers, on a compute stream.

A reload in a serving engine runs while the model computes, either other requests' batch
(independent of the reload) or the hit's own forward, which waits for each layer's load
before computing that layer (SGLang's ``layer_done_counter``). :class:`ModelForward` queues
such a forward on a stream, optionally calling ``before_layer(i)`` first so that the caller
can make the stream wait for layer ``i``'s copy.

Two layer shapes, each one set of weights shared by every layer (so weights are read from
memory on every layer, as in a real model larger than the L2 cache):

- ``llama3-8b``: RMS norm, the fused QKV projection (4096 -> 6144), the output projection
  (4096 -> 4096), RMS norm, the fused gate-up projection (4096 -> 2 x 14336), SiLU x up,
  the down projection (14336 -> 4096), two residual adds;
- ``deepseek-v3``: RMS norm, MLA's projections (q down 7168 -> 1536, q up 1536 -> 128 x 192,
  KV down 7168 -> 576, KV up 512 -> 128 x 256, output 128 x 128 -> 7168), RMS norm, and the
  MoE as dense GEMMs of the same FLOPs per token as 8 routed experts plus the shared one
  (7168 -> 9 x 2 x 2048, SiLU x up, 9 x 2048 -> 7168).

Attention's own kernel (softmax over the KV cache) is left out: it is what the reload feeds,
and its cost depends on the context length rather than the layer shape. Token counts pick
the regime: a decode batch (64, 256 tokens: short, weight-bound kernels) or a prefill chunk
(4096 tokens: long, compute-bound GEMMs).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    """The widths of one decoder layer's projections."""

    hidden: int
    attention: tuple[tuple[int, int], ...]
    """(in, out) of each attention projection, in order; the first reads the layer's input,
    each later one the previous output's first ``in`` columns."""
    mlp_inner: int
    """The width SiLU x up leaves (the gate-up projection's output is twice this)."""


SHAPES: dict[str, LayerShape] = {
    "llama3-8b": LayerShape(hidden=4096, attention=((4096, 6144), (4096, 4096)), mlp_inner=14336),
    "deepseek-v3": LayerShape(
        hidden=7168,
        attention=((7168, 1536), (1536, 24576), (7168, 576), (512, 32768), (16384, 7168)),
        mlp_inner=9 * 2048,
    ),
}

MODEL_FOR_KIND = {"mha": "llama3-8b", "mla": "deepseek-v3"}
"""The forward that belongs beside each SGLang pool kind's reload (the sweep's row shapes:
MHA 8 x 128 heads is Llama-3-8B's, MLA 512 + 64 DeepSeek-V3's)."""


def scaled(shape: LayerShape, divisor: int) -> LayerShape:
    """``shape`` with every width divided by ``divisor`` (at least 1): the same kernels, small
    enough for a CPU test."""

    def width(n: int) -> int:
        return max(1, n // divisor)

    return LayerShape(
        hidden=width(shape.hidden),
        attention=tuple((width(i), width(o)) for i, o in shape.attention),
        mlp_inner=width(shape.mlp_inner),
    )


class ModelForward:
    """One layer's weights and activations for ``tokens`` tokens; :meth:`queue` issues the
    forward of ``layers`` layers on a stream."""

    def __init__(
        self,
        shape: LayerShape,
        tokens: int,
        layers: int,
        device: torch.device,
        *,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        if tokens < 1 or layers < 1:
            raise ValueError(f"tokens and layers must be positive, got {tokens}, {layers}")
        for (fan_in, _), previous in zip(shape.attention[1:], shape.attention[:-1], strict=True):
            if fan_in > max(previous[1], shape.hidden):
                raise ValueError(f"projection input {fan_in} is wider than what precedes it")
        self.shape, self.tokens, self.layers, self.device = shape, tokens, layers, device
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            w = torch.randn(fan_in, fan_out, device=device, dtype=dtype, generator=gen)
            return w.mul_(fan_in**-0.5)

        h = shape.hidden
        self._attention = [weight(i, o) for i, o in shape.attention]
        self._last_out = shape.attention[-1][1]
        if self._last_out != h:
            raise ValueError(f"the last attention projection must return {h} wide")
        self._gate_up = weight(h, 2 * shape.mlp_inner)
        self._down = weight(shape.mlp_inner, h)
        self._norm = torch.ones(h, device=device, dtype=dtype)
        self._x = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen)

    @property
    def flops_per_layer(self) -> int:
        """Multiply-adds x 2 of one layer's GEMMs."""
        pairs = [*self.shape.attention, (self.shape.hidden, 2 * self.shape.mlp_inner)]
        pairs.append((self.shape.mlp_inner, self.shape.hidden))
        return 2 * self.tokens * sum(i * o for i, o in pairs)

    def layer(self) -> None:
        """One layer's kernels on the current stream."""
        x = self._x
        h = F.rms_norm(x, (self.shape.hidden,), self._norm)
        out = h
        for w in self._attention:
            # A projection reads the previous one's output where it is wide enough (MLA's
            # up-projections), else the normed input (its down-projections).
            source = out if out.shape[1] >= w.shape[0] else h
            out = source[:, : w.shape[0]] @ w
        x.add_(out)
        h = F.rms_norm(x, (self.shape.hidden,), self._norm)
        gate_up = h @ self._gate_up
        inner = self.shape.mlp_inner
        x.add_((F.silu(gate_up[:, :inner]) * gate_up[:, inner:]) @ self._down)

    def queue(
        self,
        stream: torch.cuda.Stream | None,
        *,
        count: int | None = None,
        before_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """``count`` layers (one forward of every layer where None; more cycle through the
        model's layers again) on ``stream`` (the current stream where None),
        ``before_layer(i)`` called on that stream before each of layer ``i``; on CUDA the
        (start, end) events around them, None elsewhere."""
        timed = self.device.type == "cuda"
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if timed:
                start.record()
            for step in range(self.layers if count is None else count):
                if before_layer is not None:
                    before_layer(step % self.layers)
                self.layer()
            if timed:
                end.record()
        return (start, end) if timed else None


@dataclass(frozen=True)
class ComputeLoad:
    """A named forward beside a reload: which layer shape, how many tokens."""

    name: str
    tokens: int
    regime: str
    """``decode`` or ``prefill``."""


COMPUTE_LOADS: dict[str, ComputeLoad] = {
    "decode-64": ComputeLoad("decode-64", 64, "decode"),
    "decode-256": ComputeLoad("decode-256", 256, "decode"),
    "prefill-4096": ComputeLoad("prefill-4096", 4096, "prefill"),
}


@dataclass
class ForwardGraph:
    """A compute load's forward for one pool kind: eager (:attr:`model`) for a forward that
    waits on each layer's copy, and one CUDA graph of :attr:`count` layers, replayed on
    :attr:`stream`, for another batch's forward beside a reload."""

    model: ModelForward
    stream: torch.cuda.Stream
    layer_ms: float
    count: int = 0
    """Layers in the graph: as many as last about as long as the reload beside them, so
    that the forward's slowdown is not diluted by time it runs alone."""
    graph: torch.cuda.CUDAGraph | None = None

    def size_for(self, target_ms: float) -> None:
        self.size_layers(max(1, math.ceil(target_ms / self.layer_ms)))

    def size_layers(self, count: int) -> None:
        """A graph of ``count`` layers (the model's count: one step of the engine)."""
        if count == self.count:
            return
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.model.queue(None, count=count)
        self.count = count

    def mark(self) -> torch.cuda.Event:
        """An event on the forward's stream now: a start to time a later replay's end from."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def replay(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        assert self.graph is not None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            self.graph.replay()
            end.record()
        return start, end


def measured_forward(kind: str, load: str, layers: int, device: torch.device) -> ForwardGraph:
    """The forward of ``load`` beside pools of ``kind`` (mha, mla), its time per layer
    measured after a warm-up."""
    model = ModelForward(SHAPES[MODEL_FOR_KIND[kind]], COMPUTE_LOADS[load].tokens, layers, device)
    stream = torch.cuda.Stream(device)
    model.queue(stream)  # warm-up: cuBLAS handles and heuristics
    times = []
    for _ in range(3):
        events = model.queue(stream)
        assert events is not None
        events[1].synchronize()
        times.append(events[0].elapsed_time(events[1]))
    return ForwardGraph(model, stream, statistics.median(times) / layers)
