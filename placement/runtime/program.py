"""The compiled run of a placed model on ONNX Runtime: typed steps over a value table.

:class:`placement.runtime.ort.Runner` partitions a model into stages and builds
one session per stage; :func:`compile_program` then turns the partition into a
:class:`Program`, a flat list of steps that a run walks in order (as
``torch.fx.Interpreter`` walks its nodes), each step reading and writing a
*value table* (key -> ``OrtValue`` or host value):

* :class:`StageStep` runs a stage session on ``OrtValue`` s: on the CPU with the
  session's native ``run_with_ort_values`` (one call; the run allocates fresh outputs),
  on a GPU with ``run_with_iobinding`` (outputs bound to, and allocated on, the GPU);
* :class:`HostStep` runs a stage whose boundary carries sequences, optionals or
  string tensors with ``InferenceSession.run`` (which takes and returns them as
  lists, ``None`` and object arrays);
* :class:`TransferStep` moves a blob to another device (:func:`transfer_kind`
  says how: share, host copy, host <-> GPU, GPU -> GPU).

Every step carries the keys whose last reader it is (``free``), so intermediate
values are dropped as soon as possible. :meth:`Program.collect` hands the graph
outputs back as numpy arrays that own their memory (or keep their ``OrtValue``
alive), so later allocations can never overwrite them; or, asked for device
outputs (``outputs="torch"`` / ``"ortvalue"``, see :data:`OUTPUT_KINDS`), as torch
tensors over the ``OrtValue`` s' memory (DLPack, no copy) or the ``OrtValue`` s
themselves, on the device that made them.

Host copies: every copy of a tensor through host memory that a run makes (a graph
input fed from numpy to a GPU, a transfer to or from the host, an output on a GPU
handed back as numpy) is counted in :data:`HOST_COPIES`; with device-resident
inputs and outputs, stages on GPUs make none (the GPU tests assert it).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> runner = pl.Runner(model, device_map="cpu")
    >>> [type(step).__name__ for step in runner.program.steps]
    ['StageStep', 'TransferStep', 'StageStep']
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.stages import Partition, Stage

__all__ = [
    "HOST_COPIES",
    "OUTPUT_KINDS",
    "HostCopies",
    "HostStep",
    "NativeRun",
    "Program",
    "StageExec",
    "StageStep",
    "Step",
    "TransferStep",
    "compile_program",
    "place",
    "to_output",
    "transfer_kind",
]

log = logging.getLogger(__name__)

#: The host device of native ``OrtValue`` s (:class:`NativeRun`).
_CPU = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)

#: How a blob moves between two physical devices (see :func:`transfer_kind`).
ALIAS, TO_GPU, TO_HOST, GPU_TO_GPU = "alias", "h2d", "d2h", "d2d"
_warned_d2d_fallback = False

#: What :meth:`Program.collect` (and ``Runner.run(outputs=...)``) hands back: host numpy arrays
#: (the default), torch tensors on the outputs' devices (DLPack, no copy), or ``OrtValue`` s.
OUTPUT_KINDS = ("numpy", "torch", "ortvalue")


class HostCopies:
    """A process-wide count of tensor copies through host memory (see the module docstring).

    Example:
        >>> before = HOST_COPIES.count
        >>> HOST_COPIES.add()
        >>> HOST_COPIES.count - before
        1
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int = 1) -> None:
        """Count ``n`` more copies."""
        with self._lock:
            self.count += n


#: The count of host copies made by runs in this process.
HOST_COPIES = HostCopies()


@dataclass
class StageExec:
    """A stage with its physical device and session (and, once compiled, how it runs).

    Attributes:
        stage, physical, session: the stage, its device and its session.
        binding: the stage's own ``IOBinding`` (stages on a GPU; None on the CPU).
        out_device: where a GPU stage's outputs are allocated.
        direct: for a stage on the CPU, the session's native ``run_with_ort_values``
            (see :meth:`StageStep.call`); None where outputs are bound instead.
    """

    stage: Stage
    physical: PhysicalDevice
    session: ort.InferenceSession
    binding: Any = None
    out_device: tuple[str, int] = ("cpu", 0)
    direct: Any = None

    def new_binding(self, outputs: tuple[str, ...]) -> Any:
        """An ``IOBinding`` of this stage's session with ``outputs`` bound to its device
        (None for a stage that runs without one, see :meth:`StageStep.call`)."""
        if self.direct is not None:
            return None
        binding = self.session.io_binding()
        self.bind_outputs(binding, outputs)
        return binding

    def bind_outputs(self, binding: Any, outputs: tuple[str, ...]) -> None:
        """Bind ``outputs`` of ``binding`` to this stage's device (fresh buffers each run)."""
        device_type, device_id = self.out_device
        for name in outputs:
            binding.bind_output(name, device_type, device_id)

    def error(self, err: Exception) -> PlacementError:
        """ONNX Runtime failed while running this stage: say which stage, device and ops."""
        ops = self.stage.ops
        span = f"op {ops[0]!r}" if len(ops) == 1 else f"ops {ops[0]!r} .. {ops[-1]!r}"
        return PlacementError(
            f"stage {self.stage.index} ({self.stage.device} -> {self.physical}, {span}) "
            f"failed in ONNX Runtime: {_first_line(err)}"
        )


# --- steps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageStep:
    """Run a stage session on ``OrtValue`` s (activations stay on the device).

    :meth:`run` is :meth:`inputs`, :meth:`call`, :meth:`store` in turn (separate
    so that ``benchmarks/runtime.py --explain`` can time each).

    Attributes:
        exec: the stage, its device and session.
        bind: (session input name, value-table key) pairs.
        outputs: the stage's outputs (also their value-table keys).
        free: keys whose last reader this step is.
    """

    exec: StageExec
    bind: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    free: tuple[str, ...] = ()

    def run(self, values: dict[str, Any], binding: Any = None) -> None:
        """Run on ``values`` (``binding``: an ``IOBinding`` of a GPU stage's session
        to use instead of the stage's own; a pipeline gives each worker its own)."""
        self.store(values, self.call(self.inputs(values), binding))

    def inputs(self, values: dict[str, Any]) -> dict[str, ort.OrtValue]:
        """The session's inputs, read from ``values`` (host tensors from a host-value
        stage become ``OrtValue`` s on the stage's device, in ``values`` too)."""
        physical = self.exec.physical
        feeds = {}
        for name, key in self.bind:
            value = values[key]
            if not isinstance(value, ort.OrtValue):
                value = values[key] = ortvalue(value, physical)
            feeds[name] = value
        return feeds

    def call(self, feeds: dict[str, ort.OrtValue], binding: Any = None) -> list[ort.OrtValue]:
        """Run the session on ``feeds``; the outputs, in fresh buffers on the stage's device.

        A stage on the CPU calls the session's native ``run_with_ort_values``
        (outputs are allocated by the run, one call, none of the Python checks the
        public wrapper repeats each run); a stage on a GPU runs through an
        ``IOBinding`` whose outputs are bound to its device (``run_with_ort_values``
        would hand them back in host memory), cleared and bound again after the run
        so the next run allocates fresh buffers (returned arrays are never overwritten).
        """
        ex = self.exec
        if ex.direct is not None:
            try:
                native = ex.direct({name: v._ortvalue for name, v in feeds.items()}, self.outputs, None)
            except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
                raise ex.error(err) from err
            return [ort.OrtValue(native[i]) for i in range(len(self.outputs))]
        binding = ex.binding if binding is None else binding
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        try:
            ex.session.run_with_iobinding(binding)
        except Exception as err:
            binding.clear_binding_inputs()
            raise ex.error(err) from err
        outputs = binding.get_outputs()
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        ex.bind_outputs(binding, self.outputs)
        return outputs

    def store(self, values: dict[str, Any], outputs: list[ort.OrtValue]) -> None:
        """Put the outputs into ``values``; drop the keys this step read last."""
        _store(values, self.outputs, outputs, self.free)


@dataclass(frozen=True)
class HostStep:
    """Run a stage on host values (sequences, optionals or strings cross its boundary).

    :meth:`run` is :meth:`inputs`, :meth:`call`, :meth:`store` in turn, as for :class:`StageStep`.
    """

    exec: StageExec
    bind: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    free: tuple[str, ...] = ()

    def run(self, values: dict[str, Any], binding: Any = None) -> None:
        """Run on ``values`` with ``InferenceSession.run`` (``binding`` is unused)."""
        self.store(values, self.call(self.inputs(values)))

    def inputs(self, values: dict[str, Any]) -> dict[str, Any]:
        """The session's inputs, read from ``values`` as host values."""
        return {name: _host(values[key]) for name, key in self.bind}

    def call(self, feeds: dict[str, Any], binding: Any = None) -> list[Any]:
        """Run the session on ``feeds``; its outputs as host values."""
        try:
            return self.exec.session.run(list(self.outputs), feeds)
        except Exception as err:  # noqa: BLE001 (re-raised as a PlacementError naming the stage)
            raise self.exec.error(err) from err

    def store(self, values: dict[str, Any], outputs: list[Any]) -> None:
        """Put the outputs into ``values``; drop the keys this step read last."""
        _store(values, self.outputs, outputs, self.free)


@dataclass(frozen=True)
class TransferStep:
    """Move the value at ``source`` to ``physical`` as ``target`` (see :func:`transfer_kind`)."""

    kind: str
    source: str
    target: str
    physical: PhysicalDevice
    free: tuple[str, ...] = ()

    @property
    def moves_data(self) -> bool:
        """False for an alias (both ends share the value)."""
        return self.kind != ALIAS

    def run(self, values: dict[str, Any], binding: Any = None) -> None:
        """Run on ``values`` (``binding`` is unused)."""
        value = values[self.source]
        if not isinstance(value, ort.OrtValue):
            values[self.target] = value if self.kind == ALIAS else _host_copy(value)
        else:
            try:
                values[self.target] = move(value, self.kind, self.physical)
            except PlacementError:
                raise
            except Exception as err:  # an allocation on the destination device failed
                raise PlacementError(
                    f"moving blob {self.source!r} to {self.physical} failed: {_first_line(err)}"
                ) from err
        _drop(values, self.free)


Step = StageStep | HostStep | TransferStep


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
            return [to_numpy(values[key]) if const is None else const.copy() for key, const in self.outputs]
        fed = {name for name, _ in self.feeds}
        return [
            to_output(const.copy() if const is not None else values[key], kind, copy=key in fed)
            for key, const in self.outputs
        ]

    def run(self, arrays: list[Any], kind: str = "numpy") -> list[Any]:
        """One whole run: feed, every step, collect (by :attr:`native` where it is set)."""
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
        values: dict[str, Any] = dict(self.resident)
        for key, array in zip(self.feeds, arrays):
            if _is_tensor(array):
                values[key] = _C.OrtValue.ortvalue_from_numpy(array, _CPU)
            elif isinstance(array, ort.OrtValue) or _is_torch(array):
                values[key] = place(array, _HOST)._ortvalue
            else:
                values[key] = array
        for ex, bind, outputs, free in self.stages:
            try:
                results = ex.direct({name: values[key] for name, key in bind}, outputs, None)
            except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
                raise ex.error(err) from err
            for i, name in enumerate(outputs):  # indexing: one native call per output,
                values[name] = results[i]  # where iterating takes one more per stage
            for key in free:
                del values[key]
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
                self._add_stage(stage, ex)
                self._flush_transfers()
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

    def _flush_transfers(self) -> None:
        """Add the explicit copies whose source exists by now."""
        waiting = []
        for tr in self.pending:
            if tr.source in self.home:
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


# --- values ------------------------------------------------------------------------------


def transfer_kind(src: PhysicalDevice, dst: PhysicalDevice, *, same_logical: bool) -> str:
    """How a blob moves between two physical devices.

    Values move only between different memories: two logical devices on one real
    device share them (``"alias"``), and so do logical devices emulated on the CPU,
    which all live in host memory; otherwise ``"h2d"``, ``"d2h"`` or ``"d2d"``.
    Sharing is safe: ONNX Runtime never writes into a value it is fed, a run's
    outputs are freshly allocated, and nothing else here writes into a value.
    The torch lowering behaves the same way: ``tensor.to`` the
    device a tensor is already on returns it as is.

    Emulated devices used to copy, to "pay what a real GPU pair pays"; but a host
    memcpy costs nothing like an NVLink or PCIe transfer, so the copy only added
    work this machine does not need (0.2 ms, 1% of bench ResNet, per 1 MiB blob).
    The planner charges transfers through its link model (:mod:`placement.planning.link_model`),
    independently of how the emulation runs them.

    Example:
        >>> cpu, gpu = PhysicalDevice("cpu", 0, emulated=True), PhysicalDevice("cuda", 1)
        >>> transfer_kind(cpu, cpu, same_logical=False), transfer_kind(cpu, gpu, same_logical=False)
        ('alias', 'h2d')
    """
    if same_logical:
        return ALIAS
    if src.is_cuda and dst.is_cuda:
        return ALIAS if src.index == dst.index else GPU_TO_GPU
    if src.is_cuda:
        return TO_HOST
    if dst.is_cuda:
        return TO_GPU
    return ALIAS


def ortvalue(array: np.ndarray, physical: PhysicalDevice) -> ort.OrtValue:
    """``array`` as an ``OrtValue`` on ``physical`` (a host copy when that is a GPU)."""
    if physical.is_cuda:
        HOST_COPIES.add()
        return ort.OrtValue.ortvalue_from_numpy(array, "cuda", physical.index)
    return ort.OrtValue.ortvalue_from_numpy(array)


#: The host, as a physical device (where values of CPU stages and emulated devices live).
_HOST = PhysicalDevice("cpu", 0)


def value_device(value: ort.OrtValue) -> PhysicalDevice:
    """The physical device an ``OrtValue`` lives on."""
    if value.device_name().lower() == "cpu":
        return _HOST
    _, index = value._ortvalue.__dlpack_device__()
    return PhysicalDevice("cuda", int(index))


def place(value: Any, physical: PhysicalDevice) -> Any:
    """A graph input as the value table holds it on ``physical``: numpy arrays become
    ``OrtValue`` s there (a host copy for a GPU), torch tensors ``OrtValue`` s over their
    memory (DLPack), and ``OrtValue`` s on another device are moved
    (:func:`transfer_kind`); host values (lists, ``None``, strings) stay as they are.

    Example:
        >>> import numpy as np
        >>> value = place(np.ones(3, np.float32), PhysicalDevice("cpu"))
        >>> value.device_name().lower(), value.shape()
        ('cpu', [3])
    """
    if _is_tensor(value):
        return ortvalue(value, physical)
    if _is_torch(value):
        from placement.runtime.inputs import ortvalue_from_torch

        value = ortvalue_from_torch(value)  # a CUDA tensor's stream is synchronised there
    if not isinstance(value, ort.OrtValue):
        return value
    here = value_device(value)
    if here.is_cuda == physical.is_cuda and here.index == physical.index:
        return value
    return move(value, transfer_kind(here, physical, same_logical=False), physical)


def to_output(value: Any, kind: str, *, copy: bool = False) -> Any:
    """A graph output handed to the caller as ``kind`` (:data:`OUTPUT_KINDS`), on the device
    it was made on; ``copy``: the value is not the run's own (a graph input passed through),
    so it is copied first. Host values (lists, ``None``) are returned as they are.

    Example:
        >>> import numpy as np
        >>> to_output(np.arange(3), "torch")
        tensor([0, 1, 2])
    """
    if kind == "numpy":
        out = to_numpy(value)
        return out.copy() if copy and isinstance(out, np.ndarray) else out
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
        array = np.array(value) if copy else value
        if kind == "torch":
            import torch

            return torch.from_numpy(array)  # the tensor keeps the array alive
        return ort.OrtValue.ortvalue_from_numpy(array)  # the OrtValue keeps the array alive
    if not isinstance(value, ort.OrtValue):
        return value
    if copy:
        value = _copy_value(value)
    if kind == "ortvalue":
        return value
    if kind == "torch":
        import torch

        tensor = torch.from_dlpack(value._ortvalue)
        return tensor.view(torch.bool) if value.data_type() == "tensor(bool)" else tensor
    raise PlacementError(f"unknown output kind {kind!r}; expected one of {', '.join(OUTPUT_KINDS)}")


def _copy_value(value: ort.OrtValue) -> ort.OrtValue:
    """A copy of an ``OrtValue`` on its own device."""
    device = value_device(value)
    if not device.is_cuda:  # memory ONNX Runtime owns (a DLPack view of it stays valid on its own)
        dst = ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), _numpy_dtype(value), "cpu", 0)
        dst.update_inplace(np.ascontiguousarray(value.numpy()))
        return dst
    dst = ort.OrtValue.ortvalue_from_shape_and_type(value.shape(), _numpy_dtype(value), "cuda", device.index)
    ort.copy_tensors([value], [dst])
    return dst


def _is_torch(value: Any) -> bool:
    return (type(value).__module__ or "").startswith("torch") and hasattr(value, "__dlpack__")


def _is_native(value: Any) -> bool:
    return isinstance(value, _C.OrtValue)


def move(value: ort.OrtValue, kind: str, physical: PhysicalDevice) -> ort.OrtValue:
    """``value`` moved to ``physical`` the way ``kind`` says (an alias returns it as is)."""
    if kind == ALIAS:
        return value
    if kind == TO_HOST:
        HOST_COPIES.add()
        return ort.OrtValue.ortvalue_from_numpy(value.numpy())
    if kind == TO_GPU:
        HOST_COPIES.add()
        return ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", physical.index)
    return _gpu_to_gpu(value, physical)


class _KeepAlive:
    """The base of an array viewing an ``OrtValue``'s memory: holds the ``OrtValue``."""

    def __init__(self, value: ort.OrtValue, view: np.ndarray) -> None:
        self.value = value
        self.__array_interface__ = view.__array_interface__


def to_numpy(value: Any) -> Any:
    """A host array of ``value`` that stays valid after ``value`` is dropped.

    ``OrtValue.numpy()`` on a CPU tensor returns a view of the ``OrtValue``'s buffer
    whose base (a capsule) does not keep that buffer alive: once the ``OrtValue``
    (or the numpy array it was made from) is released, the next allocation can
    overwrite the view. The returned array keeps the ``OrtValue`` alive instead
    (no copy), or is a copy where that is cheaper (up to 64 KiB); arrays that own
    their data (GPU values copied to the host) and host values (lists, ``None``,
    object arrays) are returned as they are.
    """
    if not isinstance(value, ort.OrtValue):
        return value
    if value.device_name().lower() != "cpu":
        HOST_COPIES.add()
    array = value.numpy()
    if not isinstance(array, np.ndarray):
        return array
    return _owned(value, array)


#: Outputs up to this size are copied out of their ``OrtValue`` rather than kept alive
#: with it: a small copy costs less than the array wrapper around a kept value.
_COPY_BELOW = 1 << 16


def _owned(value: Any, array: np.ndarray) -> np.ndarray:
    """``array`` (``value.numpy()``) as an array that stays valid: as it is if it owns its
    memory, copied if small, else a view that keeps ``value`` alive."""
    if array.flags.owndata:
        return array
    if array.nbytes <= _COPY_BELOW:
        return array.copy()
    return np.asarray(_KeepAlive(value, array))


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


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind not in "OUS"


def _host(value: Any) -> Any:
    """A value as ``InferenceSession.run`` takes it (``OrtValue`` s become arrays)."""
    return to_numpy(value) if isinstance(value, ort.OrtValue) else value


def _host_copy(value: Any) -> Any:
    """A separate copy of a host value (arrays, lists of them, ``None``)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return [_host_copy(v) for v in value]
    return value


def _store(values: dict[str, Any], names: tuple[str, ...], results: list[Any], free: tuple[str, ...]) -> None:
    """Put a stage's ``results`` into ``values`` under ``names``, then drop the keys in ``free``."""
    values.update(zip(names, results))
    _drop(values, free)


def _drop(values: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        del values[key]


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _gpu_to_gpu(value: ort.OrtValue, physical: PhysicalDevice) -> ort.OrtValue:
    """Device-to-device copy; a host round trip where this onnxruntime build cannot."""
    global _warned_d2d_fallback
    if not _warned_d2d_fallback:
        try:
            dst = ort.OrtValue.ortvalue_from_shape_and_type(
                value.shape(), _numpy_dtype(value), "cuda", physical.index
            )
            ort.copy_tensors([value], [dst])
            return dst
        except Exception as err:  # no registered GPU-GPU data transfer in this build
            _warned_d2d_fallback = True
            log.warning(
                "onnxruntime cannot copy between GPUs directly here (%s); "
                "cross-GPU transfers go through host memory",
                err,
            )
    HOST_COPIES.add(2)
    return ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", physical.index)


def _numpy_dtype(value: ort.OrtValue) -> Any:
    """The numpy dtype of an ``OrtValue`` (ONNX Runtime names types ``tensor(float)``)."""
    import onnx_ir as ir
    from onnx import TensorProto

    name = value.data_type().removeprefix("tensor(").removesuffix(")")
    try:
        return ir.DataType(TensorProto.DataType.Value(name.upper())).numpy()
    except (ValueError, TypeError):
        raise PlacementError(f"cannot move a {value.data_type()} between GPUs") from None
