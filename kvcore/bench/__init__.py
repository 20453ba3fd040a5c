"""``kvcore bench``'s core suite: measuring code shipped with the product, kept apart from it.

:mod:`~kvcore.bench.cli` wires the command, :mod:`~kvcore.bench.suite` is the core suite
(every transfer path beside the link ceiling, and allocator churn over the
:mod:`~kvcore.bench.stock_allocator` model), :mod:`~kvcore.bench.report` and
:mod:`~kvcore.bench.plot` print and chart the results, :mod:`~kvcore.bench.host_buffers`
gets exact-size host memory. The engines' A/Bs, sweeps, soaks and live drivers are in the
checkout's top-level ``benchmarks/`` package, which the wheel does not carry;
``kvcore bench --engine`` reaches them from a checkout.

It stays apart by one rule, checked by ``tests/unit/test_bench_boundary.py``: no product
module (the rest of ``kvcore``, ``kvcore_sglang``, ``kvcore_vllm``) imports it, except
``kvcore.cli`` reaching :mod:`kvcore.bench.cli` from inside a function when ``bench`` is
the command.
"""
