"""The engine's step loop beside a load (``kvcore bench --engine vllm --sweep
--beside-compute --engine-steps``).

vLLM's worker hands a step's loads to the handlers (``transfer_async``), runs the running
batch's forward, and at the step's end asks which jobs finished (``get_finished``); a hit
is scheduled only after the step that reports its last job, and nothing waits for a load.
So in an engine a load costs steps: the hit is ready at a step's end, and the running
batch's requests wait through every step, the first of which also holds the submissions.

Each step here is the model's forward at the row's compute load, all of the model's layers
(:meth:`benchmarks.model_forward.ForwardGraph.size_layers`), replayed and waited for as the
engine's sampling waits for it. Per side and request, on the host's clock from the first
submission: ``ready`` (the end of the step whose ``get_finished`` reported the request's
last job), the steps taken, the first step's time and the mean step's. Rows have situation
``steps``: ``stock_ms`` and ``kvcore_ms`` are the hit's ready times, ``forward_alone_ms`` a
step with no load, ``forward_with_*_ms`` the mean step beside each side's load, and
``steps_taken``, ``first_step_ms`` and ``submit_host_ms`` are per side.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.beside_rows import RowPlace, SideSamples, Tally, alternated, median, reload_row
from benchmarks.vllm.sweep import request_errors, request_specs
from benchmarks.vllm.sweep_pools import Pools
from benchmarks.vllm.sweep_sides import Side

MAX_STEPS = 1000
"""Steps a request may take before its jobs count as lost (a load takes tens at most)."""
ALONE_STEPS = 3
"""Steps timed with no load before each request: the step's own time, that request's."""


class StepForward(Protocol):
    """What the step loop needs of a forward (:class:`benchmarks.model_forward.ForwardGraph`)."""

    def size_layers(self, count: int) -> None: ...

    def replay(self) -> tuple[Any, Any]: ...


class RequestIds(Protocol):
    """Hands out job ids, new for every request (:class:`benchmarks.vllm.beside._Loads`)."""

    pools: Pools

    def new_ids(self, count: int) -> list[int]: ...


@dataclass(frozen=True)
class Stepped:
    """One request of a side through the step loop, in ms from its first submission."""

    ready_ms: float
    steps: int
    first_step_ms: float
    mean_step_ms: float
    submit_ms: float
    checked: bool


def engine_step(forward: StepForward) -> Callable[[], None]:
    """One step: the forward replayed, then waited for."""

    def step() -> None:
        _, end = forward.replay()
        end.synchronize()

    return step


def stepped(
    side: Side, pools: Pools, request: Any, ids: list[int], step: Callable[[], None]
) -> Stepped:
    """``request``'s jobs (numbered ``ids``) through ``side`` in the step loop, then checked."""
    pools.prepare(request)
    started, host_s, results, ends = side.run_steps(request_specs(request, ids), step, MAX_STEPS)
    walls = [(end - begin) * 1e3 for begin, end in zip([started, *ends], ends, strict=False)]
    return Stepped(
        ready_ms=(ends[-1] - started) * 1e3,
        steps=len(ends),
        first_step_ms=walls[0],
        mean_step_ms=statistics.fmean(walls),
        submit_ms=host_s * 1e3,
        checked=not request_errors(results, ids, request, pools),
    )


def step_alone_ms(step: Callable[[], None], count: int = ALONE_STEPS) -> float:
    """The median host time of ``count`` steps with no load."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        step()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def steps_row(
    place: RowPlace,
    load: str,
    link_ms: float,
    loads: RequestIds,
    sides: Sequence[Side],
    forward: StepForward,
    draw: Callable[[], Any],
    repeats: int,
    tally: Tally,
) -> dict[str, Any]:
    """The ``steps`` row of one cell: a warm-up, then ``repeats`` requests drawn by ``draw``,
    the sides alternating which goes first, each request's steps timed alone before it."""
    forward.size_layers(place.layers)
    step = engine_step(forward)
    samples = SideSamples(
        [side.name for side in sides],
        ["ready_ms", "mean_step_ms", "first_step_ms", "steps", "submit_ms"],
    )
    alone: list[float] = []
    ok = True
    for i in range(repeats + 1):
        step_alone = step_alone_ms(step)
        request = draw()
        for side in alternated(sides, i):
            ids = loads.new_ids(len(request.jobs))
            one: Stepped = tally.timed(
                side, functools.partial(stepped, side, loads.pools, request, ids, step)
            )
            ok &= one.checked
            if i:
                samples.add(side.name, one)
        if i:
            alone.append(step_alone)
    row = reload_row(
        place,
        "steps",
        load,
        link_ms,
        samples["ready_ms"],
        samples["mean_step_ms"],
        median(alone),
        ok,
        tally,
    )
    row["steps_taken"] = samples.medians("steps")
    row["first_step_ms"] = samples.medians("first_step_ms")
    row["submit_host_ms"] = samples.medians("submit_ms")
    return row
