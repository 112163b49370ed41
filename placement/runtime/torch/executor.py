"""Who runs a torch pipeline's stages: a thread per stage, or the caller's thread alone.

``pl.to_torch(model, chunks=k, executor=...)`` chooses how the stages of a
:class:`~placement.runtime.torch.pipelined.PipelinedModule` run, for its
forward, its GPipe backward and ``train_step`` (1F1B):

* ``"threads"``: one worker thread per stage (the last stage on the caller's
  thread). Stages compute at the same time where the *host* computes them (stages
  on the CPU, one core each), but every micro-batch is handed from thread to
  thread, and every tiny torch op releases and re-takes the GIL: with two busy
  threads each op can become a hand-off between cores (a futex wake and a context
  switch), several times the op's own cost.
* ``"inline"``: the caller's thread runs every stage in the same schedule order
  (the fill-drain clock for GPipe, each stage's next ready task in turn for
  1F1B), as ``torch.distributed.pipelining`` runs several local stages. On a GPU
  nothing is lost: kernels are asynchronous and each stage still queues its work
  on its own CUDA stream, ordered by events, so the stages overlap on the device.
  On the CPU the stages then run one after another, without hand-offs.
* ``"auto"`` (the default): ``"threads"`` when at least two stages compute on
  the host and the biggest of them does at least :data:`THREADS_MIN_MACS` (2**25)
  multiply-adds per micro-batch (rows x parameter elements, as
  :func:`~placement.runtime.torch.one_f_one_b.defer_pays` counts them), on a
  machine with more than one core; ``"inline"`` otherwise (GPU stages, tiny CPU stages).

Outputs and gradients are the same bit for bit whichever runs: the work per
(stage, micro-batch) is the same, and gradients are summed in micro-batch order.
``module.stats.executor`` says which one the last step used.

Example:
    >>> import torch
    >>> from placement.runtime.torch.executor import check_executor, choose_executor
    >>> check_executor("auto")
    'auto'
    >>> choose_executor("auto", [("cpu", 64), ("cpu", 64)], rows=4)
    'inline'
    >>> choose_executor("auto", [("cpu", 1 << 20), ("cpu", 1 << 20)], rows=64, cores=2)
    'threads'
    >>> choose_executor("auto", [("cuda", 1 << 30), ("cuda", 1 << 30)], rows=64)
    'inline'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from placement.errors import InputError
from placement.runtime.torch.stage_exec import TorchStage

__all__ = [
    "EXECUTORS",
    "THREADS_MIN_MACS",
    "check_executor",
    "choose_executor",
    "input_rows",
    "stage_executor",
]

#: The ``executor=`` choices of a pipelined torch module.
EXECUTORS = ("auto", "threads", "inline")

#: Least multiply-adds (rows x parameter elements) of one micro-batch through one host
#: stage at which ``executor="auto"`` runs the stages on threads of their own. Each
#: micro-batch a thread hands on, and each tiny op while two threads are busy, waits for a
#: core to wake the other thread: microseconds on an idle machine, milliseconds on a busy
#: one. ``benchmarks/pipeline_fixed_cost.py --crossover`` (1F1B, two stages of
#: ``Linear(d, d)``, 16 rows per micro-batch) on an idle 2-core CPU: threads 0.76x at 2.1e6,
#: 1.19x at 8.4e6, 1.68x at 3.4e7 multiply-adds per micro-batch per stage; under load
#: (load average 15) still 0.63x at 3.4e7. The bench-size GPT and ResNet stages of
#: ``benchmarks/pipeline.py`` (about 1e9) gain from threads. Picking one thread where threads
#: would have paid costs at most their speed-up (under 2x on 2 stages); picking threads where
#: they do not can cost far more, so the bar sits high: 2**25.
THREADS_MIN_MACS = 1 << 25


def check_executor(executor: str) -> str:
    """``executor`` checked: one of :data:`EXECUTORS`.

    Raises:
        InputError: anything else (a :class:`~placement.errors.PlacementError` and a ``ValueError``).

    Example:
        >>> check_executor("threads")
        'threads'
    """
    if executor not in EXECUTORS:
        raise InputError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    return executor


def input_rows(inputs: Sequence[Any], chunks: int) -> int:
    """Rows one micro-batch of ``inputs`` carries: the most over the tensors of their
    elements over the last axis (floating point: features on the last axis) or of all
    their elements (integers: token ids, each a row of the embedding's output), split
    ``chunks`` ways.

    Example:
        >>> import torch
        >>> input_rows([torch.zeros(64, 8)], 16), input_rows([torch.zeros(8, 128, dtype=torch.long)], 2)
        (4, 512)
    """
    rows = 1
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            rows = max(rows, t.numel() // max(1, t.shape[-1]) if t.is_floating_point() else t.numel())
    return max(1, -(-rows // max(1, chunks)))


def choose_executor(
    executor: str, stages: Sequence[tuple[str, int]], *, rows: int, cores: int | None = None
) -> str:
    """``"threads"`` or ``"inline"`` for ``executor`` (``"auto"`` resolved; see the module
    docstring) and ``stages``: per stage, its device type and its parameter elements;
    ``rows``: a micro-batch's rows (:func:`input_rows`).

    Example:
        >>> choose_executor("threads", [("cuda", 1)], rows=1)
        'threads'
    """
    if check_executor(executor) != "auto":
        return executor
    host = [elements for device_type, elements in stages if device_type == "cpu"]
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if len(host) < 2 or cores < 2:
        return "inline"
    return "threads" if rows * max(host) >= THREADS_MIN_MACS else "inline"


def stage_executor(executor: str, stages: Sequence[TorchStage], inputs: Sequence[Any], chunks: int) -> str:
    """:func:`choose_executor` for a pipelined module's ``stages`` on a call's ``inputs``
    cut into ``chunks`` micro-batches (each stage's parameter elements counted)."""
    if check_executor(executor) != "auto":
        return executor
    per_stage = [
        (s.device.type, sum(v.numel() for v in s.consts.values() if isinstance(v, torch.Tensor)))
        for s in stages
    ]
    return choose_executor(executor, per_stage, rows=input_rows(inputs, chunks))
