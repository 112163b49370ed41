"""Run a 2D split (tensor parallelism inside pipeline stages) as a grid of ``torch.distributed`` ranks.

:func:`placement.split_tensor_parallel` with ``devices=[[0, 1], [2, 3]]`` splits each
pipeline stage over its own device group. :class:`DistributedTensorPipeline` runs it with one
rank per device: rank ``g * t + k`` runs device ``k`` of group ``g``
(:func:`~placement.distributed.grid.grid_groups`).

* The ranks of a group run its collectives: each tagged collective is one
  ``torch.distributed`` all-reduce or all-gather on a ``new_group`` of the group's ranks
  (:mod:`~placement.distributed.collectives`, Megatron's f and g in training), as
  :class:`~placement.distributed.DistributedTensorParallel` does over the whole world.
* The ranks with one ``k`` form a pipeline (a ``new_group`` too): this rank's stage
  (:func:`~placement.distributed.grid.split_grid`) is a
  ``torch.distributed.pipelining.PipelineStage`` run by ``ScheduleGPipe`` or ``Schedule1F1B``,
  exactly as in :class:`~placement.distributed.DistributedPipeline` (micro-batches included):
  a value crossing stages goes by point-to-point send/recv from rank ``k`` of group ``g`` to
  rank ``k`` of group ``g + 1``, as the placed graph copies it.

Rank 0 takes the graph inputs and sends them to the ranks of the first group; the rank
computing the graph outputs (the last group's first device) returns them and computes the
loss in training. The last group's other ranks start their backward at the collectives whose
results only that rank reads, with a zero loss. A parameter read at several stages of one
chain (a tied embedding and LM head) gets the sum of the stages' gradients.

Example (one process: the class; see ``docs/distributed.md`` for ranks)::

    >>> from placement.distributed import DistributedTensorPipeline
    >>> DistributedTensorPipeline.__name__
    'DistributedTensorPipeline'
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from placement.distributed.backend import uses_nccl
from placement.distributed.grid import GridStage, grid_groups, split_grid
from placement.distributed.torch_ranks import SCHEDULES, DistributedPipeline, _HostStaged
from placement.errors import InputError, PlacementError
from placement.graph.model import Model

__all__ = ["DistributedTensorPipeline"]

log = logging.getLogger(__name__)


class DistributedTensorPipeline(DistributedPipeline):
    """This rank's device of a 2D-split placed model: a tensor-parallel member of a pipeline stage.

    Build it on every rank of the world (collectively, in the same order on every rank:
    it creates the groups' and the chains' process groups).

    Args:
        model: the placed model (split with ``devices=[[...], [...]]``) or its ``.onnx`` path.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        chunks: micro-batches per call (default: rank 0's rows over the graph's batch size).
        loss_fn: ``loss_fn(output, target) -> scalar`` (mean over a micro-batch) for
            :meth:`train_step`.
        device: this rank's physical device (default
            :func:`~placement.distributed.member.rank_device`).
        heartbeat: seconds between heartbeats (0: none).
        grace: seconds a rank waits, after a peer fails, for that peer's report.
        ordered: all-reduces sum the partials in device order on every rank (bitwise the
            emulated split at any group size; by default a ring all-reduce, bitwise at 2).

    Raises:
        WorldSizeError: the world size differs from the number of devices of the split.
        PlacementError: the model is not a 2D split that ranks can run.
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(
        self,
        model: Model | str | Path,
        *,
        schedule: str = "gpipe",
        chunks: int | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        device: str | torch.device | None = None,
        heartbeat: float = 0.25,
        grace: float = 3.0,
        ordered: bool = False,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        from placement.runtime import to_torch

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
        if not isinstance(model, Model):
            from placement.graph.loading import load

            model = load(model)
        groups = grid_groups(model)
        model = self._join_group(
            model,
            kind="tp2d",
            ranks=[[d] for group in groups for d in group],
            chunks=chunks,
            group=None,
            device=device,
            heartbeat=heartbeat,
            grace=grace,
        )
        self.schedule_name, self.loss_fn = schedule, loss_fn
        self.grid = groups
        t = len(groups[0])
        self.position, self.index = divmod(self.rank, t)
        # every rank creates every group, in one order (new_group is collective over the world)
        tp = [dist.new_group([g * t + k for k in range(t)]) for g in range(len(groups))]
        chains = [dist.new_group([g * t + k for g in range(len(groups))]) for k in range(t)]
        self.tp_group, self._pipe_group = tp[self.position], chains[self.index]
        self.comm_device = self.device if uses_nccl(self.device, None) else torch.device("cpu")
        module = to_torch(model, device_map={str(d): str(self.device) for g in groups for d in g})
        self.initializer_paths: dict[str, str] = dict(module.initializer_paths)
        self.grid_stage: GridStage = split_grid(
            module, model, rank=self.rank, group=self.tp_group, ordered=ordered, comm_device=self.comm_device
        )
        self.module: torch.fx.GraphModule = self.grid_stage.module
        self._staged = (
            self.module if self.comm_device == self.device else _HostStaged(self.module, self.device)
        )
        self.stage = PipelineStage(
            self._staged, *self._stage_place(), self.comm_device, group=self._pipe_group
        )
        self._dynamic = any(not isinstance(d, int) for spec in self._specs for d in spec.shape)
        self._stages: dict[Any, Any] = {}
        self._schedules: dict[tuple[int, Any, bool], Any] = {}
        self._shared = [
            (path, module.get_parameter(path).shape) for path in self.grid_stage.shared_parameters
        ]
        log.info(
            "rank %d/%d runs %s (stage %d of %d, chain %d) on %s: %d collectives, %d values in, %d out",
            self.rank,
            self.world_size,
            self.grid_stage.device,
            self.position,
            len(groups),
            self.index,
            self.device,
            len(self.grid_stage.collectives),
            len(self.grid_stage.inputs),
            len(self.grid_stage.outputs),
        )

    # -- public -------------------------------------------------------------------------------

    @property
    def is_last(self) -> bool:
        """True on the rank that returns the graph outputs (and the loss, when training)."""
        return self.grid_stage.holds_outputs

    @property
    def issued(self) -> dict[str, int]:
        """Collectives this rank has called so far: ``{"forward": n, "backward": m}``
        (torch's first run of a stage infers shapes by running it once more)."""
        return self.grid_stage.issued

    def __repr__(self) -> str:
        return (
            f"DistributedTensorPipeline(rank {self.rank}/{self.world_size}, {self.grid_stage.device}: "
            f"stage {self.position}, chain {self.index}, {self.schedule_name}, on {self.device})"
        )

    # -- the hooks of DistributedPipeline -----------------------------------------------------

    def _stage_place(self) -> tuple[int, int]:
        return self.position, len(self.grid)

    @property
    def _first_stage(self) -> bool:
        return self.position == 0

    @property
    def _last_stage(self) -> bool:
        return self.position == len(self.grid) - 1

    def _stage_inputs(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """Rank 0's graph inputs on every rank of the first group (their shapes go to all ranks)."""
        arrays = self._check_inputs(inputs) if self.is_first else None
        metas = self._share([(a.shape, a.dtype.str) for a in arrays] if arrays is not None else None)
        if not self._first_stage:
            return ()
        tensors = []
        with self._guard("sending the inputs"):
            for i, (shape, dtype) in enumerate(metas):
                if arrays is not None:
                    tensor = torch.from_numpy(np.ascontiguousarray(arrays[i])).to(self.comm_device)
                else:
                    tensor = torch.from_numpy(np.empty(shape, np.dtype(dtype))).to(self.comm_device)
                wire = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
                if len(self.grid[0]) > 1:
                    dist.broadcast(wire, src=0, group=self.tp_group)
                tensors.append(tensor)
        return tuple(tensors)

    def _stage_target(self, target: Any, chunks: int) -> torch.Tensor:
        if self.is_last:
            if target is None:
                raise InputError("train_step needs the loss target on the rank holding the outputs")
            return torch.as_tensor(np.asarray(target)).to(self.comm_device)
        return torch.zeros(chunks, device=self.comm_device)  # one row per micro-batch: unused

    def _stage_loss(self) -> Callable[..., torch.Tensor] | None:
        if self.loss_fn is None:
            raise PlacementError("train_step needs a loss_fn (DistributedTensorPipeline(..., loss_fn=...))")
        return self.loss_fn if self.is_last else _zero_loss

    def _holds_shared(self, path: str) -> bool:
        """Whether this rank's stage of its chain reads the tied parameter ``path`` (the
        gradients are summed over the chain, :meth:`DistributedPipeline._sum_shared_gradients`)."""
        return self.position in self.grid_stage.shared_parameters[path]


def _zero_loss(output: Any, target: Any) -> torch.Tensor:
    """The loss of a last-stage rank without the graph outputs: zero, reaching the collectives
    it takes part in (its outputs), so that their backward runs here too."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    parts = [o.sum() * 0 for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if not parts:
        return torch.zeros((), requires_grad=True)
    return torch.stack(parts).sum()
