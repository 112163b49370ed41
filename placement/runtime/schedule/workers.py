"""The workers that run the fill-drain schedule: one thread per stage, chained by FIFO queues.

:class:`StageWorkers` runs stage ``j`` of micro-batch ``i`` after stage ``j - 1`` finished it and
after it finished micro-batch ``i - 1`` itself: the clock-cycle order of
:func:`placement.runtime.schedule.clock.clock_cycles`, without a barrier per tick.
:func:`run_microbatches` runs a list of payloads through them; :func:`stream_microbatches` a stream,
with at most ``window`` in flight (back-pressure). An error in any stage stops the pipeline and
re-raises in the caller as :class:`placement.errors.PipelineError` naming the stage and micro-batch
(:func:`stage_error`); every worker thread is joined before the call returns or raises. With
``errors="yield"`` a failure stops only its own micro-batch: the later stages pass it by, and the
caller gets the error in that micro-batch's place, in order, while the pipeline goes on.

Example:
    >>> from placement.runtime.schedule.workers import run_microbatches
    >>> run_microbatches([lambda i, x: x + 1, lambda i, x: x * 10], [0, 1, 2])
    [10, 20, 30]
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from placement.errors import PipelineError

__all__ = [
    "ERRORS",
    "StageFn",
    "StageWorkers",
    "check_errors",
    "failed_payload",
    "run_microbatches",
    "stage_error",
    "stream_microbatches",
]

#: What a stream does when a request fails: ``"raise"`` (stop, raise) or ``"yield"`` (the error in its place).
ERRORS = ("raise", "yield")

_STOP = object()


@dataclass
class _Failure:
    stage: int
    microbatch: int
    error: BaseException


StageFn = Callable[[int, Any], Any]


def failed_payload(error: BaseException) -> Any:
    """A payload that stands for a request that failed before the first stage (bad inputs):
    with ``errors="yield"`` the stages pass it by and the caller gets ``error`` itself in its place."""
    return _Failure(-1, -1, error)


def check_errors(errors: str) -> str:
    """``errors`` checked: one of :data:`ERRORS`.

    Raises:
        InputError: anything else.
    """
    if errors not in ERRORS:
        from placement.errors import InputError

        raise InputError(f"errors must be 'raise' or 'yield', got {errors!r}")
    return errors


class StageWorkers:
    """One worker thread per stage, chained by FIFO queues: the fill-drain pipeline.

    ``stages[j](i, payload)`` runs stage ``j`` on micro-batch ``i`` and returns
    the payload handed to stage ``j + 1`` (the last stage's result is what
    :meth:`results` yields). Use as a context manager: leaving it stops and
    joins every worker, also on errors.

    Args:
        stages: the stage functions, in order.
        names: a readable name per stage (used in error messages and thread names).
        context: optional factory of a context manager each worker enters
            around its loop (thread-local state: grad mode, a CUDA stream).
        inline_last: run the last stage on the caller's thread, inside :meth:`result`
            (entering ``context`` around each call), instead of on a worker of its own.
            The caller waits in :meth:`result` anyway; on the CPU this saves a thread
            hand-off per micro-batch and a glibc malloc arena whose memory would be
            returned to the system and faulted in again every step.
        errors: ``"raise"`` (default): a failure stops the pipeline and :meth:`result` raises
            it; ``"yield"``: it stops only its micro-batch, whose :meth:`result` *returns* the
            error (a :class:`~placement.errors.PipelineError`, or for a
            :func:`failed_payload`, its own error), and the pipeline goes on.

    Example:
        >>> with StageWorkers([lambda i, x: x + 1, lambda i, x: x * 10], ["add", "mul"]) as workers:
        ...     for i in range(3):
        ...         workers.submit(i, i)
        ...     [workers.result() for _ in range(3)]
        [10, 20, 30]
    """

    def __init__(
        self,
        stages: Sequence[StageFn],
        names: Sequence[str] | None = None,
        *,
        context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        inline_last: bool = False,
        errors: str = "raise",
    ) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self._keep_going = check_errors(errors) == "yield"
        self._fns = list(stages)
        self.names = list(names) if names is not None else [f"stage {j}" for j in range(len(stages))]
        self._context = context
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(len(stages) + 1)]
        self._failed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pending = 0
        self._running = False
        #: the last stage runs on the caller's thread, in :meth:`result` (one thread fewer)
        self._inline = self._fns[-1] if inline_last else None
        self._workers = len(self._fns) - 1 if inline_last else len(self._fns)  # stages on threads
        self._final = self._queues[self._workers]  # what the caller reads: the last worker's output

    def __enter__(self) -> StageWorkers:
        self._running = True
        for j in range(self._workers):
            thread = threading.Thread(
                target=self._loop, args=(j,), name=f"placement-pipeline-{self.names[j]}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def usable(self) -> bool:
        """Whether the workers still run (not closed, no stage failed): :meth:`map` may be called."""
        return self._running and not self._failed.is_set()

    def map(self, payloads: Sequence[Any]) -> list[Any]:
        """Run every payload through the stages; the results in order. The workers stay up,
        so a caller that runs many batches pays for starting threads once."""
        for i, payload in enumerate(payloads):
            self.submit(i, payload)
        return [self.result() for _ in payloads]

    @property
    def in_flight(self) -> int:
        """Micro-batches submitted whose results were not taken yet."""
        return self._pending

    def submit(self, microbatch: int, payload: Any) -> None:
        """Hand micro-batch ``microbatch`` to the first stage."""
        if not self._running:
            raise RuntimeError("the pipeline is not running (use it as a context manager)")
        self._pending += 1
        self._queues[0].put((microbatch, payload))

    def result(self) -> Any:
        """The last stage's result for the oldest submitted micro-batch (blocks until it is there).

        Raises:
            PipelineError: a stage failed; names the stage and micro-batch.
        """
        if self._pending <= 0:
            raise RuntimeError("no micro-batch in flight")
        item = self._final.get()
        if isinstance(item, _Failure):
            self._pending = 0
            raise self._error(item)
        self._pending -= 1
        i, payload = item
        if isinstance(payload, _Failure):  # errors="yield": a failed micro-batch, in its place
            return payload.error if payload.stage < 0 else self._error(payload)
        if self._inline is None:
            return payload
        last = len(self._fns) - 1
        try:
            with self._context(last) if self._context is not None else contextlib.nullcontext():
                return self._inline(i, payload)
        except BaseException as err:  # noqa: BLE001 - re-raised naming the stage
            if self._keep_going and isinstance(err, Exception):
                return self._error(_Failure(last, i, err))
            self._failed.set()
            self._pending = 0
            raise self._error(_Failure(last, i, err)) from err

    def close(self) -> None:
        """Stop and join every worker (idempotent)."""
        if not self._running:
            return
        self._running = False
        self._failed.set()  # queued work is skipped, not run
        self._queues[0].put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _error(self, failure: _Failure) -> PipelineError:
        return stage_error(failure.stage, self.names[failure.stage], failure.microbatch, failure.error)

    def _loop(self, j: int) -> None:
        served = False
        try:
            with self._context(j) if self._context is not None else contextlib.nullcontext():
                self._serve(j)
                served = True
        except BaseException as err:  # noqa: BLE001 - entering or leaving the context: re-raised in the caller
            if not self._failed.is_set():
                self._failed.set()
                self._final.put(_Failure(j, -1, err))
            if not served:  # the stop has not passed this worker yet: pass it on when it comes
                self._drain(j)

    def _drain(self, j: int) -> None:
        """Skip what reaches worker ``j`` until the stop, and pass the stop on (a worker that
        could not enter its context still lets :meth:`close` join the ones after it)."""
        while self._queues[j].get() is not _STOP:
            pass
        if j + 1 < self._workers:
            self._queues[j + 1].put(_STOP)

    def _serve(self, j: int) -> None:
        fn = self._fns[j]
        q_in, q_out = self._queues[j], self._queues[j + 1]
        final = self._final
        while True:
            item = q_in.get()
            if item is _STOP:
                if j + 1 < self._workers:
                    q_out.put(_STOP)
                return
            if self._failed.is_set():
                continue
            i, payload = item
            if isinstance(payload, _Failure):  # errors="yield": failed earlier, passed by
                q_out.put(item)
                continue
            try:
                result = fn(i, payload)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller
                if self._keep_going and isinstance(err, Exception):
                    q_out.put((i, _Failure(j, i, err)))
                    continue
                if not self._failed.is_set():
                    self._failed.set()
                    final.put(_Failure(j, i, err))
                continue
            q_out.put((i, result))


def stage_error(stage: int, name: str, microbatch: int, err: BaseException) -> PipelineError:
    """The :class:`~placement.errors.PipelineError` for ``err`` raised by stage ``stage``
    (called ``name``) on micro-batch ``microbatch``; ``err`` is its cause.

    Example:
        >>> stage_error(1, "stage 1 on cpu", 3, ValueError("bad")).args[0]
        'pipeline stage 1 (stage 1 on cpu) failed on micro-batch 3: ValueError: bad'
    """
    message = (
        f"pipeline stage {stage} ({name}) failed on micro-batch {microbatch}: {type(err).__name__}: {err}"
    )
    error = PipelineError(message, stage=stage, microbatch=microbatch)
    error.__cause__ = err
    return error


def run_microbatches(
    stages: Sequence[StageFn],
    payloads: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
    inline_last: bool = False,
) -> list[Any]:
    """Run every payload through the stages in the fill-drain schedule; results in order.

    ``inline_last``: run the last stage on the caller's thread (see :class:`StageWorkers`).

    Example:
        >>> run_microbatches([lambda i, x: x * 2, lambda i, x: x + i], [1, 2, 3])
        [2, 5, 8]
    """
    with StageWorkers(stages, names, context=context, inline_last=inline_last) as workers:
        return workers.map(payloads)


def stream_microbatches(
    stages: Sequence[StageFn],
    payloads: Iterable[Any],
    *,
    window: int,
    names: Sequence[str] | None = None,
    context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
    inline_last: bool = False,
    errors: str = "raise",
) -> Iterator[Any]:
    """Yield the stages' results for a stream of payloads, in order, at most ``window`` in flight.

    The next payload is read from ``payloads`` only when fewer than ``window``
    are in the pipeline, so memory stays bounded however long the stream. A full
    window first drains to half (its results yielded as they come), then takes
    payloads until full again: the first stage's worker, which is often faster than
    the consumer, is handed a burst at a time instead of waking for every payload
    (each wake-up is a thread hand-off). ``inline_last``: the last stage runs in the
    consumer's thread (see :class:`StageWorkers`). The
    workers stop when the stream ends, when the consumer stops iterating
    (``close()`` on the generator) or on an error; with ``errors="yield"`` a failed
    payload's error is yielded in its place and the stream goes on (see :class:`StageWorkers`).

    Example:
        >>> list(stream_microbatches([lambda i, x: -x], iter(range(4)), window=2))
        [0, -1, -2, -3]
        >>> results = stream_microbatches([lambda i, x: 1 / x], [1, 0, 2], window=2, errors="yield")
        >>> [type(r).__name__ for r in results]
        ['float', 'PipelineError', 'float']
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    source = iter(payloads)
    low = window // 2  # a full window drains to here before the next payloads go in, together
    with StageWorkers(stages, names, context=context, inline_last=inline_last, errors=errors) as workers:
        i = 0
        while True:
            if workers.in_flight >= window:
                while workers.in_flight > low:
                    yield workers.result()
                continue
            try:
                payload = next(source)
            except StopIteration:
                break
            workers.submit(i, payload)
            i += 1
        while workers.in_flight:
            yield workers.result()
