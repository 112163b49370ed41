"""How a :class:`placement.Runner` builds a program: fold, partition, sessions, compile.

:func:`build_program` turns a placed model (the runner's private copy) into a compiled
:class:`~placement.runtime.ort.program.Program`: logical devices that share a physical
device are folded into one (:mod:`placement.runtime.ort.fold`), the model is cut into
stages, each stage gets its session (reused from :class:`SessionCache` when a stage with
the same fingerprint was built before), the program is compiled, and blobs between CPU
stages' convolutions are kept in ONNX Runtime's blocked layout
(:mod:`placement.runtime.ort.boundaries`).

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.runtime.device_map import resolve_device_map
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> model.set_device(model.ops[-1].name, 1)
    >>> dmap = resolve_device_map(logical_devices(model), "cpu")
    >>> cache = SessionCache()
    >>> built = build_program(model, dmap, cache, BuildOptions(), workdir=None)
    >>> (stage,) = built.program.partition.stages
    >>> built.built, [str(d) for d in stage.folded]
    (1, ['cuda:0', 'cuda:1'])
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort

from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort.boundaries import keep_blocked_boundaries, optimized_path
from placement.runtime.ort.concurrent import ConcurrentRun, stage_width
from placement.runtime.ort.fold import fold_groups, fold_model, folded_devices
from placement.runtime.ort.program import Program, compile_program
from placement.runtime.ort.sessions import stage_session
from placement.runtime.ort.steps import StageExec
from placement.runtime.ort.stream_split import restore_devices, split_streamed
from placement.runtime.precision import DEFAULT_PRECISION
from placement.runtime.schedule import stage_threads
from placement.runtime.stages import split_stages

__all__ = ["BuildOptions", "Built", "SessionCache", "build_program", "logical_devices", "stale_copies"]

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    """What a program is built for (the :class:`placement.Runner` options that shape it).

    Attributes:
        fold: fold logical devices sharing a physical device (None: the default rule of
            :func:`placement.runtime.ort.fold.fold_groups`).
        pipelined: the program runs micro-batches through stage workers.
        emulating: the device map is ``"auto"`` emulating GPUs on the CPU.
        threads: intra-op threads of every session (None: see ``threads_per_stage``).
        threads_per_stage: intra-op threads per stage session (None: for a pipelined
            program the cores divided among its stages, else ONNX Runtime's choice).
        keep_layout: keep blocked layouts across CPU stages' convolution boundaries.
        precision: ``"fp32"`` or ``"tf32"`` (GPU stages).
        allow_cpu_fallback: a GPU stage whose session falls back to the CPU runs there
            (with a warning) instead of raising ``DeviceError``.
        concurrent: run stages that do not depend on each other at once (None: where the
            stage graph is wider than a chain and the program is not pipelined); each
            session then gets the cores divided among the widest set of such stages.
    """

    fold: bool | None = None
    pipelined: bool = False
    emulating: bool = False
    threads: int | None = None
    threads_per_stage: int | None = None
    keep_layout: bool = True
    precision: str = DEFAULT_PRECISION
    allow_cpu_fallback: bool = False
    concurrent: bool | None = None

    def session_threads(self, n_stages: int) -> int | None:
        """The intra-op threads of each session of a program with ``n_stages`` stages."""
        if self.threads is not None:
            return self.threads
        if self.pipelined or self.threads_per_stage is not None:
            return self.threads_per_stage or stage_threads(n_stages)
        return None


@dataclass
class SessionCache:
    """Sessions a runner built, by (stage fingerprint, physical device, threads), kept across rebuilds.

    Attributes:
        sessions: the stage sessions.
        blocked: sessions of stages rebuilt for blocked boundaries.
        optimized: ONNX Runtime's optimised graph of a stage (for blocked boundaries).
    """

    sessions: dict[tuple[str, PhysicalDevice, int | None], ort.InferenceSession] = field(default_factory=dict)
    blocked: dict[tuple[str, ...], ort.InferenceSession] = field(default_factory=dict)
    optimized: dict[tuple[str, ...], Any] = field(default_factory=dict)

    def clear(self) -> None:
        """Release every session."""
        self.sessions, self.blocked, self.optimized = {}, {}, {}


@dataclass
class Built:
    """A built program and what building it cost.

    Attributes:
        program: the compiled program.
        built: sessions created.
        reused: sessions taken from the cache.
        folds: logical device -> the device it was folded into.
        blocked_boundaries: blobs handed over in the blocked layout.
        providers: stage index -> the execution provider its session really runs on.
    """

    program: Program
    built: int
    reused: int
    folds: dict[Device, Device]
    blocked_boundaries: list[str]
    providers: dict[int, str] = field(default_factory=dict)


def logical_devices(model: Model) -> list[Device]:
    """Every logical device a run of ``model`` touches: its ops', its graph inputs' and its
    streamed parameters' homes.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> [str(d) for d in logical_devices(pl.from_torch(*mlp.build("tiny")))]
        ['cuda:0']
    """
    found = {node_device(node) for node in model.graph}
    found |= {model.blob_device(model.value(name)) for name in model.inputs}
    found |= set(model.streamed.values())
    return sorted(found)


def build_program(
    model: Model,
    device_map: dict[Device, PhysicalDevice],
    cache: SessionCache,
    options: BuildOptions,
    *,
    workdir: Path | None,
    keep: bool = True,
) -> Built:
    """Build the program of ``model`` (which it may relabel: pass a private copy).

    Args:
        model: the placed model (copies up to date, see :func:`stale_copies`).
        device_map: logical -> physical, covering :func:`logical_devices`.
        cache: sessions to reuse; the ones this program uses are added to it. With
            ``keep=False`` the cache then holds only those (the others are released).
        options: see :class:`BuildOptions`.
        workdir: where CPU stage sessions write their optimised graphs (blocked
            boundaries); None: a temporary folder.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="placement-stages-", ignore_cleanup_errors=True) as tmp:
            return build_program(model, device_map, cache, options, workdir=Path(tmp), keep=keep)
    folds = fold_groups(
        device_map, fold=options.fold, pipelined=options.pipelined, emulating=options.emulating
    )
    if folds:
        fold_model(model, folds)
    segments = split_streamed(model, device_map)  # each session fed at most the streamed window
    part = split_stages(model)
    restore_devices(part, segments)
    runs = folded_devices(folds)
    for stage in part.stages:
        stage.folded = runs.get(stage.device, ())
    threads = options.session_threads(len(part.stages))
    width = stage_width([s.depends_on for s in part.stages])
    concurrent = not options.pipelined and options.concurrent is not False and width > 1
    if concurrent and threads is None:
        threads = stage_threads(width)
    layout = options.keep_layout and sum(not device_map[s.device].is_cuda for s in part.stages) > 1
    sessions: dict[tuple[str, PhysicalDevice, int | None], ort.InferenceSession] = {}
    execs: dict[int, StageExec] = {}
    providers: dict[int, str] = {}
    fell_back: dict[Device, PhysicalDevice] = {}  # GPU stages whose sessions run on the CPU
    built = reused = 0
    for stage in part.stages:
        if not stage.outputs:
            log.debug("stage %d computes nothing that is read; skipped", stage.index)
            continue
        physical = device_map[stage.device]
        key = (stage.fingerprint, physical, threads)
        session = cache.sessions.get(key) or sessions.get(key)
        if session is None:
            dump = layout and not physical.is_cuda and any(op.op_type == "Conv" for op in stage.model.graph)
            session = stage_session(
                stage,
                physical,
                threads=threads,
                optimized_path=optimized_path(workdir, stage) if dump else None,
                precision=options.precision,
                allow_cpu_fallback=options.allow_cpu_fallback,
            )
            built += 1
        else:
            reused += 1
        sessions[key] = session
        providers[stage.index] = session.get_providers()[0]
        if physical.is_cuda and providers[stage.index] != "CUDAExecutionProvider":  # allowed fallback
            physical = fell_back[stage.device] = PhysicalDevice("cpu")
        execs[stage.index] = StageExec(stage, physical, session)
    if keep:
        cache.sessions.update(sessions)
    else:
        cache.sessions = sessions  # sessions of stages that no longer exist are released
    device_map = {**device_map, **fell_back}
    program = compile_program(model, part, execs, device_map)
    blobs: list[str] = []
    if options.keep_layout and sum(not ex.physical.is_cuda for ex in execs.values()) > 1:
        plan = keep_blocked_boundaries(program, threads, cache.blocked, cache.optimized, workdir=workdir)
        built += plan.built
        if keep:
            cache.blocked.update(plan.sessions)
        else:  # keep only what the current stages use
            cache.blocked = plan.sessions
            current = {ex.stage.fingerprint for ex in execs.values()}
            cache.optimized = {k: g for k, g in cache.optimized.items() if k[0] in current}
        if plan.blobs:
            blobs = plan.blobs
            program = compile_program(model, part, execs, device_map)
    if concurrent:
        program.concurrent = ConcurrentRun.of(program)
    return Built(program, built, reused, folds, blobs, providers)


def stale_copies(model: Model) -> bool:
    """True if a copy no longer matches the placement: its ends share a device, or a
    reader of its blob moved to another device than the copy's."""
    for node in model.graph:
        if not is_copy_node(node):
            continue
        device = node_device(node)
        source = node.inputs[0] if node.inputs else None
        if source is None or model.blob_device(source) == device:
            return True
        if any(node_device(use.node) != device for use in node.outputs[0].uses()):
            return True
    return False
