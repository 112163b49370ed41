"""One training step through the pipeline, its loss computed micro-batch by micro-batch.

``loss = module(x)...; loss.backward()`` on a :class:`PipelinedModule` is GPipe:
every micro-batch's forward must end before the caller's loss exists, so the
last stage idles while the first fills the pipeline, the first idles across
the turn from forward to backward, and the last idles again while the first
drains. With ``k`` micro-batches on ``N`` stages a fraction ``(N - 1) / (k + N - 1)``
of the step is such a bubble.

``module.train_step(x, loss_fn=..., targets=(y,))`` knows the loss, so the last
stage computes each micro-batch's loss (and its gradient) right after that
micro-batch's forward and starts its backward at once, while earlier stages
are still running later forwards (*1F1B*, as in PipeDream-Flush and
``torch.distributed.pipelining``). On top of that a stage whose inputs come
from an earlier stage computes only its input gradients first and leaves its
weight gradients for later (:mod:`placement.runtime.torch.weight_grads`),
so the earlier stage gets its gradient sooner; the stage computes the deferred
weight gradients whenever it would otherwise wait for work (*zero-bubble*, Qi
et al. 2023, ZB-H1). Each worker picks its next task as work arrives: a
backward that is ready, else the next forward (at most ``max_in_flight``
micro-batches between a forward and its backward), else one group of deferred
weight gradients, else it waits. Stages on the CPU (one physical device, however
many logical ones) share the deferred work: an idle worker runs any CPU stage's,
which also evens out a plan whose stages turned out unequal; a stage on a GPU runs
only its own, on its own stream. Backwards run in micro-batch order and
weight gradients are summed in that order, so a step's gradients do not depend
on timing.

The result: the gradients ``loss_fn`` over the whole mini-batch would give
(``reduction="mean"``: micro-batch losses weighted by their share of the batch,
right for a loss that is a mean over the batch; ``"sum"``: added), added to each
parameter's ``.grad`` as ``loss.backward()`` would, and the loss returned. The
inputs' gradients are not computed: inputs are data here.

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> module = pl.to_torch(model, device_map="cpu", chunks=2)
    >>> y = torch.randn(net(x).shape)
    >>> loss = module.train_step(x, loss_fn=torch.nn.functional.mse_loss, targets=(y,))
    >>> ref = torch.nn.functional.mse_loss(net(x), y)
    >>> ref.backward()
    >>> torch.allclose(loss, ref), all(
    ...     torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(module.parameters(), net.parameters()))
    (True, True)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from placement.errors import InputError
from placement.runtime.schedule import microbatch_bounds, split_batch, stage_error
from placement.runtime.torch.concurrent import budgeted, restored_threads, stage_concurrency, with_final_sink
from placement.runtime.torch.device_streams import current_stream, has_streams, record_event, tensor_device
from placement.runtime.torch.engine_grad import engine_grad
from placement.runtime.torch.executor import stage_executor
from placement.runtime.torch.outputs import move_outputs
from placement.runtime.torch.stage_exec import (
    StepStats,
    TorchStage,
    accumulate,
    add_input_grads,
    backward_operands,
    call_stage,
    detached,
    forward_for_backward,
    hand_over,
    input_slots,
    join_streams,
    keeps_activations,
    microbatch_envs,
    owned_grads,
    signal,
    stage_args,
    stage_name,
    static_grads,
    trainable_params,
    wait_for_stage,
    worker_context,
    write_grads,
)
from placement.runtime.torch.step_loss import REDUCTIONS, LossFn, check_reduction, scalar_loss, step_loss
from placement.runtime.torch.step_shared import STOP, Pending, StepShared
from placement.runtime.torch.weight_grads import (
    DEFER_MIN_MACS,
    DeferredWeights,
    activation_rows,
    backward_inputs,
    defer_pays,
)

__all__ = [
    "DEFER_MIN_MACS",
    "REDUCTIONS",
    "check_reduction",
    "defer_pays",
    "pipelined_train_step",
    "scalar_loss",
]


def pipelined_train_step(
    stages: list[TorchStage],
    inputs: Sequence[Any],
    *,
    input_keys: Sequence[str],
    input_axes: Sequence[int | None],
    output_keys: Sequence[str],
    chunks: int,
    checkpoint: str,
    loss_fn: LossFn,
    targets: Sequence[Any] = (),
    reduction: str = "mean",
    defer_weights: bool | str = "auto",
    max_in_flight: int | None = None,
    outputs_device: torch.device | None = None,
    stats: StepStats | None = None,
    executor: str = "auto",
    concurrent: bool | None = None,
) -> torch.Tensor:
    """Forward and backward of one mini-batch through ``stages``, the loss per micro-batch.

    See the module docstring (``PipelinedModule.train_step`` calls this with its stages and
    the inputs bound).

    Args:
        stages: the pipelined module's stages, in order.
        inputs: the model's inputs, in ``module.input_names`` order.
        input_keys: the environment keys the inputs go under (in ``inputs``' order).
        input_axes: each input's batch axis (None: not split).
        output_keys: the environment keys of the model's outputs, in order.
        chunks: micro-batches per step.
        checkpoint: which micro-batches drop their activations (``"always"``,
            ``"except_last"``, ``"never"``; see :func:`.stage_exec.keeps_activations`).
        loss_fn: ``loss_fn(output, *targets)`` -> a scalar tensor, for one micro-batch;
            ``output`` is the model's output (a tuple when it has several).
        targets: tensors cut along their first axis like the inputs' batch.
        reduction: ``"mean"`` (``loss_fn`` averages over the batch) or ``"sum"``.
        defer_weights: compute weight gradients after input gradients where that
            helps (stages after the first); ``False`` runs plain 1F1B; ``"auto"`` (the
            default) defers where a micro-batch's weight gradients are big enough to pay
            for computing them apart (:func:`defer_pays`), ``True`` wherever it can.
        max_in_flight: most micro-batches a stage holds between their forward and
            backward (their activations); default: no bound beyond ``chunks``.
        outputs_device: the device ``loss_fn`` gets the outputs on (moved there inside
            autograd; :func:`.outputs.move_outputs`); None: the last stage's.
        stats: where to count what the step did (recomputed forwards); a new one if None.
        executor: ``"threads"`` (a worker thread per stage), ``"inline"`` (this thread
            runs every stage, each its next ready task in turn) or ``"auto"``; see
            :mod:`placement.runtime.torch.executor`. Same gradients either way.
        concurrent: whether stages that do not depend on each other run at once (a worker
            each, handing work on along the stage DAG); see
            :mod:`placement.runtime.torch.concurrent`.

    Returns:
        The mini-batch's loss (detached).

    Raises:
        PipelineError: a stage (or the loss, on the last stage) failed; names the
            stage and micro-batch. No worker thread is left running.
        InputError: a target's batch size differs from the inputs'.
    """
    check_reduction(reduction)
    if defer_weights not in (True, False, "auto"):
        raise ValueError(f"defer_weights must be True, False or 'auto', got {defer_weights!r}")
    if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
        raise ValueError(f"max_in_flight must be a positive integer or None, got {max_in_flight!r}")
    inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]
    size = next(
        (int(t.shape[a]) for t, a in zip(inputs, input_axes) if a is not None and hasattr(t, "shape")), 1
    )
    for n, target in enumerate(targets):
        if not isinstance(target, torch.Tensor) or target.dim() == 0 or int(target.shape[0]) != size:
            shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise InputError(f"target {n} must have the batch ({size}) on its first axis, got {shape}")
    envs = microbatch_envs(list(input_keys), list(input_axes), chunks, inputs)
    parts = split_batch(list(targets), [0] * len(targets), chunks) if targets else [[] for _ in envs]
    bounds = microbatch_bounds(size, chunks)
    stats = stats if stats is not None else StepStats()
    stats.microbatches, stats.recomputed, stats.deferred = len(envs), [0] * len(stages), 0
    stats.executor = stage_executor(executor, stages, inputs, chunks)
    plan = stage_concurrency(False if executor == "inline" else concurrent, stages, stats.executor)
    if plan is not None:  # the last stage computes the loss: it waits for every other sink
        plan = with_final_sink(plan)
        stats.executor = "threads"
    elif chunks == 1 and executor == "auto":
        stats.executor = "inline"  # one micro-batch through a chain: threads would only hand off
    stats.concurrent, stats.timeline = (plan.width if plan is not None else 0), []
    shared = StepShared(
        stages=stages,
        input_keys=set(input_keys),
        output_keys=list(output_keys),
        checkpoint=checkpoint,
        envs=envs,
        targets=parts,
        weights=[(stop - start) / size if reduction == "mean" else 1.0 for start, stop in bounds],
        loss_fn=loss_fn,
        outputs_device=outputs_device,
        defer=defer_weights,
        limit=max_in_flight or len(envs),
        inboxes=[queue.SimpleQueue() for _ in stages],
        params=[trainable_params(stage) for stage in stages],
        stats=stats,
        tracked=lambda key, data=frozenset(input_keys): key not in data,  # graph inputs are data
        losses=[None] * len(envs),
        backwards_left=len(stages) * len(envs),
        flushed=[0] * len(stages),
        param_grads=[{} for _ in stages],
        owned=[set() for _ in stages],
        inline=stats.executor == "inline",
        plan=plan,
    )
    if shared.inline:
        _run_inline(shared)
    else:
        with restored_threads(plan):
            _run_threads(shared)
    join_streams(stages)  # the caller's stream waits for the workers' (no host synchronisation)
    if shared.failures:
        stage, microbatch, err = shared.failures[0]
        raise stage_error(stage, stage_name(stages[stage]), microbatch, err) from err
    if shared.flushed != [len(envs)] * len(stages):  # pragma: no cover - a bug, not an input error
        raise RuntimeError(f"train_step lost gradients: flushed {shared.flushed} of {len(envs)}")
    write_grads(stages, shared.param_grads, shared.owned)
    losses = [hand_over(loss, shared.loss_events.get(i)) for i, loss in enumerate(shared.losses)]
    return step_loss(losses, shared.weights)


def _run_threads(shared: StepShared) -> None:
    """Every stage's loop on a thread of its own, the last one on this thread."""
    last = len(shared.stages) - 1
    context = budgeted(worker_context(shared.stages, True), shared.plan)
    threads = [
        threading.Thread(
            target=_run_loop, args=(shared, j, context), name=f"placement-train-stage-{j}", daemon=True
        )
        for j in range(last)
    ]
    for thread in threads:
        thread.start()
    try:
        _run_loop(shared, last, context)  # the last stage on the caller's thread
    except BaseException as err:  # noqa: BLE001 - (KeyboardInterrupt) stop the workers first
        shared.fail(last, -1, err)
        raise
    finally:
        for thread in threads:
            thread.join()


def _run_loop(shared: StepShared, j: int, context: Any) -> None:
    with context(j):  # made on the caller's thread: its grad mode and autocast state
        _StageLoop(shared, j).run()


def _run_inline(shared: StepShared) -> None:
    """Every stage's loop on this thread: round after round, each stage (first to last) runs
    its next ready task, until a round finds nothing to run. A GPU stage runs inside its
    context (its device and stream), so it queues its kernels on its own stream as its worker
    would; CPU stages need only grad mode, set once."""
    context = worker_context(shared.stages, True)
    shared.loops = loops = [_StageLoop(shared, j) for j in range(len(shared.stages))]
    on_gpu = [has_streams(s.device) for s in shared.stages]
    loop = loops[0]
    try:
        with torch.enable_grad():
            while True:
                progressed = False
                for loop in loops:
                    if on_gpu[loop.j]:
                        with context(loop.j):
                            progressed = loop.step() or progressed
                    else:
                        progressed = loop.step() or progressed
                if not progressed:
                    break
    except BaseException as err:  # noqa: BLE001 - re-raised in the caller, naming the stage
        shared.fail(*loop.current, err)
        return
    waiting = [loop.j for loop in loops if not loop.finished()]
    if waiting:  # pragma: no cover - a bug, not an input error
        raise RuntimeError(f"train_step stalled: stages {waiting} wait for work that never comes")


class _StageLoop:
    """Stage ``j``'s worker for one step: its forwards and backwards, and any stage's deferred
    weight gradients when it has nothing else to do."""

    def __init__(self, shared: StepShared, j: int) -> None:
        self.shared = shared
        self.j = j
        self.stage = shared.stages[j]
        self.last = j == len(shared.stages) - 1
        self.k = len(shared.envs)
        self.forward_ready: dict[int, dict[str, Any]] = (
            dict(enumerate(shared.envs)) if shared.first(j) else {}
        )
        self.backward_ready: dict[int, dict[str, Any]] = {}
        self.saved: dict[int, tuple[list[Any], dict[str, Any] | None]] = {}
        self.current = (j, 0)  # the (stage, micro-batch) being worked on, named in errors
        self.next_f = self.next_b = 0  # the next micro-batch to run forward / backward
        self._param_elements = sum(self.stage.consts[key].numel() for _, key in shared.params[j])
        self._seeds: dict[tuple[float, torch.dtype], torch.Tensor] = {}

    def _seed(self, weight: float, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a micro-batch's loss starts from (its weight), made once per value."""
        seed = self._seeds.get((weight, loss.dtype))
        if seed is None:
            seed = self._seeds[weight, loss.dtype] = torch.tensor(
                weight, dtype=loss.dtype, device=loss.device
            )
        return seed

    def _defer_pays(self, inputs: Sequence[torch.Tensor]) -> bool:
        """:func:`defer_pays` for this stage's parameters (their size counted once)."""
        return activation_rows(inputs) * self._param_elements >= DEFER_MIN_MACS

    def run(self) -> None:
        """The stage's loop on a thread of its own: run what is ready, else wait for a message."""
        shared, inbox = self.shared, self.shared.inboxes[self.j]
        try:
            while not shared.failed.is_set():
                if self.drain():
                    return
                if not self.step():
                    if self.finished():
                        return
                    message = inbox.get()
                    if message is STOP:
                        return
                    self.file(message)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller, naming the stage
            shared.fail(*self.current, err)

    def drain(self) -> bool:
        """File the messages that have arrived, without waiting; ``True`` when told to stop."""
        inbox = self.shared.inboxes[self.j]
        while not inbox.empty():
            message = inbox.get_nowait()
            if message is STOP:
                return True
            self.file(message)
        return self.shared.failed.is_set()

    def step(self) -> bool:
        """Run one ready task (a backward first, else a forward within the in-flight bound,
        else a group of deferred weight gradients); ``False`` when none is ready."""
        if self.next_b in self.backward_ready:
            self.current = (self.j, self.next_b)
            self._backward(self.next_b, self.backward_ready.pop(self.next_b))
            self.next_b += 1
        elif (
            self.next_f < self.k
            and self.next_f in self.forward_ready
            and self.next_f - self.next_b < self.shared.limit
        ):
            self.current = (self.j, self.next_f)
            self._forward(self.next_f)
            self.next_f += 1
            self.next_b += self.last  # the last stage's backward ran with its forward
        else:
            return self._weights()
        return True

    def finished(self) -> bool:
        """Every backward of this stage ran, and no weight gradients it may run are left or to come."""
        return self.next_b == self.k and self._done()

    def file(self, message: tuple[str, int, Any]) -> None:
        kind, i, env = message
        if kind == "F":
            self.forward_ready[i] = env
        elif kind == "B":
            self.backward_ready[i] = env

    def _may_run(self, stage: int) -> bool:
        return stage == self.j or (
            self.stage.device.type == "cpu" and self.shared.stages[stage].device.type == "cpu"
        )

    def _done(self) -> bool:
        """No weight gradients to run and none to come."""
        with self.shared.lock:
            mine = any(self._may_run(p.stage) for p in self.shared.pool)
            return not mine and self.shared.backwards_left == 0

    def _forward(self, i: int) -> None:
        """Micro-batch ``i``'s forward; on the last stage also its loss and backward, at once
        (its activations are never held across other work, so they are never recomputed)."""
        stage, shared = self.stage, self.shared
        env = self.forward_ready.pop(i)
        wait_for_stage(env, stage.device)
        args = stage_args(stage, env, shared.tracked)
        if self.last:
            with torch.enable_grad():
                outs = call_stage(stage, args, immediate=True)
                loss, leaves = self._loss(i, env, outs)
            self._backward(i, {}, (args, outs), loss, leaves)
            return
        outs, saved = forward_for_backward(stage, args, keeps_activations(shared.checkpoint, i, self.k))
        self.saved[i] = (args, saved)
        env.update(outs)
        signal(env, stage.device)
        shared.forward_done(self.j, i, env)

    def _loss(
        self, i: int, env: dict[str, Any], outs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Micro-batch ``i``'s loss (None when nothing in it takes a gradient) from
        the model's outputs: this stage's own, and leaves cut from an earlier stage's values
        (returned by key: their gradients go back to that stage)."""
        shared = self.shared
        leaves: dict[str, torch.Tensor] = {}
        values = []
        for key in shared.output_keys:
            if key in outs:
                values.append(outs[key])
            else:
                leaves[key] = detached(env[key], True)
                values.append(leaves[key])
        with torch.enable_grad():
            values = move_outputs(values, shared.outputs_device)
            loss = scalar_loss(
                shared.loss_fn(values[0] if len(values) == 1 else tuple(values), *shared.targets[i])
            )
        shared.losses[i] = loss.detach()  # weighted and summed once, at the end of the step
        device = tensor_device(loss)
        if device is not None:  # the caller reads it on its own stream: an event hands it over
            shared.loss_events[i] = record_event(current_stream(device))
        if not loss.requires_grad:
            return None, leaves
        return (loss if loss.dim() == 0 else loss.reshape(())), leaves

    def _backward(
        self,
        i: int,
        genv: dict[str, Any],
        saved: tuple[list[Any], dict[str, Any] | None] | None = None,
        loss: torch.Tensor | None = None,
        leaves: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Micro-batch ``i``'s backward on this stage: input gradients now, weight gradients
        now or deferred; the input gradients go to the stage before. On the last stage it
        starts from ``loss`` (``saved`` its forward's), elsewhere from the gradients in ``genv``."""
        shared, stage = self.shared, self.stage
        if shared.plan is not None:  # its outputs' gradients from the stages that read them
            genv = shared.joins[i].gather(stage, shared.dependents[self.j])
            before = set(genv)
        wait_for_stage(genv, stage.device)
        args, outs = saved if saved is not None else self.saved.pop(i)
        params = shared.params[self.j]
        leaf_keys = [k for k, leaf in (leaves or {}).items() if leaf.requires_grad]
        if self.last:
            outputs, seeds = [], []
            if loss is not None:  # weighted by the micro-batch's share of the batch
                outputs, seeds = [loss], [self._seed(shared.weights[i], loss)]
            arg_slots = input_slots(args, params)
        else:
            outputs, seeds, arg_slots = backward_operands(stage, args, outs, genv, params, shared.stats)
        now: list[torch.Tensor | None] = []
        later: DeferredWeights | None = None
        if outputs and (arg_slots or params or leaf_keys):
            arg_values = [args[n] for n in arg_slots] + [leaves[k] for k in leaf_keys]  # type: ignore[index]
            param_values = [args[n] for n, _ in params]
            defer = shared.defer is True or (shared.defer == "auto" and self._defer_pays(arg_values))
            if defer and arg_values and params and not static_grads(stage):
                arg_grads, now, later = backward_inputs(outputs, seeds, arg_values, param_values)
            else:
                grads = engine_grad(outputs, arg_values + param_values, seeds)
                grads = owned_grads(stage, grads)
                arg_grads, now = list(grads[: len(arg_values)]), list(grads[len(arg_values) :])
            add_input_grads(genv, stage, arg_slots, arg_grads[: len(arg_slots)])
            for key, g in zip(leaf_keys, arg_grads[len(arg_slots) :]):
                if g is not None:
                    accumulate(genv, key, g)
        signal(genv, stage.device)
        if shared.plan is not None:
            shared.joins[i].deltas[self.j] = {k: v for k, v in genv.items() if k not in before}
        shared.backward_done(self.j, i, genv)
        groups = len(later) if later is not None else 0
        with shared.lock:
            if later is not None and groups:
                shared.pool.append(Pending(self.j, i, later))
                shared.stats.deferred += groups
            shared.finish(self.j, i, [(p, g) for p, g in enumerate(now) if g is not None], groups)
            last = shared.backwards_left == 0
        if last or (groups and stage.device.type == "cpu"):  # others may run CPU stages' groups
            shared.wake(exclude=self.j)

    def _weights(self) -> bool:
        """Claim and run one group of the oldest deferred weight gradients this worker may run;
        ``False`` when there are none.

        On the CPU that is any stage's; a stage on a GPU runs only its own, on its own stream
        (autograd orders a backward's kernels on the streams of the forward, and the gradients
        kept for later were made on this worker's)."""
        shared = self.shared
        with shared.lock:
            pending = next((p for p in shared.pool if self._may_run(p.stage)), None)
            if pending is None:
                return False
            group = pending.later.take()
            if not len(pending.later):
                shared.pool.remove(pending)
        self.current = (pending.stage, pending.microbatch)
        grads = pending.later.run(group)
        with shared.lock:
            shared.finish(pending.stage, pending.microbatch, grads, -1)
        return True
