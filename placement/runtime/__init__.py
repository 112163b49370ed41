"""Running a placed graph: two runtimes over one stage cut, one micro-batch schedule, device maps.

Shared by both runtimes:

- :mod:`~placement.runtime.stages`: cut a placed graph into per-device stages (an acyclic
  stage graph), with the transfers between them.
- :mod:`~placement.runtime.schedule`: the micro-batch schedule (``chunks=``, ``Runner.stream``,
  pipelined ``to_torch`` forward and backward): clock, batch axes, split/concat, stage workers.
- :mod:`~placement.runtime.device_map`: logical to physical devices (CUDA, GPUs shared in
  order, or CPU emulation).
- :mod:`~placement.runtime.precision`: whether fp32 goes through TF32 on a GPU (``precision=``)
  and the tolerance a check against the CPU uses.
- :mod:`~placement.runtime.inputs`: checking and converting user inputs (numpy, torch tensors
  and ``OrtValue`` s; device values kept on their device through DLPack).
- :mod:`~placement.runtime.calibrate`: ``calibrate``, plans re-balanced on the measured
  times of their stages: ONNX Runtime stage sessions, or (``runtime="torch"``) the lowered
  torch stages of :mod:`~placement.runtime.torch.timing`.

The runtimes:

- :mod:`~placement.runtime.ort`: the ONNX Runtime executor, ``Runner``/``run``, one session
  per stage (its runner, compiled program, pipelined runs, sessions, blocked-layout
  boundaries, and ``measure_links``, which times its copies between devices).
- :mod:`~placement.runtime.torch`: running lowered modules: ``to_torch`` (which assembles the
  translation of :mod:`placement.lowering` with execution), pipelined GPipe and 1F1B schedules,
  executors, train steps, streamed weights and the copy engine, CUDA graphs.

The runtimes sit side by side: neither imports the other; what both need lives here.

May import: ``placement.errors``, ``graph``, ``analysis``, ``passes``, ``planning``,
``lowering``.

Example:
    >>> import numpy as np
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.place_evenly(pl.from_torch(net, (x,)), 2)
    >>> (y,) = pl.run(model, [x.numpy()], device_map="cpu")
    >>> bool(np.allclose(y, net(x).detach().numpy(), atol=1e-5))
    True
"""

from __future__ import annotations

from placement.runtime.calibrate import Calibration, calibrate
from placement.runtime.device_map import PhysicalDevice, resolve_device_map
from placement.runtime.ort import Runner, RunnerStats, run
from placement.runtime.stages import Partition, Stage, partition, split_stages
from placement.runtime.torch import to_torch

__all__ = [
    "Calibration",
    "calibrate",
    "PhysicalDevice",
    "resolve_device_map",
    "Runner",
    "RunnerStats",
    "run",
    "Stage",
    "Partition",
    "partition",
    "split_stages",
    "to_torch",
]
