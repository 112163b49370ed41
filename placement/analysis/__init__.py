"""Facts about a graph that every layer above shares, each defined once.

- :mod:`~placement.analysis.dependence`: data dependence (which blobs depend on a graph
  input, which are activations), copy origin (the blob a chain of copies carries) and
  load-time values (blobs computable from parameters and constants alone, which runtimes
  fold where read and never transfer per run).

The passes, the planner and the runtime all ask these questions; answering them in one
place keeps the planner's idea of what a cut copies equal to what the runtime moves.

May import: ``placement.errors``, ``placement.graph``.

Example:
    >>> import placement as pl
    >>> from placement.analysis import activation_values
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> [v.name for v in activation_values(model.graph)][:2]
    ['linear', 'relu']
"""

from __future__ import annotations

from placement.analysis.dependence import (
    NONDETERMINISTIC_OPS,
    activation_values,
    copy_origin,
    independent_values,
    load_time_values,
)
from placement.analysis.shapes import infer_shapes

__all__ = [
    "NONDETERMINISTIC_OPS",
    "activation_values",
    "copy_origin",
    "independent_values",
    "load_time_values",
    "infer_shapes",
]
