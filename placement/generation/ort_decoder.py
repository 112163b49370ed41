"""Decode steps on ONNX Runtime: stage sessions with the KV cache in preallocated device buffers.

:class:`OrtDecoder` builds a :class:`placement.Runner` over a decoder-ready model
(:func:`placement.generation.prepare.decoder_model`) once, and walks its program's steps
itself for every decode step:

* each layer's cache lives in two buffers on its stage's device, allocated once for the
  largest batch and length (``OrtValue`` s of ``batch * heads * max_length * head_dim``
  elements). A step binds the past input to one buffer (a ``(batch, heads, past, dim)``
  view of its start) and the present output to the other (``IOBinding`` with the buffer's
  address), then the two swap: no cache is allocated, copied to the host or handed
  between devices, ever;
* the other inputs (``input_ids``, ``attention_mask``, ``position_ids``: a few int64 per
  sequence) are fed on their devices; boundary blobs go stage to stage as ``OrtValue`` s
  through the program's transfers (only the new tokens' activations cross a device);
* only the last position's logits come back to the host.

The hot path (one stage call per stage per token) is kept short: each stage keeps one
``IOBinding`` per slot for a whole generation, so what does not change between steps is
bound once. A host input that is the same array as in the last step (the loop updates
its token, position and mask buffers in place, see
:class:`~placement.generation.sequences.Sequences`) is not bound again; on the CPU the
last position's logits are written straight into a host buffer of the slot; aliases
between emulated devices are resolved once; the step's caches are bound with
onnxruntime's native calls by address, shapes built once per step. What changes per
step is bound again: each cache (its length grows), the attention mask (a longer
view) and the values that cross from stage to stage.

:attr:`OrtDecoder.stats` counts the bytes the transfers moved, so tests can check that a
decode step moves the new tokens' hidden state and not the cache.

A :class:`Slot` is one group of sequences with its own buffers: pipelined generation
keeps several slots in flight, one per group, each worker running its parts
(:attr:`OrtDecoder.workers`, :meth:`OrtDecoder.run_part`) for one slot while the next worker
runs another. A stage that only reads shapes (``Shape`` of a cache on another device, say)
gets no worker of its own: it runs on the worker of the part after it, so that a step
costs no hand-over between threads for it. Pipelined sessions get the CPU's cores divided
among the logical devices (each emulated device owns its share of the cores) unless
``threads_per_stage`` says otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

from placement.errors import PlacementError
from placement.generation.prepare import DecoderSpec
from placement.graph.causal_lm import KVLayer
from placement.runtime.device_map import DeviceMapLike
from placement.runtime.ort import Runner
from placement.runtime.ort.build import logical_devices
from placement.runtime.ort.steps import HostStep, StageStep, TransferStep
from placement.runtime.ort.values import ALIAS, move, ortvalue
from placement.runtime.schedule import stage_threads

__all__ = ["CopyStats", "OrtDecoder", "Slot"]

log = logging.getLogger(__name__)

#: ONNX element types of the numpy dtypes a cache or logits buffer may have (onnxruntime's
#: native binding takes the number; other dtypes are passed as numpy dtypes).
_ELEMENT = {
    np.dtype(np.float32): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.int8): 3,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.float16): 10,
    np.dtype(np.float64): 11,
}
_CPU = ort.OrtDevice.make("cpu", 0)._get_c_device()
#: Op types that read no tensor data (only shapes, or nothing): a stage of these alone costs no
#: compute, so pipelined generation runs it on the next part's worker.
_SHAPE_ONLY = frozenset({"Shape", "Size", "Constant"})


@dataclass
class CopyStats:
    """What crossed devices: transfers run and their bytes, since the last :meth:`reset`."""

    transfers: int = 0
    bytes: int = 0
    largest: int = 0
    names: set[str] = field(default_factory=set)

    def add(self, name: str, value: Any) -> None:
        """Count one transfer of ``value`` (an ``OrtValue``, native or not, or an array) as ``name``."""
        size = _nbytes(value)
        self.transfers += 1
        self.bytes += size
        if size > self.largest:
            self.largest = size
        self.names.add(name)

    def add_all(self, names: frozenset[str], values: list[Any]) -> None:
        """Count one transfer of each of ``values``, named ``names`` (a decode step's aliases
        between emulated devices, counted at once)."""
        sizes = [v.tensor_size_in_bytes() if type(v) is _C.OrtValue else _nbytes(v) for v in values]
        self.transfers += len(sizes)
        self.bytes += sum(sizes)
        self.largest = max(self.largest, *sizes)
        self.names |= names

    def reset(self) -> None:
        self.transfers = self.bytes = self.largest = 0
        self.names = set()


@dataclass
class _Cache:
    """One cache tensor (a layer's key or value): its two buffers and where they live."""

    past: str
    present: str
    buffers: tuple[ort.OrtValue, ort.OrtValue]
    device: tuple[str, int]
    heads: int
    dim: int
    dtype: Any
    c_device: Any = None  # onnxruntime's native device of the buffers
    pointers: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self.c_device = ort.OrtDevice.make(self.device[0], self.device[1])._get_c_device()
        self.pointers = (self.buffers[0].data_ptr(), self.buffers[1].data_ptr())


@dataclass
class _Bound:
    """A stage's ``IOBinding`` for one slot during one generation, and what it holds."""

    native: Any  # onnxruntime's native SessionIOBinding
    held: dict[str, Any] = field(default_factory=dict)  # input -> host array bound by address
    inputs: tuple[tuple[tuple[Any, ...], ...], ...] = ((), ())  # cache inputs, per buffer holding the past
    outputs: tuple[tuple[tuple[Any, ...], ...], ...] = ((), ())  # cache outputs, likewise
    fresh: bool = True  # nothing bound yet: the first step binds every output, in order


@dataclass
class Slot:
    """One group of sequences decoding together: its cache buffers and current past length."""

    caches: dict[str, _Cache]
    batch: int = 0
    max_length: int = 0
    active: int = 0  # sequences of the current generation (at most ``batch``)
    past: int = 0
    current: int = 0  # which buffer of each pair holds the past
    logits: np.ndarray | None = None  # host buffer the last stage writes the logits into
    bound: dict[int, _Bound] = field(default_factory=dict)
    table: dict[str, Any] = field(default_factory=dict)  # the step's values (sequential runs)


@dataclass(frozen=True)
class _StagePlan:
    """How one stage step binds and runs (see :meth:`OrtDecoder._plan`).

    ``feeds``: (input, key) of host inputs; ``values``: (input, key) of values from earlier
    steps; ``caches``: (input, past key) of cache inputs; ``outputs``: per stage output in
    order, ``"cache"``, ``"logits"`` (into the slot's host buffer) or ``"fresh"``
    (allocated by the run); ``stores``: (output index, key) of outputs later steps read.
    """

    index: int
    step: StageStep
    host: bool  # a CPU stage: host inputs bound by address
    feeds: tuple[tuple[str, str], ...]
    values: tuple[tuple[str, str], ...]
    caches: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    stores: tuple[tuple[int, str], ...]
    device: Any  # native device of the run's own outputs
    groups: tuple[tuple[int, int], ...]  # the (heads, dim) of its caches, each once


class OrtDecoder:
    """Runs decode steps of a decoder-ready model on ONNX Runtime (see the module docstring).

    Args:
        spec: the decoder-ready model.
        device_map: logical -> physical devices (as :class:`placement.Runner`).
        chunks: stage parts pipelined generation runs concurrently (sessions are built for
            it: stages on a shared CPU stay apart, each with its share of the cores).
        threads_per_stage: intra-op threads of each stage session (None: ONNX Runtime's
            choice for ``chunks=1``; for ``chunks > 1`` the CPU's cores divided among the
            model's logical devices).
    """

    def __init__(
        self,
        spec: DecoderSpec,
        *,
        device_map: DeviceMapLike = "auto",
        chunks: int = 1,
        threads_per_stage: int | None = None,
    ) -> None:
        self.spec = spec
        if threads_per_stage is None and chunks > 1:
            threads_per_stage = stage_threads(len(logical_devices(spec.model)))
        self.runner = Runner(
            spec.model,
            device_map=device_map,
            auto_update=False,
            chunks=chunks,
            threads_per_stage=threads_per_stage,
        )
        program = self.runner.program
        self.stats = CopyStats()
        self._steps: list[Any] = list(program.steps)
        self._alias = {}
        for step in self._steps:
            if isinstance(step, TransferStep) and step.kind == ALIAS:
                self._alias[step.target] = self._alias.get(step.source, step.source)
        self._feeds = [(name, physical) for name, physical in program.feeds]
        self._device_feeds = tuple((name, physical) for name, physical in self._feeds if physical.is_cuda)
        self._resident = {key: value._ortvalue for key, value in program.resident.items()}
        named = zip(program.outputs, self.runner.output_names)
        logits = next(key for (key, _), out in named if out == "logits")
        self._logits = self._alias.get(logits, logits)
        self._logits_type = _logits_type(spec)
        self._homes = self._cache_homes()
        self._past_of = {}
        for layer in spec.layers:
            self._past_of[layer.present_key] = layer.past_key
            self._past_of[layer.present_value] = layer.past_value
        self._host_logits = False
        self.parts = self._split_parts()
        self.workers = self._worker_parts()

    # -- setup ------------------------------------------------------------------------------

    def _cache_homes(self) -> dict[str, tuple[tuple[str, int], KVLayer]]:
        """Cache input name -> (device of the stage reading it, its layer); checks that the
        stage producing the matching present runs on the same device."""
        layer_of = {}
        for layer in self.spec.layers:
            layer_of[layer.past_key] = (layer.present_key, layer)
            layer_of[layer.past_value] = (layer.present_value, layer)
        readers: dict[str, tuple[str, int]] = {}
        producers: dict[str, tuple[str, int]] = {}
        for step in self._steps:
            if isinstance(step, TransferStep) and step.source in layer_of:
                raise PlacementError(
                    f"cache input {step.source!r} is read on more than one device: a KV cache stays on "
                    "the device of its attention (a tensor-parallel split keeps one cache per device "
                    "only where each device reads its own heads)"
                )
            if isinstance(step, HostStep) and any(key in layer_of for _, key in step.bind):
                raise PlacementError(f"stage {step.exec.stage.index} reads a KV cache through host values")
            if not isinstance(step, StageStep):
                continue
            for name, key in step.bind:
                if key in layer_of:
                    if name != key:
                        raise PlacementError(f"cache input {key!r} reaches its stage renamed {name!r}")
                    readers[key] = step.exec.out_device
            for name in step.outputs:
                producers[name] = step.exec.out_device
        homes = {}
        for past, (present, layer) in layer_of.items():
            if past not in readers or present not in producers:
                raise PlacementError(f"no stage reads cache input {past!r} or produces {present!r}")
            if readers[past] != producers[present]:
                raise PlacementError(
                    f"cache {past!r} is read on {readers[past]}, {present!r} made on {producers[present]}"
                )
            homes[past] = (readers[past], layer)
        return homes

    def _split_parts(self) -> list[list[tuple[str, Any]]]:
        """The program's steps as the decoder runs them, cut before each stage step (a
        transfer goes with the stage after it): ``("stage", plan)``, ``("aliases", (names,
        keys))`` (counted, not run: the aliases are resolved), ``("move", step)``, ``("host", step)``."""
        reads: set[str] = {self._logits}
        for step in self._steps:
            if isinstance(step, TransferStep):
                reads.add(self._alias.get(step.source, step.source))
            else:
                reads.update(self._alias.get(key, key) for _, key in step.bind)
        parts: list[list[tuple[str, Any]]] = []
        pending: list[tuple[str, Any]] = []
        for step in self._steps:
            if isinstance(step, StageStep):
                pending.append(("stage", self._plan(len(parts), step, reads)))
            elif isinstance(step, HostStep):
                pending.append(("host", step))
            else:
                pending.append(("alias" if step.kind == ALIAS else "move", step))
            if isinstance(step, (StageStep, HostStep)):
                parts.append(self._counted(pending))
                pending = []
        if pending:
            if parts:
                parts[-1] = self._counted(parts[-1] + pending)
            else:
                parts.append(self._counted(pending))
        return parts

    def _counted(self, part: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``part`` with each run of consecutive aliases as one ``("aliases", (names, keys))``
        item, counted at once per step (aliases are not run: they are resolved)."""
        out: list[tuple[str, Any]] = []
        run: list[Any] = []
        for kind, item in [*part, ("end", None)]:
            if kind == "alias":
                run.append(item)
                continue
            if run:
                names = frozenset(step.source for step in run)
                keys = tuple(self._alias.get(step.source, step.source) for step in run)
                out.append(("aliases", (names, keys)))
                run = []
            if kind != "end":
                out.append((kind, item))
        return out

    def _worker_parts(self) -> list[tuple[int, ...]]:
        """The part indices each pipelined worker runs, in order: a part whose stage only reads
        shapes (:data:`_SHAPE_ONLY`) joins the part after it (the one before it, when last)."""
        light = [
            all(kind == "aliases" or (kind == "stage" and _shape_only(item.step)) for kind, item in part)
            and any(kind == "stage" for kind, _ in part)
            for part in self.parts
        ]
        workers: list[list[int]] = []
        pending: list[int] = []
        for index, is_light in enumerate(light):
            pending.append(index)
            if not is_light:
                workers.append(pending)
                pending = []
        if pending:
            if workers:
                workers[-1].extend(pending)
            else:
                workers.append(pending)
        return [tuple(indices) for indices in workers]

    def _plan(self, index: int, step: StageStep, reads: set[str]) -> _StagePlan:
        """How ``step`` binds: each input by what it reads, each output by where it goes."""
        host = not step.exec.physical.is_cuda
        fed = {name for name, _ in self._feeds}
        feeds, values, caches = [], [], []
        for name, key in step.bind:
            key = self._alias.get(key, key)
            if key in self._homes:
                caches.append((name, key))
            elif host and key in fed:
                feeds.append((name, key))
            else:
                values.append((name, key))
        outputs, stores = [], []
        for position, name in enumerate(step.outputs):
            if name in self._past_of:
                outputs.append((name, "cache"))
                if name in reads:  # a split cache a device reads whole (its shards gathered)
                    stores.append((position, name))
            elif name == self._logits and host and self._logits_type is not None:
                outputs.append((name, "logits"))
                self._host_logits = True
            else:
                outputs.append((name, "fresh"))
                if name in reads:
                    stores.append((position, name))
        keys = [key for _, key in caches] + [self._past_of[name] for name, kind in outputs if kind == "cache"]
        layers = [self._homes[key][1] for key in keys]
        groups = tuple(sorted({(int(layer.kv_heads or 0), int(layer.head_dim or 0)) for layer in layers}))
        device = ort.OrtDevice.make(*step.exec.out_device)._get_c_device()
        return _StagePlan(
            index, step, host, tuple(feeds), tuple(values), tuple(caches),
            tuple(outputs), tuple(stores), device, groups,
        )  # fmt: skip

    def new_slot(self, batch: int, max_length: int) -> Slot:
        """A group's cache buffers for up to ``batch`` sequences of ``max_length`` tokens (allocated once)."""
        caches = {}
        for past, (device, layer) in self._homes.items():
            present = layer.present_key if past == layer.past_key else layer.present_value
            size = batch * int(layer.kv_heads or 0) * max_length * int(layer.head_dim or 0)
            dtype = np.dtype(layer.dtype)
            pair = tuple(
                ort.OrtValue.ortvalue_from_shape_and_type([max(size, 1)], dtype, device[0], device[1])
                for _ in range(2)
            )
            caches[past] = _Cache(
                past, present, pair, device, int(layer.kv_heads), int(layer.head_dim), dtype
            )  # type: ignore[arg-type]
        logits = None
        if self._host_logits and self._logits_type is not None:
            logits = np.zeros((batch, 1, self._logits_type[1]), self._logits_type[0])
        return Slot(caches=caches, batch=batch, max_length=max_length, logits=logits)

    # -- running -----------------------------------------------------------------------------

    def start(self, slot: Slot, batch: int) -> None:
        """Begin a new generation in ``slot``: an empty past of ``batch`` sequences."""
        if batch > slot.batch:
            raise PlacementError(f"slot holds {slot.batch} sequences, asked for {batch}")
        slot.past, slot.current = 0, 0
        slot.active = batch
        slot.bound = {}
        slot.table = dict(self._resident)

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """A step's value table: the non-cache inputs (host arrays; copies on their devices
        for inputs fed on a GPU) and the streamed parameters."""
        values = dict(self._resident)
        values.update(arrays)
        for name, physical in self._device_feeds:
            if name in arrays:
                values[name] = ortvalue(arrays[name], physical)._ortvalue
        return values

    def run_part(self, index: int, slot: Slot, values: dict[str, Any], new_tokens: int) -> None:
        """Run part ``index`` of the steps for ``slot`` on ``values`` (``new_tokens`` per sequence)."""
        for kind, item in self.parts[index]:
            if kind == "stage":
                self._run_stage(item, slot, values, new_tokens)
            elif kind == "aliases":
                names, keys = item
                self.stats.add_all(names, [values[key] for key in keys])
            elif kind == "move":
                self._move(item, values)
            else:
                self._run_host(item, values)

    def finish(self, slot: Slot, values: dict[str, Any], new_tokens: int) -> np.ndarray:
        """After every part: swap the slot's buffers, return the last position's logits ``(batch, vocab)``
        (on the CPU a view of the slot's logits buffer, valid until its next step)."""
        slot.past += new_tokens
        slot.current = 1 - slot.current
        if slot.logits is not None:
            return slot.logits[: slot.active, 0]
        logits = values[self._logits]
        if type(logits) is _C.OrtValue:
            logits = ort.OrtValue(logits)
        array = logits.numpy() if isinstance(logits, ort.OrtValue) else np.asarray(logits)
        return array.reshape(array.shape[0], -1)

    def step(self, slot: Slot, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """One whole step (prefill or decode) for ``slot``: the last position's logits."""
        new_tokens = arrays["input_ids"].shape[1]
        if slot.past + new_tokens > slot.max_length:
            raise PlacementError(
                f"the cache holds {slot.max_length} tokens; step needs {slot.past + new_tokens}"
            )
        values = slot.table
        values.update(arrays)
        for name, physical in self._device_feeds:
            values[name] = ortvalue(arrays[name], physical)._ortvalue
        for index in range(len(self.parts)):
            self.run_part(index, slot, values, new_tokens)
        return self.finish(slot, values, new_tokens)

    def _bind(self, plan: _StagePlan, slot: Slot) -> _Bound:
        """A new ``IOBinding`` of ``plan``'s stage for ``slot``, with its cache inputs' and
        outputs' (name, device, element type, shape group, address) for either buffer of
        each pair holding the past."""
        native = plan.step.exec.session.io_binding()._iobinding
        inputs: list[list[tuple[Any, ...]]] = [[], []]
        outputs: list[list[tuple[Any, ...]]] = [[], []]
        caches = [(name, key, inputs, 0) for name, key in plan.caches]
        caches += [(name, self._past_of[name], outputs, 1) for name, kind in plan.outputs if kind == "cache"]
        for name, key, rows, side in caches:
            cache = slot.caches[key]
            element = _ELEMENT.get(cache.dtype, cache.dtype)
            group = plan.groups.index((cache.heads, cache.dim))
            for current in (0, 1):
                at = cache.pointers[current if side == 0 else 1 - current]
                rows[current].append((name, cache.c_device, element, group, at))
        bound = _Bound(native, inputs=(tuple(inputs[0]), tuple(inputs[1])))
        bound.outputs = (tuple(outputs[0]), tuple(outputs[1]))
        slot.bound[plan.index] = bound
        return bound

    def _run_stage(self, plan: _StagePlan, slot: Slot, values: dict[str, Any], new_tokens: int) -> None:
        """Run one stage session with its caches bound to the slot's buffers (this runs once
        per stage per token: see the module docstring for what it binds again)."""
        bound = slot.bound.get(plan.index)
        if bound is None:
            bound = self._bind(plan, slot)
        native, held = bound.native, bound.held
        batch, past = slot.active, slot.past
        for name, key in plan.feeds:  # host arrays, bound by address while the same array
            array = values[key]
            if held.get(name) is not array:
                native.bind_ortvalue_input(name, _C.OrtValue.ortvalue_from_numpy(array, _CPU))
                held[name] = array
        for name, key in plan.values:
            value = values[key]
            if type(value) is not _C.OrtValue:
                value = _native(value, plan.step.exec.physical)
            native.bind_ortvalue_input(name, value)
        shapes = [
            ([batch, heads, past, dim], [batch, heads, past + new_tokens, dim]) for heads, dim in plan.groups
        ]
        current = slot.current
        for name, device, element, group, at in bound.inputs[current]:
            native.bind_input(name, device, element, shapes[group][0], at)
        if bound.fresh:  # first step: every output bound, in the stage's order (stores index them)
            self._bind_outputs(plan, slot, native, bound, shapes)
            bound.fresh = False
        else:
            for name, device, element, group, at in bound.outputs[current]:
                native.bind_output(name, device, element, shapes[group][1], at)
            for name, kind in plan.outputs:
                if kind == "fresh":  # a new buffer per run: the last one may still be read
                    native.bind_output(name, plan.device)
        try:
            plan.step.exec.session._sess.run_with_iobinding(native, None)
        except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
            slot.bound.pop(plan.index, None)
            raise plan.step.exec.error(err) from err
        if plan.stores:
            outputs = native.get_outputs()
            for position, key in plan.stores:
                values[key] = outputs[position]

    def _bind_outputs(self, plan: _StagePlan, slot: Slot, native: Any, bound: _Bound, shapes: list) -> None:
        """Bind every output of ``plan``'s stage, in the stage's order (later steps bind them
        again by name, which keeps each in its place)."""
        caches = {row[0]: row for row in bound.outputs[slot.current]}
        for name, kind in plan.outputs:
            if kind == "fresh":
                native.bind_output(name, plan.device)
            elif kind == "logits":
                logits = slot.logits
                assert logits is not None  # a host-logits stage: every slot has the buffer
                shape, element = [slot.active, *logits.shape[1:]], _ELEMENT.get(logits.dtype, logits.dtype)
                native.bind_output(name, _CPU, element, shape, logits.ctypes.data)
            else:
                _, device, element, group, at = caches[name]
                native.bind_output(name, device, element, shapes[group][1], at)

    def _move(self, step: TransferStep, values: dict[str, Any]) -> None:
        """A transfer that moves data (to or from a GPU, or between GPUs)."""
        value = values[self._alias.get(step.source, step.source)]
        self.stats.add(step.source, value)
        if isinstance(value, np.ndarray):
            values[step.target] = ortvalue(value, step.physical)._ortvalue
            return
        wrapped = ort.OrtValue(value) if type(value) is _C.OrtValue else value
        try:
            values[step.target] = move(wrapped, step.kind, step.physical)._ortvalue
        except PlacementError:
            raise
        except Exception as err:  # an allocation on the destination device failed
            raise PlacementError(f"moving blob {step.source!r} to {step.physical} failed: {err}") from err

    def _run_host(self, step: HostStep, values: dict[str, Any]) -> None:
        """A stage with host values at its boundary (sequences, optionals, strings)."""
        table = {}
        for _, key in step.bind:
            value = values[self._alias.get(key, key)]
            table[key] = ort.OrtValue(value) if type(value) is _C.OrtValue else value
        outputs = step.call(step.inputs(table))
        values.update(zip(step.outputs, outputs))


def _shape_only(step: StageStep) -> bool:
    """Whether ``step``'s stage reads no tensor data (every op in :data:`_SHAPE_ONLY`)."""
    return all(op.op_type in _SHAPE_ONLY for op in step.exec.stage.model.graph)


def _nbytes(value: Any) -> int:
    """Bytes of ``value``: an ``OrtValue`` (native or not) or an array."""
    if type(value) is _C.OrtValue:
        return int(value.tensor_size_in_bytes())
    if isinstance(value, ort.OrtValue):
        return int(value._ortvalue.tensor_size_in_bytes())
    return int(getattr(value, "nbytes", 0))


def _native(value: Any, physical: Any) -> Any:
    """``value`` (an ``OrtValue`` or a host array) as a native ``OrtValue`` on ``physical``."""
    if isinstance(value, ort.OrtValue):
        return value._ortvalue
    return ortvalue(np.ascontiguousarray(value), physical)._ortvalue


def _logits_type(spec: DecoderSpec) -> tuple[np.dtype, int] | None:
    """(numpy dtype, vocabulary size) of the ``logits`` output, where both are static."""
    value = next(v for v in spec.model.graph.outputs if v.name == "logits")
    shape = list(value.shape) if value.shape is not None else []
    if len(shape) != 3 or not isinstance(shape[2], int) or value.dtype is None:
        return None
    try:
        return np.dtype(value.dtype.numpy()), int(shape[2])
    except (TypeError, ValueError):
        return None
