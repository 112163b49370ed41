"""Workers for stages that form a DAG: stages that do not depend on each other run at once.

The stages of a placed model form a DAG, not a chain: the branches of a tensor-parallel layer
(one stage per device, joined by an all-reduce) depend on each other only through what they
read. :class:`DagWorkers` gives every stage a worker thread of its own, as
:class:`~placement.runtime.schedule.workers.StageWorkers` does for a chain, but starts stage
``j`` on micro-batch ``i`` as soon as every stage it depends on finished ``i`` (and it finished
``i - 1`` itself): the branches of a layer compute at the same time, and with several
micro-batches the stages still pipeline. Each micro-batch's payload is one object every stage
of it receives (the stages' functions fill it in; what they return is not used); a micro-batch
is done when all its stages are. An error stops the run and re-raises in the caller as
:class:`~placement.errors.PipelineError` naming the stage and micro-batch; every worker is
joined before the call returns or raises. :attr:`DagWorkers.timeline` records when each
(stage, micro-batch) ran, on which thread.

Example:
    >>> from placement.runtime.schedule.dag import DagWorkers, dependents_of, graph_width
    >>> deps = [(), (), (0, 1)]                      # two branches, then their join
    >>> graph_width(deps), dependents_of(deps)
    (2, [[2], [2], []])
    >>> def branch(j):
    ...     return lambda i, env: env.update({j: env["x"] * (j + 1)})
    >>> join = lambda i, env: env.update(y=env[0] + env[1])
    >>> with DagWorkers([branch(0), branch(1), join], deps) as workers:
    ...     [env["y"] for env in workers.map([{"x": 1}, {"x": 10}])]
    [3, 30]
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from placement.errors import PipelineError
from placement.runtime.schedule.workers import StageFn, stage_error

__all__ = ["DagWorkers", "StageRun", "dependents_of", "graph_width", "topological_check"]

_STOP = object()


@dataclass(frozen=True)
class StageRun:
    """One (stage, micro-batch) a worker ran: ``start`` and ``end`` by ``time.perf_counter``."""

    stage: int
    microbatch: int
    start: float
    end: float
    thread: str


def topological_check(depends_on: Sequence[Sequence[int]]) -> None:
    """Raise ``ValueError`` unless every stage depends only on stages before it (a DAG in a
    topological order).

    Example:
        >>> topological_check([(), (0,)])
    """
    for j, deps in enumerate(depends_on):
        bad = [d for d in deps if not 0 <= d < j]
        if bad:
            raise ValueError(f"stage {j} depends on {bad}: stages must be in a topological order")


def dependents_of(depends_on: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per stage, the stages that depend on it, in order."""
    found: list[list[int]] = [[] for _ in depends_on]
    for j, deps in enumerate(depends_on):
        for d in sorted(set(deps)):
            found[d].append(j)
    return found


def graph_width(depends_on: Sequence[Sequence[int]], counted: Sequence[bool] | None = None) -> int:
    """The most stages at one depth of the stage graph (stage ``j`` depends on
    ``depends_on[j]``, stages in a topological order): how many can run at once. A chain
    has width 1. ``counted``: which stages count (e.g. those computing on the host).

    Example:
        >>> graph_width([(), (0,), (1,)]), graph_width([(), (), (0, 1)]), graph_width([(), ()], [True, False])
        (1, 2, 1)
    """
    depth: list[int] = []
    count: dict[int, int] = {}
    for j, deps in enumerate(depends_on):
        level = max((depth[d] for d in deps), default=-1) + 1
        depth.append(level)
        if counted is None or counted[j]:
            count[level] = count.get(level, 0) + 1
    return max(count.values(), default=0)


class DagWorkers:
    """A worker thread per stage; stage ``j`` runs micro-batch ``i`` once the stages it
    depends on finished ``i`` (see the module docstring). Use as a context manager.

    Args:
        stages: the stage functions ``fn(i, payload)``, in a topological order.
        depends_on: per stage, the indices of the stages it waits for.
        names: a readable name per stage (errors and thread names).
        context: optional factory of a context manager each worker enters around its loop
            (thread-local state: grad mode, an intra-op thread budget).
    """

    def __init__(
        self,
        stages: Sequence[StageFn],
        depends_on: Sequence[Sequence[int]],
        names: Sequence[str] | None = None,
        *,
        context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        if not stages or len(stages) != len(depends_on):
            raise ValueError("a DAG of stages needs one dependence list per stage, and a stage")
        topological_check(depends_on)
        self._fns = list(stages)
        self._deps = [len(set(d)) for d in depends_on]
        self._dependents = dependents_of(depends_on)
        self.names = list(names) if names is not None else [f"stage {j}" for j in range(len(stages))]
        self._context = context
        self._inboxes: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in stages]
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[int, list[int]] = {}  # micro-batch -> per stage, dependences not done
        self._left: dict[int, int] = {}  # micro-batch -> stages not done
        self._payloads: dict[int, Any] = {}
        self._order: list[int] = []  # micro-batches submitted, results not taken yet
        self._failed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._running = False
        #: every (stage, micro-batch) run so far, in the order they ended
        self.timeline: list[StageRun] = []

    def __enter__(self) -> DagWorkers:
        self._running = True
        for j in range(len(self._fns)):
            thread = threading.Thread(
                target=self._loop, args=(j,), name=f"placement-pipeline-dag-{self.names[j]}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def map(self, payloads: Sequence[Any]) -> list[Any]:
        """Run every payload through the stages; the payloads back, in order, once done."""
        for i, payload in enumerate(payloads):
            self.submit(i, payload)
        return [self.result() for _ in payloads]

    def submit(self, microbatch: int, payload: Any) -> None:
        """Hand micro-batch ``microbatch`` to the stages that depend on nothing."""
        if not self._running:
            raise RuntimeError("the workers are not running (use them as a context manager)")
        with self._lock:
            self._waiting[microbatch] = list(self._deps)
            self._left[microbatch] = len(self._fns)
            self._payloads[microbatch] = payload
            self._order.append(microbatch)
        for j, n in enumerate(self._deps):
            if n == 0:
                self._inboxes[j].put(microbatch)

    def result(self) -> Any:
        """The payload of the oldest submitted micro-batch, once all its stages ran.

        Raises:
            PipelineError: a stage failed; names the stage and micro-batch.
        """
        if not self._order:
            raise RuntimeError("no micro-batch in flight")
        item = self._done.get()
        if isinstance(item, PipelineError):
            self._order.clear()
            raise item
        i = self._order.pop(0)
        if item != i:  # pragma: no cover - every stage runs micro-batches in order
            raise RuntimeError(f"micro-batch {item} finished before {i}")
        return self._payloads.pop(i)

    def close(self) -> None:
        """Stop and join every worker (idempotent)."""
        if not self._running:
            return
        self._running = False
        self._failed.set()
        for inbox in self._inboxes:
            inbox.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _loop(self, j: int) -> None:
        try:
            with self._context(j) if self._context is not None else contextlib.nullcontext():
                self._serve(j)
        except BaseException as err:  # noqa: BLE001 - entering or leaving the context: no stage ran
            if not self._failed.is_set():
                self._failed.set()
                self._done.put(stage_error(j, self.names[j], -1, err))

    def _serve(self, j: int) -> None:
        fn, inbox = self._fns[j], self._inboxes[j]
        name = threading.current_thread().name
        while True:
            i = inbox.get()
            if i is _STOP:
                return
            if self._failed.is_set():
                continue
            start = time.perf_counter()
            try:
                fn(i, self._payloads[i])
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller
                if not self._failed.is_set():
                    self._failed.set()
                    self._done.put(stage_error(j, self.names[j], i, err))
                continue
            self.timeline.append(StageRun(j, i, start, time.perf_counter(), name))
            self._finished(j, i)

    def _finished(self, j: int, i: int) -> None:
        ready = []
        with self._lock:
            waiting = self._waiting[i]
            for d in self._dependents[j]:
                waiting[d] -= 1
                if waiting[d] == 0:
                    ready.append(d)
            self._left[i] -= 1
            done = self._left[i] == 0
            if done:
                del self._waiting[i], self._left[i]
        for d in ready:
            self._inboxes[d].put(i)
        if done:
            self._done.put(i)
