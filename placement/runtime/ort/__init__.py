"""The ONNX Runtime executor: one ``InferenceSession`` per stage, on the stage's device.

- :mod:`~placement.runtime.ort.runner`: ``Runner``/``run``, building the stage sessions and
  following re-placements.
- :mod:`~placement.runtime.ort.program`: the compiled run of a ``Runner`` (typed stage,
  host-value and transfer steps over a value table).
- :mod:`~placement.runtime.ort.pipelined`: ``Runner(chunks=k)`` and ``Runner.stream`` on the
  shared micro-batch schedule (:mod:`placement.runtime.schedule`).
- :mod:`~placement.runtime.ort.sessions`: how a stage becomes a session (options, providers,
  a shared CUDA arena per GPU).
- :mod:`~placement.runtime.ort.layout` and :mod:`~placement.runtime.ort.boundaries`: stage
  models and boundaries that keep ONNX Runtime's blocked convolution layout across a cut.
- :mod:`~placement.runtime.ort.link_probe`: ``measure_links``, timing the executor's real
  copies between devices.

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
