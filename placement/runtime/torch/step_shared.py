"""What the stage loops of one ``train_step`` share (:mod:`.one_f_one_b`): the inboxes, the
deferred weight gradients, the per-micro-batch losses, and where each stage hands its work on.

Stages hand a micro-batch's forward to the next stage and its backward to the one before
(a chain), or, when stages that do not depend on each other run at once
(:mod:`placement.runtime.torch.concurrent`), to every stage that reads from them once that
stage's other inputs are in (a DAG): :meth:`StepShared.forward_done` and
:meth:`StepShared.backward_done`.

Example:
    >>> from placement.runtime.torch.step_shared import STOP
    >>> STOP is not None
    True
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from placement.runtime.schedule.dag import dependents_of
from placement.runtime.torch.concurrent import Concurrency, GradJoin
from placement.runtime.torch.stage_exec import StepStats, TorchStage, accumulate_microbatch
from placement.runtime.torch.step_loss import LossFn
from placement.runtime.torch.weight_grads import DeferredWeights

__all__ = ["STOP", "Pending", "StepShared"]

STOP = object()


@dataclass
class Pending:
    """Micro-batch ``microbatch``'s deferred weight gradients on stage ``stage``, not all claimed."""

    stage: int
    microbatch: int
    later: DeferredWeights


@dataclass
class StepShared:
    """What the stage loops of one step share; ``lock`` guards the pool and the gradients."""

    stages: list[TorchStage]
    input_keys: set[str]  # env keys of the graph inputs: data, never differentiated
    output_keys: list[str]  # env keys of the model's outputs, which the loss reads
    checkpoint: str
    envs: list[dict[str, Any]]
    targets: list[list[Any]]
    weights: list[float]
    loss_fn: LossFn
    outputs_device: torch.device | None  # where loss_fn gets the outputs (None: the last stage's)
    defer: bool | str  # True, False or "auto" (see :func:`defer_pays`)
    limit: int
    inboxes: list[queue.SimpleQueue[Any]]
    params: list[list[tuple[int, str]]]  # per stage: (argument slot, key) of its trainable parameters
    stats: StepStats
    tracked: Callable[[str], bool] = field(default=lambda key: True)  # env keys that take gradients
    inline: bool = False  # one thread runs every stage: nobody to wake
    loops: list[Any] = field(default_factory=list)  # inline: the stage loops, handed messages directly
    failed: threading.Event = field(default_factory=threading.Event)
    failures: list[tuple[int, int, BaseException]] = field(default_factory=list)
    losses: list[torch.Tensor | None] = field(default_factory=list)
    loss_events: dict[int, Any] = field(default_factory=dict)  # behind each loss, on its stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: deferred weight gradients waiting for a worker, oldest first
    pool: deque[Pending] = field(default_factory=deque)
    #: backwards not run yet, all stages together (while > 0, new weight gradients may come)
    backwards_left: int = 0
    #: (stage, micro-batch) -> its parameter gradients so far / its groups not finished yet
    results: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    unfinished: dict[tuple[int, int], int] = field(default_factory=dict)
    #: per stage: the next micro-batch whose gradients go into the sums, the sums, and which
    #: of the sums are accumulators made here (added to in place)
    flushed: list[int] = field(default_factory=list)
    param_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    owned: list[set[str]] = field(default_factory=list)
    #: the DAG run (None: a chain); per micro-batch its gradients; per (stage, micro-batch)
    #: the stages it still waits for, forward and backward
    plan: Concurrency | None = None
    joins: list[GradJoin] = field(default_factory=list)
    waiting: dict[tuple[str, int, int], int] = field(default_factory=dict)
    dependents: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.plan is None:
            return
        deps = self.plan.depends_on
        self.dependents = dependents_of(deps)
        self.joins = [GradJoin({}) for _ in self.envs]
        for j, mine in enumerate(deps):
            for i in range(len(self.envs)):
                self.waiting["F", j, i] = len(mine)
                self.waiting["B", j, i] = len(self.dependents[j])

    def first(self, j: int) -> bool:
        """Whether stage ``j`` reads no other stage (its forwards are ready from the start)."""
        return j == 0 if self.plan is None else not self.plan.depends_on[j]

    def forward_done(self, j: int, i: int, env: dict[str, Any]) -> None:
        """Stage ``j`` ran micro-batch ``i``'s forward: hand it to the stage after (a chain) or
        to each stage reading from ``j`` whose other inputs are in (a DAG)."""
        if self.plan is None:
            self.post(j + 1, ("F", i, env))
            return
        for d in self._ready("F", self.dependents[j], i):
            self.post(d, ("F", i, env))

    def backward_done(self, j: int, i: int, genv: dict[str, Any]) -> None:
        """Stage ``j`` ran micro-batch ``i``'s backward: hand its gradients to the stage before
        (a chain) or to each stage it read from once all their readers ran theirs (a DAG)."""
        if self.plan is None:
            if j > 0:
                self.post(j - 1, ("B", i, genv))
            return
        for d in self._ready("B", self.plan.depends_on[j], i):
            self.post(d, ("B", i, None))

    def _ready(self, kind: str, stages: Any, i: int) -> list[int]:
        ready = []
        with self.lock:
            for d in stages:
                self.waiting[kind, d, i] -= 1
                if not self.waiting[kind, d, i]:
                    ready.append(d)
        return ready

    def fail(self, stage: int, microbatch: int, err: BaseException) -> None:
        with self.lock:
            self.failures.append((stage, microbatch, err))
        self.failed.set()
        self.wake(STOP)

    def post(self, j: int, message: tuple[str, int, Any]) -> None:
        """Hand stage ``j`` a forward (``"F"``) or backward (``"B"``) micro-batch."""
        if self.inline:
            self.loops[j].file(message)
        else:
            self.inboxes[j].put(message)

    def wake(self, message: Any = None, *, exclude: int = -1) -> None:
        """Tell every worker but ``exclude`` that something changed (new weight gradients,
        the end, a failure)."""
        if self.inline:
            return
        for j, inbox in enumerate(self.inboxes):
            if j != exclude:
                inbox.put(("W", -1, None) if message is None else message)

    def finish(self, stage: int, microbatch: int, grads: list[tuple[int, torch.Tensor]], groups: int) -> None:
        """Record parameter gradients of ``(stage, microbatch)``; call under ``lock``.

        ``groups >= 0``: its backward's, with the number of groups it deferred; ``groups < 0``:
        one deferred group's. A micro-batch's gradients go into the sums once all of them are
        in, micro-batch by micro-batch in order, so the sums do not depend on which worker ran
        what when.
        """
        key = (stage, microbatch)
        self.results.setdefault(key, []).extend(grads)
        self.unfinished[key] = self.unfinished.get(key, 0) + (groups if groups >= 0 else -1)
        if groups >= 0:
            self.backwards_left -= 1
        while True:
            key = (stage, self.flushed[stage])
            if key not in self.results or self.unfinished[key] != 0:
                return
            grads = [(self.params[stage][p][1], g) for p, g in self.results.pop(key)]
            accumulate_microbatch(self.param_grads[stage], self.owned[stage], grads)
            del self.unfinished[key]
            self.flushed[stage] += 1
