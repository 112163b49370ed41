"""Lowering a placed model to PyTorch (``pl.to_torch``).

``lower`` walks the ONNX graph and builds a ``torch.fx.GraphModule`` (with
``values``, ``opset``, ``emit``, ``walker`` and ``bodies`` beneath it); ``ops`` is
the per-op-type rule table (lowering, flags and FLOP cost of every op type, one
module per op family). ``pipelined`` runs the lowered module's stages over
micro-batches (``to_torch(chunks=k)``), ``one_f_one_b`` trains through them
(1F1B, with ``weight_grads`` deferring weight gradients; ``stage_exec`` runs one
stage for both) and ``train_step`` is ``pl.train_step``, pipelined or not; ``meta``
names the ``fx.Node.meta`` keys the lowering writes, ``traced`` runs a stage as TorchScript
traces, ``timing`` runs each stage alone for ``calibrate(runtime="torch")``,
``cuda_graphs`` replays the lowered module's GPU segments as CUDA graphs
(``to_torch(cuda_graphs=True)``), ``outputs`` hands a call's outputs back on its first
tensor input's device (``to_torch(outputs_on=...)``), ``pickled`` is the lowered module's
class, which keeps those hooks and the input check through ``torch.save``/``torch.load``.
Imports: the layers below ``placement.runtime`` and its ``device_map``,
``stages`` and ``pipeline`` modules.
"""

from __future__ import annotations

from placement.runtime.torch.lower import to_torch
from placement.runtime.torch.train_step import train_step

__all__ = ["to_torch", "train_step"]
