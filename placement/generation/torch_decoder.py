"""Decode steps on the torch runtime: a static KV cache, preallocated and updated in place.

:class:`TorchDecoder` lowers a decoder-ready model once (:func:`placement.to_torch`, outputs
left on the devices that made them) and rewrites the lowered graph so that each
``present = Concat(past, new)`` writes the new tokens into the cache buffer the past
is a view of, and returns the longer view (:func:`static_append`): each layer's cache is
one ``(batch, heads, max_length, head_dim)`` tensor on its stage's device, allocated once
and never copied; a step only writes its new tokens' keys and values. With
``cuda_graphs=True`` (one GPU) decode steps run on static inputs and replay one captured CUDA
graph (:mod:`placement.generation.static_steps`: the appends then write at a position held
by a device tensor).

Where the lowered graph makes a present some other way (a fused attention op such as
``GroupQueryAttention``), or with ``chunks > 1`` (the pipelined module concatenates its
micro-batches), the present is a new tensor, copied into the buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from placement.errors import CUDAGraphError, PlacementError
from placement.generation.prepare import DecoderSpec
from placement.generation.static_steps import StaticSteps, longer_view, make_indexed
from placement.runtime.device_map import DeviceMapLike
from placement.runtime.torch import to_torch

__all__ = ["TorchDecoder", "TorchSlot", "static_append"]

log = logging.getLogger(__name__)


def static_append(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat([past, new], dim)``, written in place when ``past`` is a view of a larger buffer.

    Where ``past`` ``(batch, heads, length, dim)`` is the start of a buffer with room for
    ``new`` along the length axis, ``new`` is copied right after it and a view of the
    longer cache is returned (no allocation, the past is not copied); otherwise this is
    ``torch.cat``.

    Example:
        >>> buffer = torch.zeros(1, 1, 4, 2)
        >>> past = buffer[:, :, :1]
        >>> out = static_append(past, torch.ones(1, 1, 2, 2), -2)
        >>> out.shape, out.data_ptr() == buffer.data_ptr(), buffer[0, 0, :, 0].tolist()
        (torch.Size([1, 1, 3, 2]), True, [0.0, 1.0, 1.0, 0.0])
    """
    out = longer_view(past, new, dim)
    if out is None:
        return torch.cat([past, new], dim)
    length = past.shape[2]
    out[:, :, length:].copy_(new)
    return out


def _make_static(module: Any, presents: set[str]) -> int:
    """Rewrite the lowered graph's ``cat(past, new)`` producing a present into :func:`static_append`."""
    graph = getattr(module, "graph", None)
    names = list(getattr(module, "output_names", []))
    if graph is None or not names:
        return 0
    output = next(node for node in graph.nodes if node.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    changed = 0
    for name, node in zip(names, results):
        if name not in presents:
            continue
        while isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == "to":
            node = node.args[0]
        if not isinstance(node, torch.fx.Node) or node.target is not torch.cat:
            log.debug("present %r is not a Concat in the lowered graph: cache appended by copy", name)
            continue
        tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if len(tensors) != 2:
            continue
        node.target, node.args, node.kwargs = static_append, (tensors[0], tensors[1], dim), {}
        changed += 1
    if changed:
        module.recompile()
    return changed


def _trim_for_decoding(module: Any, devices: set[str]) -> int:
    """Cut per-step Python from the lowered graph the decoder calls (its own module, built
    for it): ``x.to("cpu")`` where every device is the CPU (a no-op a step would still
    call), and each parameter or buffer (read through ``Module.__getattr__``, once per dot
    of ``self.model.layers.0.mlp.weight``, every step) read from a plain attribute of the
    root module instead. The attributes are not registered: ``parameters()`` and
    ``state_dict()`` are unchanged. Returns the nodes changed."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return 0
    changed = 0
    if devices <= {"cpu"}:
        for node in list(graph.nodes):
            cpu = node.args[1:] in (("cpu",), (torch.device("cpu"),))
            if (
                node.op == "call_method"
                and node.target == "to"
                and cpu
                and set(node.kwargs) <= {"non_blocking"}
            ):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                changed += 1
    for node in graph.nodes:
        if node.op == "get_attr" and not str(node.target).startswith("_decode_"):
            flat = "_decode_" + str(node.target).replace(".", "_")
            if flat not in module.__dict__:
                object.__setattr__(module, flat, _attribute(module, str(node.target)))
            node.target = flat
            changed += 1
    if changed:
        module.recompile()
    return changed


def _attribute(module: Any, target: str) -> Any:
    """The tensor at dotted path ``target`` of ``module``."""
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


@dataclass
class TorchSlot:
    """One group's cache buffers (past input name -> ``(batch, heads, max_length, head_dim)``)."""

    buffers: dict[str, torch.Tensor]
    batch: int
    max_length: int
    active: int = 0
    past: int = 0
    held: dict[str, Any] = field(default_factory=dict)  # input -> (array, tensor over it)
    #: static decode inputs by batch (:class:`~placement.generation.static_steps.StaticSteps`)
    static: dict[int, Any] = field(default_factory=dict)


class TorchDecoder:
    """Runs decode steps of a decoder-ready model on the torch runtime (see the module docstring).

    Args:
        spec: the decoder-ready model.
        device_map: logical -> physical devices (as :func:`placement.to_torch`).
        chunks: micro-batches per step (the runtime's pipelined module).
        cuda_graphs: replay each decode step as a CUDA graph (one GPU; :mod:`.static_steps`;
            with ``chunks > 1``, the pipelined module's stages as :func:`placement.to_torch` does).
        static_shapes: run decode steps on static inputs, as a capture would (default:
            ``cuda_graphs``); on the CPU it shows what a capture would see.
    """

    def __init__(
        self,
        spec: DecoderSpec,
        *,
        device_map: DeviceMapLike = "auto",
        chunks: int = 1,
        cuda_graphs: bool = False,
        static_shapes: bool | None = None,
    ) -> None:
        self.spec = spec
        # chunks=1: the decoder captures its own decode steps (static cache, static inputs)
        self.module = to_torch(
            spec.model,
            device_map=device_map,
            outputs_on="last",
            chunks=chunks,
            cuda_graphs=cuda_graphs and chunks > 1,
        )
        presents = {name for layer in spec.layers for name in (layer.present_key, layer.present_value)}
        self.static = _make_static(self.module, presents) if chunks == 1 else 0
        physical = getattr(self.module, "device_map", {})
        if self.static:
            _trim_for_decoding(self.module, {torch.device(str(d)).type for d in physical.values()})
        self.inputs = list(getattr(self.module, "input_names", []))
        self.outputs = list(getattr(self.module, "output_names", []))
        self._forward = _unchecked_forward(self.module)
        self._devices: dict[str, torch.device] = {}
        self._shapes: dict[str, tuple[int, int, Any]] = {}
        self._present_of: dict[str, str] = {}
        model = spec.model
        for name in spec.feeds:
            self._devices[name] = torch.device(physical.get(str(model.blob_device(model.value(name))), "cpu"))
        for layer in spec.layers:
            for past, present in (
                (layer.past_key, layer.present_key),
                (layer.past_value, layer.present_value),
            ):
                logical = str(model.blob_device(model.value(past)))
                self._devices[past] = torch.device(physical.get(logical, "cpu"))
                dtype = getattr(torch, str(np.dtype(layer.dtype)))
                self._shapes[past] = (int(layer.kv_heads or 0), int(layer.head_dim or 0), dtype)
                self._present_of[present] = past
        wanted = cuda_graphs if static_shapes is None else static_shapes
        self.static_steps = self._static_steps(len(presents), cuda_graphs) if chunks == 1 and wanted else None

    def _static_steps(self, presents: int, cuda_graphs: bool) -> StaticSteps | None:
        """Decode steps on static inputs (:mod:`placement.generation.static_steps`), captured as
        CUDA graphs with ``cuda_graphs`` where every device is one GPU."""
        devices = set(self._devices.values())
        if cuda_graphs and (not torch.cuda.is_available() or not any(d.type == "cuda" for d in devices)):
            raise CUDAGraphError(f"cuda_graphs=True needs the model on a CUDA GPU; its devices: {devices}")
        if self.static < presents:
            log.warning(
                "%d of %d cache outputs are not appended in place in the lowered graph: decode steps "
                "run with growing shapes%s", presents - self.static, presents,
                ", not as CUDA graphs" if cuda_graphs else "",
            )  # fmt: skip
            return None
        missing = [name for name in ("attention_mask", "position_ids") if name not in self.inputs]
        if missing:  # a step over the whole buffer needs the mask to hide the unwritten positions,
            # and positions that do not come from the past's length (the buffer's, there)
            log.warning(
                "the model takes no %s: decode steps run with growing shapes%s",
                " or ".join(missing), ", not as CUDA graphs" if cuda_graphs else "",
            )  # fmt: skip
            return None
        capture = cuda_graphs and len(devices) == 1
        if cuda_graphs and not capture:
            log.warning("cuda_graphs: a decode step is captured on one GPU; on %s it runs eagerly", devices)
        first = self._devices[self.spec.layers[0].past_key]
        make_indexed(self.module, static_append, device=first)
        return StaticSteps(self.module, self.inputs, self._devices, capture=capture)

    def new_slot(self, batch: int, max_length: int) -> TorchSlot:
        """A group's cache buffers for up to ``batch`` sequences of ``max_length`` tokens (allocated once)."""
        buffers = {
            past: torch.zeros(batch, heads, max_length, dim, dtype=dtype, device=self._devices[past])
            for past, (heads, dim, dtype) in self._shapes.items()
        }
        return TorchSlot(buffers, batch, max_length)

    def start(self, slot: TorchSlot, batch: int) -> None:
        """Begin a new generation in ``slot``: an empty past of ``batch`` sequences."""
        if batch > slot.batch:
            raise PlacementError(f"slot holds {slot.batch} sequences, asked for {batch}")
        slot.active, slot.past = batch, 0
        slot.held = {}
        slot.held = {}

    def step(self, slot: TorchSlot, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """One whole step (prefill or decode) for ``slot``: the last position's logits ``(batch, vocab)``.

        A generation's first step calls the module (its input check runs); the next ones call
        its forward directly where the check is the module's only hook: the decoder made
        every input itself, of the dtype and shape the check passed.
        """
        batch, past = slot.active, slot.past
        new_tokens = arrays["input_ids"].shape[1]
        if past + new_tokens > slot.max_length:
            raise PlacementError(f"the cache holds {slot.max_length} tokens; step needs {past + new_tokens}")
        if self.static_steps is not None:
            results = self.static_steps.call(slot.buffers, slot.static, batch, past, arrays)
        else:
            buffers, held = slot.buffers, slot.held
            args = []
            for name in self.inputs:
                buffer = buffers.get(name)
                if buffer is not None:
                    args.append(buffer[:batch, :, :past])
                    continue
                array = arrays[name]
                tensor = held.get(name)
                if tensor is None or tensor[0] is not array:  # the loop's buffers: wrapped once
                    tensor = held[name] = (array, torch.from_numpy(array))
                args.append(tensor[1])
            call = self.module if past == 0 or self._forward is None else self._forward
            with torch.inference_mode():
                results = call(*args)
        results = results if isinstance(results, (tuple, list)) else (results,)
        logits = None
        for name, value in zip(self.outputs, results):
            past_name = self._present_of.get(name)
            if past_name is None:
                if name == "logits":
                    logits = value
                continue
            buffer = slot.buffers[past_name]
            if value.data_ptr() != buffer.data_ptr():  # not appended in place: copy into the buffer
                buffer[:batch, :, : past + new_tokens].copy_(value)
        slot.past = past + new_tokens
        if logits is None:
            raise PlacementError("the lowered module returned no 'logits'")
        logits = logits.reshape(logits.shape[0], -1)
        if logits.dtype != torch.float32 or logits.device.type != "cpu":
            logits = logits.float().cpu()
        return logits.numpy()


def _unchecked_forward(module: Any) -> Any:
    """``module.forward`` where the module's only hook is its input check (None otherwise:
    every call goes through ``module(...)``)."""
    from placement.runtime.torch.input_check import _InputCheck

    hooks = list(module._forward_hooks.values())
    pre = list(module._forward_pre_hooks.values())
    if hooks or not pre or not all(isinstance(hook, _InputCheck) for hook in pre):
        return None
    if torch.nn.modules.module._global_forward_pre_hooks or torch.nn.modules.module._global_forward_hooks:
        return None
    return module.forward
