"""The ONNX Runtime executor: one ``InferenceSession`` per stage, on the stage's device.

Data flow (precomputed at construction, so a run is a short loop):

* graph inputs become ``OrtValue`` s on the device they are fed on;
* each stage runs on ``OrtValue`` s, so activations stay on the device between
  stages: a GPU stage with ``InferenceSession.run_with_iobinding``, inputs bound
  with ``bind_ortvalue_input`` and outputs with ``bind_output(name, "cuda",
  device_id)``; a CPU stage with one call of the session's native
  ``run_with_ort_values`` (no binding to set up and clear per run); see
  :class:`placement.runtime.ort.steps.StageStep`;
* a BatchNormalization that a cut separated from its Conv runs, in a CPU stage's
  session, as the equivalent depthwise Conv, so ONNX Runtime keeps its blocked
  layout and Add+Relu fusion after the cut (:mod:`placement.runtime.ort.layout`);
* a dynamic copy is a *transfer*, not a session op: the blob is moved to the
  destination device (see :func:`placement.runtime.ort.values.transfer_kind`): nothing to do between two
  logical devices on one physical GPU (the value is shared), a device-to-device
  ``onnxruntime.copy_tensors`` between two GPUs (falling back, once logged, to
  a host round trip when this onnxruntime build has no such data transfer), a
  host <-> GPU copy, or, between logical devices emulated on the CPU, nothing
  either (they all live in host memory, and no session writes what it is fed);
* where a blob passes between two CPU stages' convolutions it stays in ONNX
  Runtime's blocked layout (``keep_layout``, :mod:`placement.runtime.ort.boundaries`):
  no conversion out of it at the end of one stage and back in at the start of the next;
* static copies (of parameters) need nothing at run time: each stage carries
  the parameters it reads as initializers, so they reach its device once, when
  its session loads (never through a protobuf: the stage's proto holds only its
  graph and each weight is handed to ONNX Runtime as an ``OrtValue`` over the
  model's own, possibly memory-mapped, array, so a stage of any size loads and
  a weight is read only by the stage that uses it); values computed from parameters alone (a transposed
  weight) are recomputed at load time by the stages that read them (see
  :mod:`placement.runtime.stages`), never moved per run;
* every intermediate value is dropped after its last use (as torch.fx's
  ``Interpreter`` does); outputs come back as numpy arrays in graph-output order.

Copies: a model with explicit copies (``inject_cross_device_copies``) runs with
exactly those transfers. A model without them, or whose copies went stale after
ops moved, runs as if copies were injected on a private copy: every
cross-device edge gets an implicit transfer (one per blob and destination
device) and a copy whose ends now share a device costs nothing. The user's
model is never modified.

- :mod:`~placement.runtime.ort.runner`: ``Runner``/``run``, building the stage sessions and
  following re-placements.
- :mod:`~placement.runtime.ort.program`: the compiled run of a ``Runner`` (a program of
  steps, its native CPU form, the compiler).
- :mod:`~placement.runtime.ort.steps`: the typed stage, host-value and transfer steps over a
  value table.
- :mod:`~placement.runtime.ort.values`: ``OrtValue`` s on devices: transfer kinds, moves,
  graph inputs placed, outputs handed back owning their memory, host copies counted.
- :mod:`~placement.runtime.ort.pipelined`: ``Runner(chunks=k)`` and ``Runner.stream`` on the
  shared micro-batch schedule (:mod:`placement.runtime.schedule`).
- :mod:`~placement.runtime.ort.sessions`: how a stage becomes a session (options, providers,
  a shared CUDA arena per GPU).
- :mod:`~placement.runtime.ort.layout` and :mod:`~placement.runtime.ort.boundaries`: stage
  models and boundaries that keep ONNX Runtime's blocked convolution layout across a cut.
- :mod:`~placement.runtime.ort.link_probe`: ``measure_links``, timing the executor's real
  copies between devices.

May import: the layers below ``placement.runtime`` and the shared modules of ``placement.runtime``
(``stages``, ``device_map``, ``precision``, ``inputs``, ``schedule``); never
:mod:`placement.runtime.torch`.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.runtime.ort import Runner
    >>> net, (x,) = mlp.build("tiny")
    >>> Runner(pl.from_torch(net, (x,)), device_map="cpu").run([x])[0].shape
    (4, 8)
"""

from __future__ import annotations

from placement.runtime.ort.runner import Runner, RunnerStats, run

__all__ = ["Runner", "RunnerStats", "run"]
