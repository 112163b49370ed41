"""The lowered stages of a placed model, each runnable alone: what ``calibrate(runtime="torch")`` times.

A pipelined ``pl.to_torch(model, chunks=k)`` module runs one ``torch.fx``
submodule per stage (:mod:`placement.runtime.torch.pipelined`). How long
each takes is what bounds the pipeline's throughput, and no per-op profile
predicts it well: the plan's op times come from ONNX Runtime, one op at a time,
while the stages run torch kernels, after warm-up as TorchScript traces
(:mod:`placement.runtime.torch.traced`), with the cost of every stage call
on top. :class:`LoweredStages` cuts the lowered module exactly as the pipeline
does, runs it once on sample inputs to give each stage its own inputs, and
returns per stage a function that runs that stage alone, as the pipeline's
worker would: forward without grad, or (``training=True``) forward with grad
on detached inputs and backward through ``torch.autograd.grad`` with ones as
output gradients, as the pipeline's backward does per stage. A call on a GPU
waits for its kernels (``torch.cuda.synchronize``), so it takes as long as its work.

Example:
    >>> import placement as pl
    >>> from placement.graph.device import Device
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> from placement.planning.profile import make_sample_inputs
    >>> inputs = make_sample_inputs(model)
    >>> devices = [Device.parse("cuda:0"), Device.parse("cuda:1")]
    >>> stages = LoweredStages(model, devices, inputs, device_map="cpu")
    >>> stages.part_of, len(stages.runs)
    ([0, 1], 2)
    >>> [tuple(run().shape) for run in stages.runs]
    [(4, 32), (4, 8)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from placement.errors import LoweringError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.runtime.device_map import DeviceMapLike
from placement.runtime.stages import partition
from placement.runtime.torch.lower import to_torch
from placement.runtime.torch.stage_exec import TorchStage, call_stage, detached, stage_args
from placement.runtime.torch.stage_split import nondeterministic_ops, split_stages, traced_stage

__all__ = ["LoweredStages"]

#: Calls of each stage before timing: the first ones run the fx code, then the stage is traced.
WARMUP_CALLS = 3


class LoweredStages:
    """The lowered stages of ``model``'s placement, each runnable alone on its sample inputs.

    Args:
        model: a placed model (no copies needed).
        order: the plan's devices, in part order; ``part_of[s]`` is the index in it of
            stage ``s``'s device.
        inputs: graph input name -> array: one pipeline step's worth (a micro-batch).
        device_map: as for :func:`placement.to_torch`.
        training: time forward and backward (a training step's share of each stage)
            instead of forward alone.

    Attributes:
        runs: per stage, in execution order, a function running it once (warmed up:
            after :data:`WARMUP_CALLS` calls a stage runs as its TorchScript trace) and
            returning its outputs, or with ``training`` the gradients of the sum of its
            outputs with respect to its inputs and parameters (those that take one, in
            argument order; ``None`` where an input does not reach an output).
        part_of: per stage, its part (index into ``order``).
        parts: how many parts (``len(order)``); :func:`placement.runtime.calibrate.per_part`
            sums stage times into part times.

    Raises:
        LoweringError: the model cannot be lowered, or an input is missing (named).
    """

    def __init__(
        self,
        model: Model,
        order: Sequence[Device],
        inputs: dict[str, np.ndarray],
        *,
        device_map: DeviceMapLike = "auto",
        training: bool = False,
    ) -> None:
        parts = partition(model)
        stage_of = {op: stage.index for stage in parts for op in stage.ops}
        module = to_torch(model, device_map=device_map)
        stages, placeholders, _ = split_stages(module, stage_of)
        untraceable = nondeterministic_ops(model)
        env: dict[str, Any] = {}
        for name, key in zip(module.input_names, placeholders):
            if name not in inputs:
                raise LoweringError(f"no sample value for graph input {name!r}")
            env[key] = torch.as_tensor(np.ascontiguousarray(inputs[name]))
        self.part_of = [list(order).index(parts[stage.part].device) for stage in stages]
        self.parts = len(order)
        self.runs: list[Callable[[], Any]] = []
        for stage in stages:
            stage.call = traced_stage(stage, warmup=1, untraceable=untraceable)
            args = stage_args(stage, env)
            with torch.no_grad():
                env.update(call_stage(stage, args))
            run = _backward(stage, args) if training else _forward(stage, args)
            for _ in range(WARMUP_CALLS):
                run()
            self.runs.append(run)


def _forward(stage: TorchStage, args: list[Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.inference_mode():  # as the pipeline's forward-only workers run
            result = stage.call(*args)
        _synchronize(stage.device)
        return result

    return run


def _synchronize(device: torch.device) -> None:
    """Wait for a GPU stage's kernels, so that the time of a call is the time of its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backward(stage: TorchStage, args: list[Any]) -> Callable[[], Any]:
    consts = {n for n, a in enumerate(stage.args) if a in stage.consts}

    def run() -> tuple[torch.Tensor | None, ...]:
        grads: tuple[torch.Tensor | None, ...]
        with torch.enable_grad():
            leaves = [a if n in consts else detached(a, True) for n, a in enumerate(args)]
            result = stage.call(*leaves)
            outs = [t for t in (result if isinstance(result, (tuple, list)) else [result]) if t.requires_grad]
            wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = (
                torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
                if outs and wrt
                else ()
            )
        _synchronize(stage.device)
        return grads

    return run
