"""What the modules beneath ``Model`` read of a placed model, as a structural type.

:class:`~placement.graph.model.Model` delegates to modules it imports (``saving``, ``views``);
they annotate their argument with :class:`PlacedModel` instead of importing ``Model`` back, so
the import graph of ``placement.graph`` has no circle. ``Model`` is a ``PlacedModel``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> isinstance(model, PlacedModel)
    True
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import onnx_ir as ir

__all__ = ["PlacedModel"]


@runtime_checkable
class PlacedModel(Protocol):
    """An ``onnx_ir.Model`` with placement state in its node metadata (``Model`` is one)."""

    ir_model: ir.Model

    @property
    def graph(self) -> ir.Graph:
        """The main graph of :attr:`ir_model`."""
        ...
