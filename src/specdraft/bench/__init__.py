"""Benchmarks: ``specdraft bench`` (methods x datasets x settings), ``--verify-cost``
(target forward time vs tree size) and ``specdraft sweep`` (best drafting shape).

One module per concern: ``datasets`` (prompt sets), ``methods`` / ``peers`` (what is
timed: our engine, transformers' generate), ``specs`` (method specs -> methods), ``metrics`` (the figures' definitions),
``runner`` (the measuring loop), ``store`` (results.json, resume), ``report`` (tables
and plots), ``verify_cost`` and ``sweep``.
"""

from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
