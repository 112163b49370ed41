"""Serve a tensor-parallel placed model as ``torch.distributed`` ranks on ONNX Runtime (inference).

The ONNX Runtime counterpart of :class:`~placement.distributed.DistributedTensorParallel`:
rank ``r`` runs the stages of the ``r``-th device of the split exactly as
:class:`placement.Runner` cuts them (:func:`placement.runtime.stages.split_stages`; a
collective opens a stage), one ``InferenceSession`` each, and every tagged collective is one
``torch.distributed`` call between two of its stages (:func:`tensor_rank_plan`):

* an all-reduce: ``dist.all_reduce`` of the rank's partial; the stage's ``Sum`` then reads
  the reduced value in the rank's own slot and negative zeros in the other devices' slots
  (``x + -0.0 == x`` for every ``x``, signed zeros included), so its result is the
  all-reduce's bits;
* an all-gather: ``dist.all_gather`` of the rank's shard; the stage's ``Concat`` reads
  every device's shard, as in the emulated run.

Ranks issue the collectives in the order of their ids (the split numbers them in graph
order, and a collective's inputs depend only on collectives numbered before it), each as
soon as the rank's share of it is computed. At two ranks the outputs are bitwise those of
``pl.Runner`` on the emulated split with the same threads.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
    >>> plan = tensor_rank_plan(model, 1)
    >>> [step[0] for step in plan.steps]
    ['stage', 'collective', 'stage', 'collective']
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from placement.distributed.spmd import spmd_devices
from placement.distributed.tensor_ranks import SpmdInputs
from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import collective_tag, node_device
from placement.runtime.stages import split_stages

__all__ = ["DistributedTensorParallelRunner", "TensorRankPlan", "tensor_rank_plan"]

log = logging.getLogger(__name__)


@dataclass
class _Collective:
    kind: str
    id: int
    axis: int
    contributions: list[str]  # each device's blob, in group order
    sizes: list[int] | None = None  # all-gather: each device's extent along the axis, when static
    slots: dict[str, int] = field(default_factory=dict)  # blobs the rank's Sum/Concat reads -> device


@dataclass
class TensorRankPlan:
    """What one rank runs: its stages and collectives in one order, and where each stage input comes from.

    Attributes:
        rank: the rank (its device's place in the group).
        device: its logical device.
        steps: ``("stage", Stage)`` and ``("collective", id)`` in run order.
        collectives: id -> the collective (kind, axis, every device's contribution blob).
        sources: stage input blob -> ``("input", i)``, ``("value", blob)``,
            ``("reduced", id)``, ``("zeros", id)`` or ``("gathered", id, device)``.
        outputs: the graph outputs' blobs on this rank (empty where it holds none).
    """

    rank: int
    device: Device
    steps: list[tuple[Any, ...]]
    collectives: dict[int, _Collective]
    sources: dict[str, tuple[Any, ...]]
    outputs: list[str]


def tensor_rank_plan(model: Model, rank: int) -> TensorRankPlan:
    """Rank ``rank``'s stages of a tensor-parallel ``model`` and its collectives, in one order.

    Raises:
        PlacementError: the collectives span several groups, or a stage reads a value of
            another device outside a collective.
    """
    devices = spmd_devices(model)
    me = devices[rank]
    part = split_stages(model)
    transfers = {t.target: t for t in part.transfers}
    inputs = {name: i for i, name in enumerate(part.inputs)}

    def origin(blob: str) -> str:
        while blob in transfers:
            blob = transfers[blob].source
        return blob

    collectives = _collectives(model, devices, origin, me)
    sources: dict[str, tuple[Any, ...]] = {}
    for k, coll in collectives.items():
        for blob, d in coll.slots.items():
            if coll.kind == "all_gather":
                sources[blob] = ("value", blob) if d == rank else ("gathered", k, d)
            else:
                sources[blob] = ("reduced", k) if d == rank else ("zeros", k)
    stages = [s for s in part.stages if s.device == me and s.outputs]
    produced: set[str] = set()
    steps: list[tuple[Any, ...]] = []
    pending = sorted(collectives)
    for stage in stages:
        pending = _issue(pending, collectives, rank, produced, inputs, steps)
        for blob in stage.inputs:
            if blob in sources:
                continue
            root = origin(blob)
            if root in inputs:
                sources[blob] = ("input", inputs[root])
            elif root in produced:
                sources[blob] = ("value", root)
            else:
                raise PlacementError(
                    f"stage {stage.index} on {me} reads {blob!r}, computed on another device outside "
                    "a collective: the model is not a tensor-parallel (SPMD) split that ranks can run"
                )
        steps.append(("stage", stage))
        produced.update(stage.outputs)
    pending = _issue(pending, collectives, rank, produced, inputs, steps)
    if pending:
        raise PlacementError(f"collective #{pending[0]}: rank {rank} never computes its share")
    outputs = []
    for name in part.outputs:
        root = origin(name)
        if root in produced or root in inputs:
            outputs.append(root)
    return TensorRankPlan(
        rank, me, steps, collectives, sources, outputs if len(outputs) == len(part.outputs) else []
    )


def _collectives(model: Model, devices: list[Device], origin: Any, me: Device) -> dict[int, _Collective]:
    """Every collective by id: its kind, axis, each device's contribution, and the blobs the
    rank's own ``Sum`` / ``Concat`` reads (a collective the rank does not read has none)."""
    found: dict[int, _Collective] = {}
    for node in model.graph:
        tag = collective_tag(node)
        if tag is None:
            continue
        k = int(tag["id"])
        names = [(v.name or "") if v is not None else "" for v in node.inputs]
        if len(names) != len(devices):
            raise PlacementError(
                f"collective #{k} ({node.name}) reads {len(names)} values for {len(devices)} devices"
            )
        axis = int(node.attributes["axis"].value) if tag["kind"] == "all_gather" else 0
        coll = found.setdefault(k, _Collective(str(tag["kind"]), k, axis, [origin(n) for n in names]))
        dims = [v.shape[axis] if v is not None and v.shape is not None else None for v in node.inputs]
        if tag["kind"] == "all_gather" and all(isinstance(d, int) for d in dims):
            coll.sizes = [int(d) for d in dims]
        if node_device(node) == me:
            coll.slots.update({name: d for d, name in enumerate(names)})
    return found


def _issue(
    pending: list[int],
    collectives: dict[int, _Collective],
    rank: int,
    produced: set[str],
    inputs: dict[str, int],
    steps: list[tuple[Any, ...]],
) -> list[int]:
    """Append the pending collectives (in id order) whose share this rank has computed."""
    while pending:
        own = collectives[pending[0]].contributions[rank]
        if own not in produced and own not in inputs:
            break
        steps.append(("collective", pending.pop(0)))
    return pending


class DistributedTensorParallelRunner(SpmdInputs):
    """This rank's device of a tensor-parallel placed model, on ONNX Runtime (inference).

    Build it on every rank of ``group`` (collectively): rank ``r`` runs the ``r``-th device
    of the split. Rank 0 takes the graph inputs; the rank holding the graph outputs (rank 0)
    returns them.

    Args:
        model: the placed model, or the path of a placed ``.onnx`` file.
        group: the process group (default: the world).
        device: this rank's physical device (default
            :func:`~placement.distributed.member.rank_device`).
        threads: intra-op threads per stage session (default: ONNX Runtime's choice).
        precision: ``"fp32"`` (TF32 off on GPUs, default) or ``"tf32"``.
        heartbeat: seconds between heartbeats (0: none).
        grace: seconds a rank waits, after a peer fails, for that peer's report.

    Raises:
        WorldSizeError: the group size differs from the number of devices of the split.
        PlacementError: the model is not a tensor-parallel split over all its devices.
    """

    def __init__(
        self,
        model: Model | str | Path,
        *,
        group: Any = None,
        device: str | torch.device | None = None,
        threads: int | None = None,
        precision: str = "fp32",
        heartbeat: float = 0.25,
        grace: float = 3.0,
    ) -> None:
        from placement.runtime.device_map import PhysicalDevice
        from placement.runtime.ort.sessions import stage_session

        model, _ = self._join_split(
            model, "tp-ort", group=group, device=device, heartbeat=heartbeat, grace=grace
        )
        self.plan = tensor_rank_plan(model, self.rank)
        physical = PhysicalDevice(self.device.type, self.device.index or 0)
        self.sessions = {
            step[1].index: stage_session(step[1], physical, threads=threads, precision=precision)
            for step in self.plan.steps
            if step[0] == "stage"
        }
        #: collectives called so far
        self.issued = 0
        log.info(
            "rank %d/%d runs %s on %s (ONNX Runtime): %d stage session(s), %d collectives",
            self.rank,
            self.world_size,
            self.plan.device,
            self.device,
            len(self.sessions),
            len(self.plan.collectives),
        )

    @property
    def is_last(self) -> bool:
        """True on the rank that returns the graph outputs."""
        return bool(self.plan.outputs)

    def run(self, inputs: Any = None) -> list[np.ndarray] | None:
        """Run the model: the graph outputs on the rank holding them (rank 0), None elsewhere.

        Args:
            inputs: on rank 0, the graph inputs (a dict by name or a sequence in input
                order); ignored on the other ranks.
        """
        arrays = [t.cpu().numpy() for t in self._broadcast_inputs(inputs)]
        values: dict[str, np.ndarray] = {}
        results: dict[int, Any] = {}
        with self._guard("run"):
            for step in self.plan.steps:
                if step[0] == "collective":
                    results[step[1]] = self._collective(self.plan.collectives[step[1]], values, arrays)
                    continue
                stage = step[1]
                feeds = {blob: self._source(blob, values, results, arrays) for blob in stage.inputs}
                outs = self.sessions[stage.index].run(list(stage.outputs), feeds)
                values.update(zip(stage.outputs, outs))
        if not self.is_last:
            return None
        index = {name: i for i, name in enumerate(self.input_names)}
        return [np.array(arrays[index[b]]) if b in index else values[b] for b in self.plan.outputs]

    def _source(self, blob: str, values: dict[str, Any], results: dict[int, Any], arrays: list[Any]) -> Any:
        kind, *rest = self.plan.sources[blob]
        if kind == "input":
            return arrays[rest[0]]
        if kind == "value":
            return values[rest[0]]
        if kind == "reduced":
            return results[rest[0]]
        if kind == "zeros":  # another device's slot of the rank's Sum: x + -0.0 is x, bit for bit
            return np.full_like(results[rest[0]], -0.0)
        return results[rest[0]][rest[1]]  # gathered: that device's shard

    def _collective(self, coll: _Collective, values: dict[str, Any], arrays: list[Any]) -> Any:
        own = coll.contributions[self.rank]
        index = {name: i for i, name in enumerate(self.input_names)}
        array = np.ascontiguousarray(arrays[index[own]] if own in index else values[own])
        tensor = torch.from_numpy(array.copy()).to(self.comm_device)
        self.issued += 1
        if coll.kind == "all_reduce":
            dist.all_reduce(tensor, group=self.group)
            return tensor.cpu().numpy()
        sizes = self._sizes(coll, tensor)
        widest = max(sizes)
        axis = coll.axis % tensor.dim()
        if tensor.shape[axis] < widest:
            pad = list(tensor.shape)
            pad[axis] = widest - tensor.shape[axis]
            tensor = torch.cat([tensor, tensor.new_zeros(pad)], axis)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return [p.narrow(axis, 0, n).cpu().numpy() for p, n in zip(parts, sizes)]

    def _sizes(self, coll: _Collective, tensor: torch.Tensor) -> list[int]:
        """Each rank's extent along the all-gather's axis (ragged shards): from the graph, else
        all-gathered first."""
        if coll.sizes is not None:
            return coll.sizes
        axis = coll.axis % tensor.dim()
        size = torch.tensor([tensor.shape[axis]], dtype=torch.int64, device=self.comm_device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        return [int(s.item()) for s in sizes]
