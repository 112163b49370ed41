"""GPipe on the placed graph: the lowered module cut into per-stage submodules, run over micro-batches.

``pl.to_torch(model, chunks=k)`` lowers the model as usual, cuts the
``GraphModule`` into one submodule per stage (the stages of
:func:`placement.runtime.stages.partition`, the same cut the ONNX Runtime executor
uses; ``torch.fx.passes.split_module``, see :mod:`.stage_split`) and wraps them in a
:class:`PipelinedModule`. Its forward splits the batch into ``k`` micro-batches
and runs them through the stages in the fill-drain schedule: on the workers of
:mod:`placement.runtime.schedule` (one thread per stage), so stage ``j``
computes micro-batch ``i`` while stage ``j + 1`` computes micro-batch ``i - 1``,
or all on the caller's thread in the same order (``executor=``, see
:mod:`placement.runtime.torch.executor`: GPU stages and tiny CPU stages run
inline by default). On GPUs each stage runs on its own CUDA stream, and a
stage waits (an event) only for the micro-batch it reads. On the CPU, once a
micro-batch shape recurs (more than ``chunks`` calls), a stage runs as a
TorchScript trace of its code (:mod:`placement.runtime.torch.traced`): no
Python per op, and the two workers do not take turns on the GIL
(``module.trace_stages = False`` switches it off).

Training: when gradients are needed, the whole pipeline is one autograd
function. Each (stage, micro-batch) keeps its own small autograd graph on
detached inputs; backward runs the stages in reverse on the same workers
(stage ``j`` back-propagates micro-batch ``i`` while stage ``j - 1`` does
micro-batch ``i + 1``), with ``torch.autograd.grad`` per stage, and returns the
gradients of the inputs and of every parameter (summed over micro-batches and,
for a parameter several stages read such as a tied embedding, over stages).
So ``loss.backward()`` and ``torch.autograd.grad`` both work and give the
unsplit module's gradients. When the autograd engine calls that backward on one
of its per-device threads (a GPU output: the engine runs GPU backward work on a
thread per device), the backward never waits there for workers that would need
that same thread: it runs each stage's ``torch.autograd.grad`` itself, in the
schedule's order (a reentrant backward; see
:mod:`placement.runtime.torch.reentrant`). ``checkpoint`` chooses which micro-batches drop
their activations after forward and recompute them in backward: ``"always"``,
``"except_last"`` (GPipe's default: the last micro-batch is needed first in
backward) or ``"never"``.

That is GPipe: the caller's loss exists only after every micro-batch's forward.
Given the loss function, ``module.train_step(x, loss_fn=..., targets=(y,))``
takes the whole step faster with the same gradients: each micro-batch's loss is
computed and back-propagated as soon as its forward ends (1F1B), and weight
gradients are deferred to fill idle time (:mod:`placement.runtime.torch.one_f_one_b`).

BatchNorm: the placed graph comes from an eval-mode export, and the lowering
runs ``BatchNormalization`` with its running statistics (inference semantics)
whatever ``module.training`` says. Normalisation therefore does not depend on
how the batch is split, and pipelined outputs and gradients equal the unsplit
ones exactly; no deferred batch statistics are needed. (Training BatchNorm
statistics through a placed graph would need a training-mode export.)

Parameters are shared with the lowered module, under the same attribute paths
(``state_dict`` keys and ``initializer_paths`` are the plain lowering's), so an
optimizer over ``module.parameters()`` trains them and
``model.update_parameters(module)`` writes them back into the placed graph.

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> module = pl.to_torch(model, device_map="cpu", chunks=2)
    >>> len(module.stages)
    2
    >>> torch.allclose(module(x), net(x), atol=1e-6)
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from placement.errors import LoweringError, PlacementError
from placement.graph.model import Model
from placement.runtime.schedule import (
    CHECKPOINT_MODES,
    BatchAxes,
    batch_axes,
    check_chunks,
    split_batch,
)
from placement.runtime.torch.concurrent import (
    Concurrency,
    backward_schedule,
    check_concurrent,
    run_stages,
    stage_concurrency,
)
from placement.runtime.torch.engine_grad import engine_grad
from placement.runtime.torch.executor import check_executor, stage_executor
from placement.runtime.torch.one_f_one_b import pipelined_train_step
from placement.runtime.torch.outputs import first_tensor_device
from placement.runtime.torch.stage_exec import (
    StepStats,
    TorchStage,
    accumulate,
    accumulate_microbatch,
    add_input_grads,
    autocast_like,
    backward_operands,
    call_stage,
    caller_autocast,
    forward_for_backward,
    hand_over,
    join_streams,
    keeps_activations,
    microbatch_envs,
    owned_grads,
    per_parameter,
    signal,
    signal_all,
    stage_args,
    trainable_params,
    value_devices,
    wait_for,
    wait_for_stage,
)
from placement.runtime.torch.stage_graphs import graph_stages
from placement.runtime.torch.stage_split import (
    nondeterministic_ops,
    split_stages,
    stage_of_ops,
    traced_stage,
)

__all__ = ["PipelinedModule", "pipeline_module"]

log = logging.getLogger(__name__)


def pipeline_module(
    model: Model,
    module: fx.GraphModule,
    *,
    chunks: int,
    checkpoint: str = "except_last",
    batch_axes: Mapping[str, int | None] | None = None,
    cuda_graphs: bool = False,
    executor: str = "auto",
    concurrent: bool | None = None,
) -> PipelinedModule:
    """Wrap a lowered module of ``model`` as a :class:`PipelinedModule` (see ``to_torch(chunks=)``);
    ``cuda_graphs``: its GPU stages replay CUDA graphs (:mod:`.stage_graphs`); ``executor``:
    who runs the stages (:mod:`.executor`); ``concurrent``: whether stages that do not depend
    on each other run at once (:mod:`.concurrent`). With ``chunks=1`` (one micro-batch: the
    stages of a tensor-parallel split run at once) the model needs no batch axis."""
    check_chunks(chunks)
    check_executor(executor)
    check_concurrent(concurrent, executor)
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {checkpoint!r}")
    try:
        axes = _batch_axes(model, batch_axes)
    except PlacementError:
        if chunks > 1:
            raise
        axes = _whole(model)  # one micro-batch: nothing is cut
    untraceable = nondeterministic_ops(model)
    pipelined = PipelinedModule(
        module, stage_of_ops(model), chunks=chunks, checkpoint=checkpoint, axes=axes, untraceable=untraceable
    )
    pipelined.executor = executor
    pipelined.concurrent = concurrent
    if cuda_graphs:
        pipelined._pl_cuda_graphs = True
        graph_stages(pipelined._pl_stages)
    return pipelined


def _batch_axes(model: Model, overrides: Mapping[str, int | None] | None) -> BatchAxes:
    return batch_axes(model, overrides=overrides)


def _whole(model: Model) -> BatchAxes:
    """Batch axes that cut nothing (every input and output whole)."""
    return BatchAxes({name: None for name in model.inputs}, {name: None for name in model.outputs}, None)


class PipelinedModule(torch.nn.Module):
    """A lowered placed model whose forward and backward are pipelined over micro-batches.

    Built by ``pl.to_torch(model, chunks=k)``; see the module docstring.
    Attributes: ``chunks``, ``checkpoint``, ``executor`` (``"auto"``, ``"threads"`` or
    ``"inline"``: who runs the stages, see :mod:`.executor`; may be changed between calls),
    ``concurrent`` (None, True or False: whether stages that do not depend on each other run
    at once, see :mod:`.concurrent`; may be changed between calls),
    ``outputs_on``, ``stages`` (the per-stage ``GraphModule`` s, in order), ``batch_axes``,
    ``stats`` (what the last step did, :class:`.stage_exec.StepStats`), and the plain lowering's
    ``input_names``, ``output_names``, ``device_map``, ``initializer_paths``.
    """

    def __init__(
        self,
        module: fx.GraphModule,
        stage_of_op: Mapping[str, int],
        *,
        chunks: int,
        checkpoint: str,
        axes: BatchAxes,
        untraceable: Collection[str] = (),
    ) -> None:
        super().__init__()
        # The lowered module's parameters and buffers, under the same paths.
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, param in module._parameters.items():
            self.register_parameter(name, param)
        for name, buf in module._buffers.items():
            self.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
        self.input_names: list[str] = list(module.input_names)
        self.output_names: list[str] = list(module.output_names)
        self.device_map: dict[str, str] = dict(module.device_map)
        self.initializer_paths: dict[str, str] = dict(module.initializer_paths)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.outputs_on = "last"  # where outputs come back; to_torch sets it (see .outputs)
        self.executor = "auto"  # who runs the stages (see .executor)
        self.concurrent: bool | None = None  # independent stages at once (see .concurrent)
        self.batch_axes = axes
        self._placeholders = [n.target for n in module.graph.nodes if n.op == "placeholder"]
        self._in_axes = [axes.inputs[name] for name in self.input_names]
        self._out_axes = [axes.outputs[name] for name in self.output_names]
        # What the stages are rebuilt from after copy.deepcopy or a pickle (see __setstate__):
        # the lowered module (not a submodule: its tensors are ours) and the split.
        object.__setattr__(self, "_pl_source", module)
        self._pl_split = (dict(stage_of_op), frozenset(untraceable))
        self._pl_cuda_graphs = False
        self._pl_build_stages()
        #: what the last step did: micro-batches, stage forwards recomputed (``checkpoint``)
        self.stats = StepStats.start(len(self._pl_stages), 0)
        log.info(
            "pipelined module: %d stages, chunks=%d, checkpoint=%s", len(self._pl_stages), chunks, checkpoint
        )

    def _pl_build_stages(self) -> None:
        """Split the lowered module into its stages (threads, traces and CUDA graphs are per
        object: a copy builds its own, over the copy's tensors)."""
        stage_of_op, untraceable = self._pl_split
        host = not any(str(d).startswith("cuda") for d in self.device_map.values())
        stages, env_inputs, outputs = split_stages(self._pl_source, stage_of_op, own_input_moves=host)
        for stage in stages:
            stage.call = traced_stage(stage, warmup=self.chunks, untraceable=untraceable)
        self._pl_inputs = env_inputs
        object.__setattr__(self, "_pl_stages", stages)  # not submodules: their tensors are ours
        self._pl_outputs = outputs
        if self._pl_cuda_graphs:
            graph_stages(stages)

    def __getstate__(self) -> dict[str, Any]:
        """``copy.deepcopy``, ``torch.save``: everything but the stages (locks, traces, graphs),
        which :meth:`__setstate__` rebuilds from the lowered module, sharing the copy's tensors."""
        state = dict(self.__dict__)
        state.pop("_pl_stages", None)
        state["_pl_trace"] = self.trace_stages
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        trace = state.pop("_pl_trace", True)
        super().__setstate__(state)
        self._pl_build_stages()
        self.trace_stages = trace

    @property
    def trace_stages(self) -> bool:
        """Whether the stages run as per-signature TorchScript traces (default ``True``).

        See :mod:`placement.runtime.torch.traced`: a stage input signature (shapes,
        grad mode) seen in more than ``chunks`` calls is traced once and then runs without
        Python (and without the GIL), forward and, through autograd, backward; stages whose
        code depends on input values run untraced. Outputs and gradients are the same.
        """
        return all(s.call.enabled for s in self._pl_stages)

    @trace_stages.setter
    def trace_stages(self, value: bool) -> None:
        for s in self._pl_stages:
            s.call.enabled = bool(value)

    @property
    def stages(self) -> list[fx.GraphModule]:
        """The per-stage submodules, in execution order."""
        return [s.module for s in self._pl_stages]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the inputs (positionally in ``input_names`` order, or by keyword) through the pipeline."""
        inputs = self._bind(args, kwargs)
        if len(self._out_axes) != len(self._pl_outputs):
            raise LoweringError("the pipelined module's outputs do not match the model's")
        params = [p for p in self.parameters() if p.requires_grad]
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params)
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        )
        if needs_grad:
            tensors = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in inputs]
            outputs = _PipelineFunction.apply(_Run(self, len(tensors), params), *tensors, *params)
        else:
            outputs = _forward_only(self, inputs, *self._plan(inputs))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def train_step(
        self,
        *args: Any,
        loss_fn: Callable[..., torch.Tensor],
        targets: Sequence[Any] = (),
        reduction: str = "mean",
        defer_weights: bool | str = "auto",
        max_in_flight: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of one mini-batch, the loss computed per micro-batch (1F1B with
        deferred weight gradients); adds the gradients to ``.grad`` and returns the loss.

        The faster way to train through the pipeline than ``loss_fn(module(x), y).backward()``
        (GPipe); same gradients. See :mod:`placement.runtime.torch.one_f_one_b`.

        Example:
            >>> import torch
            >>> import placement as pl
            >>> from placement.models import mlp
            >>> net, (x,) = mlp.build("tiny")
            >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
            >>> model.set_device(model.ops[-1].name, 1)
            >>> module = pl.to_torch(model, device_map="cpu", chunks=2)
            >>> loss = module.train_step(x, loss_fn=lambda out: out.square().mean())
            >>> loss.shape, all(p.grad is not None for p in module.parameters())
            (torch.Size([]), True)
        """
        inputs = self._bind(args, kwargs)
        if getattr(self, "mode_warning", None) is not None:  # trains without calling forward
            self.mode_warning(self)
        on_input = getattr(self, "outputs_on", "last") == "input"
        return pipelined_train_step(
            self._pl_stages,
            inputs,
            input_keys=self._pl_inputs,
            input_axes=self._in_axes,
            output_keys=self._pl_outputs,
            chunks=self.chunks,
            checkpoint=self.checkpoint,
            loss_fn=loss_fn,
            targets=targets,
            reduction=reduction,
            defer_weights=defer_weights,
            max_in_flight=max_in_flight,
            outputs_device=first_tensor_device(inputs) if on_input else None,
            stats=self.stats,
            executor=self.executor,
            concurrent=check_concurrent(self.concurrent),
        )

    def _plan(self, inputs: Sequence[Any]) -> tuple[str, Concurrency | None]:
        """Who runs the stages for a call on ``inputs``: ``"threads"`` or ``"inline"``
        (``executor`` resolved), and the DAG run where independent stages run at once
        (``concurrent`` resolved; then ``"threads"``)."""
        concurrent = check_concurrent(self.concurrent)
        executor = stage_executor(self.executor, self._pl_stages, inputs, self.chunks)
        if self.executor == "inline" and concurrent is not False:
            concurrent = False  # the caller's thread runs every stage, as asked
        plan = stage_concurrency(concurrent, self._pl_stages, executor)
        if plan is not None:
            return "threads", plan
        if self.chunks == 1 and self.executor == "auto":
            return "inline", None  # one micro-batch through a chain: threads would only hand off
        return executor, None

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        names = self._placeholders
        if len(args) > len(names):
            raise TypeError(f"expected at most {len(names)} inputs ({', '.join(names)}), got {len(args)}")
        values: list[Any] = list(args) + [None] * (len(names) - len(args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"unexpected input {key!r}; the inputs are: {', '.join(names)}")
            values[names.index(key)] = value
        missing = [n for n, v in zip(names, values) if v is None]
        if missing:
            raise TypeError(f"missing input(s): {', '.join(missing)}")
        return values


# --- running ----------------------------------------------------------------------------------


def _join(module: PipelinedModule, envs: list[dict[str, Any]]) -> list[torch.Tensor]:
    keys = module._pl_outputs
    # The concatenation runs on the caller's stream of the outputs' device (the last stage's,
    # not the caller's current device): that stream waits for each micro-batch's last work.
    devices = value_devices(envs, keys)
    for env in envs:
        wait_for(env, *devices)
    if len(envs) == 1:  # one micro-batch (a model without a batch axis has one)
        return [hand_over(envs[0][key]) for key in keys]
    return [
        torch.cat([hand_over(env[key]) for env in envs], dim=axis)
        for key, axis in zip(keys, module._out_axes)
    ]


def _forward_only(
    module: PipelinedModule, inputs: Sequence[Any], executor: str, plan: Concurrency | None
) -> list[torch.Tensor]:
    stages: list[TorchStage] = module._pl_stages

    def make(stage: TorchStage) -> Any:
        def fn(i: int, env: dict[str, Any]) -> dict[str, Any]:
            wait_for_stage(env, stage.device)
            env.update(call_stage(stage, stage_args(stage, env)))
            signal(env, stage.device)
            return env

        return fn

    envs = microbatch_envs(module._pl_inputs, module._in_axes, module.chunks, inputs)
    module.stats = stats = StepStats.start(len(stages), len(envs), executor, plan)
    return _join(
        module, run_stages(stages, make, envs, grad=False, executor=executor, plan=plan, stats=stats)
    )


@dataclass
class _Run:
    """What one training forward leaves for its backward."""

    module: PipelinedModule
    n_inputs: int
    params: list[torch.nn.Parameter]
    envs: list[dict[str, Any]] = field(default_factory=list)
    # (stage, micro-batch) -> (detached inputs, outputs or None when checkpointed)
    saved: dict[tuple[int, int], tuple[list[Any], dict[str, Any] | None]] = field(default_factory=dict)
    input_requires_grad: list[bool] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)
    casts: tuple[Any, ...] = ()  # the forward's autocast state: checkpointed stages recompute under it
    plan: Concurrency | None = None  # the DAG run, where independent stages run at once


class _PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _Run, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        module = run.module
        stages: list[TorchStage] = module._pl_stages
        inputs = list(tensors[: run.n_inputs])
        run.input_requires_grad = [t.requires_grad for t in inputs]
        run.casts = caller_autocast()
        envs = microbatch_envs(module._pl_inputs, module._in_axes, module.chunks, inputs)
        n_mb = len(envs)
        executor, run.plan = module._plan(inputs)
        module.stats = run.stats = StepStats.start(len(stages), n_mb, executor, run.plan)
        placeholders = set(module._pl_inputs)
        grad_inputs = {name for name, rg in zip(module._pl_inputs, run.input_requires_grad) if rg}

        def tracked(key: str) -> bool:
            # Graph inputs need grad when the caller's do; every other value between
            # stages is tracked (it depends on parameters).
            return key in grad_inputs or key not in placeholders

        def make(stage: TorchStage) -> Any:
            def fn(i: int, env: dict[str, Any]) -> dict[str, Any]:
                wait_for_stage(env, stage.device)
                args = stage_args(stage, env, tracked)
                keep = keeps_activations(module.checkpoint, i, n_mb)
                outs, saved = forward_for_backward(stage, args, keep)
                run.saved[(stage.index, i)] = (args, saved)
                env.update(outs)
                signal(env, stage.device)
                return env

            return fn

        run.envs = run_stages(
            stages, make, envs, grad=True, executor=executor, plan=run.plan, stats=run.stats
        )
        outputs = [t.detach() for t in _join(module, run.envs)]
        ctx.run = run
        for out in outputs:
            if not out.is_floating_point():
                ctx.mark_non_differentiable(out)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:  # type: ignore[override]
        run: _Run = ctx.run
        ctx.run = None
        module = run.module
        stages: list[TorchStage] = module._pl_stages
        n_mb = len(run.envs)
        out_keys = module._pl_outputs
        genvs: list[dict[str, Any]] = [{} for _ in range(n_mb)]
        for key, axis, g in zip(out_keys, module._out_axes, grad_outputs):
            if g is None:
                continue
            for genv, (part,) in zip(genvs, split_batch([g], [axis], module.chunks)):
                accumulate(genv, key, part)
        signal_all(genvs, value_devices(genvs))  # made on the caller's streams: the stages wait
        param_grads: list[dict[str, torch.Tensor]] = [{} for _ in stages]
        owned: list[set[str]] = [set() for _ in stages]  # accumulators made here: added to in place

        def make(stage: TorchStage) -> Any:
            params = trainable_params(stage)

            def fn(i: int, genv: dict[str, Any]) -> dict[str, Any]:
                wait_for_stage(genv, stage.device)
                args, outs = run.saved.pop((stage.index, i))
                with autocast_like(run.casts):
                    outputs, seeds, arg_slots = backward_operands(stage, args, outs, genv, params, run.stats)
                if outputs and (arg_slots or params):
                    grads = owned_grads(
                        stage,
                        engine_grad(outputs, [args[n] for n in arg_slots + [n for n, _ in params]], seeds),
                    )
                    add_input_grads(genv, stage, arg_slots, grads[: len(arg_slots)])
                    pairs = [(k, g) for (_, k), g in zip(params, grads[len(arg_slots) :]) if g is not None]
                    accumulate_microbatch(param_grads[stage.index], owned[stage.index], pairs)
                signal(genv, stage.device)
                return genv

            return fn

        done = backward_schedule(list(reversed(stages)), make, genvs, run.stats.executor, run.plan)
        done.reverse()
        devices = value_devices(done)  # the input gradients' devices: the caller reads them there
        for genv in done:
            wait_for(genv, *devices)
        join_streams(stages)  # parameter gradients were made on the workers' streams: events, no host wait
        # Input gradients: concatenated along the batch axis, summed over micro-batches when unbatched.
        placeholders = module._pl_inputs
        input_grads: list[Any] = []
        for name, axis, needs in zip(placeholders, module._in_axes, run.input_requires_grad):
            parts = [hand_over(genv.get(name)) for genv in done]  # made on the workers' streams
            if not needs or all(p is None for p in parts):
                input_grads.append(None)
            elif axis is None:
                input_grads.append(sum(p for p in parts if p is not None))
            else:
                input_grads.append(torch.cat(parts, dim=axis))
        # Parameter gradients: summed over stages (a parameter several stages read).
        by_param = per_parameter(stages, param_grads, owned)
        return (
            None,
            *input_grads,
            *[hand_over(by_param[id(p)][1]) if id(p) in by_param else None for p in run.params],
        )
