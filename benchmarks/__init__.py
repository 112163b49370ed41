"""Reproducible measurements of placement, each printing its table with ratios side by side.

Each module measures one thing and is run as a script (``python benchmarks/pipeline.py``) or a
module (``python -m benchmarks.pipeline``); :mod:`benchmarks.harness` holds what they share
(alternating timed blocks, the environment line, tables, results JSON) and
:mod:`benchmarks.tables` renders ``docs/benchmarks.md`` from ``benchmarks/results/*.json``.
Modules here import ``placement``, :mod:`benchmarks.harness` and each other without a circle
(``tests/test_layering.py``).
"""
