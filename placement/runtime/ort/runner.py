"""``Runner`` and ``run``: one ONNX Runtime ``InferenceSession`` per stage, on the stage's device.

:class:`Runner` cuts a placed model into stages (:mod:`placement.runtime.stages`),
maps each stage's logical device to a physical one
(:func:`placement.runtime.device_map.resolve_device_map`) and builds one
session per stage: the CUDA execution provider with that GPU's ``device_id``,
or the CPU provider. Logical devices that share a physical device are folded
into one first (:mod:`placement.runtime.ort.fold`), so a device map onto fewer
devices costs no extra sessions. Without the GPUs the model names,
``device_map="auto"`` emulates every logical device on the CPU, each stage still
in its own session, and says so once (a ``logging`` warning).

Data flow and copies: see :mod:`placement.runtime.ort`.

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
    >>> runner = Runner(model, device_map="cpu", fold=False)
    >>> (y,) = runner.run({"input": x.numpy()})
    >>> bool(np.allclose(y, net(x).detach().numpy(), atol=1e-5))
    True
    >>> runner.stats.sessions_built
    2
    >>> Runner(model, device_map="cpu").stats.sessions_built  # both logical devices on the CPU: folded
    1
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from placement.errors import InputError, PlacementError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import DEVICE_KEY, INPUT_DEVICE_KEY, OUTPUT_DEVICE_KEY
from placement.passes.copies import inject_cross_device_copies
from placement.runtime.device_map import DeviceMapLike, PhysicalDevice, is_auto, resolve_device_map
from placement.runtime.inputs import InputsLike, InputSpec, input_specs, normalize_inputs
from placement.runtime.ort.build import (
    BuildOptions,
    SessionCache,
    build_program,
    logical_devices,
    stale_copies,
)
from placement.runtime.ort.fold import fold_groups
from placement.runtime.ort.pipelined import ort_run_pipelined, ort_stream
from placement.runtime.ort.program import Program
from placement.runtime.ort.sessions import check_threads
from placement.runtime.ort.stats import RunnerStats
from placement.runtime.ort.values import HOST_COPIES, OUTPUT_KINDS
from placement.runtime.precision import DEFAULT_PRECISION, Tolerance, check_precision, tolerance
from placement.runtime.schedule import batch_axes, check_chunks
from placement.runtime.schedule.workers import check_errors
from placement.runtime.stages import Stage

__all__ = ["Runner", "RunnerStats", "run"]

log = logging.getLogger(__name__)

_REBUILD_ATTEMPTS = 8


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
        chunks: split each :meth:`run`'s batch into this many micro-batches and run
            them through the stages in a fill-drain (GPipe) schedule, one worker
            thread per stage (see :mod:`placement.runtime.schedule`); the outputs
            are the unsplit run's. Default 1: stages run one after another.
        batch_axes: graph input/output name -> batch axis (None: the input goes
            whole to every micro-batch), replacing the detection from the
            graph's symbolic batch dimension for the names listed.
        threads_per_stage: intra-op threads of each stage session when
            pipelining (``chunks > 1``, and every :meth:`stream`, which pipelines
            whatever ``chunks`` is); default: the CPU cores divided among the
            stages. ``threads`` wins when given.
        auto_update: check for re-placement before every run (cheap: one pass
            over the ops' device labels). With False, call :meth:`update` yourself.
        keep_sessions: keep the sessions of stages that a re-placement made
            unused, so that switching back to an earlier placement costs nothing
            (modelsplit's ``enable_clone``: memory for speed). Default: release them.
        keep_layout: where a blob passes between two CPU stages' convolutions, hand
            it over in ONNX Runtime's blocked layout instead of converting it out and
            back in (:mod:`placement.runtime.ort.boundaries`; :attr:`blocked_boundaries`
            lists those blobs). Outputs are identical either way.
        fold: run the stages of logical devices that share a physical device as one session
            (:mod:`placement.runtime.ort.fold`; :attr:`folds` and :meth:`summary` say what
            folded). ``None`` (default): logical devices sharing a GPU always fold; sharing
            the CPU (``device_map="cpu"``), they fold for sequential runs but stay apart for
            pipelined ones (``chunks > 1``, :meth:`stream`), where the CPU's cores run stages
            at once; ``"auto"``'s emulation of GPUs on the CPU never folds (it exists to
            exercise stage boundaries). ``True``: fold every shared device; ``False``: one
            session per logical-device stage (measurements, tests of stage boundaries).
            The placement itself (op devices, copies, the saved file) is never changed.
        precision: ``"fp32"`` (default): GPU stages compute fp32 strictly (ONNX Runtime's
            CUDA provider with ``use_tf32=0``), so outputs match the CPU's within
            :data:`~placement.runtime.precision.FP32_TOLERANCE`; ``"tf32"``: TF32 tensor
            cores allowed (faster, within :data:`~placement.runtime.precision.TF32_TOLERANCE`).
            No effect on CPU stages. :attr:`tolerance` is the one that applies.
        allow_cpu_fallback: a GPU stage whose session came back on the CPU (the CUDA provider did not
            load) runs there, warning; by default ``DeviceError`` names the load error.
        concurrent: run independent stages at once (:mod:`placement.runtime.ort.concurrent`);
            ``None`` (default): where the stage graph is wider than a chain and ``chunks == 1``.

    Threads: :meth:`run` may be called from several threads at once (runs of one
    runner take turns), and another thread may re-place the model meanwhile: a
    run uses the sessions of one whole placement, the one current when it
    started or a later one, never a mix (each rebuild partitions a private copy
    of the model, taken at once).

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
        chunks: int = 1,
        batch_axes: Mapping[str, int | None] | None = None,
        threads_per_stage: int | None = None,
        keep_layout: bool = True,
        precision: str = DEFAULT_PRECISION,
        fold: bool | None = None,
        allow_cpu_fallback: bool = False,
        concurrent: bool | None = None,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"Runner needs a placement.Model, got {type(model).__name__}")
        self.model = model
        #: ``"fp32"`` or ``"tf32"`` (see ``precision``)
        self.precision = check_precision(precision)
        self.stats = RunnerStats()
        self.auto_update = auto_update
        self.keep_sessions = keep_sessions
        self.keep_layout = keep_layout
        #: boundary blobs handed between CPU stages in the blocked layout (see ``keep_layout``)
        self.blocked_boundaries: list[str] = []
        #: folds of the current program: logical device -> the device it runs as (see ``fold``)
        self.folds: dict[Device, Device] = {}
        self.fold, self.allow_cpu_fallback = fold, allow_cpu_fallback
        self.concurrent = concurrent
        self._cache = SessionCache()
        self._base: Model | None = None  # the private copy of the model the program was built from
        self._piped: tuple[Program, Program] | None = None  # (program, its pipelined form)
        self._device_map_arg = device_map
        threads = check_threads(threads)
        threads_per_stage = check_threads(threads_per_stage, what="threads_per_stage")
        self._threads = threads
        self.chunks = check_chunks(chunks)
        self._batch_axes_arg = dict(batch_axes) if batch_axes is not None else None
        self._threads_per_stage = threads_per_stage
        self._lock = threading.Lock()
        self._state: tuple[Any, ...] | None = None
        self._watched: list[dict[str, str]] = []
        self._program: Program | None = None
        self._specs: list[InputSpec] = []
        self._device_map: dict[Device, PhysicalDevice] = {}
        self._axes: tuple[Any, Any] | None = None
        self.update()
        if chunks > 1:
            self._pipeline_axes()  # a model that cannot be split fails here, not on the first run

    # -- public ------------------------------------------------------------------------

    @property
    def tf32(self) -> bool:
        """Whether fp32 goes through TF32 anywhere: ``precision="tf32"`` and a stage on a GPU."""
        return self.precision == "tf32" and any(p.is_cuda for p in self._device_map.values())

    @property
    def tolerance(self) -> Tolerance:
        """How close this runner's outputs are to strict fp32 (the CPU, eager torch) by design:
        :func:`placement.runtime.precision.tolerance` for its precision and devices.

        Example:
            >>> import placement as pl
            >>> from placement.models import mlp
            >>> str(Runner(pl.from_torch(*mlp.build("tiny")), device_map="cpu").tolerance)
            'fp32 (TF32 off), rtol=0.0001, atol=0.0001'
        """
        on_gpu = any(p.is_cuda for p in self._device_map.values())
        return tolerance(self.precision, on_gpu=on_gpu)

    @property
    def stages(self) -> list[Stage]:
        """The current stages, in execution order."""
        assert self._program is not None
        return list(self._program.partition.stages)

    def summary(self) -> str:
        """One line per stage: its logical device(s), the physical device and the ONNX Runtime
        provider its session really got, ops and boundary.

        Example:
            >>> import placement as pl
            >>> from placement.models import mlp
            >>> model = pl.from_torch(*mlp.build("tiny"))
            >>> model.set_device(model.ops[-1].name, 1)
            >>> print(Runner(model, device_map="cpu").summary())
            stage 0: cuda:0+cuda:1 (folded) on cpu (ORT CPU), 5 ops, inputs ['input'], outputs ['linear_2']
        """
        lines = []
        for stage in self.stages:
            logical = "+".join(map(str, stage.folded)) + " (folded)" if stage.folded else str(stage.device)
            ep = self.stats.providers.get(stage.index, "no session").removesuffix("ExecutionProvider")
            lines.append(
                f"stage {stage.index}: {logical} on {self._device_map[stage.device]} (ORT {ep}), "
                f"{len(stage.ops)} ops, "
                f"inputs {list(stage.inputs)}, outputs {list(stage.outputs)}"
            )
        return "\n".join(lines)

    @property
    def program(self) -> Program:
        """The compiled run (typed steps, see :mod:`placement.runtime.ort.program`), for
        inspection: what :meth:`run` does, step by step."""
        assert self._program is not None
        return self._program

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
            if not force and self._state is not None and self._snapshot() == self._state:
                return False  # another thread rebuilt meanwhile
            self._rebuild()
        return True

    def run(self, inputs: InputsLike, *, outputs: str = "numpy") -> list[Any]:
        """Run the model once.

        Args:
            inputs: a dict by graph-input name or a sequence in graph-input
                order (one value for a one-input model): numpy arrays, torch tensors
                (CPU or CUDA) or ``onnxruntime.OrtValue`` s. Torch tensors and
                ``OrtValue`` s are read where they are, without a copy (DLPack); a value
                on another device than the stage reading it is moved there (GPU to GPU
                directly). A CUDA tensor's producing stream is synchronised first.
            outputs: what the graph outputs come back as: ``"numpy"`` (default; host
                arrays), ``"torch"`` (torch tensors on the device that made each
                output, sharing its memory through DLPack) or ``"ortvalue"``
                (``OrtValue`` s on that device). Every output owns its memory: nothing
                a later run allocates overwrites it.

        Returns:
            The graph outputs, in graph-output order.

        Raises:
            InputError: unknown/missing input names, wrong dtypes or static
                dimensions (the message names the input), or an unknown ``outputs``.

        Example:
            >>> import torch
            >>> import placement as pl
            >>> from placement.models import mlp
            >>> net, (x,) = mlp.build("tiny")
            >>> runner = Runner(pl.from_torch(net, (x,)), device_map="cpu")
            >>> (y,) = runner.run([x], outputs="torch")
            >>> type(y).__name__, bool(torch.allclose(y, net(x), atol=1e-5))
            ('Tensor', True)
        """
        if outputs not in OUTPUT_KINDS:
            raise InputError(f"outputs must be one of {', '.join(map(repr, OUTPUT_KINDS))}, got {outputs!r}")
        if self.auto_update:
            self.update()
        arrays = normalize_inputs(inputs, self._specs, device_values=True)
        with self._lock:
            self.stats.runs += 1
            before = HOST_COPIES.count
            try:
                if self.chunks > 1:
                    return ort_run_pipelined(self, arrays, outputs=outputs)
                return self._execute(arrays, outputs)
            finally:
                self.stats.host_copies = HOST_COPIES.count - before

    def stream(
        self,
        batches: Iterable[InputsLike],
        *,
        window: int | None = None,
        outputs: str = "numpy",
        errors: str = "raise",
    ) -> Iterator[list[Any] | PlacementError]:
        """Run a stream of input batches with every stage busy; yield their outputs in order.

        Each batch goes through the stages as one micro-batch (or ``chunks``
        of them), one worker thread per stage, so stage ``j`` runs batch ``n``
        while stage ``j + 1`` runs batch ``n - 1``. At most ``window`` batches
        are in flight (default: four per stage): the next batch is read from
        ``batches`` only after an output was taken (back-pressure). Stopping
        the iteration early stops the workers. The last stage runs on the
        consumer's thread, as the consumer takes each output.

        Args:
            batches: an iterable of inputs, each as :meth:`run` takes them (device values too).
            window: batches in flight at most.
            outputs: ``"numpy"``, ``"torch"`` or ``"ortvalue"``, as for :meth:`run`.
            errors: ``"raise"`` (default): the first failed batch ends the stream with its
                error; ``"yield"``: a failed batch's error (a ``PipelineError`` naming the
                stage and batch, or the ``InputError`` of bad inputs) is yielded in its
                place and the stream goes on with the next (a server answers each request).

        Yields:
            Each batch's outputs in graph-output order, as ``outputs`` says (numpy by default);
            with ``errors="yield"``, a failed batch's error instead.

        Raises:
            PipelineError: a stage failed (names the stage and the batch).
            InputError: a batch has bad inputs.

        Example:
            >>> import placement as pl
            >>> from placement.models import mlp
            >>> net, (x,) = mlp.build("tiny")
            >>> runner = Runner(pl.from_torch(net, (x,)), device_map="cpu")
            >>> [out[0].shape for out in runner.stream([x, 2 * x, 3 * x])]
            [(4, 8), (4, 8), (4, 8)]
        """
        if outputs not in OUTPUT_KINDS:
            raise InputError(f"outputs must be one of {', '.join(map(repr, OUTPUT_KINDS))}, got {outputs!r}")
        if self.auto_update:
            self.update()
        return ort_stream(self, batches, window=window, outputs=outputs, errors=check_errors(errors))

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

    def _pipeline_axes(self) -> Any:
        """The batch axes of the model's inputs and outputs (cached per placement)."""
        if self._axes is None or self._axes[0] is not self._state:
            self._axes = (self._state, batch_axes(self.model, overrides=self._batch_axes_arg))
        return self._axes[1]

    # -- building ----------------------------------------------------------------------

    def _snapshot(self, watched: list[dict[str, str]] | None = None) -> tuple[Any, ...]:
        """A cheap fingerprint of the placement (op devices through the metadata dicts cached at
        the last build, op and parameter counts, outputs, I/O devices), read before every run as
        cheaply as it can: onnx_ir's containers through ``data`` (no Python ``__len__``/``__iter__``)."""
        graph = self.model.graph
        props = self.model.ir_model.metadata_props
        return (
            len(graph),
            len(graph.initializers.data),
            tuple(map(id, graph.outputs.data)),
            props.get(INPUT_DEVICE_KEY),
            props.get(OUTPUT_DEVICE_KEY),
            tuple(map(dict.get, self._watched if watched is None else watched, repeat(DEVICE_KEY))),
        )

    def _rebuild(self) -> None:
        """Rebuild for the model's current placement, on a private copy (tensors shared) taken
        after reading the snapshot: another thread re-placing the model cannot make it
        inconsistent (the next run sees the change and rebuilds); a build that fails while the
        model changes under it is started again."""
        for attempt in range(_REBUILD_ATTEMPTS):
            before = self._current_state()
            try:
                self._rebuild_once(self.model.copy(), before)
                return
            except Exception:
                if attempt + 1 < _REBUILD_ATTEMPTS and self._current_state() != before:
                    log.debug("the model was re-placed during a rebuild; rebuilding again")
                    continue
                raise

    def _current_state(self) -> tuple[list[dict[str, str]], tuple[Any, ...]] | None:
        """(the ops' metadata dicts, the placement snapshot), read now; None if the graph
        changed while it was being read."""
        try:
            watched = [node.metadata_props for node in self.model.graph]
            return watched, self._snapshot(watched)
        except (RuntimeError, KeyError, AttributeError):
            return None

    def _rebuild_once(self, model: Model, state: tuple[list[dict[str, str]], tuple[Any, ...]] | None) -> None:
        with tempfile.TemporaryDirectory(prefix="placement-stages-", ignore_cleanup_errors=True) as tmp:
            self._rebuild_in(model, state, Path(tmp))

    def _rebuild_in(
        self, model: Model, state: tuple[list[dict[str, str]], tuple[Any, ...]] | None, workdir: Path
    ) -> None:
        """The rebuild, with ``workdir`` for the optimised graphs of stages whose boundaries may
        stay blocked: their sessions write them as they are built, so the blocked layout does
        not build them a second time to read them."""
        if stale_copies(model):
            log.info("copies went stale after ops moved; running with them re-injected on a private copy")
            inject_cross_device_copies(model)
        self._device_map = resolve_device_map(logical_devices(model), self._device_map_arg, runtime="ort")
        self._base = model
        self._piped = None
        built = build_program(
            model.copy() if self.chunks == 1 else model,
            self._device_map,
            self._cache,
            self._build_options(self.chunks > 1),
            workdir=workdir,
            keep=self.keep_sessions,
        )
        self.stats.sessions_built += built.built
        if self.stats.partitions:
            self.stats.sessions_reused += built.reused
        self.stats.partitions += 1
        self._specs = input_specs(model.graph)
        self._program = built.program
        self.folds = built.folds
        self.blocked_boundaries = built.blocked_boundaries
        self.stats.providers = dict(built.providers)
        self.stats.transfers = built.program.n_transfers
        if state is None:
            raise PlacementError("the model changed while the runner read it")
        self._watched, self._state = state
        log.info(
            "runner: %d stages on %s (%d sessions built, %d reused, %d transfers per run%s)",
            len(built.program.partition.stages),
            ", ".join(sorted({f"{d}->{p}" for d, p in self._device_map.items()})),
            built.built,
            built.reused,
            built.program.n_transfers,
            "; folded " + ", ".join(f"{d}->{t}" for d, t in built.folds.items()) if built.folds else "",
        )

    def _build_options(self, pipelined: bool) -> BuildOptions:
        return BuildOptions(
            fold=self.fold,
            pipelined=pipelined,
            emulating=is_auto(self._device_map_arg),
            threads=self._threads,
            threads_per_stage=self._threads_per_stage,
            keep_layout=self.keep_layout,
            precision=self.precision,
            allow_cpu_fallback=self.allow_cpu_fallback,
            concurrent=self.concurrent,
        )

    def _pipelined_program(self) -> Program:
        """The program pipelined runs and every stream walk: the runner's own if built the same
        (``chunks > 1``, one stage, or equal folds and thread budgets), else one whose stages stay
        apart where they fold on the CPU only when sequential (:mod:`placement.runtime.ort.fold`)
        and divide the cores (``threads_per_stage``), built once per placement."""
        program = self._program
        assert program is not None and self._base is not None
        if self.chunks > 1:
            return program
        options = self._build_options(True)
        folds = fold_groups(self._device_map, fold=self.fold, pipelined=True, emulating=options.emulating)
        n_stages = len(program.partition.stages)
        sequential = self._build_options(False).session_threads(n_stages)
        same_threads = n_stages == 1 or options.session_threads(n_stages) == sequential
        if folds == self.folds and same_threads:
            return program
        with self._lock:
            if self._piped is None or self._piped[0] is not program:
                built = build_program(self._base.copy(), self._device_map, self._cache, options, workdir=None)
                self.stats.sessions_built += built.built
                log.info("runner: %d stages kept apart for pipelining", len(built.program.partition.stages))
                self._piped = (program, built.program)
            return self._piped[1]

    # -- running -----------------------------------------------------------------------

    def _execute(self, arrays: list[Any], outputs: str = "numpy") -> list[Any]:
        assert self._program is not None
        return self._program.run(arrays, outputs)


def run(
    model: Model,
    inputs: InputsLike,
    *,
    device_map: DeviceMapLike = "auto",
    precision: str = DEFAULT_PRECISION,
    outputs: str = "numpy",
) -> list[Any]:
    """Run a placed model once through per-stage ONNX Runtime sessions: the one-shot form
    of :class:`Runner` (which builds its sessions once; use it to run many times).

    Args:
        model: a placed :class:`placement.Model` (not modified).
        inputs: a dict by input name or a sequence in input order (numpy arrays, torch tensors).
        device_map: see :class:`Runner`.
        precision: ``"fp32"`` or ``"tf32"``; see :class:`Runner`.
        outputs: ``"numpy"``, ``"torch"`` or ``"ortvalue"`` (see :meth:`Runner.run`).

    Returns:
        The graph outputs (numpy arrays by default), in graph-output order.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> run(pl.from_torch(net, (x,)), [x], device_map="cpu")[0].shape
        (4, 8)
    """
    runner = Runner(model, device_map=device_map, auto_update=False, precision=precision)
    return runner.run(inputs, outputs=outputs)
