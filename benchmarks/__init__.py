"""The engine benchmarks: measuring code that runs from a checkout, not shipped in the wheel.

``kvcore bench --engine sglang|vllm [--sweep [--beside-compute]]`` reaches these (through
:mod:`kvcore.bench.cli`), as do ``scripts/`` and the tests. One subpackage per engine
(:mod:`benchmarks.sglang`, :mod:`benchmarks.vllm`) holds that engine's A/B, engine-shaped
sweeps, soaks, live drivers and host-cost tools with the scaffolding they need (import
stubs, host pools, model-shaped forwards); the modules at this level are what both use
(paired speeds, soak accounting, sweep reports, process state).

The product never imports this package (``tests/unit/test_bench_boundary.py`` checks),
and it imports the product only through its public modules.
"""
