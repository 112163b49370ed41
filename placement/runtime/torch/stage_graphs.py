"""CUDA graphs for the stages of a pipelined module: ``pl.to_torch(model, chunks=k, cuda_graphs=True)``.

A micro-batch is small, so a stage's forward on a GPU costs more in kernel launches
(a few microseconds of CPU each) than in kernels. :class:`GraphedStageCall` records
a stage's launches once per input signature (shapes, dtypes, devices, grad mode) and
replays them with one call, on the stage's own stream:

* **Forwards without autograd** (inference, and the forwards of micro-batches that
  checkpointing recomputes later): one ``torch.cuda.CUDAGraph`` per signature. Inputs
  are copied into the graph's static buffers; outputs are cloned out of it (the next
  micro-batch's replay writes the same buffers while the next stage still reads them).
* **A forward whose backward follows at once** (a checkpointed micro-batch recomputed in
  backward, the last stage of a ``train_step``): ``torch.cuda.make_graphed_callables``
  captures forward and backward together. Its backward reads the activations of the
  latest replay, which is why only these pairs use it: a forward that keeps its
  activations across other micro-batches (``checkpoint="never"``, GPipe's last
  micro-batch) runs eagerly. Gradients come out of static buffers too and are cloned
  (:attr:`GraphedStageCall.static_grads`); such a stage computes its weight gradients
  with its input gradients (replaying the backward later would read another
  micro-batch's activations), so ``train_step`` does not defer them there.

Graphs are captured on first use of a signature and reused across steps (at most
``max_graphs`` per stage, the least recently used dropped). A capture that fails (an op
that synchronises with the host, a tensor read into Python) is reported once per stage
as a :class:`UserWarning`, and the stage runs eagerly for that signature from then on.
A stage on the CPU is not graphed; when no stage is on a GPU the module says so once.

Example (the capture seam: here a "capture" that fails, so the stage runs eagerly):
    >>> import warnings
    >>> import torch
    >>> def broken(fn, args, device, fixed):
    ...     raise RuntimeError("no graphs here")
    >>> call = GraphedStageCall(torch.nn.Linear(2, 2), torch.device("cpu"), "stage 0",
    ...                         capture_forward=broken)
    >>> with warnings.catch_warnings(record=True), torch.no_grad():
    ...     out = call(torch.ones(1, 2))
    >>> call.captures, call.fallbacks
    (0, 1)
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["GraphedStageCall", "capture_forward", "capture_training", "graph_stages"]

log = logging.getLogger(__name__)

#: Warm-up calls on a side stream before a capture (lazy initialisations, cuBLAS workspaces).
_WARMUP = 2

#: ``capture(fn, args, device, fixed)`` -> a replay of ``fn``; ``fixed``: positions of the args
#: that are the same tensors on every call (parameters), used in place rather than copied.
#: One capture at a time in the process (stages on one GPU capture from their own threads).
_capturing = threading.Lock()
#: Other threads' CUDA calls stay legal while one thread captures (where torch has the option).
_THREAD_LOCAL = (
    {"capture_error_mode": "thread_local"}
    if "capture_error_mode" in inspect.signature(torch.cuda.graph.__init__).parameters
    else {}
)

CaptureFn = Callable[[Callable[..., Any], Sequence[Any], torch.device, frozenset[int]], Callable[..., Any]]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


def capture_forward(
    fn: Callable[..., Any], args: Sequence[Any], device: torch.device, fixed: frozenset[int] = frozenset()
) -> Callable[..., Any]:
    """Capture ``fn(*args)`` without autograd as a CUDA graph on ``device``; returns the replay:
    a function of new args (same signature) whose outputs own their memory."""
    statics = [
        a.detach().clone() if isinstance(a, torch.Tensor) and n not in fixed else a
        for n, a in enumerate(args)
    ]
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with _capturing, torch.cuda.device(device):
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(_WARMUP):
                fn(*statics)
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, **_THREAD_LOCAL):
            outputs = fn(*statics)
    slots = [n for n, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def replay(*new: Any) -> Any:
        for n in slots:
            if new[n].data_ptr() != statics[n].data_ptr():
                statics[n].copy_(new[n], non_blocking=True)
        graph.replay()
        return _clone(outputs)

    return replay


def capture_training(
    fn: Callable[..., Any], args: Sequence[Any], device: torch.device, fixed: frozenset[int] = frozenset()
) -> Callable[..., Any]:
    """Capture ``fn``'s forward and backward together (``torch.cuda.make_graphed_callables``,
    sample inputs requiring grad as ``args`` do); returns the autograd-aware replay. Its
    backward must run right after its forward (it reads the latest replay's activations)."""
    samples = tuple(
        a.detach().clone().requires_grad_(a.requires_grad)
        if isinstance(a, torch.Tensor) and n not in fixed
        else a
        for n, a in enumerate(args)
    )

    def run(
        *args: Any,
    ) -> Any:  # a function, not the module: make_graphed_callables patches a module's forward
        return fn(*args)

    with _capturing, torch.cuda.device(device):
        graphed = torch.cuda.make_graphed_callables(run, samples, num_warmup_iters=3)
    return lambda *new: _clone(graphed(*new))


class GraphedStageCall:
    """A stage's call (``TorchStage.call``) that replays CUDA graphs, per input signature.

    Args:
        call: the stage's eager call (its module, or its :class:`.traced.TracedStage`).
        device: the stage's device.
        name: how notices name the stage.
        module: what is captured (default ``call``): the stage's fx module.
        fixed: positions of the inputs that are the same tensors on every call (parameters).
        capture_forward: the seam that captures a forward without autograd (see
            :func:`capture_forward`); tests replace it.
        capture_training: the seam that captures forward and backward together.
        max_graphs: most signatures kept with a graph.

    Attributes: ``captures`` (graphs made), ``replays``, ``fallbacks`` (signatures that
    run eagerly because their capture failed), ``static_grads`` (True: gradients out of a
    training replay are static buffers, so callers clone them and do not defer them).
    """

    static_grads = True

    def __init__(
        self,
        call: Callable[..., Any],
        device: torch.device,
        name: str,
        *,
        module: Callable[..., Any] | None = None,
        fixed: Sequence[int] = (),
        capture_forward: CaptureFn = capture_forward,
        capture_training: CaptureFn = capture_training,
        max_graphs: int = 8,
    ) -> None:
        self.call = call
        self.module = module if module is not None else call
        self.fixed = frozenset(fixed)
        self.device = device
        self.name = name
        self.max_graphs = max_graphs
        self._capture = {False: capture_forward, True: capture_training}
        self._graphs: OrderedDict[tuple[Any, ...], Callable[..., Any] | None] = OrderedDict()
        self._warned = False
        self.captures = self.replays = self.fallbacks = 0

    def __call__(self, *args: Any) -> Any:
        """Run the stage: a replay when grad mode is off (or nothing needs a gradient), else eagerly."""
        if torch.is_grad_enabled() and _needs_grad(args):
            return self.call(*args)
        return self._run(False, args)

    def immediate(self, *args: Any) -> Any:
        """Run the stage for a backward that follows at once: forward and backward replayed together."""
        if not (torch.is_grad_enabled() and _needs_grad(args)):
            return self(*args)
        return self._run(True, args)

    def _run(self, training: bool, args: Sequence[Any]) -> Any:
        key = (training, *(_signature(a) for a in args))
        if key in self._graphs:
            self._graphs.move_to_end(key)
            replay = self._graphs[key]
        else:
            replay = self._graphs[key] = self._make(training, args)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        if replay is None:
            return self.call(*args)
        self.replays += 1
        return replay(*args)

    def _make(self, training: bool, args: Sequence[Any]) -> Callable[..., Any] | None:
        try:
            replay = self._capture[training](self.module, args, self.device, self.fixed)
        except Exception as err:  # noqa: BLE001 - the stage still runs, eagerly
            self.fallbacks += 1
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            message = (
                f"cuda_graphs: capturing {self.name} ({'forward and backward' if training else 'forward'}) "
                f"failed for input shapes {[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]} "
                f"({reason}); it runs eagerly for them"
            )
            if not self._warned:
                self._warned = True
                warnings.warn(message, stacklevel=4)
            log.info(message)
            return None
        self.captures += 1
        return replay


def _needs_grad(args: Sequence[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad)
    return ("value", repr(value))


def graph_stages(
    stages: Sequence[Any],
    *,
    capture_forward: CaptureFn = capture_forward,
    capture_training: CaptureFn = capture_training,
    require_gpu: bool = True,
) -> list[Any]:
    """Wrap the call of every GPU stage in ``stages`` (``TorchStage`` s, in place) in a
    :class:`GraphedStageCall`; returns the stages wrapped. Stages on the CPU run as they
    are (``require_gpu=False`` wraps them too: the capture seams' tests). When no stage
    is wrapped, a warning says why."""
    wrapped = []
    for stage in stages:
        if require_gpu and stage.device.type != "cuda":
            log.info(
                "cuda_graphs: stage %d on %s runs eagerly: CUDA graphs need a GPU", stage.index, stage.device
            )
            continue
        stage.call = GraphedStageCall(
            stage.call,
            stage.device,
            f"stage {stage.index} on {stage.device}",
            module=stage.module,
            fixed=[n for n, key in enumerate(stage.args) if key in stage.consts],
            capture_forward=capture_forward,
            capture_training=capture_training,
        )
        wrapped.append(stage)
    if not wrapped:
        devices = ", ".join(sorted({str(s.device) for s in stages}))
        warnings.warn(
            f"cuda_graphs=True: no stage runs on a GPU (stages on {devices}); every stage runs eagerly",
            stacklevel=3,
        )
    return wrapped
