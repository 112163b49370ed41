"""Run a placed model as a pipeline of ``torch.distributed`` ranks (torch counterpart of ``ort_ranks``).

:class:`DistributedPipeline` is built on every rank of a process group. Each
rank lowers the placed model with :func:`placement.to_torch` (all its logical
devices on the rank's one physical device), keeps its own stage of the
:func:`~placement.distributed.split.split_by_rank` chain, and wraps it in
torch's :class:`~torch.distributed.pipelining.PipelineStage`. A schedule from
``torch.distributed.pipelining`` (``ScheduleGPipe`` or ``Schedule1F1B``) runs
the micro-batches; activations and gradients cross ranks with torch's own
point-to-point ops (gloo on CPU, NCCL on GPUs). Nothing here moves tensors or
orders work by itself.

Micro-batches: when the placed graph has static shapes, its batch size *is* the
micro-batch size, and a call with ``k`` times that many rows runs ``k`` micro-batches.
A graph with a dynamic batch (``placement place --dynamic-batch``) takes any rows:
``chunks`` equal micro-batches (one by default). Torch's stages are built for one
micro-batch shape, so rank 0 tells the other ranks each call's micro-batch shapes and
every rank keeps a stage per shape (the last few).

Training: give a ``loss_fn(output, target)`` (mean over the micro-batch);
:meth:`DistributedPipeline.train_step` leaves in each rank's parameters the
gradients of the mean loss over the micro-batches, equal to single-process
training of the same placed model (tied parameters read on several ranks get
the sum of their gradients from every rank). Each rank steps its own optimizer
over :meth:`DistributedPipeline.parameters`.

Failures: every rank runs a heartbeat in the process group's store. When a rank
fails, its peers raise :class:`~placement.distributed.errors.RankFailedError`
naming it (its own message when it could report one), within the process
group's timeout at worst.

Example (one process, a 1-rank pipeline)::

    >>> import os, numpy as np, torch, torch.distributed as dist
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.distributed import DistributedPipeline, free_port
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    >>> with DistributedPipeline(model) as pipe:
    ...     (out,) = pipe.run([np.concatenate([x.numpy()] * 3)])  # 3 micro-batches
    >>> (ref,) = pl.run(model, [x.numpy()], device_map="cpu")
    >>> bool(np.allclose(out[: len(x)], ref, atol=1e-5)), out.shape[0] // len(x)
    (True, 3)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from placement.distributed.backend import uses_nccl
from placement.distributed.member import RankMember, rank_device
from placement.distributed.ranks import RanksLike, format_groups
from placement.distributed.split import RankSplit, split_by_rank, trains_through_shape_tokens
from placement.errors import InputError, PlacementError
from placement.graph.model import Model

__all__ = ["DistributedPipeline", "SCHEDULES", "rank_device", "free_port"]

log = logging.getLogger(__name__)

#: Schedule names accepted by ``schedule=`` (torch.distributed.pipelining classes).
SCHEDULES = ("gpipe", "1f1b")
#: micro-batch shapes a rank keeps a torch stage for (graphs with a dynamic shape)
_KEPT_SHAPES = 4


class DistributedPipeline(RankMember):
    """This rank's stage of a placed model, run with a ``torch.distributed.pipelining`` schedule.

    Build it on every rank of ``group`` (collectively, in the same order on every rank).

    Args:
        model: the placed model, or the path of a placed ``.onnx`` file.
        ranks: which logical devices each rank runs (see
            :func:`~placement.distributed.ranks.rank_groups`); default one device per
            rank in pipeline order.
        schedule: ``"gpipe"`` (fill-drain) or ``"1f1b"`` (one forward, one backward;
            less activation memory when training).
        chunks: the number of micro-batches per call; default: the rows of rank 0's
            inputs divided by the graph's batch size (sent to the other ranks each call),
            or one when the graph's batch is dynamic.
        loss_fn: ``loss_fn(output, target) -> scalar`` for :meth:`train_step`.
        group: the process group (default: the world); its ranks are the stages.
        device: this rank's physical device (default :func:`rank_device`).
        heartbeat: seconds between heartbeats (0: none; failures are then named
            only when the failing rank reports itself).
        grace: seconds a rank waits, after a peer fails, for that peer's report.

    Raises:
        WorldSizeError: the group size differs from the number of ranks of the placement.
        NotAPipelineError: a later rank feeds an earlier one.
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(
        self,
        model: Model | str | Path,
        *,
        ranks: RanksLike = None,
        schedule: str = "gpipe",
        chunks: int | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        group: Any = None,
        device: str | torch.device | None = None,
        heartbeat: float = 0.25,
        grace: float = 3.0,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        from placement.runtime import to_torch  # wherever the lowering module lives

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
        model = self._join_group(
            model,
            kind="pipe",
            ranks=ranks,
            chunks=chunks,
            group=group,
            device=device,
            heartbeat=heartbeat,
            grace=grace,
        )
        self.schedule_name = schedule
        self.loss_fn = loss_fn

        phys = str(self.device)
        module = to_torch(model, device_map={str(d): phys for group_ in self.groups for d in group_})
        self.initializer_paths: dict[str, str] = dict(module.initializer_paths)
        self.split: RankSplit = split_by_rank(module, self.groups, rank=self.rank)
        stage_module = self.split.stages[self.rank]
        assert stage_module is not None
        self.module: torch.fx.GraphModule = stage_module
        #: where activations and gradients cross ranks: the rank's device under NCCL, else the host
        self.comm_device = self.device if uses_nccl(self.device, group) else torch.device("cpu")
        self._pipe_group = group
        on_device = self.comm_device == self.device
        self._staged = self.module if on_device else _HostStaged(self.module, self.device)
        #: this rank's torch stage (for a graph with a dynamic shape: the one of the latest shape)
        self.stage = PipelineStage(
            self._staged, *self._stage_place(), self.comm_device, group=self._pipe_group
        )
        self._dynamic = any(not isinstance(d, int) for spec in self._specs for d in spec.shape)
        self._stages: dict[Any, Any] = {}  # micro-batch shapes -> stage (graphs with a dynamic shape)
        self._schedules: dict[tuple[int, Any, bool], Any] = {}
        self._shared = self._shared_parameters(module)
        log.info(
            "rank %d/%d runs %s on %s (%d nodes; %d values to the next rank)",
            self.rank,
            self.world_size,
            format_groups([self.groups[self.rank]])[0],
            self.device,
            self.split.node_counts[self.rank],
            len(self.split.boundaries[self.rank]) if self.rank < self.world_size - 1 else 0,
        )

    # -- public -------------------------------------------------------------------------------

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's parameters (give them to this rank's optimizer)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters by attribute path (as in ``pl.to_torch(model).named_parameters()``)."""
        return self.module.named_parameters()

    def run(self, inputs: Any = None, *, chunks: int | None = None) -> list[np.ndarray] | None:
        """Run the placed model on a batch: graph outputs on the last rank, None elsewhere.

        Args:
            inputs: on rank 0, the graph inputs (a dict by name or a sequence in input
                order; numpy arrays or tensors) with ``chunks`` times the graph's batch
                size rows; ignored on the other ranks.
            chunks: micro-batches (default: the constructor's, else from rank 0's rows).

        Returns:
            On the last rank, numpy arrays in graph-output order. Each views a fresh
            tensor of this run (the schedule concatenates micro-batch results into new
            tensors) and keeps it alive, so no copy is made and later runs never
            overwrite it.
        """
        args = self._stage_inputs(inputs)
        n, shapes = self._plan(chunks, args)
        schedule = self._schedule(n, shapes, training=False)
        with self._guard("run"), torch.no_grad():
            out = schedule.eval(*args) if self._first_stage else schedule.eval()
        if not self.is_last:
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [t.detach().cpu().numpy() for t in outs]

    def train_step(
        self, inputs: Any = None, target: Any = None, *, chunks: int | None = None
    ) -> torch.Tensor | None:
        """Forward and backward over one batch; gradients accumulate in :meth:`parameters`.

        Args:
            inputs: graph inputs on rank 0 (ignored elsewhere), as for :meth:`run`.
            target: the loss target on the last rank (ignored elsewhere), split into
                micro-batches like the inputs.
            chunks: micro-batches (default as in :meth:`run`).

        Returns:
            The mean loss over the micro-batches on the last rank, None elsewhere.
        """
        if self.loss_fn is None:
            raise PlacementError("train_step needs a loss_fn (DistributedPipeline(..., loss_fn=...))")
        args = self._stage_inputs(inputs)
        n, shapes = self._plan(chunks, args)
        schedule = self._schedule(n, shapes, training=True)
        losses: list[torch.Tensor] = []
        with self._guard("train_step"):
            try:
                if self._last_stage:
                    target_t = self._stage_target(target, n)
                    schedule.step(*args, target=target_t, losses=losses)
                else:
                    schedule.step(*args)
            except RuntimeError as err:
                if "can require gradients" not in str(err) or trains_through_shape_tokens():
                    raise
                raise PlacementError(
                    f"rank {self.rank} receives the shape of an integer value (a shape token: a later "
                    "stage reads the shape of token ids, say), and this torch's pipelining marks every "
                    "received buffer as requiring gradients, which an integer one cannot: train these "
                    "ranks with a newer torch (2.13 trains them), or place the shape reads on the "
                    "stage that computes the value"
                ) from err
            self._sum_shared_gradients()
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def __repr__(self) -> str:
        return (
            f"DistributedPipeline(rank {self.rank}/{self.world_size}, "
            f"devices {format_groups([self.groups[self.rank]])[0]}, {self.schedule_name}, on {self.device})"
        )

    # -- internals ------------------------------------------------------------------------

    # hooks a grid of ranks (tensor_pipeline) changes: which stage this rank runs, over which group

    _pipe_group: Any = None

    def _stage_place(self) -> tuple[int, int]:
        """This rank's stage index and the number of stages of its pipeline."""
        return self.rank, self.world_size

    @property
    def _first_stage(self) -> bool:
        return self.is_first

    @property
    def _last_stage(self) -> bool:
        return self.is_last

    def _stage_inputs(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """The inputs this rank's stage takes from the caller (rank 0's graph inputs)."""
        return self._inputs(inputs) if self.is_first else ()

    def _stage_target(self, target: Any, chunks: int) -> torch.Tensor:
        """The loss target of the last stage's schedule."""
        if target is None:
            raise InputError("train_step needs the loss target on the last rank")
        return torch.as_tensor(np.asarray(target)).to(self.comm_device)

    def _stage_loss(self) -> Callable[..., torch.Tensor] | None:
        return self.loss_fn

    def _inputs(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(a).to(self.comm_device) for a in self._check_inputs(inputs))

    def _plan(self, chunks: int | None, args: tuple[torch.Tensor, ...]) -> tuple[int, Any]:
        """The micro-batch count and, for a graph with a dynamic shape, one micro-batch's input
        shapes (rank 0's, sent to every rank); None for a static graph."""
        rows = args[0].shape[0] if args and args[0].dim() else None
        if not self._dynamic:
            return self._micro_batches(chunks, rows, self._share), None
        plan = None
        if self.is_first:
            n = self._micro_batches(chunks, rows, lambda counted: int(counted or 1))
            for name, array in zip(self.input_names, args):
                if array.dim() and array.shape[0] % n:
                    raise InputError(
                        f"input {name!r} has {array.shape[0]} rows, which do not split into "
                        f"{n} equal micro-batches (chunks={n})"
                    )
            plan = (n, tuple((a.shape[0] // n, *a.shape[1:]) if a.dim() else () for a in args))
        n, shapes = self._share(plan)
        return int(n), tuple(tuple(s) for s in shapes)

    def _share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (an object broadcast; None elsewhere)."""
        box = [value]
        with self._guard("sending the micro-batches"):
            dist.broadcast_object_list(box, src=self._peers[0], group=self.group)
        return box[0]

    def _schedule(self, chunks: int, shapes: Any, *, training: bool) -> Any:
        schedule = self._schedules.get((chunks, shapes, training))
        if schedule is None:
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            stage = self._stage(shapes)
            schedule = cls(stage, n_microbatches=chunks, loss_fn=self._stage_loss() if training else None)
            self._schedules[(chunks, shapes, training)] = schedule
        return schedule

    def _stage(self, shapes: Any) -> Any:
        """The torch stage for micro-batches of ``shapes``: torch sizes a stage's receive buffers
        from the first micro-batch it runs, so each shape of a dynamic graph gets its own."""
        if shapes is None:
            return self.stage
        stage = self._stages.pop(shapes, None)
        if stage is None:
            from torch.distributed.pipelining import PipelineStage

            stage = PipelineStage(
                self._staged, *self._stage_place(), self.comm_device, group=self._pipe_group
            )
            if len(self._stages) >= _KEPT_SHAPES:  # forget the oldest shape and its schedules
                oldest = next(iter(self._stages))
                del self._stages[oldest]
                self._schedules = {k: v for k, v in self._schedules.items() if k[1] != oldest}
        self._stages[shapes] = self.stage = stage  # the latest last
        return stage

    def _shared_parameters(self, module: torch.nn.Module) -> list[tuple[str, torch.Size]]:
        """Parameters read on several ranks (tied weights), with their shapes (known on every rank)."""
        return [(path, module.get_parameter(path).shape) for path in self.split.shared_parameters]

    def _holds_shared(self, path: str) -> bool:
        """Whether this rank's stage reads the tied parameter ``path``."""
        return self.rank in self.split.shared_parameters[path]

    def _sum_shared_gradients(self) -> None:
        """Sum the gradients of tied parameters over the ranks holding them: one all-reduce
        over the pipeline's group (ranks without a parameter add zeros)."""
        if not self._shared:
            return
        parts = []
        for path, shape in self._shared:
            grad = self.module.get_parameter(path).grad if self._holds_shared(path) else None
            parts.append((grad if grad is not None else torch.zeros(shape, device=self.device)).reshape(-1))
        flat = torch.cat(parts).to(self.comm_device)
        dist.all_reduce(flat, group=self._pipe_group)
        flat = flat.to(self.device)
        offset = 0
        for path, shape in self._shared:
            n = shape.numel()
            if self._holds_shared(path):
                self.module.get_parameter(path).grad = flat[offset : offset + n].view(shape).clone()
            offset += n


class _HostStaged(torch.nn.Module):
    """A rank's stage computing on ``device`` whose inputs and outputs are host tensors: what a
    rank on a GPU hands to gloo, which moves host memory only (autograd follows the copies)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self.device = device

    def forward(self, *args: Any) -> Any:
        out = self.module(*(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args))
        if isinstance(out, (tuple, list)):
            return type(out)(o.cpu() if isinstance(o, torch.Tensor) else o for o in out)
        return out.cpu() if isinstance(out, torch.Tensor) else out


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a local ``tcp://`` rendezvous).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
