"""Run a program's stages as a DAG: stages that do not depend on each other run at once.

The stages of a placed model form a DAG, not a chain: the branches of a tensor-parallel layer
(one per device, joined by an all-reduce) or parallel branches placed on different devices
depend on each other only through their inputs. :class:`ConcurrentRun` walks a
:class:`~placement.runtime.ort.program.Program`'s steps in dependence order instead of list
order: a step starts when the steps that make what it reads are done; ready stage steps run on
a pool of worker threads (ONNX Runtime releases the GIL while a session runs), each session
with its own intra-op thread budget; transfers run on the caller's thread. A value is dropped
when its last reader is done (reference counts, since readers finish in any order). Outputs are
those of the sequential walk, bit for bit: each stage computes the same thing from the same
inputs, whatever ran beside it.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
    >>> runner = pl.Runner(model, device_map={0: "cpu", 1: "cpu"}, fold=False)
    >>> runner.program.concurrent is not None
    True
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from placement.errors import PlacementError
from placement.runtime.ort.steps import HostStep, StageStep, Step, TransferStep

if TYPE_CHECKING:
    from placement.runtime.ort.program import Program

__all__ = ["ConcurrentRun", "step_reads", "step_writes", "stage_width"]

log = logging.getLogger(__name__)


def step_reads(step: Step) -> list[str]:
    """The value-table keys a step reads."""
    if isinstance(step, TransferStep):
        return [step.source]
    return [key for _, key in step.bind]


def step_writes(step: Step) -> list[str]:
    """The value-table keys a step writes."""
    if isinstance(step, TransferStep):
        return [step.target]
    return list(step.outputs)


@dataclass
class ConcurrentRun:
    """A program's steps with their dependences, run as a DAG (see the module docstring).

    Attributes:
        program: the program (its feeds and outputs).
        steps: its steps, without their list-order frees.
        deps: per step, how many steps it waits for.
        dependents: per step, the steps waiting for it.
        readers: per key, how many steps read it.
        keep: keys never dropped (graph outputs, streamed parameters).
        width: the most stage steps that can run at once (one worker each).
    """

    program: Program
    steps: list[Step]
    deps: list[int]
    dependents: list[list[int]]
    readers: dict[str, int]
    keep: frozenset[str]
    width: int

    @classmethod
    def of(cls, program: Program) -> ConcurrentRun | None:
        """The concurrent form of ``program``, or None where no two stages may run at once."""
        steps = [replace(step, free=()) for step in program.steps]
        maker: dict[str, int] = {}
        deps: list[set[int]] = []
        readers: dict[str, int] = {}
        for i, step in enumerate(steps):
            mine = set()
            for key in step_reads(step):
                readers[key] = readers.get(key, 0) + 1
                if key in maker:
                    mine.add(maker[key])
            deps.append(mine)
            for key in step_writes(step):
                maker[key] = i
        width = _width(steps, deps)
        if width < 2:
            return None
        dependents: list[list[int]] = [[] for _ in steps]
        for i, mine in enumerate(deps):
            for j in mine:
                dependents[j].append(i)
        keep = frozenset(key for key, const in program.outputs if const is None) | frozenset(program.resident)
        return cls(program, steps, [len(d) for d in deps], dependents, readers, keep, width)

    def run(self, arrays: list[Any], kind: str = "numpy") -> list[Any]:
        """One whole run: the graph outputs, as :meth:`Program.run` gives them."""
        values = self.program.feed(arrays)
        waiting = list(self.deps)
        refs = dict(self.readers)
        finished: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()
        ready = [i for i, n in enumerate(waiting) if n == 0]
        pending = len(self.steps)
        in_flight = 0
        pool = _pool(self)

        def work(i: int) -> None:
            try:
                self.steps[i].run(values)
            except BaseException as err:  # handed to the caller's thread
                finished.put((i, err))
            else:
                finished.put((i, None))

        def complete(i: int) -> None:
            for key in step_reads(self.steps[i]):
                refs[key] -= 1
                if not refs[key] and key not in self.keep:
                    values.pop(key, None)
            for j in self.dependents[i]:
                waiting[j] -= 1
                if not waiting[j]:
                    ready.append(j)

        while pending:
            transfers = [i for i in ready if isinstance(self.steps[i], TransferStep)]
            if transfers:  # cheap: on the caller's thread, before any stage starts
                ready[:] = [i for i in ready if i not in transfers]
                for i in transfers:
                    self.steps[i].run(values)
                    pending -= 1
                    complete(i)
                continue
            stages, ready[:] = list(ready), []
            for i in stages[1:]:
                pool.submit(work, i)
            in_flight += len(stages)
            if stages:
                work(stages[0])  # the caller's thread runs one stage itself
            if not in_flight:
                raise PlacementError(f"{pending} steps wait for steps that never run (a cycle)")
            while True:
                i, err = finished.get()
                in_flight -= 1
                if err is not None:
                    while in_flight:  # let the others finish before raising
                        finished.get()
                        in_flight -= 1
                    raise err
                pending -= 1
                complete(i)
                if ready or not in_flight:
                    break
        return self.program.collect(values, kind)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(run: ConcurrentRun) -> ThreadPoolExecutor:
    """A shared pool with at least ``run.width - 1`` workers (the caller runs one stage)."""
    need = max(1, run.width - 1)
    with _POOLS_LOCK:
        pool = _POOLS.get(need)
        if pool is None:
            pool = _POOLS[need] = ThreadPoolExecutor(max_workers=need, thread_name_prefix="placement-stage")
        return pool


def _width(steps: list[Step], deps: list[set[int]]) -> int:
    """The largest number of stage steps at one depth of the dependence DAG (a lower bound
    of what can run at once, enough to tell a chain from a DAG)."""
    depth: list[int] = []
    count: dict[int, int] = {}
    for i, step in enumerate(steps):
        level = max((depth[j] for j in deps[i]), default=0) + (0 if isinstance(step, TransferStep) else 1)
        depth.append(level)
        if isinstance(step, (StageStep, HostStep)):
            count[depth[i]] = count.get(depth[i], 0) + 1
    return max(count.values(), default=0)


def stage_width(depends_on: list[tuple[int, ...]]) -> int:
    """The most stages at one depth of a stage graph (stage ``i`` depends on
    ``depends_on[i]``, stages in a topological order): how many could run at once."""
    depth: list[int] = []
    count: dict[int, int] = {}
    for deps in depends_on:
        level = max((depth[j] for j in deps), default=-1) + 1
        depth.append(level)
        count[level] = count.get(level, 0) + 1
    return max(count.values(), default=0)
