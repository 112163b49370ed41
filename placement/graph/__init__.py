"""The IR layer: the operator graph and its placement state.

- :mod:`~placement.graph.model`: ``Model`` (an ``onnx_ir.Model`` plus the Caffe2 vocabulary:
  ops, blobs, parameters, scopes, each op's device in node metadata).
- :mod:`~placement.graph.device`: ``Device`` and its parsing (``1``, ``"cuda:1"``, ``"cpu"``).
- :mod:`~placement.graph.nodes`: the metadata keys and fast per-node helpers (device, copy, scope).
- :mod:`~placement.graph.saving` / :mod:`~placement.graph.loading`: ``save``/``load`` (standard
  ONNX, external data); :mod:`~placement.graph.atomic`: atomic writes;
  :mod:`~placement.graph.external_data`: every path a file names stays in its folder;
  :mod:`~placement.graph.weights`: ``split_weights`` for ONNX Runtime sessions.
- :mod:`~placement.graph.session`: ``ort_session``, an ONNX Runtime session whose weights bypass
  the protobuf (every session the package builds).
- :mod:`~placement.graph.dims`: dimensions written as ``-1`` (off the spec) read as dynamic.
- :mod:`~placement.graph.torch_import`: ``from_torch`` (the exporter front-end).
- :mod:`~placement.graph.verify`: ``verify``, the placement invariants.
- :mod:`~placement.graph.views`: networkx views of the op graph.
- :mod:`~placement.graph.placed`: ``PlacedModel``, what the modules beneath ``Model`` read of it.

May import: ``placement.errors`` only. Knows nothing of analyses, passes, planners or runtimes.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> len(model.ops), str(model.devices[0])
    (5, 'cuda:0')
"""

from __future__ import annotations

from placement.graph.causal_lm import from_causal_lm
from placement.graph.device import Device, DeviceLike
from placement.graph.loading import load
from placement.graph.model import Model, Op, Parameter
from placement.graph.saving import save, to_proto
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
    "from_causal_lm",
    "load",
    "save",
    "to_proto",
    "verify",
    "op_graph",
]
