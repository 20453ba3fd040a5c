"""Everything behind ``kvcore bench``: measuring code, kept apart from the product.

Laid out like vLLM's ``vllm/benchmarks/``: :mod:`~kvcore.bench.cli` wires the command,
:mod:`~kvcore.bench.suite` is the core suite (every transfer path beside the link
ceiling, and allocator churn), :mod:`~kvcore.bench.report`, :mod:`~kvcore.bench.plot`
and :mod:`~kvcore.bench.sweep_report` print and chart the results, and one subpackage per
engine (:mod:`kvcore.bench.sglang`, :mod:`kvcore.bench.vllm`) holds that engine's A/B
and engine-shaped sweep with the scaffolding they need (churn traces, the stock
allocator model, import stubs, host pools).

Why a subpackage of ``kvcore`` rather than a top-level package: ``kvcore bench`` ships
with the product (README's first command runs it), so it goes wherever ``kvcore`` is
installed, under the name of the command that runs it, and the lint and type checks that
cover ``kvcore`` cover it too. It stays apart by one rule, checked by
``tests/unit/test_bench_boundary.py``: no product module (the rest of ``kvcore``,
``kvcore_sglang``, ``kvcore_vllm``) imports it, except ``kvcore.cli`` reaching
:mod:`kvcore.bench.cli` from inside a function when ``bench`` is the command. Nothing
here imports an engine or its adapter until that engine's bench is asked for.
"""
