"""Backward inside the autograd engine: when the pipelined backward must not use its workers.

PyTorch's autograd engine runs the backward of CPU work on the thread that called
``backward`` (or ``torch.autograd.grad``), but the backward of work on a GPU on
*one engine thread per device*, which the engine started (not Python). A custom
``autograd.Function`` whose output lives on ``cuda:0`` therefore has its
``backward`` called on the ``cuda:0`` engine thread. If that ``backward`` hands
work to other threads that call ``torch.autograd.grad`` on ``cuda:0`` stages and
waits for them, the engine queues their work for the ``cuda:0`` thread, which is
the one waiting: a deadlock (the CPU can never show it, its backward runs in the
caller's thread).

A ``torch.autograd.grad`` called *from* an engine thread, on the other hand, is a
reentrant backward: the engine runs it on that thread and, while it waits for work
on other devices, keeps serving that thread's queue. That is how reentrant
checkpointing works, and it is what the pipelined backward does there:

* :func:`on_engine_thread`: is this an engine thread (a thread Python did not
  start)? Then the pipelined backward runs every (stage, micro-batch) itself, with
  :func:`run_in_order` in the fill-drain schedule's order; it never blocks the
  thread waiting on another thread. On a GPU the kernels it launches are
  asynchronous, and each backward op runs on the stream of its forward op (the
  stage's stream), so GPUs still overlap.
* otherwise (the CPU, or a backward rooted in CPU work) it is the caller's own
  thread, which no other thread's ``torch.autograd.grad`` ever needs: the stages'
  backward run on the pipeline's workers, as their forward did.

Example:
    >>> on_engine_thread()
    False
    >>> run_in_order([lambda i, x: x + [("a", i)], lambda i, x: x + [("b", i)]],
    ...              ["a", "b"], [[], []])
    [[('a', 0), ('b', 0)], [('a', 1), ('b', 1)]]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from placement.runtime.schedule import clock_cycles, stage_error

__all__ = ["on_engine_thread", "run_in_order"]


def on_engine_thread() -> bool:
    """Whether the calling thread was started outside Python's ``threading``: an autograd
    engine device thread when called from a ``backward`` (any foreign thread otherwise,
    where running inline is merely the safe choice).

    Example:
        >>> on_engine_thread()
        False
    """
    return isinstance(threading.current_thread(), threading._DummyThread)


def run_in_order(
    stages: Sequence[Callable[[int, Any], Any]],
    names: Sequence[str],
    payloads: Sequence[Any],
    *,
    ids: Sequence[int] | None = None,
    context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> list[Any]:
    """Run ``payloads[i]`` through ``stages`` on this thread, in the fill-drain order.

    The counterpart of :class:`placement.runtime.schedule.StageWorkers` without threads:
    at tick ``t`` stage ``j`` runs micro-batch ``t - j`` (:func:`clock_cycles`), stage
    ``j``'s result handed to stage ``j + 1``; stages are called with ``ids[i]`` (default
    ``i``), the number errors name. ``context(j)`` is entered around each call of stage
    ``j``. Returns the last stage's results in the order of ``payloads``.

    Raises:
        PipelineError: a stage failed; names the stage and micro-batch (its cause chained).

    Example:
        >>> run_in_order([lambda i, x: x * 10], ["times ten"], [1, 2])
        [10, 20]
    """
    current = list(payloads)
    if not current:
        return []
    numbers = list(ids) if ids is not None else list(range(len(current)))
    for tick in clock_cycles(len(current), len(stages)):
        for i, j in tick:
            try:
                with context(j) if context is not None else contextlib.nullcontext():
                    current[i] = stages[j](numbers[i], current[i])
            except BaseException as err:  # noqa: BLE001 - re-raised naming the stage
                raise stage_error(j, names[j], numbers[i], err) from err
    return current
