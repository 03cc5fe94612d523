"""Benchmarks: ratios against reference implementations, measured side by side in one run.

``python -m benchmarks [--quick] [--only NAME]`` runs them all and prints one table. Each module
(``bench_jit``, ``bench_optim``, ``bench_ragged``, ``bench_checkpoint``) has ``run(quick)``
returning rows ``{name, vsf, ref, unit, ratio, target, met}``: vsf's figure and the reference's
taken in the same run (``unit`` ``"s"`` or ``"B"``), their ratio as the target states it, the
target, and whether this run met it (``None`` for a figure that is reported without a target).
"""
