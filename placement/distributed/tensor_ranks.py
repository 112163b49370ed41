"""Run a tensor-parallel placed model as ``torch.distributed`` ranks, one device each (SPMD).

:class:`DistributedTensorParallel` is built on every rank of a process group. Each rank
lowers the placed model (:func:`placement.to_torch`) and keeps its device's ops
(:func:`~placement.distributed.spmd.split_spmd`): every tagged collective becomes one
``torch.distributed`` all-reduce or all-gather (gloo on the CPU, NCCL on GPUs) of the rank's
partial or shard, instead of copies of every partial. Rank 0 takes the graph inputs and
broadcasts them; the rank holding the graph outputs (the split puts them on the group's
first device: rank 0) returns them.

Training follows Megatron's f and g (:mod:`~placement.distributed.collectives`): gradients
on every rank equal the unsplit model's (a shard's gradient is the slice of the whole one;
replicated parameters get the whole gradient on every rank that reads them), with dropout
off. The loss is computed on the rank holding the outputs; the other ranks start their
backward at the collectives whose results only that rank reads.

Example (one process, a 1-rank world, so no split: see ``docs/distributed.md`` for ranks)::

    >>> import numpy as np, torch.distributed as dist
    >>> from placement.distributed import DistributedTensorParallel
    >>> DistributedTensorParallel.__name__
    'DistributedTensorParallel'
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
from placement.distributed.member import RankMember
from placement.distributed.spmd import SpmdStage, split_spmd, spmd_devices
from placement.errors import InputError, PlacementError
from placement.graph.model import Model

__all__ = ["DistributedTensorParallel", "SpmdInputs"]

log = logging.getLogger(__name__)


class SpmdInputs(RankMember):
    """What tensor-parallel ranks share: rank 0's graph inputs broadcast to every rank.

    Subclasses set ``comm_device`` (where collectives run) and ``device``.
    """

    comm_device: torch.device

    def _join_split(
        self, model: Model | str | Path, kind: str, *, group: Any, device: Any, heartbeat: float, grace: float
    ) -> tuple[Model, list[Any]]:
        """Load ``model`` (a path) if needed, join the group as one rank per device of the split,
        and set ``comm_device``: the rank's device under NCCL, else the host (gloo; a rank
        computing on a GPU stages its partials through host memory). The model and its devices."""
        if not isinstance(model, Model):
            from placement.graph.loading import load

            model = load(model)
        devices = spmd_devices(model)
        model = self._join_group(
            model,
            kind=kind,
            ranks=[[d] for d in devices],
            chunks=None,
            group=group,
            device=device,
            heartbeat=heartbeat,
            grace=grace,
        )
        self.comm_device = self.device if uses_nccl(self.device, group) else torch.device("cpu")
        return model, devices

    def _broadcast_inputs(self, inputs: Any) -> list[torch.Tensor]:
        """Rank 0's graph inputs on every rank: their shapes (unless the graph fixes them all),
        then the tensors."""
        from placement.runtime.inputs import normalize_inputs

        arrays = normalize_inputs(inputs, self._specs) if self.is_first else None
        with self._guard("sending the inputs"):
            metas = self._static_inputs()
            if metas is None:
                box = [[(a.shape, a.dtype.str) for a in arrays] if arrays is not None else None]
                dist.broadcast_object_list(box, src=self._peers[0], group=self.group)
                metas = box[0]
            if metas is None:
                raise InputError("rank 0 has no graph inputs")
            tensors = []
            for i, (shape, dtype) in enumerate(metas):
                if arrays is not None:
                    tensor = torch.from_numpy(np.ascontiguousarray(arrays[i])).to(self.comm_device)
                else:
                    tensor = torch.empty(shape, dtype=_torch_dtype(np.dtype(dtype)), device=self.comm_device)
                wire = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
                dist.broadcast(wire, src=self._peers[0], group=self.group)
                tensors.append(tensor.to(self.device))
        return tensors

    def _static_inputs(self) -> list[tuple[tuple[int, ...], str]] | None:
        """The inputs' shapes and dtypes when the graph fixes them all (rank 0's inputs are
        checked against them), else None."""
        metas = []
        for spec in self._specs:
            if spec.kind != "tensor" or spec.dtype is None or spec.shape is None:
                return None
            if not all(isinstance(d, int) for d in spec.shape):
                return None
            metas.append((tuple(int(d) for d in spec.shape), np.dtype(spec.dtype).str))
        return metas


class DistributedTensorParallel(SpmdInputs):
    """This rank's device of a tensor-parallel placed model (:func:`placement.split_tensor_parallel`).

    Build it on every rank of ``group`` (collectively, in the same order on every rank):
    rank ``r`` runs the ``r``-th device of the collectives' group.

    Args:
        model: the placed model, or the path of a placed ``.onnx`` file.
        loss_fn: ``loss_fn(output, target) -> scalar`` for :meth:`train_step`.
        group: the process group (default: the world).
        device: this rank's physical device (default
            :func:`~placement.distributed.member.rank_device`).
        heartbeat: seconds between heartbeats (0: none).
        grace: seconds a rank waits, after a peer fails, for that peer's report.
        ordered: sum every all-reduce's partials in device order on each rank (an all-gather
            and a local sum), so outputs are bitwise the emulated split's at any degree;
            by default a ring all-reduce, bitwise equal at two ranks and within rounding
            (the same bits on every rank) at more.

    Raises:
        WorldSizeError: the group size differs from the number of devices of the split.
        PlacementError: the model is not a tensor-parallel split over all its devices.
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(
        self,
        model: Model | str | Path,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        group: Any = None,
        device: str | torch.device | None = None,
        heartbeat: float = 0.25,
        grace: float = 3.0,
        ordered: bool = False,
    ) -> None:
        from placement.runtime import to_torch

        model, devices = self._join_split(
            model, "tp", group=group, device=device, heartbeat=heartbeat, grace=grace
        )
        self.loss_fn = loss_fn
        module = to_torch(model, device_map={str(d): str(self.device) for d in devices})
        self.initializer_paths: dict[str, str] = dict(module.initializer_paths)
        self.stage: SpmdStage = split_spmd(
            module, model, rank=self.rank, group=group, ordered=ordered, comm_device=self.comm_device
        )
        self.module: torch.fx.GraphModule = self.stage.module
        log.info(
            "rank %d/%d runs %s on %s: %d collectives, %d copy-ins",
            self.rank,
            self.world_size,
            devices[self.rank],
            self.device,
            len(self.stage.collectives),
            self.stage.copy_ins,
        )

    # -- public -------------------------------------------------------------------------------

    @property
    def is_last(self) -> bool:
        """True on the rank that returns the graph outputs (and the loss, when training)."""
        return self.stage.holds_outputs

    @property
    def issued(self) -> dict[str, int]:
        """Collectives this rank has called so far: ``{"forward": n, "backward": m}``."""
        return self.stage.issued

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's parameters: its shards and the replicated ones it reads."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters by attribute path (as in ``pl.to_torch(model).named_parameters()``)."""
        return self.module.named_parameters()

    def forward(self, inputs: Any = None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """One forward with autograd: ``(outputs, dangling)`` (see :class:`SpmdStage`)."""
        args = self._broadcast_inputs(inputs)
        with self._guard("forward"):
            outs, dangling = self.module(*args)
        return tuple(outs), tuple(dangling)

    def run(self, inputs: Any = None) -> list[np.ndarray] | None:
        """Run the model: the graph outputs as numpy arrays on the output rank, None elsewhere.

        Args:
            inputs: on rank 0, the graph inputs (a dict by name or a sequence in input
                order; numpy arrays or tensors); ignored on the other ranks.
        """
        with torch.no_grad():
            outs, _ = self.forward(inputs)
        if not self.is_last:
            return None
        return [t.detach().cpu().numpy() for t in outs]

    def train_step(self, inputs: Any = None, target: Any = None) -> torch.Tensor | None:
        """Forward and backward; gradients accumulate in :meth:`parameters`.

        Args:
            inputs: the graph inputs on rank 0 (ignored elsewhere).
            target: the loss target on the output rank (ignored elsewhere).

        Returns:
            The loss on the output rank, None elsewhere.
        """
        if self.loss_fn is None:
            raise PlacementError("train_step needs a loss_fn (DistributedTensorParallel(..., loss_fn=...))")
        if self.is_last and target is None:
            raise InputError("train_step needs the loss target on the rank holding the outputs")
        outs, dangling = self.forward(inputs)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        loss = None
        if self.is_last:
            target_t = torch.as_tensor(np.asarray(target)).to(self.device)
            loss = self.loss_fn(*outs, target_t)
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        for value in dangling:  # results only other ranks read: their gradient comes from there
            if value.requires_grad:
                roots.append(value)
                grads.append(torch.zeros_like(value))
        with self._guard("train_step"):
            if roots:
                torch.autograd.backward(roots, grads)
        return None if loss is None else loss.detach()

    def __repr__(self) -> str:
        where = f"{self.stage.device}, on {self.device}"
        return f"DistributedTensorParallel(rank {self.rank}/{self.world_size}, {where})"

    # -- internals ------------------------------------------------------------------------


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype
