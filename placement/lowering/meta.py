"""The ``fx.Node.meta`` keys the lowering writes and the pipelined runtime reads.

The lowering (:mod:`placement.runtime.torch.lower`) and the op rules that emit
their own nodes (:mod:`placement.lowering.ops.control`) write them; the
stage split and the traced stages (:mod:`placement.runtime.torch.pipelined`) read
them.

Example:
    >>> import torch
    >>> import placement as pl
    >>> model = pl.from_torch(torch.nn.ReLU(), (torch.randn(2),))
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> sorted({n.meta[OP_META] for n in module.graph.nodes if OP_META in n.meta})
    ['node_relu']
"""

from __future__ import annotations

__all__ = ["DEVICE_META", "OP_META", "UNTRACEABLE_META"]

#: ``fx.Node.meta`` key: the name of the ONNX op a node was lowered from.
OP_META = "placement_op"
#: ``fx.Node.meta`` key: the logical device of the op a node was lowered from (for splits by device).
DEVICE_META = "placement_device"
#: ``fx.Node.meta`` key: why a TorchScript trace must never record the node (control flow that
#: depends on tensor values, such as a ``Loop``'s trip count or an ``If``'s condition).
UNTRACEABLE_META = "placement_untraceable"
