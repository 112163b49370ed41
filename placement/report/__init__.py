"""What a person reads to judge a placement: per-device tables (and pictures).

- :mod:`~placement.report.summary`: the per-device table (ops, parameters, activations,
  copies, bytes moved, peak activations, estimated time).
- :mod:`~placement.report.draw`: the operator graph coloured by device, through Graphviz
  (``pl.draw``); :mod:`~placement.report.dot` writes its DOT source and
  :mod:`~placement.report.colours` holds the device colours every picture shares.
- :mod:`~placement.report.html`: one self-contained HTML page with tables, charts and the
  graph picture (``pl.write_report``).

May import every layer below it: ``placement.errors``, ``graph``, ``analysis``, ``passes``,
``planning``, ``runtime``, ``distributed``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> pl.summary(model).rows[0].ops
    5
"""

from __future__ import annotations

from placement.report.summary import Column, DeviceRow, Summary, summary

__all__ = ["summary", "Summary", "DeviceRow", "Column"]
