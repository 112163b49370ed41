"""Stage boundaries that stay in ONNX Runtime's blocked layout (CPU stages).

ONNX Runtime runs a CPU session's 2-D convolutions in a blocked memory layout
(NCHWc) and converts to plain NCHW only where a value leaves the blocked kernels,
at the latest at a graph output. A placed convolutional network cut into stages
therefore pays, at every cut between two convolutions, a ``ReorderOutput`` at the
end of the first stage and a ``ReorderInput`` at the start of the next: two passes
over the activation that the single session never makes (on bench ResNet, 0.18 ms
of a 20 ms run for one 1 MiB activation).

:func:`keep_blocked_boundaries` removes both. For a :class:`~placement.runtime.ort.program.Program`
whose stages are CPU sessions it finds every blob that one CPU stage produces and
only CPU stages read (not a graph output, not read by a host stage), asks ONNX
Runtime for the optimised graph of the stages involved, and where the producer's
graph ends with a ``ReorderOutput`` for that blob and every reader starts with a
``ReorderInput`` of it, rebuilds those stages from their optimised graphs without
the two conversions (:func:`placement.runtime.ort.layout.keep_blocked`): the blob then
travels between stages in the blocked layout, which only these sessions read.
Outputs are bit for bit the same (the same kernels run on the same data).

The rebuilt sessions load ONNX Runtime's own optimised graph with further
optimisation off. That graph is specific to this machine's CPU (its block size), so it
is made and used in one process and never saved for elsewhere. Sessions on GPUs,
stages without convolutions and boundaries that are graph outputs are left as they are.
:class:`placement.Runner` has each CPU stage with a convolution write its optimised graph
while its usual session is built (:func:`optimized_path`), so a stage that ends up blocked
costs one more session build, not two.

Example:
    >>> import placement as pl
    >>> from placement.models import resnet
    >>> model = pl.from_torch(*resnet.build("tiny"))
    >>> model = pl.place_evenly(model, 2)
    >>> runner = pl.Runner(model, device_map="cpu", fold=False)  # folded, no boundary is left
    >>> "conv2d_3" in runner.blocked_boundaries
    True
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnxruntime as ort

from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort.layout import blocked_inputs, blocked_outputs, keep_blocked
from placement.runtime.ort.program import Program
from placement.runtime.ort.sessions import stage_options, stage_session
from placement.runtime.ort.steps import HostStep, StageExec, StageStep, TransferStep
from placement.runtime.stages import Stage

__all__ = [
    "BlockedPlan",
    "blocked_plan",
    "blocked_session",
    "keep_blocked_boundaries",
    "optimized_graph",
    "optimized_path",
]

log = logging.getLogger(__name__)


@dataclass
class BlockedPlan:
    """Which stage outputs stay blocked, and which stage inputs arrive blocked.

    Attributes:
        outputs: stage index -> its outputs handed over in the blocked layout.
        inputs: stage index -> its session inputs that read a blocked value.
        blobs: the boundary blobs kept blocked (value-table keys of their producers).
    """

    outputs: dict[int, set[str]] = field(default_factory=dict)
    inputs: dict[int, set[str]] = field(default_factory=dict)
    blobs: list[str] = field(default_factory=list)
    sessions: dict[tuple[str, ...], ort.InferenceSession] = field(default_factory=dict)  # as used
    built: int = 0  # sessions built (the others came from the cache)

    def stages(self) -> set[int]:
        """Indices of the stages whose sessions change."""
        return set(self.outputs) | set(self.inputs)


def _readers(program: Program) -> tuple[dict[str, StageExec], dict[str, list[tuple[StageExec | None, str]]]]:
    """Who produces each stage output (by value-table key), and who reads it, through transfers.

    A reader is (stage, session input name), or (None, key) for anything that is not
    a CPU stage session's input (a host stage, a graph output).
    """
    producer: dict[str, StageExec] = {}
    origin: dict[str, str] = {}
    readers: dict[str, list[tuple[StageExec | None, str]]] = {}
    for step in program.steps:
        if isinstance(step, TransferStep):
            origin[step.target] = origin.get(step.source, step.source)
            continue
        for name, key in step.bind:
            source = origin.get(key, key)
            reader = step.exec if isinstance(step, StageStep) and not step.exec.physical.is_cuda else None
            readers.setdefault(source, []).append((reader, name))
        if isinstance(step, StageStep) and not step.exec.physical.is_cuda:
            for out in step.outputs:
                producer[out] = step.exec
        elif isinstance(step, HostStep):
            for out in step.outputs:
                readers.setdefault(out, []).append((None, out))
    for key, _ in program.outputs:
        readers.setdefault(origin.get(key, key), []).append((None, key))
    return producer, readers


def blocked_plan(program: Program, optimized: Callable[[StageExec], onnx.ModelProto | None]) -> BlockedPlan:
    """The boundaries of ``program`` that can stay in the blocked layout.

    Args:
        program: a compiled program (its stage sessions built as usual).
        optimized: a stage's ONNX Runtime-optimised graph, or None when it has none
            (called only for stages at candidate boundaries, possibly more than once).
    """
    producer, readers = _readers(program)
    plan = BlockedPlan()
    for blob, ex in producer.items():
        reads = readers.get(blob, [])
        if not reads or any(reader is None for reader, _ in reads):
            continue
        if not _has_conv(ex) or not all(_has_conv(r) for r, _ in reads if r is not None):
            continue
        made = optimized(ex)
        if made is None or blob not in blocked_outputs(made):
            continue
        if not all(_reads_blocked(optimized(r), name) for r, name in reads if r is not None):
            continue
        plan.outputs.setdefault(ex.stage.index, set()).add(blob)
        for r, name in reads:
            if r is not None:
                plan.inputs.setdefault(r.stage.index, set()).add(name)
        plan.blobs.append(blob)
    return plan


def _reads_blocked(graph: onnx.ModelProto | None, name: str) -> bool:
    return graph is not None and name in blocked_inputs(graph)


def _has_conv(ex: StageExec) -> bool:
    return any(node.op_type == "Conv" for node in ex.stage.model.graph)


def optimized_path(workdir: Path, stage: Stage) -> Path:
    """Where a stage's optimised graph is written in ``workdir`` (its weights beside it)."""
    return workdir / f"stage{stage.index}.onnx"


def optimized_graph(ex: StageExec, threads: int | None, workdir: Path) -> onnx.ModelProto:
    """ONNX Runtime's optimised graph of a CPU stage, under ``workdir`` (weights beside it).

    Read from :func:`optimized_path` when the stage's session wrote it there as it was
    built (:class:`placement.Runner` asks for that for the stages that may keep a
    boundary blocked); otherwise the stage's session is built once more, by
    :func:`placement.runtime.ort.sessions.stage_session` with ``optimized_path`` set. The
    graph is loaded without its weights, which stay in ``workdir`` for
    :func:`blocked_session`.
    """
    path = optimized_path(workdir, ex.stage)
    if not path.exists():
        stage_session(ex.stage, ex.physical, threads=threads, optimized_path=path)
    return onnx.load(str(path), load_external_data=False)


def blocked_session(
    proto: onnx.ModelProto,
    outputs: set[str],
    inputs: set[str],
    physical: PhysicalDevice,
    threads: int | None,
    workdir: Path,
    name: str,
) -> ort.InferenceSession:
    """The session of an optimised stage graph with ``outputs``/``inputs`` kept blocked.

    The graph is written next to its weights in ``workdir`` and loaded with ONNX
    Runtime's optimisations off (it is already optimised).
    """
    path = workdir / f"{name}.blocked.onnx"
    onnx.save(keep_blocked(proto, outputs, inputs), str(path))
    options = stage_options(physical, threads=threads)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=[physical.ort_provider])


def keep_blocked_boundaries(
    program: Program,
    threads: int | None,
    cache: dict[tuple[str, ...], ort.InferenceSession] | None = None,
    graphs: dict[tuple[str, ...], onnx.ModelProto | None] | None = None,
    *,
    workdir: Path | None = None,
) -> BlockedPlan:
    """Rebuild the CPU stage sessions of ``program`` so that their boundaries stay blocked.

    Replaces ``session`` in the program's :class:`StageExec` s of the stages
    involved (recompile the program afterwards) and returns what was kept blocked,
    with the sessions used (``plan.sessions``) and how many were built (``plan.built``).
    ``cache`` maps (stage fingerprint, device, threads, blocked outputs, blocked inputs)
    to sessions built earlier and ``graphs`` (stage fingerprint, device, threads) to
    optimised graphs, so a re-placement back to a known placement builds nothing.
    ``workdir``: a directory where stage sessions already wrote their optimised graphs
    (:func:`optimized_path`), read instead of building those sessions again; new files
    go there too (default: a temporary directory of this call). Any failure leaves every
    usual session in place (logged): this is an optimisation.
    """
    cache = {} if cache is None else cache
    graphs = {} if graphs is None else graphs
    execs = {step.exec.stage.index: step.exec for step in program.steps if isinstance(step, StageStep)}
    with contextlib.ExitStack() as scope:
        where = workdir if workdir is not None else Path(scope.enter_context(_scratch()))
        fresh: dict[int, onnx.ModelProto | None] = {}  # made in this call: their weights are in workdir

        def made_here(ex: StageExec) -> onnx.ModelProto | None:
            if ex.stage.index not in fresh:
                try:
                    fresh[ex.stage.index] = optimized_graph(ex, threads, where)
                except Exception as err:  # noqa: BLE001 (an optimisation: the usual session stays)
                    log.debug("stage %d: no optimised graph (%s)", ex.stage.index, err)
                    fresh[ex.stage.index] = None
                graphs[_graph_key(ex, threads)] = fresh[ex.stage.index]
            return fresh[ex.stage.index]

        def optimized(ex: StageExec) -> onnx.ModelProto | None:
            key = _graph_key(ex, threads)
            return graphs[key] if key in graphs else made_here(ex)

        plan = blocked_plan(program, optimized)
        built: dict[int, tuple[tuple[str, ...], ort.InferenceSession]] = {}
        try:  # all or nothing: a blob is blocked on both sides or on neither
            for index in sorted(plan.stages()):
                ex = execs[index]
                outs, ins = plan.outputs.get(index, set()), plan.inputs.get(index, set())
                key = (*_graph_key(ex, threads), *sorted(outs), "|", *sorted(ins))
                session = cache.get(key)
                if session is None:
                    proto = made_here(ex)
                    if proto is None:
                        raise RuntimeError(f"stage {index}: ONNX Runtime gave no optimised graph")
                    name = f"stage{index}"
                    session = blocked_session(proto, outs, ins, ex.physical, threads, where, name)
                    plan.built += 1
                built[index] = (key, session)
        except Exception as err:  # noqa: BLE001 (an optimisation: every usual session stays)
            log.warning("stage boundaries stay in NCHW: building a blocked stage session failed: %s", err)
            return BlockedPlan()
    for index, (key, session) in built.items():
        plan.sessions[key] = session
        execs[index].session = session
    if plan.blobs:
        log.info("stage boundaries kept in the blocked layout: %s", ", ".join(plan.blobs))
    return plan


def _scratch() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="placement-blocked-", ignore_cleanup_errors=True)


def _graph_key(ex: StageExec, threads: int | None) -> tuple[str, ...]:
    return (ex.stage.fingerprint, str(ex.physical), str(threads))
