"""Translating a placed ONNX graph into ``torch.fx`` (the layer beneath ``pl.to_torch``).

One concern per module, read top to bottom: :mod:`.values` (a blob during lowering, and the
conversions of names and data), :mod:`.opset` (models older than opset 13 upgraded first),
:mod:`.emit` (the fx graph's attributes, parameters, constants and copies), :mod:`.walker`
(lowering one op: folding, rules, shapes), :mod:`.bodies` (op subgraphs lowered into modules of
their own), :mod:`.meta` (the ``fx.Node.meta`` keys it writes) and :mod:`.ops`, the per-op-type
rule table (lowering, flags and FLOP cost of every op type, one module per op family).

Running what it builds (``to_torch``, pipelines, streamed weights, CUDA graphs) is
:mod:`placement.runtime.torch`, which sits above it: this package never imports the runtime.
A streamed copy asks :meth:`~.emit.Emitter.new_streamer` for its module, which the runtime provides.

May import: ``placement.errors``, ``graph``, ``analysis``, ``passes``, ``planning``.
"""

from __future__ import annotations
