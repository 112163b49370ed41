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

:attr:`OrtDecoder.stats` counts the bytes the transfers moved, so tests can check that a
decode step moves the new tokens' hidden state and not the cache.

A :class:`Slot` is one group of sequences with its own buffers: pipelined generation
keeps several slots in flight, one per group, each stage's worker running
:meth:`OrtDecoder.run_part` for one slot while the next stage runs another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from placement.errors import PlacementError
from placement.generation.prepare import DecoderSpec
from placement.graph.causal_lm import KVLayer
from placement.runtime.device_map import DeviceMapLike
from placement.runtime.ort import Runner
from placement.runtime.ort.steps import HostStep, StageStep, TransferStep
from placement.runtime.ort.values import ortvalue

__all__ = ["CopyStats", "OrtDecoder", "Slot"]

log = logging.getLogger(__name__)


@dataclass
class CopyStats:
    """What crossed devices: transfers run and their bytes, since the last :meth:`reset`."""

    transfers: int = 0
    bytes: int = 0
    largest: int = 0
    names: set[str] = field(default_factory=set)

    def add(self, name: str, value: Any) -> None:
        """Count one transfer of ``value`` (an ``OrtValue`` or array) under blob ``name``."""
        if isinstance(value, ort.OrtValue):
            size = int(np.prod(value.shape())) * _itemsize(value.data_type())
        else:
            size = int(getattr(value, "nbytes", 0))
        self.transfers += 1
        self.bytes += size
        self.largest = max(self.largest, size)
        self.names.add(name)

    def reset(self) -> None:
        self.transfers = self.bytes = self.largest = 0
        self.names = set()


def _itemsize(data_type: str) -> int:
    table = {"float": 4, "float16": 2, "bfloat16": 2, "double": 8, "int64": 8, "int32": 4, "bool": 1}
    return table.get(data_type.removeprefix("tensor(").removesuffix(")"), 4)


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
class Slot:
    """One group of sequences decoding together: its cache buffers and current past length."""

    caches: dict[str, _Cache]
    batch: int = 0
    max_length: int = 0
    active: int = 0  # sequences of the current generation (at most ``batch``)
    past: int = 0
    current: int = 0  # which buffer of each pair holds the past


class OrtDecoder:
    """Runs decode steps of a decoder-ready model on ONNX Runtime (see the module docstring).

    Args:
        spec: the decoder-ready model.
        device_map: logical -> physical devices (as :class:`placement.Runner`).
        chunks: stage parts pipelined generation runs concurrently (sessions are built for
            it: stages on a shared CPU stay apart, each with its share of the cores).
    """

    def __init__(self, spec: DecoderSpec, *, device_map: DeviceMapLike = "auto", chunks: int = 1) -> None:
        self.spec = spec
        self.runner = Runner(spec.model, device_map=device_map, auto_update=False, chunks=chunks)
        program = self.runner.program
        self.stats = CopyStats()
        self._feeds = [(name, physical) for name, physical in program.feeds]
        self._logits = next(
            key for (key, _), out in zip(program.outputs, self.runner.output_names) if out == "logits"
        )
        self._steps: list[Any] = list(program.steps)
        self._bindings: dict[int, Any] = {}
        self._homes = self._cache_homes()
        self._needed = {self._logits}
        for step in self._steps:
            if isinstance(step, TransferStep):
                self._needed.add(step.source)
            else:
                self._needed.update(key for _, key in step.bind)
        self._past_of = {}
        for layer in spec.layers:
            self._past_of[layer.present_key] = layer.past_key
            self._past_of[layer.present_value] = layer.past_value
        self.parts = self._split_parts()

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

    def _split_parts(self) -> list[list[Any]]:
        """The program's steps cut before each stage step (a transfer goes with the stage after it)."""
        parts: list[list[Any]] = []
        pending: list[Any] = []
        for step in self._steps:
            pending.append(step)
            if isinstance(step, (StageStep, HostStep)):
                parts.append(pending)
                pending = []
        if pending:
            if parts:
                parts[-1].extend(pending)
            else:
                parts.append(pending)
        return parts

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
        return Slot(caches=caches, batch=batch, max_length=max_length)

    # -- running -----------------------------------------------------------------------------

    def start(self, slot: Slot, batch: int) -> None:
        """Begin a new generation in ``slot``: an empty past of ``batch`` sequences."""
        if batch > slot.batch:
            raise PlacementError(f"slot holds {slot.batch} sequences, asked for {batch}")
        slot.past, slot.current = 0, 0
        slot.active = batch

    def feed(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """A step's value table: the non-cache inputs as ``OrtValue`` s on their devices."""
        return {name: ortvalue(arrays[name], physical) for name, physical in self._feeds if name in arrays}

    def run_part(self, index: int, slot: Slot, values: dict[str, Any], new_tokens: int) -> None:
        """Run part ``index`` of the steps for ``slot`` on ``values`` (``new_tokens`` per sequence)."""
        for step in self.parts[index]:
            if isinstance(step, StageStep):
                self._run_stage(step, slot, values, new_tokens)
            elif isinstance(step, TransferStep):
                step.run(values)
                if step.target in values:
                    self.stats.add(step.source, values[step.target])
            else:
                step.run(values)

    def finish(self, slot: Slot, values: dict[str, Any], new_tokens: int) -> np.ndarray:
        """After every part: swap the slot's buffers, return the last position's logits ``(batch, vocab)``."""
        slot.past += new_tokens
        slot.current = 1 - slot.current
        logits = values[self._logits]
        array = logits.numpy() if isinstance(logits, ort.OrtValue) else np.asarray(logits)
        return array.reshape(array.shape[0], -1)

    def step(self, slot: Slot, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """One whole step (prefill or decode) for ``slot``: the last position's logits."""
        new_tokens = arrays["input_ids"].shape[1]
        if slot.past + new_tokens > slot.max_length:
            raise PlacementError(
                f"the cache holds {slot.max_length} tokens; step needs {slot.past + new_tokens}"
            )
        values = self.feed(arrays)
        for index in range(len(self.parts)):
            self.run_part(index, slot, values, new_tokens)
        return self.finish(slot, values, new_tokens)

    def _run_stage(self, step: StageStep, slot: Slot, values: dict[str, Any], new_tokens: int) -> None:
        """Run one stage session with its caches bound to the slot's buffers (onnxruntime's
        native binding: this runs once per stage per token, so its Python is kept short)."""
        ex = step.exec
        found = self._bindings.get(id(step))
        if found is None:
            binding = ex.session.io_binding()
            device = ort.OrtDevice.make(*ex.out_device)._get_c_device()
            found = self._bindings[id(step)] = (binding, binding._iobinding, device)
        binding, native, device = found
        batch, past, current = slot.active, slot.past, slot.current
        caches, past_of = slot.caches, self._past_of
        for name, key in step.bind:
            cache = caches.get(key)
            if cache is None:
                value = values[key]
                if isinstance(value, ort.OrtValue):
                    native.bind_ortvalue_input(name, value._ortvalue)
                else:
                    binding.bind_ortvalue_input(name, ortvalue(value, ex.physical))
                continue
            shape = [batch, cache.heads, past, cache.dim]
            native.bind_input(name, cache.c_device, cache.dtype, shape, cache.pointers[current])
        for name in step.outputs:
            cache = caches.get(past_of.get(name, ""))
            if cache is None:
                native.bind_output(name, device)
            else:
                shape = [batch, cache.heads, past + new_tokens, cache.dim]
                native.bind_output(name, cache.c_device, cache.dtype, shape, cache.pointers[1 - current])
        try:
            ex.session._sess.run_with_iobinding(native, None)
        except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
            native.clear_binding_inputs()
            native.clear_binding_outputs()
            raise ex.error(err) from err
        outputs = native.get_outputs()
        needed = self._needed
        for index, name in enumerate(step.outputs):
            if name in needed:  # a present too (a view of its buffer) when a later step reads it
                values[name] = ort.OrtValue(outputs[index])
        native.clear_binding_inputs()
        native.clear_binding_outputs()
        for key in step.free:
            values.pop(key, None)
