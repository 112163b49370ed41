"""The micro-batch schedule both runtimes share: GPipe's fill-drain over stage workers.

A placed model cut into stages ``0 .. N-1`` (one per device segment, see
:mod:`placement.runtime.stages`) runs a mini-batch split into ``k``
*micro-batches* in GPipe's fill-drain schedule: at clock tick ``t`` stage ``j``
works on micro-batch ``t - j``, so after ``N - 1`` ticks of filling every stage
is busy on a different micro-batch (see :func:`clock_cycles`). The idle share
of the stage-time grid, the *bubble*, is ``(N - 1) / (k + N - 1)``
(:func:`bubble_fraction`).

The schedule is executed by :class:`StageWorkers`: one worker thread per stage,
stage ``j`` reading micro-batches from a FIFO queue that stage ``j - 1`` fills.
Each worker takes the next micro-batch as soon as its predecessor hands it
over, so stage ``j`` runs micro-batch ``i`` after stage ``j - 1`` finished it
and after it finished micro-batch ``i - 1`` itself: exactly the clock-cycle
order, without a barrier per tick. The number of micro-batches in flight is
bounded (a window), so a stream of inputs never grows memory without bound
(back-pressure: the next input is read only when an output was taken). An
error in any stage stops the pipeline and re-raises in the caller as
:class:`placement.errors.PipelineError` naming the stage and micro-batch; every
worker thread is joined before the call returns or raises.

The ONNX Runtime executor (:class:`placement.runtime.ort.Runner` with
``chunks=k`` and :meth:`~placement.runtime.ort.Runner.stream`, see
:mod:`placement.runtime.ort.pipelined`) and the torch lowering
(``to_torch(model, chunks=k)``, forward *and* backward) both run on these
workers. Micro-batches are cut along each input's *batch axis*
(:func:`batch_axes`) with :func:`split_batch` and outputs are joined with
:func:`concat_batch`.

- :mod:`~placement.runtime.schedule.clock`: the clock ticks, the bubble, threads per stage,
  the ``chunks`` check.
- :mod:`~placement.runtime.schedule.axes`: the batch axis of every graph input and output.
- :mod:`~placement.runtime.schedule.split`: micro-batch bounds, split and concatenation.
- :mod:`~placement.runtime.schedule.workers`: the stage worker threads.

Example:
    >>> from placement.runtime.schedule import clock_cycles, bubble_fraction
    >>> for tick in clock_cycles(3, 2):
    ...     print(tick)
    [(0, 0)]
    [(1, 0), (0, 1)]
    [(2, 0), (1, 1)]
    [(2, 1)]
    >>> round(bubble_fraction(8, 2), 3)
    0.111
"""

from __future__ import annotations

from placement.runtime.schedule.axes import BatchAxes, batch_axes
from placement.runtime.schedule.clock import (
    CHECKPOINT_MODES,
    bubble_fraction,
    check_chunks,
    clock_cycles,
    stage_threads,
)
from placement.runtime.schedule.split import concat_batch, microbatch_bounds, split_batch
from placement.runtime.schedule.workers import (
    StageFn,
    StageWorkers,
    run_microbatches,
    stage_error,
    stream_microbatches,
)

__all__ = [
    "CHECKPOINT_MODES",
    "BatchAxes",
    "StageFn",
    "StageWorkers",
    "batch_axes",
    "bubble_fraction",
    "check_chunks",
    "clock_cycles",
    "concat_batch",
    "microbatch_bounds",
    "run_microbatches",
    "split_batch",
    "stage_error",
    "stage_threads",
    "stream_microbatches",
]
