"""Pass infrastructure: placement passes on top of ``onnx_ir.passes``, and a ``PassSequence``.

A placement pass is an ``onnx_ir.passes.InPlacePass``: it holds its options, its
``call`` rewrites the ``onnx_ir.Model`` under a :class:`placement.Model` in place and
returns a ``PassResult`` whose ``modified`` says whether anything changed. Passes
accept a :class:`placement.Model`, an ``onnx_ir.Model`` or a previous ``PassResult``.

Each pass declares what it guarantees (``ensures_verified``): copy injection leaves
a model that passes :func:`placement.verify`; shifting leaves one whose cross-device
edges still lack copies, so after it only the structural invariants hold (every op
has a well-formed device, ops are in topological order, valid ONNX). In debug mode
(``debug=True``, or the environment variable ``PLACEMENT_DEBUG=1``) each pass checks
its guarantee after running and a :class:`PassSequence` checks after every pass; a broken
guarantee raises :class:`PassVerificationError`, which is both a
:class:`placement.VerificationError` and an ``onnx_ir`` ``PostconditionError``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.passes import InjectCrossDeviceCopiesPass, ShiftActivationDevicesPass
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> sequence = pl.PassSequence(
    ...     ShiftActivationDevicesPass(acts[2:], {0: 1}), InjectCrossDeviceCopiesPass(), debug=True
    ... )
    >>> sequence(model).modified
    True
    >>> sequence(model).modified   # shifting again moves nothing, copies are in place
    False
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from placement.errors import DeviceError, VerificationError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import DEVICE_KEY
from placement.graph.verify import run_onnx_checker, verify

__all__ = [
    "PlacementPass",
    "PassSequence",
    "PassSequenceResult",
    "StepResult",
    "PassVerificationError",
    "debug_enabled",
    "check_structure",
    "no_gc",
    "Stopwatch",
    "run_phases",
    "DEBUG_ENV",
]

log = logging.getLogger(__name__)

#: Environment variable that turns debug mode (verify after every pass) on.
DEBUG_ENV = "PLACEMENT_DEBUG"


class PassVerificationError(VerificationError, PostconditionError):
    """A pass broke the invariant it promises; the message names the pass and the first broken op."""


def debug_enabled() -> bool:
    """True when ``PLACEMENT_DEBUG`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


ModelLike = Any  # Model | ir.Model | PassResult


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the body (restored afterwards).

    Passes allocate many small objects while walking graphs of millions of ops;
    every few thousand allocations the collector would traverse the whole heap
    (the graph itself), which made passes several times slower and superlinear.
    Passes create no garbage cycles worth collecting mid-way, so it runs after.

    What the body allocated is mostly new graph (copies, their blobs and links) that
    lives as long as the model, so it joins the oldest generation directly
    (``gc.freeze()`` then ``gc.unfreeze()``: two list splices) instead of being traversed
    as young objects on the first allocation after the pause, which cost a second per
    million ops. Skipped when the program froze objects itself (``gc.get_freeze_count()``),
    which unfreezing would undo.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class Stopwatch:
    """Seconds per named section of a pass, for debug logs and benchmarks.

    Example:
        >>> watch = Stopwatch()
        >>> watch.start("scan"); watch.start("apply"); watch.stop()
        >>> sorted(watch.seconds)
        ['apply', 'scan']
    """

    __slots__ = ("seconds", "_name", "_since")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._since = 0.0

    def start(self, name: str) -> None:
        """End the running section (if any) and start ``name``."""
        now = time.perf_counter()
        if self._name is not None:
            self.seconds[self._name] = self.seconds.get(self._name, 0.0) + now - self._since
        self._name, self._since = name, now

    def stop(self) -> None:
        """End the running section."""
        self.start("")
        self.seconds.pop("", None)
        self._name = None

    def __str__(self) -> str:
        return ", ".join(f"{name} {sec:.3f}s" for name, sec in self.seconds.items())


def run_phases(
    name: str, phases: Sequence[tuple[str, Callable[[list[Any]], Any]]]
) -> tuple[list[Any], Stopwatch]:
    """Run a pass's phases in order, timing each: read-only ones (scan, plan) first, the one
    that mutates the graph last, so an error before it leaves the model unchanged.

    Each phase gets the list of the earlier phases' results; the timings are logged at debug
    level under ``name``.

    Example:
        >>> results, watch = run_phases("demo", [("scan", lambda r: 2), ("apply", lambda r: r[0] * 3)])
        >>> results, sorted(watch.seconds)
        ([2, 6], ['apply', 'scan'])
    """
    watch = Stopwatch()
    results: list[Any] = []
    for phase, run in phases:
        watch.start(phase)
        results.append(run(results))
    watch.stop()
    log.debug("%s timings: %s", name, watch)
    return results, watch


def as_ir_model(model: ModelLike) -> ir.Model:
    """The ``onnx_ir.Model`` behind a :class:`Model`, an ``ir.Model`` or a ``PassResult``."""
    if isinstance(model, Model):
        return model.ir_model
    if isinstance(model, PassResult):
        return model.model
    if isinstance(model, ir.Model):
        return model
    raise TypeError(f"expected a placement.Model or onnx_ir.Model, got {type(model).__name__}")


class DeviceReader:
    """Parses node device annotations once per distinct string and interns the results.

    Equal devices come back as the *same* object, so hot loops compare with ``is``.
    """

    __slots__ = ("_by_spec", "_canonical")

    def __init__(self) -> None:
        self._by_spec: dict[str, Device] = {}
        self._canonical: dict[Device, Device] = {}

    def canonical(self, device: Device) -> Device:
        """The interned object equal to ``device``."""
        return self._canonical.setdefault(device, device)

    def parse(self, spec: Any) -> Device:
        """Parse a device-like value and intern it."""
        return self.canonical(Device.parse(spec))

    def of(self, node: ir.Node) -> Device:
        """The device of ``node`` (``cuda:0`` when unannotated, like ``node_device``).

        Raises:
            DeviceError: the annotation is malformed; the message names the op.
        """
        spec = node.metadata_props.get(DEVICE_KEY)
        if spec is None:
            spec = "cuda:0"
        device = self._by_spec.get(spec)
        if device is None:
            try:
                device = self.parse(spec)
            except DeviceError as err:
                raise DeviceError(f"op {node.name!r} has a bad device {spec!r}: {err}") from None
            self._by_spec[spec] = device
        return device


def check_structure(ir_model: ir.Model, *, check_onnx: bool = False) -> None:
    """The invariants that hold between passes even before copies are injected.

    Every op has a well-formed device and reads only graph inputs, parameters or
    outputs of earlier ops; with ``check_onnx`` the model is also valid ONNX.

    Raises:
        VerificationError: names the first broken op.
    """
    graph = ir_model.graph
    defined = {id(v) for v in graph.inputs} | {id(v) for v in graph.initializers.values()}
    reader = DeviceReader()
    for node in graph:
        if DEVICE_KEY not in node.metadata_props:
            raise VerificationError(f"op {node.name!r} ({node.op_type}) has no device")
        try:
            reader.of(node)
        except DeviceError as err:
            raise VerificationError(str(err)) from None
        for value in node.inputs:
            if value is not None and id(value) not in defined:
                raise VerificationError(
                    f"op {node.name!r} reads blob {value.name!r} before it is produced "
                    "(ops are not in topological order, or the blob has no producer)"
                )
        defined.update(id(v) for v in node.outputs)
    if check_onnx:
        run_onnx_checker(ir_model)


def _check(ir_model: ir.Model, *, full: bool, check_onnx: bool, wrapper: Model | None) -> None:
    if not full:
        check_structure(ir_model, check_onnx=check_onnx)
        return
    check_structure(ir_model)  # every op has a device, so wrapping assigns no defaults
    placed = wrapper if wrapper is not None and wrapper.ir_model is ir_model else Model(ir_model)
    verify(placed, check_onnx=check_onnx)


class PlacementPass(InPlacePass):
    """Base class of placement passes: in place, options held by the object.

    Subclasses implement :meth:`call` on an ``onnx_ir.Model`` and return a
    ``PassResult`` (or a subclass carrying statistics) with an honest ``modified``.

    Args:
        debug: check this pass's guarantee after it runs (default: ``PLACEMENT_DEBUG``).
        check_onnx: in debug mode, also run ``onnx.checker``.
    """

    #: True when the pass leaves a model that passes ``verify`` (given a verified input).
    ensures_verified: ClassVar[bool] = True

    def __init__(self, *, debug: bool | None = None, check_onnx: bool = True) -> None:
        self.debug = debug_enabled() if debug is None else debug
        self.check_onnx = check_onnx
        self._wrapper: Model | None = None

    def __call__(self, model: ModelLike, /) -> PassResult:  # type: ignore[override]
        """Run the pass on a :class:`Model`, an ``onnx_ir.Model`` or a ``PassResult``."""
        self._wrapper = model if isinstance(model, Model) else None
        try:
            with no_gc():
                return super().__call__(as_ir_model(model))
        finally:
            self._wrapper = None

    @abc.abstractmethod
    def call(self, model: ir.Model) -> PassResult:
        """Rewrite ``model`` in place; report whether it changed."""

    def ensures(self, model: ir.Model) -> None:
        """In debug mode, check the invariant this pass promises."""
        if self.debug:
            self.verify_after(model, self)

    def verify_after(self, model: ir.Model, pass_: PlacementPass | InPlacePass) -> None:
        """Check ``model`` at the level ``pass_`` guarantees; raise naming the pass."""
        full = getattr(pass_, "ensures_verified", False)  # foreign passes: structure only
        try:
            _check(model, full=full, check_onnx=self.check_onnx, wrapper=self._wrapper)
        except VerificationError as err:
            raise PassVerificationError(f"after pass {type(pass_).__name__}: {err}") from err

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclasses.dataclass
class StepResult:
    """One pass of a pass-sequence run: its name, whether it changed the model, seconds taken."""

    name: str
    modified: bool
    seconds: float
    result: PassResult


@dataclasses.dataclass
class PassSequenceResult(PassResult):
    """A pass sequence's result: ``modified`` if any pass changed the model, and every step."""

    steps: list[StepResult] = dataclasses.field(default_factory=list)


class PassSequence(PlacementPass):
    """Run placement passes in order; in debug mode verify after every pass.

    A pass that guarantees a verified model (copy injection) is followed by a full
    :func:`placement.verify`; one that does not (shifting, or a plain ``onnx_ir``
    pass, which declares nothing) by the structural checks.
    Errors from a pass propagate unchanged (a ``PlacementError`` stays one).

    Why not ``onnx_ir.passes.Sequential``: it wraps every error from a pass in a generic
    ``PassError``, so a user's ``UnknownBlobError`` would no longer be caught as one, and it
    keeps no per-step results; this class is the thin loop that keeps both.

    Args:
        *passes: ``onnx_ir`` in-place passes, usually :class:`PlacementPass` objects.
        debug: verify after every pass (default: ``PLACEMENT_DEBUG``).
        check_onnx: in debug mode, also run ``onnx.checker`` after every pass.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> from placement.passes import InjectCrossDeviceCopiesPass
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> result = pl.PassSequence(InjectCrossDeviceCopiesPass(), debug=True)(model)
        >>> [(step.name, step.modified) for step in result.steps]
        [('InjectCrossDeviceCopiesPass', True)]
    """

    def __init__(self, *passes: InPlacePass, debug: bool | None = None, check_onnx: bool = True) -> None:
        super().__init__(debug=debug, check_onnx=check_onnx)
        if not passes:
            raise ValueError("PassSequence needs at least one pass")
        for pass_ in passes:
            if not getattr(pass_, "in_place", False):
                raise TypeError(f"PassSequence runs in-place passes only; {pass_!r} is not in place")
        self.passes = passes

    @property
    def ensures_verified(self) -> bool:  # type: ignore[override]
        """As strong as the last pass's guarantee."""
        return getattr(self.passes[-1], "ensures_verified", False)

    def call(self, model: ir.Model) -> PassSequenceResult:
        steps: list[StepResult] = []
        for pass_ in self.passes:
            start = time.perf_counter()
            if isinstance(pass_, PlacementPass) and self._wrapper is not None:
                result = pass_(self._wrapper)
            else:
                result = pass_(model)
            seconds = time.perf_counter() - start
            name = type(pass_).__name__
            steps.append(StepResult(name, bool(result.modified), seconds, result))
            log.debug("pass %s: modified=%s in %.3fs", name, result.modified, seconds)
            if self.debug and not getattr(pass_, "debug", False):
                self.verify_after(model, pass_)
        return PassSequenceResult(model, any(s.modified for s in steps), steps)

    def ensures(self, model: ir.Model) -> None:
        """Steps are checked one by one in :meth:`call`; nothing more to do."""

    def __repr__(self) -> str:
        return f"PassSequence({', '.join(repr(p) for p in self.passes)})"
