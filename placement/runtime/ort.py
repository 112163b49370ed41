"""The ONNX Runtime executor: one ``InferenceSession`` per stage, on the stage's device.

:class:`Runner` cuts a placed model into stages (:mod:`placement.runtime.stages`),
maps each stage's logical device to a physical one
(:func:`placement.runtime.device_map.resolve_device_map`) and builds one
session per stage: the CUDA execution provider with that GPU's ``device_id``,
or the CPU provider. Without the GPUs the model names, ``device_map="auto"``
emulates every logical device on the CPU, each stage still in its own session,
and says so once (a ``logging`` warning).

Data flow (precomputed at construction, so a run is a short loop):

* graph inputs become ``OrtValue`` s on the device they are fed on;
* each stage runs with ``InferenceSession.run_with_iobinding``: inputs are bound
  as ``OrtValue`` s (``bind_ortvalue_input``) and outputs are bound to the
  stage's device (``bind_output(name, "cuda", device_id)`` on a GPU), so
  activations stay on the device between stages;
* a dynamic copy is a *transfer*, not a session op: the blob is moved to the
  destination device (see :func:`_transfer_kind`): nothing to do between two
  logical devices on one physical GPU (the value is shared), a device-to-device
  ``onnxruntime.copy_tensors`` between two GPUs (falling back, once logged, to
  a host round trip when this onnxruntime build has no such data transfer), a
  host <-> GPU copy, or, on CPU emulation, a fresh ``OrtValue`` (a real copy, as
  on separate devices);
* static copies (of parameters) need nothing at run time: each stage carries
  the parameters it reads as initializers, so they reach its device once, when
  its session loads; values computed from parameters alone (a transposed
  weight) are recomputed at load time by the stages that read them (see
  :mod:`placement.runtime.stages`), never moved per run;
* every intermediate value is dropped after its last use (as torch.fx's
  ``Interpreter`` does); outputs come back as numpy arrays in graph-output order.

Copies: a model with explicit copies (``inject_cross_device_copies``) runs with
exactly those transfers. A model without them, or whose copies went stale after
ops moved, runs as if copies were injected on a private copy: every
cross-device edge gets an implicit transfer (one per blob and destination
device) and a copy whose ends now share a device costs nothing. The user's
model is never modified.

Re-placement (modelsplit's ``update_flow`` / ``enable_clone``): a runner keeps a
reference to the model. Before each run (or on :meth:`Runner.update`) it compares
the model's device state with the one it was built for; when ops moved it
re-partitions and builds sessions only for stages whose fingerprint (device,
ops, boundary blobs, carried parameters) is new, reusing every other session.
:attr:`Runner.stats` counts sessions built and reused. With
``keep_sessions=True`` sessions of stages that went out of use are kept too, so
switching back to an earlier placement builds nothing (``enable_clone``).

Example:
    >>> import numpy as np
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> runner = Runner(model, device_map="cpu")
    >>> (y,) = runner.run({"input": x.numpy()})
    >>> bool(np.allclose(y, net(x).detach().numpy(), atol=1e-5))
    True
    >>> runner.stats.sessions_built
    2
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from placement.errors import PlacementError
from placement.graph.device import Device
from placement.graph.model import DEVICE_KEY, INPUT_DEVICE_KEY, OUTPUT_DEVICE_KEY, Model
from placement.runtime.device_map import DeviceMapLike, PhysicalDevice, resolve_device_map
from placement.runtime.inputs import InputsLike, InputSpec, input_specs, normalize_inputs
from placement.runtime.stages import Partition, Stage, split_stages

__all__ = ["Runner", "RunnerStats", "run", "session_options"]

log = logging.getLogger(__name__)

_ALIAS, _HOST_COPY, _TO_GPU, _TO_HOST, _GPU_TO_GPU = "alias", "host", "h2d", "d2h", "d2d"
_warned_d2d_fallback = False


@dataclass
class RunnerStats:
    """Counters a :class:`Runner` keeps (for tests and reports).

    Attributes:
        sessions_built: ``InferenceSession`` s created so far.
        sessions_reused: stage sessions kept across a re-placement.
        partitions: times the model was partitioned (1 + re-placements seen).
        runs: calls to :meth:`Runner.run`.
        transfers: transfers per run (cross-device copies that move data).
    """

    sessions_built: int = 0
    sessions_reused: int = 0
    partitions: int = 0
    runs: int = 0
    transfers: int = 0


@dataclass
class _StageExec:
    stage: Stage
    physical: PhysicalDevice
    session: ort.InferenceSession
    binding: Any = None
    out_device: tuple[str, int] = ("cpu", 0)


@dataclass
class _Program:
    """The precomputed run: feeds, steps, frees and where outputs are."""

    partition: Partition
    feeds: list[tuple[str, PhysicalDevice]]  # graph input -> the physical device it is fed on
    steps: list[tuple[Any, ...]] = field(default_factory=list)
    outputs: list[tuple[str, np.ndarray | None]] = field(default_factory=list)
    n_transfers: int = 0


def session_options(physical: PhysicalDevice, *, threads: int | None = None) -> ort.SessionOptions:
    """The ``SessionOptions`` a stage session gets.

    Full graph optimisation (``ORT_ENABLE_ALL``), sequential execution, ``threads``
    intra-op threads (default: ONNX Runtime's choice, one per physical core), and
    ``session.force_spinning_stop``: a stage's worker threads spin while it runs
    (fast) but stop spinning when its run ends, so a finished stage does not keep
    cores busy while the next stage runs. (A process-wide shared thread pool,
    ``use_per_session_threads = False``, would also do, but it forces every other
    session in the process to use the global pool, so a library cannot choose it.)

    Example:
        >>> opts = session_options(PhysicalDevice("cpu"))
        >>> opts.get_session_config_entry("session.force_spinning_stop")
        '1'
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


class Runner:
    """Runs a placed model through one ONNX Runtime session per stage.

    Args:
        model: a placed :class:`placement.Model`. The runner keeps a reference
            to it and follows later device changes (see :meth:`update`); it
            never modifies it.
        device_map: logical -> physical devices: ``"auto"`` (GPUs when they
            exist, else CPU emulation), a single device such as ``"cpu"``, or a
            dict such as ``{0: "cuda:0", 1: "cuda:0"}``
            (see :mod:`placement.runtime.device_map`).
        threads: intra-op threads per session (default: ONNX Runtime's choice).
        auto_update: check for re-placement before every run (cheap: one pass
            over the ops' device labels). With False, call :meth:`update` yourself.
        keep_sessions: keep the sessions of stages that a re-placement made
            unused, so that switching back to an earlier placement costs nothing
            (modelsplit's ``enable_clone``: memory for speed). Default: release them.

    Raises:
        DeviceError: the device map is malformed or names a missing GPU.
        PlacementError: a stage cannot be built (the message names it).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,))
        >>> runner = Runner(model, device_map="cpu")
        >>> runner.run([x])[0].shape
        (4, 8)
    """

    def __init__(
        self,
        model: Model,
        *,
        device_map: DeviceMapLike = "auto",
        threads: int | None = None,
        auto_update: bool = True,
        keep_sessions: bool = False,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"Runner needs a placement.Model, got {type(model).__name__}")
        self.model = model
        self.stats = RunnerStats()
        self.auto_update = auto_update
        self.keep_sessions = keep_sessions
        self._device_map_arg = device_map
        self._threads = threads
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, PhysicalDevice], ort.InferenceSession] = {}
        self._state: tuple[Any, ...] | None = None
        self._watched: list[dict[str, str]] = []
        self._program: _Program | None = None
        self._specs: list[InputSpec] = []
        self._device_map: dict[Device, PhysicalDevice] = {}
        self.update()

    # -- public ------------------------------------------------------------------------

    @property
    def stages(self) -> list[Stage]:
        """The current stages, in execution order."""
        assert self._program is not None
        return list(self._program.partition.stages)

    @property
    def device_map(self) -> dict[Device, PhysicalDevice]:
        """The resolved logical -> physical device map."""
        return dict(self._device_map)

    @property
    def input_names(self) -> list[str]:
        """The model's graph input names, in order."""
        return [s.name for s in self._specs]

    @property
    def output_names(self) -> list[str]:
        """The model's graph output names, in order."""
        assert self._program is not None
        return list(self._program.partition.outputs)

    def update(self, *, force: bool = False) -> bool:
        """Follow the model's placement (modelsplit's ``update_flow``).

        If any op's device (or the set of ops) changed since the last build,
        re-partition and build sessions only for stages that changed; sessions of
        unchanged stages are reused.

        Args:
            force: re-partition even if nothing seems to have changed. Moving ops
                (``set_device``, the passes), adding or removing ops (copy
                injection) and changing graph outputs are detected; use ``force``
                after other edits (e.g. replacing an op by another).

        Returns:
            True if the model was re-partitioned.
        """
        if not force and self._state is not None and self._snapshot() == self._state:
            return False
        with self._lock:
            self._rebuild()
        return True

    def run(self, inputs: InputsLike) -> list[np.ndarray]:
        """Run the model once.

        Args:
            inputs: a dict by graph-input name or a sequence in graph-input
                order (numpy arrays or torch tensors; one array for a one-input model).

        Returns:
            The graph outputs as numpy arrays, in graph-output order.

        Raises:
            InputError: unknown/missing input names, wrong dtypes or static
                dimensions (the message names the input).
        """
        if self.auto_update:
            self.update()
        arrays = normalize_inputs(inputs, self._specs)
        with self._lock:
            self.stats.runs += 1
            return self._execute(arrays)

    def __call__(self, inputs: InputsLike) -> list[np.ndarray]:
        """Same as :meth:`run`."""
        return self.run(inputs)

    def __repr__(self) -> str:
        stages = self._program.partition.stages if self._program else []
        return (
            f"Runner(stages={len(stages)}, devices="
            f"{ {str(k): str(v) for k, v in self._device_map.items()} }, "
            f"sessions_built={self.stats.sessions_built})"
        )

    # -- building ----------------------------------------------------------------------

    def _snapshot(self) -> tuple[Any, ...]:
        """A cheap fingerprint of the model's placement: every op's device label (read
        through metadata dicts cached at the last build), the op and parameter counts,
        the graph outputs and the input/output devices."""
        graph = self.model.graph
        props = self.model.ir_model.metadata_props
        return (
            len(graph),
            len(graph.initializers),
            tuple(id(v) for v in graph.outputs),
            props.get(INPUT_DEVICE_KEY),
            props.get(OUTPUT_DEVICE_KEY),
            tuple([md.get(DEVICE_KEY) for md in self._watched]),
        )

    def _rebuild(self) -> None:
        model = self.model
        part = split_stages(model)
        logical = set(model.devices) | set(part.input_devices.values())
        self._device_map = resolve_device_map(sorted(logical), self._device_map_arg, runtime="ort")
        sessions: dict[tuple[str, PhysicalDevice], ort.InferenceSession] = {}
        execs: dict[int, _StageExec] = {}
        built = reused = 0
        for stage in part.stages:
            if not stage.outputs:
                log.debug("stage %d computes nothing that is read; skipped", stage.index)
                continue
            physical = self._device_map[stage.device]
            key = (stage.fingerprint, physical)
            session = self._sessions.get(key) or sessions.get(key)
            if session is None:
                session = self._build_session(stage, physical)
                built += 1
            else:
                reused += 1
            sessions[key] = session
            execs[stage.index] = _StageExec(stage, physical, session)
        if self.keep_sessions:
            self._sessions.update(sessions)
        else:
            self._sessions = sessions  # sessions of stages that no longer exist are released
        self.stats.sessions_built += built
        if self.stats.partitions:
            self.stats.sessions_reused += reused
        self.stats.partitions += 1
        self._specs = input_specs(model.graph)
        self._program = self._compile(part, execs)
        self.stats.transfers = self._program.n_transfers
        self._watched = [node.metadata_props for node in model.graph]
        self._state = self._snapshot()
        log.info(
            "runner: %d stages on %s (%d sessions built, %d reused, %d transfers per run)",
            len(part.stages),
            ", ".join(sorted({f"{d}->{p}" for d, p in self._device_map.items()})),
            built,
            reused,
            self._program.n_transfers,
        )

    def _build_session(self, stage: Stage, physical: PhysicalDevice) -> ort.InferenceSession:
        options = session_options(physical, threads=self._threads)
        options.logid = f"stage{stage.index}-{stage.device.slug}"
        provider = physical.ort_provider
        providers: list[Any] = [provider]
        if physical.is_cuda:
            providers.append("CPUExecutionProvider")
        try:
            data = stage.to_proto().SerializeToString()
            return ort.InferenceSession(data, options, providers=providers)
        except Exception as err:  # ORT raises several types (Fail, InvalidGraph, ...)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PlacementError(
                f"cannot build the ONNX Runtime session of stage {stage.index} "
                f"({stage.device} -> {physical}, {len(stage.ops)} ops starting with "
                f"{stage.ops[0]!r}): {first}"
            ) from err

    def _compile(self, part: Partition, execs: dict[int, _StageExec]) -> _Program:
        """Turn the partition into a flat list of steps with precomputed bindings and frees."""
        dmap = self._device_map
        program = _Program(partition=part, feeds=[])
        where: dict[tuple[str, Device], str] = {}  # (blob, logical device) -> key in the value table
        home: dict[str, Device] = {}  # blob -> device where it was produced / fed
        steps: list[tuple[Any, ...]] = []
        reads: list[list[str]] = []  # per step: keys it reads

        for name in part.inputs:
            device = part.input_devices[name]
            where[(name, device)] = name
            home[name] = device
            program.feeds.append((name, dmap[device]))

        pending = list(part.transfers)

        def deliver(blob: str, device: Device) -> str:
            key = where.get((blob, device))
            if key is not None:
                return key
            src_device = home.get(blob)
            if src_device is None:
                raise PlacementError(f"blob {blob!r} is read before any stage produces it")
            src_key = where[(blob, src_device)]
            key = f"{blob}@{device}"
            add_transfer(src_key, key, src_device, device)
            where[(blob, device)] = key
            return key

        def add_transfer(src_key: str, dst_key: str, src: Device, dst: Device) -> None:
            kind = _transfer_kind(dmap[src], dmap[dst], same_logical=src == dst)
            if kind != _ALIAS:
                program.n_transfers += 1
            steps.append(("transfer", kind, src_key, dst_key, dmap[dst]))
            reads.append([src_key])

        def flush_transfers() -> None:
            nonlocal pending
            waiting = []
            for tr in pending:
                if tr.source in home:
                    src_key = deliver(tr.source, home[tr.source])
                    add_transfer(src_key, tr.target, home[tr.source], tr.device)
                    where[(tr.target, tr.device)] = tr.target
                    home[tr.target] = tr.device
                else:
                    waiting.append(tr)
            pending = waiting

        flush_transfers()
        for stage in part.stages:
            ex = execs.get(stage.index)
            if ex is None:
                continue
            # Transfers whose source became available are flushed after each stage; a stage
            # may also read a copy target produced by a transfer flushed just before it.
            bind = [(name, deliver(name, stage.device)) for name in stage.inputs]
            binding = ex.session.io_binding()
            device_type, device_id = ("cuda", ex.physical.index) if ex.physical.is_cuda else ("cpu", 0)
            ex.binding = binding
            ex.out_device = (device_type, device_id)
            for out in stage.outputs:
                binding.bind_output(out, device_type, device_id)
            steps.append(("stage", ex, tuple(bind), stage.outputs))
            reads.append([key for _, key in bind])
            for out in stage.outputs:
                where[(out, stage.device)] = out
                home[out] = stage.device
            flush_transfers()
        if pending:
            names = ", ".join(repr(t.op) for t in pending)
            raise PlacementError(f"copies {names} read blobs that no stage produces")

        # Graph outputs: a key in the value table, or a constant (parameter outputs).
        keep: set[str] = set()
        inits = self.model.graph.initializers
        for name in part.outputs:
            device = home.get(name)
            if device is not None:
                key = where[(name, device)]
                keep.add(key)
                program.outputs.append((key, None))
            elif name in inits or name in part.static_copies:
                param = inits[part.static_copies.get(name, name)]
                program.outputs.append((name, np.array(param.const_value.numpy())))
            else:
                raise PlacementError(f"graph output {name!r} is produced by no op")

        # Free each value after its last reader (graph outputs are kept to the end).
        last: dict[str, int] = {}
        for i, keys in enumerate(reads):
            for key in keys:
                last[key] = i
        frees: list[list[str]] = [[] for _ in steps]
        for key, i in last.items():
            if key not in keep:
                frees[i].append(key)
        program.steps = [(*step, tuple(free)) for step, free in zip(steps, frees)]
        return program

    # -- running -----------------------------------------------------------------------

    def _execute(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        program = self._program
        assert program is not None
        values: dict[str, Any] = {}
        for (name, physical), array in zip(program.feeds, arrays):
            values[name] = _ortvalue(array, physical)
        for step in program.steps:
            if step[0] == "stage":
                _, ex, bind, outs, free = step
                binding = ex.binding
                for name, key in bind:
                    binding.bind_ortvalue_input(name, values[key])
                ex.session.run_with_iobinding(binding)
                results = binding.get_outputs()
                for name, value in zip(outs, results):
                    values[name] = value
                # Release this run's values from the binding and re-bind the outputs, so the
                # next run allocates fresh buffers (returned arrays are never overwritten).
                binding.clear_binding_inputs()
                binding.clear_binding_outputs()
                device_type, device_id = ex.out_device
                for name in outs:
                    binding.bind_output(name, device_type, device_id)
            else:
                _, kind, src, dst, physical, free = step
                values[dst] = _move(values[src], kind, physical)
            for key in free:
                del values[key]
        return [values[key].numpy() if const is None else const.copy() for key, const in program.outputs]


def run(model: Model, inputs: InputsLike, *, device_map: DeviceMapLike = "auto") -> list[np.ndarray]:
    """Run a placed model once through per-stage ONNX Runtime sessions.

    The one-shot form of :class:`Runner` (which builds its sessions once; use
    it to run many times).

    Args:
        model: a placed :class:`placement.Model` (not modified).
        inputs: a dict by input name or a sequence in input order (numpy arrays
            or torch tensors).
        device_map: see :class:`Runner`.

    Returns:
        The graph outputs as numpy arrays, in graph-output order.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> run(pl.from_torch(net, (x,)), [x], device_map="cpu")[0].shape
        (4, 8)
    """
    return Runner(model, device_map=device_map, auto_update=False).run(inputs)


# --- transfers ---------------------------------------------------------------------------


def _transfer_kind(src: PhysicalDevice, dst: PhysicalDevice, *, same_logical: bool) -> str:
    """How a blob moves between two (physical) devices.

    Two logical devices on one real device share values (alias); emulated logical
    devices are separate contexts on the CPU, so they copy, like real devices.
    """
    if same_logical:
        return _ALIAS
    if src.is_cuda and dst.is_cuda:
        return _ALIAS if src.index == dst.index else _GPU_TO_GPU
    if src.is_cuda:
        return _TO_HOST
    if dst.is_cuda:
        return _TO_GPU
    if src.emulated or dst.emulated:
        return _HOST_COPY
    return _ALIAS


def _ortvalue(array: np.ndarray, physical: PhysicalDevice) -> ort.OrtValue:
    if physical.is_cuda:
        return ort.OrtValue.ortvalue_from_numpy(array, "cuda", physical.index)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _move(value: ort.OrtValue, kind: str, physical: PhysicalDevice) -> ort.OrtValue:
    if kind == _ALIAS:
        return value
    if kind == _HOST_COPY:
        return ort.OrtValue.ortvalue_from_numpy(np.array(value.numpy(), copy=True))
    if kind == _TO_HOST:
        return ort.OrtValue.ortvalue_from_numpy(value.numpy())
    if kind == _TO_GPU:
        return ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", physical.index)
    return _gpu_to_gpu(value, physical)


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
    return ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", physical.index)


_ONNX_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _numpy_dtype(value: ort.OrtValue) -> Any:
    try:
        return _ONNX_TO_NUMPY[value.data_type()]
    except KeyError:
        raise PlacementError(f"cannot move a {value.data_type()} between GPUs") from None
