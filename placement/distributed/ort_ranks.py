"""Serve a placed ONNX model as ``torch.distributed`` ranks on ONNX Runtime (no model code).

The ORT counterpart of :class:`~placement.distributed.torch_ranks.DistributedPipeline`,
for inference. Every rank cuts the placed model into stages exactly as
:class:`placement.Runner` does (:func:`placement.runtime.stages.split_stages`),
keeps the stages of its own logical devices (:func:`rank_plan`) and builds one
``InferenceSession`` per stage; its run is a :class:`placement.runtime.ort.program.Program`
over those stages only. What crosses ranks is decided once, identically on every
rank, from the partition: a :class:`Wire` per (blob, receiving rank), sent
straight from the rank that computes the blob to each later rank that reads it
(no pass-through ranks), with ``torch.distributed`` ``isend``/``irecv`` (gloo on
CPU, NCCL on GPUs). Dtypes and shapes come from the graph's value types; a
boundary with a dynamic dimension sends a small shape header first.

numpy <-> torch without copies on the CPU: a received ``torch`` buffer becomes the
stage's input through ``Tensor.numpy()`` and ``OrtValue.ortvalue_from_numpy`` (both
views), and an output ``OrtValue`` is sent through ``torch.from_numpy`` of its view.
On GPUs (NCCL) activations are staged through host memory (one copy each way).

Micro-batches: the graph's batch size is the micro-batch size; ``k`` times as
many rows run ``k`` micro-batches in a fill-drain loop: each rank runs
micro-batch ``i`` as soon as its inputs arrived, sends its results without
waiting and goes on with ``i + 1`` (receives for ``i + 1`` are posted before
``i`` runs), so rank ``r`` computes micro-batch ``i`` while rank ``r + 1``
computes ``i - 1``.

Failures: each rank runs a :class:`~placement.distributed.watchdog.Watchdog`; when
a rank fails the others raise :class:`~placement.distributed.errors.RankFailedError`
naming it.

Example (one process, a 1-rank world)::

    >>> import numpy as np, torch.distributed as dist
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.distributed import DistributedRunner, free_port
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    >>> with DistributedRunner(model) as runner:
    ...     (out,) = runner.run([np.concatenate([x.numpy()] * 3)])  # 3 micro-batches
    >>> (ref,) = pl.run(model, [x.numpy()], device_map="cpu")
    >>> bool(np.allclose(out[: len(x)], ref, atol=1e-5)), out.shape[0] // len(x)
    (True, 3)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from placement.distributed.backend import uses_nccl
from placement.distributed.errors import NotAPipelineError
from placement.distributed.member import RankMember
from placement.distributed.ranks import RanksLike, format_groups
from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.runtime.device_map import DeviceMapLike, PhysicalDevice, resolve_device_map
from placement.runtime.stages import Partition, split_stages

if TYPE_CHECKING:
    from placement.runtime.ort.program import Program

__all__ = ["DistributedRunner", "RankPlan", "Wire", "rank_plan", "rank_program"]

log = logging.getLogger(__name__)

#: dims of a shape header (a dynamic wire sends ``[ndim, d0, d1, ...]`` padded to this + 1)
_MAX_DIMS = 8


@dataclass(frozen=True)
class Wire:
    """One blob sent from rank ``src`` to the later rank ``dst``, once per micro-batch.

    Attributes:
        blob: the value's name in the placed graph.
        src: the rank that computes it (rank 0 for graph inputs).
        dst: the rank that reads it.
        dtype: its numpy dtype.
        shape: its dimensions, None where the graph leaves one symbolic (then a
            shape header travels first); ``None`` altogether for an unknown rank.
    """

    blob: str
    src: int
    dst: int
    dtype: np.dtype
    shape: tuple[int | None, ...] | None

    @property
    def static(self) -> bool:
        """True when the receiver knows the shape beforehand (no header)."""
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


@dataclass
class RankPlan:
    """What one rank runs and what it exchanges, from the whole model's partition.

    Attributes:
        rank: the rank.
        devices: its logical devices.
        partition: its stages and copies, with the graph inputs (rank 0) and the
            received blobs as inputs and the graph outputs (last rank) and the sent
            blobs as outputs: what :func:`placement.runtime.ort.program.compile_program` takes.
        receives: the wires into this rank, in the order they are received.
        sends: the wires out of this rank, in the order they are sent.
        n_graph_inputs: the leading inputs of ``partition`` that are graph inputs.
        n_graph_outputs: the leading outputs of ``partition`` that are graph outputs.
    """

    rank: int
    devices: list[Device]
    partition: Partition
    receives: list[Wire] = field(default_factory=list)
    sends: list[Wire] = field(default_factory=list)
    n_graph_inputs: int = 0
    n_graph_outputs: int = 0


def rank_plan(model: Model, groups: Sequence[Sequence[Device]], rank: int) -> RankPlan:
    """This rank's share of ``model``'s stages and the wires between ranks.

    Every rank computes it alike from the same placed model, so ranks agree on
    what is sent without talking. Graph inputs enter at rank 0; graph outputs
    leave from the last rank (outputs computed on an earlier rank are sent to it).

    Args:
        model: the placed model.
        groups: the logical devices of each rank (:func:`~placement.distributed.ranks.rank_groups`).
        rank: the rank to plan.

    Raises:
        NotAPipelineError: a rank reads a blob computed on a later rank.
        PlacementError: a blob that must cross ranks is not a tensor (a sequence,
            an optional, strings) or has no known type.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> from placement.distributed.ranks import rank_groups
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> model.set_device(model.ops[-1].name, 1)
        >>> plan = rank_plan(model, rank_groups(model), 1)
        >>> [(w.src, w.dst, w.shape) for w in plan.receives], plan.partition.outputs
        ([(0, 1, (4, 32))], ['linear_2'])
    """
    part = split_stages(model)
    groups = [list(g) for g in groups]
    rank_of = {d: r for r, g in enumerate(groups) for d in g}
    last = len(groups) - 1
    if not 0 <= rank <= last:
        raise PlacementError(f"rank {rank} is out of range for {len(groups)} rank(s)")
    stages = [s for s in part.stages if s.outputs]  # a stage whose results nobody reads is skipped
    for s in stages:
        if s.device not in rank_of:
            raise PlacementError(f"stage {s.index} runs on {s.device}, which no rank runs")

    home: dict[str, tuple[int, Device]] = {}  # blob -> (rank, logical device) where it appears
    for name in part.inputs:
        device = part.input_devices[name]
        home[name] = (0, device if rank_of.get(device) == 0 else groups[0][0])
    for s in stages:
        for out in s.outputs:
            home[out] = (rank_of[s.device], s.device)
    for t in part.transfers:
        home[t.target] = (rank_of[t.device], t.device)

    needs: list[tuple[int, Device, str]] = []  # (reading rank, its device, blob), in run order
    for s in stages:
        needs += [(rank_of[s.device], s.device, blob) for blob in s.inputs]
    needs += [(rank_of[t.device], t.device, t.source) for t in part.transfers]
    needs += [(last, groups[last][0], name) for name in part.outputs if name in home]

    types = _value_types(model, stages)
    wires: dict[tuple[str, int], Wire] = {}
    arrive: dict[tuple[str, int], Device] = {}  # where a received blob enters its rank
    for r, device, blob in needs:
        if blob not in home:
            raise PlacementError(f"blob {blob!r} is read on {device} but produced by nothing")
        src, src_device = home[blob]
        if src == r or (blob, r) in wires:
            continue
        if src > r:
            raise NotAPipelineError(
                f"blob {blob!r} is computed on rank {src} ({src_device}) but read on the earlier rank "
                f"{r} ({device}): the ranks do not form a pipeline; run those devices on one rank "
                f"(ranks='...+...') or order the ranks differently"
            )
        wires[blob, r] = _wire(blob, src, r, types.get(blob))
        arrive[blob, r] = device

    mine = groups[rank]
    receives = [w for w in wires.values() if w.dst == rank]
    sends = [w for w in wires.values() if w.src == rank]
    graph_inputs = list(part.inputs) if rank == 0 else []
    graph_outputs = list(part.outputs) if rank == last else []
    inputs = graph_inputs + [w.blob for w in receives]
    outputs = graph_outputs + [b for b in dict.fromkeys(w.blob for w in sends) if b not in graph_outputs]
    input_devices = {name: home[name][1] for name in graph_inputs}
    input_devices.update({w.blob: arrive[w.blob, rank] for w in receives})
    local = Partition(
        stages=[s for s in stages if s.device in mine],
        transfers=[t for t in part.transfers if t.device in mine],
        static_copies=part.static_copies,
        inputs=inputs,
        outputs=outputs,
        input_devices=input_devices,
        output_devices={name: part.output_devices[name] for name in graph_outputs},
    )
    return RankPlan(
        rank=rank,
        devices=list(mine),
        partition=local,
        receives=receives,
        sends=sends,
        n_graph_inputs=len(graph_inputs),
        n_graph_outputs=len(graph_outputs),
    )


def rank_program(
    model: Model,
    plan: RankPlan,
    device_map: dict[Device, PhysicalDevice],
    *,
    threads: int | None = None,
    precision: str = "fp32",
) -> Program:
    """Build the stage sessions of one rank and compile its run.

    The program takes the graph inputs (rank 0) then the received blobs, in
    ``plan.partition.inputs`` order, and returns the graph outputs (last rank) then
    the blobs to send, in ``plan.partition.outputs`` order. No communication: a
    test can chain the programs of every rank in one process.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> from placement.distributed.ranks import rank_groups
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,))
        >>> model.set_device(model.ops[-1].name, 1)
        >>> groups = rank_groups(model)
        >>> plans = [rank_plan(model, groups, r) for r in range(2)]
        >>> cpu = {d: PhysicalDevice("cpu") for d in model.devices}
        >>> sent = rank_program(model, plans[0], cpu).run([x.numpy()])
        >>> (y,) = rank_program(model, plans[1], cpu).run(sent)
        >>> y.shape
        (4, 8)
    """
    from placement.runtime.ort.program import compile_program
    from placement.runtime.ort.sessions import stage_session
    from placement.runtime.ort.steps import StageExec

    execs = {}
    for stage in plan.partition.stages:
        physical = device_map[stage.device]
        session = stage_session(stage, physical, threads=threads, precision=precision)
        execs[stage.index] = StageExec(stage, physical, session)
    return compile_program(model, plan.partition, execs, device_map)


class DistributedRunner(RankMember):
    """This rank's stage sessions of a placed model, run as one rank of a pipeline (inference).

    Build it on every rank of ``group`` (collectively, in the same order on every rank).

    Args:
        model: the placed model, or the path of a placed ``.onnx`` file.
        ranks: which logical devices each rank runs (see
            :func:`~placement.distributed.ranks.rank_groups`); default one device per
            rank in pipeline order.
        chunks: micro-batches per call; default: the rows of rank 0's inputs divided
            by the graph's batch size (sent to the other ranks each call).
        group: the process group (default: the world); its ranks are the stages.
        device: this rank's physical device (default
            :func:`~placement.distributed.member.rank_device`); all the rank's
            logical devices run on it, sharing values.
        device_map: the rank's logical devices -> physical ones instead (see
            :class:`placement.Runner`), e.g. ``"auto"`` to emulate each on the CPU.
        threads: intra-op threads per stage session (default: ONNX Runtime's choice).
        precision: ``"fp32"`` (TF32 off on GPUs, default) or ``"tf32"``, as for
            :class:`placement.Runner`.
        heartbeat: seconds between heartbeats (0: none).
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
        chunks: int | None = None,
        group: Any = None,
        device: str | torch.device | None = None,
        device_map: DeviceMapLike | None = None,
        threads: int | None = None,
        heartbeat: float = 0.25,
        grace: float = 3.0,
        precision: str = "fp32",
    ) -> None:
        model = self._join_group(
            model,
            kind="ort",
            ranks=ranks,
            chunks=chunks,
            group=group,
            device=device,
            heartbeat=heartbeat,
            grace=grace,
        )
        self.plan = rank_plan(model, self.groups, self.rank)
        mine = self.plan.devices
        if device_map is None:
            index = self.device.index or 0
            self.device_map = {d: PhysicalDevice(self.device.type, index) for d in mine}
        else:
            self.device_map = resolve_device_map(mine, device_map, runtime="ort")
        self.program = rank_program(model, self.plan, self.device_map, threads=threads, precision=precision)
        outputs = self.plan.partition.outputs
        self._send_index = [outputs.index(w.blob) for w in self.plan.sends]
        self._prepost = all(w.static for w in self.plan.receives)
        log.info(
            "rank %d/%d runs %s on %s: %d stage session(s), %d value(s) in and %d out per micro-batch",
            self.rank,
            self.world_size,
            format_groups([mine])[0],
            self.device,
            len(self.plan.partition.stages),
            len(self.plan.receives),
            len(self.plan.sends),
        )

    # -- public -------------------------------------------------------------------------------

    def run(self, inputs: Any = None, *, chunks: int | None = None) -> list[np.ndarray] | None:
        """Run the placed model on a batch: graph outputs on the last rank, None elsewhere.

        Args:
            inputs: on rank 0, the graph inputs (a dict by name or a sequence in input
                order; numpy arrays or tensors) with ``chunks`` times the graph's batch
                size rows; ignored on the other ranks.
            chunks: micro-batches (default: the constructor's, else from rank 0's rows).

        Returns:
            On the last rank, numpy arrays in graph-output order (micro-batches joined
            along the first axis).

        Raises:
            RankFailedError: another rank failed (names it).
            InputError: bad inputs on rank 0.
        """
        with self._guard("run"):
            arrays = self._check_inputs(inputs) if self.is_first else []
            n = self._chunks(chunks, arrays)
            parts = [list(p) for p in zip(*(np.array_split(a, n) for a in arrays))] if arrays else []
            results: list[list[Any]] = []
            pending: list[Any] = []  # sends in flight, with the buffers they read
            posted = self._post_receives() if self._prepost else []
            for i in range(n):
                if not self._prepost:  # a shape header comes first: receive when it is due
                    posted = self._post_receives()
                received = self._finish(posted)
                if self._prepost and i + 1 < n:
                    posted = self._post_receives()  # micro-batch i + 1 arrives while i runs
                outs = self.program.run((parts[i] if parts else []) + received)
                for wire, index in zip(self.plan.sends, self._send_index):
                    pending += self._send(wire, outs[index])
                if self.is_last:
                    results.append(outs[: self.plan.n_graph_outputs])
            for work, _ in pending:
                work.wait()
        if not self.is_last:
            return None
        return results[0] if n == 1 else self._join(results)

    def __repr__(self) -> str:
        return (
            f"DistributedRunner(rank {self.rank}/{self.world_size}, "
            f"devices {format_groups([self.plan.devices])[0]}, "
            f"{len(self.plan.partition.stages)} stage(s), on {self.device})"
        )

    # -- internals ------------------------------------------------------------------------

    def _chunks(self, chunks: int | None, arrays: list[Any]) -> int:
        rows = arrays[0].shape[0] if arrays and arrays[0].ndim else None
        return self._micro_batches(chunks, rows, self._share_count)

    def _share_count(self, n: int | None) -> int:
        """Rank 0's micro-batch count on every rank (a tensor broadcast on the wire's device)."""
        box = torch.tensor([n or 0], dtype=torch.int64, device=self._comm_device)
        dist.broadcast(box, src=self._peers[0], group=self.group)
        return int(box.item())

    @property
    def _comm_device(self) -> torch.device:
        """Where activations cross ranks: this rank's GPU under NCCL, host memory otherwise
        (gloo moves host tensors; a rank computing on a GPU it shares goes through the host)."""
        return self.device if uses_nccl(self.device, self.group) else torch.device("cpu")

    def _post_receives(self) -> list[tuple[Wire, Any, torch.Tensor]]:
        posted = []
        for wire in self.plan.receives:
            shape = wire.shape
            if not wire.static:
                header = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self._comm_device)
                dist.recv(header, src=self._peers[wire.src], group=self.group)
                shape = tuple(int(d) for d in header[1 : 1 + int(header[0])].tolist())
            buffer = torch.empty(shape, dtype=_torch_dtype(wire.dtype), device=self._comm_device)
            work = dist.irecv(buffer, src=self._peers[wire.src], group=self.group)
            posted.append((wire, work, buffer))
        return posted

    def _finish(self, posted: list[tuple[Wire, Any, torch.Tensor]]) -> list[np.ndarray]:
        arrays = []
        for wire, work, buffer in posted:
            work.wait()
            array = buffer.numpy() if buffer.device.type == "cpu" else buffer.cpu().numpy()
            arrays.append(array.view(np.bool_) if wire.dtype == np.bool_ else array)
        return arrays

    def _send(self, wire: Wire, array: Any) -> list[tuple[Any, Any]]:
        if not isinstance(array, np.ndarray):
            raise PlacementError(f"blob {wire.blob!r} to rank {wire.dst} is not a tensor at run time")
        array = np.ascontiguousarray(array)
        if array.dtype == np.bool_:
            array = array.view(np.uint8)
        tensor = torch.from_numpy(array)
        if self._comm_device.type == "cuda":
            tensor = tensor.to(self._comm_device)
        dst = self._peers[wire.dst]
        works = []
        if not wire.static:
            if array.ndim > _MAX_DIMS:
                raise PlacementError(
                    f"blob {wire.blob!r} has {array.ndim} dims; at most {_MAX_DIMS} can cross ranks"
                )
            header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
            header[0] = array.ndim
            header[1 : 1 + array.ndim] = torch.tensor(array.shape, dtype=torch.int64)
            header = header.to(self._comm_device)
            works.append((dist.isend(header, dst=dst, group=self.group), header))
        works.append((dist.isend(tensor, dst=dst, group=self.group), (tensor, array)))
        return works

    def _join(self, results: list[list[Any]]) -> list[np.ndarray]:
        joined = []
        for name, parts in zip(self.output_names, zip(*results)):
            if any(np.ndim(p) == 0 for p in parts):
                raise PlacementError(
                    f"graph output {name!r} is a scalar, so micro-batches cannot be joined; "
                    "run one micro-batch per call (chunks=1)"
                )
            joined.append(np.concatenate(parts))
        return joined


# --- helpers ---------------------------------------------------------------------------------


def _value_types(model: Model, stages: Sequence[Any]) -> dict[str, Any]:
    """Blob -> its ``onnx_ir`` value with a type: stage boundaries are typed by the
    partition (shape inference where the exporter left them bare), graph inputs by the model."""
    found: dict[str, Any] = {}
    for stage in stages:
        graph = stage.model.graph
        for value in (*graph.inputs, *graph.outputs):
            if value.type is not None:
                found.setdefault(value.name or "", value)
    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.type is not None:
            found.setdefault(value.name or "", value)
    return found


def _wire(blob: str, src: int, dst: int, value: Any) -> Wire:
    import onnx_ir as ir

    type_ = getattr(value, "type", None)
    if type_ is None:
        raise PlacementError(f"blob {blob!r} crosses from rank {src} to rank {dst} but has no known type")
    if not isinstance(type_, ir.TensorType) or type_.dtype == ir.DataType.STRING:
        raise PlacementError(
            f"blob {blob!r} ({type_}) crosses from rank {src} to rank {dst}; only tensors of numbers "
            "can be sent between ranks: put its producer and readers on one rank"
        )
    try:
        dtype = np.dtype(type_.dtype.numpy())
        _torch_dtype(dtype)
    except (TypeError, ValueError, KeyError) as err:
        raise PlacementError(
            f"blob {blob!r} ({type_.dtype}) crosses from rank {src} to rank {dst}, "
            f"but torch.distributed cannot send that dtype: {err}"
        ) from None
    shape = value.shape
    dims = None if shape is None else tuple(d if isinstance(d, int) else None for d in shape)
    return Wire(blob, src, dst, dtype, dims)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype a wire of ``dtype`` travels as (booleans as bytes)."""
    if dtype == np.bool_:
        return torch.uint8
    return torch.from_numpy(np.empty(0, dtype)).dtype
