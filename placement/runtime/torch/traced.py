"""A pipeline stage run as a TorchScript trace, one per input signature.

A lowered stage is an fx ``GraphModule`` whose forward is Python: every op is a
Python call (argument parsing, the op rule's wrapper, ``tolist`` of shape
tensors) made while holding the GIL. A micro-batched forward pays that once per
micro-batch and stage, and two stage workers running such code at the same time
contend for the one GIL. A :class:`TracedStage` records the stage with
``torch.jit.trace`` and then runs the recorded graph: TorchScript's interpreter
executes it in C++ and releases the GIL for the whole call, so the Python cost
goes and the two workers no longer serialise on it. Graph-executor
optimisation is switched off for these calls
(``torch.jit.optimized_execution(False)``, thread-local): no profiling runs, no
fusion, no differentiable subgraphs, just the recorded aten ops, so outputs
equal the fx module's exactly. With ``grad=True`` the trace also runs with
grad mode on: each recorded op goes through autograd as in eager mode, so
``torch.autograd.grad`` of its outputs gives the fx module's gradients.

A trace is a recording: every Python value the stage's code computed from a
tensor (a reshape target read with ``tolist``, a ``bool`` of a condition) is
frozen into it. So a trace is only reused for calls that would have computed
the same Python values:

* **Per signature.** Traces are keyed by the shape and dtype of every stage
  input, the grad mode and (with grad) which inputs require grad; a micro-batch
  of another size gets (after ``warmup`` calls) its own trace and never reuses
  one recorded for a different shape.
* **Provenance.** While tracing, a ``TorchFunctionMode`` follows which stage
  inputs every tensor was computed from (shapes and metadata do not count). If
  a Python value was read from a tensor that depends on an input's *values*,
  that input's values join the key when it is a small integer tensor (a shape
  carried between stages, such as the batch size); otherwise (float data, a
  large tensor) the stage is not traced at all. An op whose output *shape*
  depends on input values (``nonzero``, ``unique``, boolean-mask indexing, ...)
  also rules tracing out.
* **Fallbacks.** A stage with a nondeterministic ONNX op is never traced; a
  trace that fails, or a traced call that raises, falls back to the fx module
  (which then raises its own readable error); non-tensor inputs, an input not
  on the CPU, or grad mode on without ``grad=True`` run the fx module.

Tracing costs about one stage call, so it waits until a signature has been seen
``warmup`` times (one-shot forwards never trace); a stage keeps at most
``max_traces`` traces. Parameters are trace inputs, not constants, so training
between inference calls is seen by the next traced call.

Example:
    >>> import torch
    >>> stage = TracedStage(torch.nn.Linear(4, 2), warmup=1)
    >>> x = torch.ones(3, 4)
    >>> with torch.no_grad():
    ...     first, second = stage(x), stage(x)   # the second call runs the trace
    >>> stage.traced, torch.equal(first, second)
    (1, True)
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["TracedStage"]

log = logging.getLogger(__name__)

#: Most elements an input may have for its values to key a trace (shapes carried between stages).
MAX_KEYED_ELEMENTS = 64

# Tensor functions returning facts about a tensor's metadata, not its values.
_METADATA = frozenset(
    {
        "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "__len__", "dtype",
        "device", "is_cuda", "is_cpu", "is_meta", "is_floating_point", "is_complex", "is_signed",
        "requires_grad", "layout", "stride", "is_contiguous", "element_size", "get_device",
        "storage_offset", "is_sparse", "is_quantized", "names", "grad_fn", "is_leaf", "_version",
        "data_ptr", "__hash__", "itemsize", "nbytes",
    }
)  # fmt: skip
# Ops whose output shape depends on input values.
_VALUE_SHAPED = frozenset(
    {
        "nonzero", "nonzero_static", "argwhere", "unique", "unique_consecutive", "masked_select",
        "repeat_interleave", "bincount", "histc", "histogram",
    }
)  # fmt: skip
_INDEXING = frozenset({"__getitem__", "index", "index_select", "take"})

_MAX_FAILURES = 3  # failed traces before a stage gives up tracing
_MAX_SEEN = 1024  # signatures counted at once
_trace_lock = threading.Lock()  # tracing swaps the process-wide warning filters


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: Tensor.shape.__get__
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


class _Untraceable(Exception):
    """The stage's Python code depends on input values in a way a trace cannot key."""


class _Provenance(TorchFunctionMode):
    """Follows which stage inputs each tensor depends on; records inputs whose values reach Python."""

    def __init__(self, inputs: Sequence[Any]) -> None:
        super().__init__()
        self._labels: dict[int, frozenset[int]] = {}
        self._keep: list[Any] = []  # keeps labelled tensors alive so their ids stay theirs
        for n, value in enumerate(inputs):
            self._label(value, frozenset({n}))
        self.read: set[int] = set()  # inputs whose values the code turned into Python values

    def _label(self, value: Any, labels: frozenset[int]) -> None:
        if isinstance(value, torch.Tensor) and labels:
            self._labels[id(value)] = self._labels.get(id(value), frozenset()) | labels
            self._keep.append(value)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        labels: frozenset[int] = frozenset()
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                labels |= self._labels.get(id(leaf), frozenset())
        name = _name(func)
        if labels and name in _VALUE_SHAPED:
            raise _Untraceable(f"{name} of an input-dependent tensor has a value-dependent shape")
        if name in _INDEXING and any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) and id(t) in self._labels
            for t in leaves[1:]
        ):
            raise _Untraceable("indexing with an input-dependent mask has a value-dependent shape")
        out = func(*args, **kwargs)
        # Metadata carries no values (while tracing, sizes are 0-d tensors: they stay unlabelled).
        if labels and name not in _METADATA:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._label(leaf, labels)
                elif leaf is not None:
                    self.read |= labels  # a Python value computed from input values
        return out


class TracedStage:
    """Calls ``module`` (a stage's ``GraphModule``) through per-signature traces where that is safe.

    Args:
        module: the stage's module; called with its positional inputs.
        fixed: positions of inputs that are the same tensors on every call
            (parameters, constants): they do not key traces.
        warmup: calls of one signature before it is traced.
        max_traces: most traces kept; further signatures run ``module``.
        untraceable: why ``module`` must never be traced (such as a nondeterministic op), or ``None``.
        grad: also trace (and run traced) calls made with grad mode on.

    Attributes: ``enabled`` (the switch: ``False`` runs ``module`` always),
    ``traced`` (traces made), ``disabled`` (why the stage runs untraced from now
    on, or ``None``).
    """

    def __init__(
        self,
        module: Callable[..., Any],
        *,
        fixed: Sequence[int] = (),
        warmup: int = 2,
        max_traces: int = 8,
        untraceable: str | None = None,
        grad: bool = False,
    ) -> None:
        self.module = module
        self.warmup = warmup
        self.max_traces = max_traces
        self.enabled = True
        self.grad = grad
        self.disabled: str | None = untraceable
        self.traced = 0
        self._fixed = frozenset(fixed)
        self._keyed: tuple[int, ...] = ()  # inputs whose values key the traces
        self._traces: dict[tuple[Any, ...], Any] = {}
        self._seen: dict[tuple[Any, ...], int] = {}
        self._lock = threading.Lock()
        self._failures = 0

    def __call__(self, *args: Any) -> Any:
        if not self.enabled or self.disabled is not None or (torch.is_grad_enabled() and not self.grad):
            return self.module(*args)
        key = self._key(args)
        if key is None:
            return self.module(*args)
        trace = self._traces.get(key)
        if trace is None:
            seen = self._seen.get(key, 0) + 1
            if len(self._seen) >= _MAX_SEEN:  # many distinct shapes: counts start again
                self._seen.clear()
            self._seen[key] = seen
            if seen <= self.warmup or len(self._traces) >= self.max_traces:
                return self.module(*args)
            trace = self._trace(args)
            if trace is None:
                return self.module(*args)
        try:
            with torch.jit.optimized_execution(False):
                return trace(*args)
        except Exception:  # noqa: BLE001 - the fx module raises its own (readable) error
            log.debug("traced stage call failed; running the fx module", exc_info=True)
            return self.module(*args)

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...] | None:
        grad = torch.is_grad_enabled()
        key: list[Any] = [grad]
        for n, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor) or arg.device.type != "cpu":
                return None
            if n not in self._fixed:
                key.append((tuple(arg.shape), arg.dtype, grad and arg.requires_grad))
            elif grad:
                key.append(arg.requires_grad)
        for n in self._keyed:
            arg = args[n]
            if arg.numel() > MAX_KEYED_ELEMENTS:
                return None
            key.append(tuple(arg.reshape(-1).tolist()))
        return tuple(key)

    def _trace(self, args: Sequence[Any]) -> Any:
        with self._lock:
            key = self._key(args)
            if key in self._traces:
                return self._traces[key]
            mode = _Provenance([None if n in self._fixed else a for n, a in enumerate(args)])
            try:
                with _trace_lock, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with mode:
                        trace = torch.jit.trace(self.module, tuple(args), check_trace=False)
            except _Untraceable as err:
                self._disable(str(err))
                return None
            except Exception as err:  # noqa: BLE001 - tracing is an optimisation; fx still runs
                # Such as a bad batch (the fx module then raises its error): try again later,
                # give up after a few failures.
                self._failures += 1
                log.debug("tracing a stage failed (%d): %s: %s", self._failures, type(err).__name__, err)
                if self._failures >= _MAX_FAILURES:
                    self._disable(f"tracing failed: {type(err).__name__}: {err}")
                return None
            read = mode.read
            bad = [
                n
                for n in read
                if args[n].is_floating_point() or args[n].is_complex() or args[n].numel() > MAX_KEYED_ELEMENTS
            ]
            if bad:
                self._disable(f"Python values computed from the values of input(s) {sorted(bad)}")
                return None
            if not read <= set(self._keyed):
                # Values of more inputs matter than the key held: earlier traces were keyed on less.
                self._keyed = tuple(sorted(read | set(self._keyed)))
                self._traces.clear()
                self._seen.clear()
                key = self._key(args)
                if key is None:
                    return None
            self._traces[key] = trace
            self.traced += 1
            log.debug("traced a stage for input signature %s", key)
            return trace

    def _disable(self, reason: str) -> None:
        log.debug("stage runs untraced: %s", reason)
        self.disabled = reason
        self._traces.clear()
