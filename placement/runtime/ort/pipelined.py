"""Pipelined runs of the ONNX Runtime executor: ``Runner(chunks=k).run`` and ``Runner.stream``.

The runner's compiled program (:mod:`placement.runtime.ort.program`) becomes one stage function per
stage session (with the transfers after it), run on the shared workers of
:mod:`placement.runtime.schedule`; batches are split along their batch axes and outputs joined.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> runner = pl.Runner(pl.from_torch(net, (x,)), device_map="cpu")
    >>> [out[0].shape for out in ort_stream(runner, [x, 2 * x])]
    [(4, 8), (4, 8)]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from placement.errors import PlacementError
from placement.runtime.inputs import contiguous, normalize_inputs, ortvalue_from_torch
from placement.runtime.ort.program import NativeRun
from placement.runtime.ort.steps import HostStep, StageStep, TransferStep
from placement.runtime.ort.values import to_output
from placement.runtime.schedule import (
    StageFn,
    concat_batch,
    run_microbatches,
    split_batch,
    stream_microbatches,
)
from placement.runtime.schedule.workers import failed_payload

__all__ = ["WINDOW_PER_STAGE", "ort_run_pipelined", "ort_stream", "ort_value_type"]


def _ort_stages(
    runner: Any, outputs: str = "numpy", *, views: bool = False
) -> tuple[list[StageFn], list[str]]:
    """The runner's program as pipeline stage functions (one per stage session).

    Each function runs one stage and the transfers that follow it on a
    micro-batch's own value table, through its own ``IOBinding`` (so a stream
    and a run of one runner never share bindings). The first also feeds the
    graph inputs; the last collects the outputs (with ``views``, as host views
    paired with the table that keeps them valid: see :func:`_native_stages`).
    """
    program = runner._pipelined_program()
    if program.native is not None:
        return _native_stages(program.native, outputs, views=views)
    groups: list[list[StageStep | HostStep | TransferStep]] = [[]]
    for step in program.steps:  # a stage (or host-value stage) and the transfers after it
        if not isinstance(step, TransferStep) and any(not isinstance(s, TransferStep) for s in groups[-1]):
            groups.append([])
        groups[-1].append(step)
    names = []
    for group in groups:
        ex = next((s.exec for s in group if not isinstance(s, TransferStep)), None)
        names.append(_name(ex) if ex else "transfers")

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


def _name(ex: Any) -> str:
    return f"stage {ex.stage.index} on {ex.stage.device} ({ex.physical})"


def _native_stages(native: NativeRun, outputs: str, *, views: bool) -> tuple[list[StageFn], list[str]]:
    """Stage functions of a program that runs natively on the CPU (:class:`NativeRun`): each
    calls its stage's native ``run_with_ort_values`` on a micro-batch's table of native
    values, with no step objects or ``OrtValue`` wrappers in between. The table keeps the
    micro-batch's input arrays alive (native values over them do not). With ``views`` and
    numpy outputs, the last returns ``(host views of the outputs, the table)``: joining the
    micro-batches then copies each output once, into the joined array."""
    last = len(native.stages) - 1

    def make(j: int, ex: Any, bind: Any, outs: list[str], free: tuple[str, ...]) -> StageFn:
        def fn(i: int, payload: Any) -> Any:
            if j == 0:
                values = native.feed(payload)
                values[_KEEP] = payload
            else:
                values = payload
            try:
                results = ex.direct({name: values[key] for name, key in bind}, outs, None)
            except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
                raise ex.error(err) from err
            for n, name in enumerate(outs):
                values[name] = results[n]
            for key in free:
                del values[key]
            if j < last:
                return values
            if views and outputs == "numpy":
                return native.views(values), values
            return native.collect(values, outputs)

        return fn

    fns = [make(j, *stage) for j, stage in enumerate(native.stages)]
    return fns, [_name(stage[0]) for stage in native.stages]


#: The key under which a native micro-batch's table keeps its input arrays alive.
_KEEP = "\0inputs"


def ort_run_pipelined(runner: Any, arrays: list[Any], *, outputs: str = "numpy") -> list[Any]:
    """One :meth:`Runner.run` with ``chunks > 1``: split, pipeline, concatenate.

    Device values (``OrtValue`` s, torch CUDA tensors) are split and the outputs joined
    where they are, as torch tensors over the same memory (DLPack): nothing goes
    through the host for device inputs and ``outputs="torch"`` / ``"ortvalue"``."""
    device = outputs != "numpy" or any(isinstance(a, ort_value_type()) for a in arrays)
    if device:
        arrays = [_as_torch(a) for a in arrays]
    axes = runner._pipeline_axes()
    in_axes = [axes.inputs[name] for name in runner.input_names]
    parts = split_batch(arrays, in_axes, runner.chunks)
    parts = [[contiguous(a) for a in part] for part in parts]
    fns, names = _ort_stages(runner, "torch" if device else "numpy", views=True)
    # the last stage on the caller's thread: one hand-off per micro-batch fewer
    results = run_microbatches(fns, parts, names=names, inline_last=True)
    pieces = results
    if results and isinstance(results[0], tuple):  # host views, valid while ``results`` holds their tables
        pieces = [views for views, _ in results]
    joined = concat_batch(pieces, [axes.outputs[name] for name in runner.output_names])
    del results
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
    return ortvalue_from_torch(value) if hasattr(value, "__dlpack__") else value


#: Batches in flight per stage that :func:`ort_stream` allows by default (times ``chunks``).
WINDOW_PER_STAGE = 4


def ort_stream(
    runner: Any,
    batches: Iterable[Any],
    *,
    window: int | None = None,
    outputs: str = "numpy",
    errors: str = "raise",
) -> Iterator[Any]:
    """The generator behind :meth:`Runner.stream` (``outputs`` as for :meth:`Runner.run`).

    The stages are the pipelined run's (on the CPU, the native stage calls of
    :func:`_native_stages`), the last on the consumer's thread (one thread and one
    hand-off per micro-batch fewer). ``window`` counts batches; by default
    :data:`WINDOW_PER_STAGE` per stage: a worker that runs ahead of the consumer
    seldom waits for it, and on a CPU every wait is a thread hand-off. ``errors="yield"``:
    a batch that fails (bad inputs, a stage) yields its error in its place (see
    :class:`~placement.runtime.schedule.workers.StageWorkers`)."""
    chunks = runner.chunks
    if chunks == 1:
        fns, names = _ort_stages(runner, outputs)
        window = window or WINDOW_PER_STAGE * len(fns)
        payloads = (_payload(runner, batch, errors) for batch in batches)
        return stream_microbatches(fns, payloads, window=window, names=names, inline_last=True, errors=errors)
    return _stream_chunked(runner, batches, window, outputs, errors)


def _payload(runner: Any, batch: Any, errors: str) -> Any:
    """A batch's checked inputs; with ``errors="yield"``, bad inputs become a failed payload."""
    try:
        return normalize_inputs(batch, runner._specs, device_values=True)
    except PlacementError as err:
        if errors == "yield":
            return failed_payload(err)
        raise


def _stream_chunked(
    runner: Any, batches: Iterable[Any], window: int | None, outputs: str, errors: str = "raise"
) -> Iterator[Any]:
    """:func:`ort_stream` with ``chunks > 1``: each batch split in micro-batches (consecutive
    in the stream), their outputs joined on the way out (numpy: from host views, one copy)."""
    chunks = runner.chunks
    on_device = outputs != "numpy"
    fns, names = _ort_stages(runner, "torch" if on_device else outputs, views=True)
    axes = runner._pipeline_axes()
    in_axes = [axes.inputs[name] for name in runner.input_names]
    out_axes = [axes.outputs[name] for name in runner.output_names]
    window = (window or WINDOW_PER_STAGE * len(fns)) * chunks

    sizes: list[int] = []  # micro-batches per batch (fewer than ``chunks`` for a short batch)

    def parts() -> Iterator[Any]:
        for batch in batches:
            try:
                arrays = normalize_inputs(batch, runner._specs, device_values=True)
                arrays = [_as_torch(a) for a in arrays]  # device values split where they are
                split = split_batch(arrays, in_axes, chunks)
            except PlacementError as err:
                if errors != "yield":
                    raise
                sizes.append(1)
                yield failed_payload(err)
                continue
            sizes.append(len(split))
            yield from ([contiguous(a) for a in part] for part in split)

    pending: list[Any] = []
    results = stream_microbatches(fns, parts(), window=window, names=names, inline_last=True, errors=errors)
    for result in results:
        pending.append(result)
        if len(pending) < sizes[0]:
            continue
        del sizes[0]
        failed = next((r for r in pending if isinstance(r, BaseException)), None)
        if failed is not None:  # errors="yield": a micro-batch of this batch failed
            pending = []
            yield failed
            continue
        pieces = [views for views, _ in pending] if isinstance(pending[0], tuple) else pending
        joined = concat_batch(pieces, out_axes)
        pending = []
        if outputs == "ortvalue":
            joined = [to_output(_as_ortvalue_or_numpy(v), outputs) for v in joined]
        yield joined
