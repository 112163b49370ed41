"""Running lowered modules: ``pl.to_torch`` and everything that executes what it builds.

:mod:`.lower` is ``to_torch``: it assembles the translation of :mod:`placement.lowering`
(ONNX -> ``torch.fx``) with execution, and gives the translation its streamed-weight seam
(:meth:`placement.lowering.emit.Emitter.new_streamer`). Beside it:

* the lowered module itself: :mod:`.input_check` (inputs checked as ``Runner`` checks them),
  :mod:`.outputs` (outputs handed back on the first tensor input's device, ``outputs_on=``),
  :mod:`.pickled` (the module class that keeps those hooks through ``torch.save``);
* pipelines over micro-batches: :mod:`.pipelined` (GPipe, ``to_torch(chunks=k)``),
  :mod:`.stage_split` and :mod:`.stage_exec` (one stage, shared by GPipe and 1F1B),
  :mod:`.executor` (a thread per stage or the caller's thread), :mod:`.reentrant` and
  :mod:`.engine_grad` (backward without blocking an autograd device thread),
  :mod:`.one_f_one_b` + :mod:`.weight_grads` (1F1B with deferred weight gradients),
  :mod:`.train_step` + :mod:`.step_loss` (``pl.train_step``), :mod:`.traced` (stages as
  TorchScript traces), :mod:`.timing` (each stage alone, for ``calibrate(runtime="torch")``);
* GPU machinery: :mod:`.streaming` (streamed weights: the window and its schedule),
  :mod:`.stream_release`, :mod:`.copy_engine` (CUDA streams and events),
  :mod:`.copy_emulation` (late, out-of-order, poisoned copies on the CPU),
  :mod:`.cuda_graphs` and :mod:`.stage_graphs` (CUDA graphs, whole module or per stage).

May import: the layers below ``placement.runtime`` (``lowering`` included) and the shared
modules of ``placement.runtime`` (``stages``, ``device_map``, ``precision``, ``inputs``,
``schedule``); never :mod:`placement.runtime.ort`.
"""

from __future__ import annotations

from placement.runtime.torch.lower import to_torch
from placement.runtime.torch.train_step import train_step

__all__ = ["to_torch", "train_step"]
