"""The IR layer: ``Model`` (an onnx_ir model + placement state), ``Device``,
import/export, networkx views and ``verify``. Knows nothing of passes or runtimes.
"""

from __future__ import annotations

from placement.graph.device import Device, DeviceLike
from placement.graph.model import Model, Op, Parameter
from placement.graph.serialize import load, save, to_proto
from placement.graph.torch_import import from_torch
from placement.graph.verify import verify
from placement.graph.views import op_graph

__all__ = [
    "Device",
    "DeviceLike",
    "Model",
    "Op",
    "Parameter",
    "from_torch",
    "load",
    "save",
    "to_proto",
    "verify",
    "op_graph",
]
