"""Pipelined execution over micro-batches: one schedule for both runtimes.

A placed model cut into stages ``0 .. N-1`` (one per device segment, see
:mod:`placement.runtime.stages`) runs a mini-batch split into ``k``
*micro-batches* in GPipe's fill-drain schedule: at clock tick ``t`` stage ``j``
works on micro-batch ``t - j``, so after ``N - 1`` ticks of filling every stage
is busy on a different micro-batch (see :func:`clock_cycles`). The idle share
of the stage-time grid, the *bubble*, is ``(N - 1) / (k + N - 1)``
(:func:`bubble_fraction`).

The schedule is executed by :class:`StageWorkers`: one worker thread per stage,
stage ``j`` reading micro-batches from a FIFO queue that stage ``j - 1`` fills.
Each worker takes the next micro-batch as soon as its predecessor hands it
over, so stage ``j`` runs micro-batch ``i`` after stage ``j - 1`` finished it
and after it finished micro-batch ``i - 1`` itself: exactly the clock-cycle
order, without a barrier per tick. The number of micro-batches in flight is
bounded (a window), so a stream of inputs never grows memory without bound
(back-pressure: the next input is read only when an output was taken). An
error in any stage stops the pipeline and re-raises in the caller as
:class:`placement.errors.PipelineError` naming the stage and micro-batch; every
worker thread is joined before the call returns or raises.

The ONNX Runtime executor (:class:`placement.runtime.ort.Runner` with
``chunks=k`` and :meth:`~placement.runtime.ort.Runner.stream`) and the torch
lowering (``to_torch(model, chunks=k)``, forward *and* backward) both run on
these workers. Micro-batches are cut along each input's *batch axis*
(:func:`batch_axes`) with :func:`split_batch` and outputs are joined with
:func:`concat_batch`.

Example:
    >>> from placement.runtime.pipeline import clock_cycles, bubble_fraction
    >>> for tick in clock_cycles(3, 2):
    ...     print(tick)
    [(0, 0)]
    [(1, 0), (0, 1)]
    [(2, 0), (1, 1)]
    [(2, 1)]
    >>> round(bubble_fraction(8, 2), 3)
    0.111
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.analysis import copy_origin
from placement.errors import InputError, PipelineError, PlacementError
from placement.graph.model import Model
from placement.runtime.inputs import input_specs

__all__ = [
    "BatchAxes",
    "StageWorkers",
    "batch_axes",
    "bubble_fraction",
    "clock_cycles",
    "concat_batch",
    "microbatch_bounds",
    "run_microbatches",
    "split_batch",
    "stage_error",
    "stage_threads",
    "stream_microbatches",
]

log = logging.getLogger(__name__)

#: Checkpointing modes of the torch pipeline (GPipe's): recompute every, all but the last, or no micro-batch.
CHECKPOINT_MODES = ("always", "except_last", "never")


# --- the schedule ---------------------------------------------------------------------------


def clock_cycles(num_microbatches: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """GPipe's fill-drain schedule: per clock tick, the ``(micro-batch, stage)`` pairs that run.

    At tick ``t`` stage ``j`` runs micro-batch ``t - j``; there are
    ``num_microbatches + num_stages - 1`` ticks.

    Example:
        >>> clock_cycles(2, 2)
        [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError("a schedule needs at least one micro-batch and one stage")
    ticks = []
    for t in range(num_microbatches + num_stages - 1):
        first = max(0, t - num_microbatches + 1)
        last = min(t, num_stages - 1)
        ticks.append([(t - j, j) for j in range(first, last + 1)])
    return ticks


def bubble_fraction(num_microbatches: int, num_stages: int) -> float:
    """The idle share of the fill-drain schedule with equal stages: ``(N-1) / (k+N-1)``.

    Example:
        >>> bubble_fraction(1, 2)
        0.5
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def stage_threads(num_stages: int, *, cores: int | None = None) -> int:
    """Intra-op threads per stage when ``num_stages`` stages share the CPU: cores / stages, at least 1.

    Example:
        >>> stage_threads(2, cores=8)
        4
    """
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, num_stages))


# --- batch axes, split and concat -----------------------------------------------------------


@dataclass(frozen=True)
class BatchAxes:
    """Where the batch is in each graph input and output.

    Attributes:
        inputs: graph input name -> batch axis, or None for an input that goes
            whole to every micro-batch (a mask broadcast over the batch, a scalar).
        outputs: graph output name -> batch axis (outputs are concatenated along it).
        symbol: the symbolic dimension recognised as the batch (None when all
            axes were given).
    """

    inputs: dict[str, int | None]
    outputs: dict[str, int]
    symbol: str | None = None


def batch_axes(model: Model, *, overrides: Mapping[str, int | None] | None = None) -> BatchAxes:
    """Find the batch axis of every graph input and output of ``model``.

    The batch is the first symbolic dimension of the first input that has
    one (a model exported with a dynamic batch: ``pl.from_torch(net, args,
    dynamic_shapes=...)``), except that an input read as the sequence of a
    time-major ``RNN``/``GRU``/``LSTM`` (``layout=0``, ``[steps, batch, features]``)
    has its batch on axis 1; each input and output is batched along the axis
    carrying that same symbol. Inputs without it go whole to every
    micro-batch. ``overrides`` (input or output name -> axis, or None for "not
    batched", inputs only) replaces the detection for the names it lists.

    Exporters sometimes annotate an output with fresh symbols of their own
    (``LayerNormalization747_dim_0``, where a window partition reshapes the
    batch away and back): for such outputs the shapes are inferred again from
    the inputs (ONNX's shape inference with data propagation, then ONNX
    Runtime's symbolic shape inference), and the batch symbol found there counts.

    Raises:
        InputError: an override names no graph input/output or an axis out of range.
        PlacementError: no input has a batch axis, or an output has none (the
            message names it): such a model cannot be split into micro-batches.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        >>> batch_axes(model)
        BatchAxes(inputs={'input': 0}, outputs={'linear_2': 0}, symbol='batch')
    """
    overrides = dict(overrides or {})
    specs = input_specs(model.graph)
    outputs = [(v.name or "", _dims(v.shape)) for v in model.graph.outputs]
    known = {s.name for s in specs} | {name for name, _ in outputs}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(
            f"batch_axes names {', '.join(map(repr, unknown))}, which is not a graph input or output; "
            f"inputs: {', '.join(repr(s.name) for s in specs)}; "
            f"outputs: {', '.join(repr(n) for n, _ in outputs)}"
        )
    symbol = None
    for spec in specs:  # an override names the batch axis
        axis = overrides.get(spec.name)
        dims = spec.shape or ()
        if axis is not None and -len(dims) <= axis < len(dims) and isinstance(dims[axis], str):
            symbol = dims[axis]
            break
    if symbol is None:  # a time-major recurrent op's input: its batch is on axis 1
        recurrent = _recurrent_batch_axes(model)
        for spec in specs:
            axis = recurrent.get(spec.name)
            dims = spec.shape or ()
            if spec.name not in overrides and axis is not None and axis < len(dims):
                if isinstance(dims[axis], str) and dims[axis]:
                    symbol = dims[axis]
                    break
    if symbol is None:  # else the first symbolic dimension of the first input with one
        for spec in specs:
            if spec.name in overrides:
                continue
            symbol = next((dim for dim in spec.shape or () if isinstance(dim, str) and dim), None)
            if symbol is not None:
                break

    def axis_of(name: str, dims: tuple[Any, ...] | None) -> int | None:
        if name in overrides:
            axis = overrides[name]
            if axis is not None and dims is not None and not -len(dims) <= axis < len(dims):
                raise InputError(f"batch axis {axis} of {name!r} is out of range for rank {len(dims)}")
            if axis is not None and dims is not None and axis < 0:
                axis += len(dims)
            return axis
        if symbol is None or dims is None:
            return None
        return dims.index(symbol) if symbol in dims else None

    ins = {spec.name: axis_of(spec.name, spec.shape) for spec in specs}
    if not any(axis is not None for axis in ins.values()):
        shapes = ", ".join(f"{s.name!r}: {s.describe()}" for s in specs)
        raise PlacementError(
            f"cannot split the inputs into micro-batches: no input has a batch axis ({shapes}); "
            "export the model with a dynamic batch dimension, e.g. "
            "pl.from_torch(net, args, dynamic_shapes=({0: torch.export.Dim('batch')},)), "
            "or name the axes with batch_axes={input: axis}"
        )
    if symbol is not None and any(
        name not in overrides and (dims is None or symbol not in dims) for name, dims in outputs
    ):
        inferred = _inferred_output_dims(model, symbol)
        outputs = [(name, dims if name in overrides else inferred.get(name, dims)) for name, dims in outputs]
    outs: dict[str, int] = {}
    for name, dims in outputs:
        axis = axis_of(name, dims)
        if axis is None:
            shown = "unknown shape" if dims is None else f"shape [{', '.join(map(str, dims))}]"
            raise PlacementError(
                f"cannot pipeline over micro-batches: graph output {name!r} ({shown}) has no batch axis"
                f"{f' {symbol!r}' if symbol else ''}, so micro-batch results cannot be concatenated "
                "(an op fixes the batch size or reduces over it); pass batch_axes={output: axis} "
                "if it has one"
            )
        outs[name] = axis
    return BatchAxes(ins, outs, symbol)


#: ONNX's recurrent ops: input 0 is ``[seq, batch, ...]`` with ``layout=0`` (the default), else batch-major.
_RECURRENT = frozenset({"RNN", "GRU", "LSTM"})


def _recurrent_batch_axes(model: Model) -> dict[str, int]:
    """Graph inputs read (directly or through copies) as the sequence input of a recurrent op:
    name -> their batch axis."""
    found: dict[str, int] = {}
    for node in model.graph:
        if node.op_type in _RECURRENT and node.domain in ("", "ai.onnx") and node.inputs:
            x = copy_origin(node.inputs[0]) if node.inputs[0] is not None else None
            if x is not None and x.is_graph_input() and x.name:
                layout = node.attributes.get("layout")
                found.setdefault(x.name, 0 if layout is not None and layout.as_int() == 1 else 1)
    return found


def _inferred_output_dims(model: Model, symbol: str) -> dict[str, tuple[Any, ...]]:
    """Graph outputs' dims inferred again from the inputs' shapes, the outputs' own
    annotations dropped: those that carry ``symbol``.

    Tries ONNX's shape inference (with data propagation) keeping the intermediate
    annotations, then without them, then ONNX Runtime's symbolic shape inference;
    an output keeps the first answer that has the symbol."""
    import onnx

    from placement.graph.weights import split_weights

    proto, _ = split_weights(model)  # big weights as stubs: their shapes are all inference needs
    for value in proto.graph.output:
        value.type.tensor_type.ClearField("shape")
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.graph.value_info[:]

    def onnx_inference(model: onnx.ModelProto) -> onnx.ModelProto:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)

    def symbolic_inference(model: onnx.ModelProto) -> onnx.ModelProto:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        return SymbolicShapeInference.infer_shapes(_tensor_constants(model), auto_merge=True)

    result: dict[str, tuple[Any, ...]] = {}
    for infer, given in ((onnx_inference, proto), (onnx_inference, bare), (symbolic_inference, proto)):
        try:
            inferred = infer(given)
        except Exception as err:  # noqa: BLE001 (a second opinion; the caller reports what stays unknown)
            log.debug("batch axes: %s failed: %s", infer.__name__, err)
            continue
        for value in inferred.graph.output if inferred is not None else ():
            dims = tuple(_dim(d) for d in value.type.tensor_type.shape.dim)
            if symbol in dims:
                result.setdefault(value.name, dims)
        if len(result) == len(proto.graph.output):
            break
    return result


def _tensor_constants(model: Any) -> Any:
    """``model`` (an ONNX ``ModelProto``, edited in place) with every ``Constant`` that holds a
    number or a list of numbers (``value_float``, ``value_ints``, ...) holding it as a tensor
    (``value``), the only form ONNX Runtime's symbolic shape inference reads."""
    from onnx import helper, numpy_helper

    dtypes = {"value_float": np.float32, "value_floats": np.float32}
    dtypes |= {"value_int": np.int64, "value_ints": np.int64}
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name in dtypes:
            attribute = node.attribute[0]
            tensor = numpy_helper.from_array(
                np.array(helper.get_attribute_value(attribute), dtype=dtypes[attribute.name])
            )
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", tensor))
    return model


def _dim(dim: Any) -> Any:
    """An ONNX ``TensorShapeProto.Dimension`` as a symbol, a size or None."""
    return dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else None)


def _dims(shape: Any) -> tuple[Any, ...] | None:
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else getattr(d, "value", None) for d in shape)


def microbatch_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each micro-batch: ``min(chunks, size)`` parts whose sizes differ by at most 1.

    Example:
        >>> microbatch_bounds(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    parts = max(1, min(chunks, size))
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_batch(values: Sequence[Any], axes: Sequence[int | None], chunks: int) -> list[list[Any]]:
    """Cut arrays (numpy or torch) into micro-batches along their batch axes.

    ``values[n]`` is cut along ``axes[n]``; a value whose axis is None goes
    whole into every micro-batch. All batched values must agree on the batch
    size. The parts are views (numpy slices / torch ``narrow``).

    Raises:
        InputError: the batched values disagree on the batch size.

    Example:
        >>> import numpy as np
        >>> parts = split_batch([np.arange(6).reshape(3, 2), np.ones(2)], [0, None], 2)
        >>> [[p.shape for p in part] for part in parts]
        [[(2, 2), (2,)], [(1, 2), (2,)]]
    """
    sizes = {int(v.shape[a]) for v, a in zip(values, axes) if a is not None}
    if len(sizes) > 1:
        raise InputError(f"batched inputs disagree on the batch size: {sorted(sizes)}")
    size = sizes.pop() if sizes else 1
    parts: list[list[Any]] = []
    for start, stop in microbatch_bounds(size, chunks):
        part = []
        for value, axis in zip(values, axes):
            if axis is None:
                part.append(value)
            elif hasattr(value, "narrow"):
                part.append(value.narrow(axis, start, stop - start))
            else:
                part.append(value[(slice(None),) * axis + (slice(start, stop),)])
        parts.append(part)
    return parts


def concat_batch(parts: Sequence[Sequence[Any]], axes: Sequence[int]) -> list[Any]:
    """Join per-micro-batch outputs along their batch axes (the inverse of :func:`split_batch`).

    Returns new arrays (numpy ``concatenate`` / ``torch.cat``), which own their memory.

    Example:
        >>> import numpy as np
        >>> concat_batch([[np.zeros((2, 3))], [np.ones((1, 3))]], [0])[0].shape
        (3, 3)
    """
    joined = []
    for n, axis in enumerate(axes):
        pieces = [part[n] for part in parts]
        first = pieces[0]
        if hasattr(first, "narrow"):
            import torch

            joined.append(torch.cat(pieces, dim=axis))
        else:
            joined.append(np.concatenate(pieces, axis=axis))
    return joined


# --- the workers ----------------------------------------------------------------------------

_STOP = object()


@dataclass
class _Failure:
    stage: int
    microbatch: int
    error: BaseException


StageFn = Callable[[int, Any], Any]


class StageWorkers:
    """One worker thread per stage, chained by FIFO queues: the fill-drain pipeline.

    ``stages[j](i, payload)`` runs stage ``j`` on micro-batch ``i`` and returns
    the payload handed to stage ``j + 1`` (the last stage's result is what
    :meth:`results` yields). Use as a context manager: leaving it stops and
    joins every worker, also on errors.

    Args:
        stages: the stage functions, in order.
        names: a readable name per stage (used in error messages and thread names).
        context: optional factory of a context manager each worker enters
            around its loop (thread-local state: grad mode, a CUDA stream).
        inline_last: run the last stage on the caller's thread, inside :meth:`result`
            (entering ``context`` around each call), instead of on a worker of its own.
            The caller waits in :meth:`result` anyway; on the CPU this saves a thread
            hand-off per micro-batch and a glibc malloc arena whose memory would be
            returned to the system and faulted in again every step.

    Example:
        >>> with StageWorkers([lambda i, x: x + 1, lambda i, x: x * 10], ["add", "mul"]) as workers:
        ...     for i in range(3):
        ...         workers.submit(i, i)
        ...     [workers.result() for _ in range(3)]
        [10, 20, 30]
    """

    def __init__(
        self,
        stages: Sequence[StageFn],
        names: Sequence[str] | None = None,
        *,
        context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        inline_last: bool = False,
    ) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self._fns = list(stages)
        self.names = list(names) if names is not None else [f"stage {j}" for j in range(len(stages))]
        self._context = context
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(len(stages) + 1)]
        self._failed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pending = 0
        self._running = False
        #: the last stage runs on the caller's thread, in :meth:`result` (one thread fewer)
        self._inline = self._fns[-1] if inline_last else None
        self._workers = len(self._fns) - 1 if inline_last else len(self._fns)  # stages on threads
        self._final = self._queues[self._workers]  # what the caller reads: the last worker's output

    def __enter__(self) -> StageWorkers:
        self._running = True
        for j in range(self._workers):
            thread = threading.Thread(
                target=self._loop, args=(j,), name=f"placement-pipeline-{self.names[j]}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def in_flight(self) -> int:
        """Micro-batches submitted whose results were not taken yet."""
        return self._pending

    def submit(self, microbatch: int, payload: Any) -> None:
        """Hand micro-batch ``microbatch`` to the first stage."""
        if not self._running:
            raise RuntimeError("the pipeline is not running (use it as a context manager)")
        self._pending += 1
        self._queues[0].put((microbatch, payload))

    def result(self) -> Any:
        """The last stage's result for the oldest submitted micro-batch (blocks until it is there).

        Raises:
            PipelineError: a stage failed; names the stage and micro-batch.
        """
        if self._pending <= 0:
            raise RuntimeError("no micro-batch in flight")
        item = self._final.get()
        if isinstance(item, _Failure):
            self._pending = 0
            raise self._error(item)
        self._pending -= 1
        if self._inline is None:
            return item[1]
        i, payload = item
        last = len(self._fns) - 1
        try:
            with self._context(last) if self._context is not None else contextlib.nullcontext():
                return self._inline(i, payload)
        except BaseException as err:  # noqa: BLE001 - re-raised naming the stage
            self._failed.set()
            self._pending = 0
            raise self._error(_Failure(last, i, err)) from err

    def close(self) -> None:
        """Stop and join every worker (idempotent)."""
        if not self._running:
            return
        self._running = False
        self._failed.set()  # queued work is skipped, not run
        self._queues[0].put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _error(self, failure: _Failure) -> PipelineError:
        return stage_error(failure.stage, self.names[failure.stage], failure.microbatch, failure.error)

    def _loop(self, j: int) -> None:
        fn = self._fns[j]
        q_in, q_out = self._queues[j], self._queues[j + 1]
        final = self._final
        with self._context(j) if self._context is not None else contextlib.nullcontext():
            while True:
                item = q_in.get()
                if item is _STOP:
                    if j + 1 < self._workers:
                        q_out.put(_STOP)
                    return
                if self._failed.is_set():
                    continue
                i, payload = item
                try:
                    result = fn(i, payload)
                except BaseException as err:  # noqa: BLE001 - re-raised in the caller
                    if not self._failed.is_set():
                        self._failed.set()
                        final.put(_Failure(j, i, err))
                    continue
                q_out.put((i, result))


def stage_error(stage: int, name: str, microbatch: int, err: BaseException) -> PipelineError:
    """The :class:`~placement.errors.PipelineError` for ``err`` raised by stage ``stage``
    (called ``name``) on micro-batch ``microbatch``; ``err`` is its cause.

    Example:
        >>> stage_error(1, "stage 1 on cpu", 3, ValueError("bad")).args[0]
        'pipeline stage 1 (stage 1 on cpu) failed on micro-batch 3: ValueError: bad'
    """
    message = (
        f"pipeline stage {stage} ({name}) failed on micro-batch {microbatch}: {type(err).__name__}: {err}"
    )
    error = PipelineError(message, stage=stage, microbatch=microbatch)
    error.__cause__ = err
    return error


def run_microbatches(
    stages: Sequence[StageFn],
    payloads: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> list[Any]:
    """Run every payload through the stages in the fill-drain schedule; results in order.

    Example:
        >>> run_microbatches([lambda i, x: x * 2, lambda i, x: x + i], [1, 2, 3])
        [2, 5, 8]
    """
    with StageWorkers(stages, names, context=context) as workers:
        for i, payload in enumerate(payloads):
            workers.submit(i, payload)
        return [workers.result() for _ in payloads]


def stream_microbatches(
    stages: Sequence[StageFn],
    payloads: Iterable[Any],
    *,
    window: int,
    names: Sequence[str] | None = None,
    context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
) -> Iterator[Any]:
    """Yield the stages' results for a stream of payloads, in order, at most ``window`` in flight.

    The next payload is read from ``payloads`` only when fewer than ``window``
    are in the pipeline, so memory stays bounded however long the stream. The
    workers stop when the stream ends, when the consumer stops iterating
    (``close()`` on the generator) or on an error.

    Example:
        >>> list(stream_microbatches([lambda i, x: -x], iter(range(4)), window=2))
        [0, -1, -2, -3]
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    source = iter(payloads)
    with StageWorkers(stages, names, context=context) as workers:
        i = 0
        while True:
            if workers.in_flight >= window:
                yield workers.result()
                continue
            try:
                payload = next(source)
            except StopIteration:
                break
            workers.submit(i, payload)
            i += 1
        while workers.in_flight:
            yield workers.result()


# --- ONNX Runtime ---------------------------------------------------------------------------


def _ort_stages(runner: Any, outputs: str = "numpy") -> tuple[list[StageFn], list[str]]:
    """The runner's program as pipeline stage functions (one per stage session).

    Each function runs one stage and the transfers that follow it on a
    micro-batch's own value table, through its own ``IOBinding`` (so a stream
    and a run of one runner never share bindings). The first also feeds the
    graph inputs; the last collects the outputs.
    """
    from placement.runtime.program import HostStep, StageStep, TransferStep

    program = runner.program
    groups: list[list[StageStep | HostStep | TransferStep]] = [[]]
    for step in program.steps:  # a stage (or host-value stage) and the transfers after it
        if not isinstance(step, TransferStep) and any(not isinstance(s, TransferStep) for s in groups[-1]):
            groups.append([])
        groups[-1].append(step)
    names = []
    for group in groups:
        ex = next((s.exec for s in group if not isinstance(s, TransferStep)), None)
        names.append(f"stage {ex.stage.index} on {ex.stage.device} ({ex.physical})" if ex else "transfers")

    def make(index: int, group: list[StageStep | HostStep | TransferStep]) -> StageFn:
        # each worker binds through its own IOBindings, never the runner's
        bindings = {id(s): s.exec.new_binding(s.outputs) for s in group if isinstance(s, StageStep)}
        first, last = index == 0, index == len(groups) - 1

        def fn(i: int, payload: Any) -> Any:
            values = program.feed(payload) if first else payload
            for step in group:
                step.run(values, bindings.get(id(step)))
            return program.collect(values, outputs) if last else values

        return fn

    return [make(n, group) for n, group in enumerate(groups)], names


def ort_run_pipelined(runner: Any, arrays: list[Any], *, outputs: str = "numpy") -> list[Any]:
    """One :meth:`Runner.run` with ``chunks > 1``: split, pipeline, concatenate.

    Device values (``OrtValue`` s, torch CUDA tensors) are split and the outputs joined
    where they are, as torch tensors over the same memory (DLPack): nothing goes
    through the host for device inputs and ``outputs="torch"`` / ``"ortvalue"``."""
    from placement.runtime.program import to_output

    device = outputs != "numpy" or any(isinstance(a, ort_value_type()) for a in arrays)
    if device:
        arrays = [_as_torch(a) for a in arrays]
    fns, names = _ort_stages(runner, "torch" if device else "numpy")
    axes = runner._pipeline_axes()
    in_axes = [axes.inputs[name] for name in runner.input_names]
    parts = split_batch(arrays, in_axes, runner.chunks)
    parts = [[_contiguous(a) for a in part] for part in parts]
    results = run_microbatches(fns, parts, names=names)
    joined = concat_batch(results, [axes.outputs[name] for name in runner.output_names])
    if not device or outputs == "torch":
        return joined
    return [to_output(_as_ortvalue_or_numpy(v), outputs) for v in joined]


def ort_value_type() -> type:
    """``onnxruntime.OrtValue`` (imported on use)."""
    import onnxruntime as ort

    return ort.OrtValue


def _as_torch(value: Any) -> Any:
    """A tensor input as a torch tensor over the same memory (DLPack; numpy: ``from_numpy``)."""
    import torch

    if isinstance(value, ort_value_type()):
        tensor = torch.from_dlpack(value._ortvalue)
        return tensor.view(torch.bool) if value.data_type() == "tensor(bool)" else tensor
    if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
        return torch.from_numpy(value)
    return value


def _as_ortvalue_or_numpy(value: Any) -> Any:
    """A joined output (a torch tensor, which owns its memory) as an ``OrtValue`` over it."""
    from placement.runtime.inputs import ortvalue_from_torch

    return ortvalue_from_torch(value) if hasattr(value, "__dlpack__") else value


def ort_stream(
    runner: Any, batches: Iterable[Any], *, window: int | None = None, outputs: str = "numpy"
) -> Iterator[list[Any]]:
    """The generator behind :meth:`Runner.stream` (``outputs`` as for :meth:`Runner.run`)."""
    from placement.runtime.inputs import normalize_inputs
    from placement.runtime.program import to_output

    chunks = runner.chunks
    joined_on_device = chunks > 1 and outputs != "numpy"
    fns, names = _ort_stages(runner, "torch" if joined_on_device else outputs)
    if chunks > 1:
        axes = runner._pipeline_axes()
        in_axes = [axes.inputs[name] for name in runner.input_names]
        out_axes = [axes.outputs[name] for name in runner.output_names]
    window = window or 2 * len(fns) * chunks

    def payloads() -> Iterator[Any]:
        for batch in batches:
            arrays = normalize_inputs(batch, runner._specs, device_values=True)
            if chunks == 1:
                yield [arrays]
            else:
                arrays = [_as_torch(a) for a in arrays]  # device values split where they are
                yield [[_contiguous(a) for a in part] for part in split_batch(arrays, in_axes, chunks)]

    def flat() -> Iterator[Any]:
        for parts in payloads():
            yield from ((len(parts), part) for part in parts)

    # Micro-batches of one batch are consecutive in the stream; regroup them on the way out.
    pending: list[Any] = []
    sizes: list[int] = []

    def tagged() -> Iterator[Any]:
        for count, part in flat():
            sizes.append(count)
            yield part

    for result in stream_microbatches(fns, tagged(), window=window, names=names):
        pending.append(result)
        if len(pending) == sizes[0]:
            del sizes[: len(pending)]
            if chunks == 1:
                yield pending[0]
            else:
                joined = concat_batch(pending, out_axes)
                if outputs == "ortvalue":
                    joined = [to_output(_as_ortvalue_or_numpy(v), outputs) for v in joined]
                yield joined
            pending = []


def _contiguous(array: Any) -> Any:
    if hasattr(array, "contiguous") and hasattr(array, "__dlpack__"):
        return array.contiguous()  # a torch tensor: on its own device
    return np.ascontiguousarray(array)
