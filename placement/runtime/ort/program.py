"""The compiled run of a placed model on ONNX Runtime: typed steps over a value table.

:class:`placement.runtime.ort.Runner` partitions a model into stages and builds
one session per stage; :func:`compile_program` then turns the partition into a
:class:`Program`, a flat list of steps that a run walks in order (as
``torch.fx.Interpreter`` walks its nodes), each step reading and writing a
*value table* (key -> ``OrtValue`` or host value):

* :class:`~placement.runtime.ort.steps.StageStep` runs a stage session on ``OrtValue`` s: on the CPU with the
  session's native ``run_with_ort_values`` (one call; the run allocates fresh outputs),
  on a GPU with ``run_with_iobinding`` (outputs bound to, and allocated on, the GPU);
* :class:`~placement.runtime.ort.steps.HostStep` runs a stage whose boundary carries
  sequences, optionals or string tensors with ``InferenceSession.run`` (which takes and
  returns them as lists, ``None`` and object arrays);
* :class:`~placement.runtime.ort.steps.TransferStep` moves a blob to another device
  (:func:`~placement.runtime.ort.values.transfer_kind` says how: share, host copy,
  host <-> GPU, GPU -> GPU).

Every step carries the keys whose last reader it is (``free``), so intermediate
values are dropped as soon as possible. :meth:`Program.collect` hands the graph
outputs back as numpy arrays that own their memory (or keep their ``OrtValue``
alive), so later allocations can never overwrite them; or, asked for device
outputs (``outputs="torch"`` / ``"ortvalue"``, see
:data:`~placement.runtime.ort.values.OUTPUT_KINDS`), as torch tensors over the
``OrtValue`` s' memory (DLPack, no copy) or the ``OrtValue`` s
themselves, on the device that made them.

Host copies: every copy of a tensor through host memory that a run makes (a graph
input fed from numpy to a GPU, a transfer to or from the host, an output on a GPU
handed back as numpy) is counted in :data:`~placement.runtime.ort.values.HOST_COPIES`; with device-resident
inputs and outputs, stages on GPUs make none (the GPU tests assert it).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> runner = pl.Runner(model, device_map="cpu", fold=False)
    >>> [type(step).__name__ for step in runner.program.steps]
    ['StageStep', 'TransferStep', 'StageStep']
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort.steps import HostStep, StageExec, StageStep, Step, TransferStep
from placement.runtime.ort.values import (
    _CPU,
    _HOST,
    ALIAS,
    _is_native,
    _is_tensor,
    _is_torch,
    _owned,
    host_array,
    ortvalue,
    place,
    to_output,
    transfer_kind,
)
from placement.runtime.stages import Partition, Stage

__all__ = ["NativeRun", "Program", "compile_program"]

log = logging.getLogger(__name__)


@dataclass
class Program:
    """The precomputed run: graph inputs, steps, and where the graph outputs are.

    Attributes:
        partition: the stages the program runs.
        feeds: (graph input, the physical device it is fed on), in input order.
        steps: what a run does, in order.
        outputs: per graph output, its value-table key and ``None``, or its
            name and a constant (an output that is a parameter).
        resident: streamed parameters (value-table key -> the value on its host), which
            every run's transfers copy to the devices that read them.
        concurrent: the same run with independent stages at once
            (:class:`~placement.runtime.ort.concurrent.ConcurrentRun`), where the stages
            form a DAG wider than a chain and the runner runs concurrently; None otherwise.
        native: the same run without per-step Python, where every stage runs
            natively on the CPU and every transfer is an alias (see
            :class:`NativeRun`); None otherwise. :meth:`run` uses it; pipelines
            walk :attr:`steps`, one micro-batch at a time.
    """

    partition: Partition
    feeds: list[tuple[str, PhysicalDevice]]
    steps: list[Step] = field(default_factory=list)
    #: streamed parameters, as values on their host: every run's table starts with them
    resident: dict[str, Any] = field(default_factory=dict)
    outputs: list[tuple[str, np.ndarray | None]] = field(default_factory=list)
    native: NativeRun | None = None
    concurrent: Any = None  # a ConcurrentRun where independent stages may run at once

    @property
    def n_transfers(self) -> int:
        """Transfers per run that move data (aliases excluded)."""
        return sum(1 for step in self.steps if isinstance(step, TransferStep) and step.moves_data)

    @property
    def n_handovers(self) -> int:
        """Transfers per run between devices, aliases included (what separate GPUs would copy)."""
        return sum(1 for step in self.steps if isinstance(step, TransferStep))

    def feed(self, arrays: list[Any]) -> dict[str, Any]:
        """The value table of one run, holding the graph inputs on their devices (numpy arrays,
        ``OrtValue`` s or torch tensors; see :func:`place`) and the streamed parameters on their
        host."""
        values = dict(self.resident)
        values.update((name, place(array, physical)) for (name, physical), array in zip(self.feeds, arrays))
        return values

    def collect(self, values: dict[str, Any], kind: str = "numpy") -> list[Any]:
        """The graph outputs of a finished run, in graph-output order, each owning its memory,
        as ``kind`` says (:data:`OUTPUT_KINDS`). An output that is a graph input (the caller's
        own memory) is copied for device kinds."""
        if kind == "numpy":
            return [host_array(values[key]) if const is None else const.copy() for key, const in self.outputs]
        fed = {name for name, _ in self.feeds}
        return [
            to_output(const.copy() if const is not None else values[key], kind, copy=key in fed)
            for key, const in self.outputs
        ]

    def run(self, arrays: list[Any], kind: str = "numpy") -> list[Any]:
        """One whole run: feed, every step, collect (by :attr:`concurrent` or :attr:`native`
        where one is set)."""
        if self.concurrent is not None:
            return self.concurrent.run(arrays, kind)
        if self.native is not None:
            return self.native.run(arrays, kind)
        values = self.feed(arrays)
        for step in self.steps:
            step.run(values)
        return self.collect(values, kind)


@dataclass(frozen=True)
class NativeRun:
    """A :class:`Program` run with its Python cut to the stage calls.

    Where every stage of a program runs natively on the CPU and every transfer is an
    alias (logical devices emulated on the CPU; ``Runner(device_map="cpu")``), a run
    is: wrap the inputs, call each stage's native ``run_with_ort_values`` on the
    values it reads, collect. This does that with ``onnxruntime``'s native values
    throughout, aliases resolved once here instead of a step each per run, and no
    step objects. The Python of a run costs far more than its hot-loop time
    suggests, because after a stage's kernels the interpreter's objects are out of
    the caches: on bench resnet (two stages, 20 ms) the step walk cost 0.2 ms more
    than the two native calls alone, this about 0.1 ms. Same results as walking
    :attr:`Program.steps` (tests compare both bit for bit).

    Attributes:
        feeds: the value-table key of each graph input, in input order.
        stages: per stage in run order: its exec, (session input, key) pairs, its
            outputs, and the keys whose last reader it is.
        outputs: as :attr:`Program.outputs`, aliases resolved.
    """

    feeds: tuple[str, ...]
    stages: tuple[tuple[StageExec, tuple[tuple[str, str], ...], list[str], tuple[str, ...]], ...]
    outputs: tuple[tuple[str, np.ndarray | None], ...]
    resident: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, program: Program) -> NativeRun | None:
        """The native run of ``program``, or None where some step needs its own Python
        (a GPU stage, a host-value stage, a transfer that moves data) or a graph
        output is a graph input."""
        if any(physical.is_cuda for _, physical in program.feeds):
            return None
        alias: dict[str, str] = {}
        stages: list[tuple[StageExec, tuple[tuple[str, str], ...], list[str]]] = []
        for step in program.steps:
            if isinstance(step, TransferStep) and step.kind == ALIAS:
                alias[step.target] = alias.get(step.source, step.source)
            elif isinstance(step, StageStep) and step.exec.direct is not None:
                bind = tuple((name, alias.get(key, key)) for name, key in step.bind)
                stages.append((step.exec, bind, list(step.outputs)))
            else:
                return None
        feeds = tuple(name for name, _ in program.feeds)
        outputs = tuple(
            (alias.get(key, key) if const is None else key, const) for key, const in program.outputs
        )
        if any(const is None and key in feeds for key, const in outputs):
            return None
        reads = [[key for _, key in bind] for _, bind, _ in stages]
        frees = _last_reads(reads, {key for key, const in outputs if const is None} | set(program.resident))
        resident = tuple((key, value._ortvalue) for key, value in program.resident.items())
        return cls(feeds, tuple((*stage, free) for stage, free in zip(stages, frees)), outputs, resident)

    def run(self, arrays: list[Any], kind: str = "numpy") -> list[Any]:
        """One whole run on ``arrays`` (graph inputs in order): the graph outputs, in
        order, each owning its memory or keeping its value alive (as ``kind`` says,
        :data:`OUTPUT_KINDS`)."""
        values = self.feed(arrays)
        for ex, bind, outputs, free in self.stages:
            try:
                results = ex.direct({name: values[key] for name, key in bind}, outputs, None)
            except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
                raise ex.error(err) from err
            for i, name in enumerate(outputs):  # indexing: one native call per output,
                values[name] = results[i]  # where iterating takes one more per stage
            for key in free:
                del values[key]
        return self.collect(values, kind)

    def feed(self, arrays: list[Any]) -> dict[str, Any]:
        """The value table of a run: the graph inputs (``arrays``, in order) as native values,
        and the streamed parameters. Native values over numpy arrays do not keep them alive:
        the caller holds ``arrays`` until the run ends."""
        values: dict[str, Any] = dict(self.resident)
        for key, array in zip(self.feeds, arrays):
            if _is_tensor(array):
                values[key] = _C.OrtValue.ortvalue_from_numpy(array, _CPU)
            elif isinstance(array, ort.OrtValue) or _is_torch(array):
                values[key] = place(array, _HOST)._ortvalue
            else:
                values[key] = array
        return values

    def collect(self, values: dict[str, Any], kind: str = "numpy") -> list[Any]:
        """The graph outputs of a finished run's table, each owning its memory or keeping its
        value alive (as ``kind`` says)."""
        collected = []
        for key, const in self.outputs:
            if const is not None:
                collected.append(const.copy() if kind == "numpy" else to_output(const.copy(), kind))
                continue
            value = values[key]
            if kind == "numpy":
                collected.append(_owned(value, value.numpy()))
            else:
                collected.append(to_output(ort.OrtValue(value) if _is_native(value) else value, kind))
        return collected

    def views(self, values: dict[str, Any]) -> list[np.ndarray]:
        """The graph outputs of a finished run's table as host views, valid while ``values``
        holds them (for joining micro-batches without a copy of each)."""
        return [values[key].numpy() if const is None else const for key, const in self.outputs]


# --- compiling ---------------------------------------------------------------------------


def compile_program(
    model: Model,
    part: Partition,
    execs: dict[int, StageExec],
    device_map: dict[Device, PhysicalDevice],
) -> Program:
    """Turn a partition with built sessions into a :class:`Program`.

    Args:
        model: the (placed) model the partition was cut from; parameter outputs
            are read from it.
        part: the stages, transfers, inputs and outputs.
        execs: stage index -> its session (stages left out compute nothing read).
        device_map: logical -> physical device of every device ``part`` uses.

    Raises:
        PlacementError: a blob is read before anything produces it, or a graph
            output is produced by nothing.
    """
    return _Compiler(model, part, execs, device_map).compile()


class _Compiler:
    """Places steps in order, tracking where each blob lives, then computes frees."""

    def __init__(
        self,
        model: Model,
        part: Partition,
        execs: dict[int, StageExec],
        device_map: dict[Device, PhysicalDevice],
    ) -> None:
        self.model, self.part, self.execs, self.dmap = model, part, execs, device_map
        self.where: dict[tuple[str, Device], str] = {}  # (blob, logical device) -> value-table key
        self.home: dict[str, Device] = {}  # blob -> device where it was produced / fed
        self.steps: list[Step] = []
        self.reads: list[list[str]] = []  # per step: the keys it reads
        self.pending = list(part.transfers)

    def compile(self) -> Program:
        part = self.part
        program = Program(partition=part, feeds=[])
        for name in part.inputs:
            device = part.input_devices[name]
            self._produced(name, device)
            program.feeds.append((name, self.dmap[device]))
        inits = self.model.graph.initializers
        for name, host in part.streamed.items():  # streamed parameters: host values, read every run
            data = inits[name].const_value
            if data is None:
                raise PlacementError(f"streamed parameter {name!r} has no data")
            self._produced(name, host)
            program.resident[name] = ortvalue(np.ascontiguousarray(data.numpy()), self.dmap[host])
        self._flush_transfers()
        for stage in part.stages:
            ex = self.execs.get(stage.index)
            if ex is not None:
                self._flush_transfers(streamed_for=set(stage.inputs))
                self._add_stage(stage, ex)
                self._flush_transfers()
        self._flush_transfers(streamed_for=None)  # streamed copies no stage reads (graph outputs)
        if self.pending:
            names = ", ".join(repr(t.op) for t in self.pending)
            raise PlacementError(f"copies {names} read blobs that no stage produces")
        program.outputs = self._outputs()
        program.steps = self._with_frees({key for key, const in program.outputs if const is None})
        program.native = NativeRun.of(program)
        return program

    def _produced(self, blob: str, device: Device, key: str | None = None) -> None:
        self.where[(blob, device)] = key or blob
        self.home[blob] = device

    def _add_stage(self, stage: Stage, ex: StageExec) -> None:
        bind = tuple((name, self._deliver(name, stage.device)) for name in stage.inputs)
        outputs = tuple(stage.outputs)
        if _host_values(ex.session):
            self._append(HostStep(ex, bind, outputs), [key for _, key in bind])
        else:
            ex.out_device = ("cuda", ex.physical.index) if ex.physical.is_cuda else ("cpu", 0)
            ex.direct = _direct_run(ex.session, ex.physical)
            ex.binding = ex.new_binding(outputs)
            self._append(StageStep(ex, bind, outputs), [key for _, key in bind])
        for out in outputs:
            self._produced(out, stage.device)

    def _deliver(self, blob: str, device: Device) -> str:
        """The value-table key of ``blob`` on ``device``, adding a transfer if needed."""
        key = self.where.get((blob, device))
        if key is not None:
            return key
        src_device = self.home.get(blob)
        if src_device is None:
            raise PlacementError(f"blob {blob!r} is read before any stage produces it")
        key = f"{blob}@{device}"
        self._add_transfer(self.where[(blob, src_device)], key, src_device, device)
        self.where[(blob, device)] = key
        return key

    def _add_transfer(self, source: str, target: str, src: Device, dst: Device) -> None:
        kind = transfer_kind(self.dmap[src], self.dmap[dst], same_logical=src == dst)
        self._append(TransferStep(kind, source, target, self.dmap[dst]), [source])

    def _flush_transfers(self, streamed_for: set[str] | None | bool = False) -> None:
        """Add the explicit copies whose source exists by now. A streamed parameter's copy waits
        for the stage that reads it (``streamed_for``: that stage's inputs; None: add them all),
        so that the device holds only the streamed weights of the stage that runs
        (see :mod:`.stream_split`)."""
        waiting = []
        for tr in self.pending:
            if tr.source in self.part.streamed and streamed_for is not None:
                ready = streamed_for is not False and tr.target in streamed_for
            else:
                ready = True
            if ready and tr.source in self.home:
                src_device = self.home[tr.source]
                self._add_transfer(self._deliver(tr.source, src_device), tr.target, src_device, tr.device)
                self._produced(tr.target, tr.device)
            else:
                waiting.append(tr)
        self.pending = waiting

    def _append(self, step: Step, reads: list[str]) -> None:
        self.steps.append(step)
        self.reads.append(reads)

    def _outputs(self) -> list[tuple[str, np.ndarray | None]]:
        """Each graph output: a value-table key, or a constant (a parameter output)."""
        outputs: list[tuple[str, np.ndarray | None]] = []
        inits = self.model.graph.initializers
        for name in self.part.outputs:
            device = self.home.get(name)
            if device is not None:
                outputs.append((self.where[(name, device)], None))
            elif name in inits or name in self.part.static_copies:
                param = inits[self.part.static_copies.get(name, name)]
                outputs.append((name, np.array(param.const_value.numpy())))
            else:
                raise PlacementError(f"graph output {name!r} is produced by no op")
        return outputs

    def _with_frees(self, keep: set[str]) -> list[Step]:
        """The steps, each freeing the keys it reads last (graph outputs are kept)."""
        return [replace(step, free=free) for step, free in zip(self.steps, _last_reads(self.reads, keep))]


def _last_reads(reads: list[list[str]], keep: set[str]) -> list[tuple[str, ...]]:
    """Per step (``reads[i]``: the keys step ``i`` reads), the keys it is the last
    reader of, except those in ``keep``: what it may free."""
    last: dict[str, int] = {}
    for i, keys in enumerate(reads):
        for key in keys:
            last[key] = i
    frees: list[list[str]] = [[] for _ in reads]
    for key, i in last.items():
        if key not in keep:
            frees[i].append(key)
    return [tuple(free) for free in frees]


def _direct_run(session: ort.InferenceSession, physical: PhysicalDevice) -> Any:
    """The native ``run_with_ort_values`` of a CPU stage's session, or None.

    ``InferenceSession.run_with_ort_values`` re-validates its inputs and their
    owning sessions in Python on every call (tens of microseconds, more than the
    run of a small stage); the native method it wraps takes the same values. None
    for a GPU stage (it binds its outputs to the device instead) or where this
    onnxruntime build has no such method (the stage then binds on the CPU).
    """
    if physical.is_cuda:
        return None
    return getattr(getattr(session, "_sess", None), "run_with_ort_values", None)


def _host_values(session: ort.InferenceSession) -> bool:
    """Whether a stage session takes or returns values that ``OrtValue`` s from numpy
    cannot hold (sequences, optionals, maps, string tensors): such a stage runs with
    ``InferenceSession.run`` on host values, which takes and returns them as ONNX
    Runtime's Python API does (lists of arrays, ``None``, object arrays)."""
    for arg in (*session.get_inputs(), *session.get_outputs()):
        if not arg.type.startswith("tensor(") or arg.type == "tensor(string)":
            return True
    return False
