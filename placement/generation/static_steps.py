"""Decode steps with static shapes and addresses on the torch runtime: what a CUDA graph replays.

A CUDA graph replays the kernels it captured on the addresses and shapes it captured:
a decode step can be one only if every step hands the lowered module the same tensors.
:class:`StaticSteps` makes it so. The cache appends (``static_append``, see
:mod:`~placement.generation.torch_decoder`) become :func:`cache_write`: the new keys and
values are written into the preallocated cache at a position held by a device tensor
(``cache_index``, one per module, set before each step) instead of right after the past.
A decode step then always hands the module the same tensors:

* each cache as the view of its first ``max_length - 1`` positions (``(batch, heads,
  max_length - 1, head_dim)``), so the present is the whole buffer;
* the new token ids and positions, ``(batch, 1)``, and the attention mask over the whole
  buffer, ``(batch, max_length)``: the real mask over the positions written so far and the
  new one, 0 on the positions not written yet. Attention does not depend on where a key sits
  in the cache, only on the mask (the rotary positions come from ``position_ids``), so the
  tokens are those of the growing cache.

These inputs live in tensors allocated once per slot and batch, filled in place before each
step. With ``capture=True`` (one GPU) the first decode step of a slot is captured as a
``torch.cuda.CUDAGraph`` (after warm-up runs on a side stream, which write the same keys
the step writes) and each later step replays it. The prompt (prefill) runs eagerly.

Example:
    >>> import torch
    >>> cache = torch.zeros(1, 1, 4, 2)
    >>> out = cache_write(cache[:, :, :3], torch.ones(1, 1, 1, 2), -2, torch.tensor([1]))
    >>> out.shape, out.data_ptr() == cache.data_ptr(), cache[0, 0, :, 0].tolist()
    (torch.Size([1, 1, 4, 2]), True, [0.0, 1.0, 0.0, 0.0])
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["INDEX_ATTRIBUTE", "StaticSteps", "cache_write", "longer_view", "make_indexed"]

log = logging.getLogger(__name__)

#: The lowered module's attribute holding the position the next tokens' keys are written at.
INDEX_ATTRIBUTE = "_pl_cache_index"
_WARMUP = 2  # warm-up runs on a side stream before a capture (lazy initialisations, workspaces)


def longer_view(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The view of the buffer ``past`` ``(batch, heads, length, width)`` is the start of, as long
    as ``past`` and ``new`` together along the length axis (``dim``); None where ``past`` is
    not such a view with room for ``new`` (or the two do not match).

    Example:
        >>> buffer = torch.zeros(1, 1, 4, 2)
        >>> longer_view(buffer[:, :, :1], torch.ones(1, 1, 2, 2), -2).shape
        torch.Size([1, 1, 3, 2])
        >>> longer_view(torch.zeros(1, 1, 1, 2), torch.ones(1, 1, 2, 2), -2) is None
        True
    """
    if (
        past.dim() != 4
        or new.dim() != 4
        or dim % 4 != 2
        or new.dtype != past.dtype
        or new.device != past.device
    ):
        return None
    batch, heads, length, width = past.shape
    total = length + new.shape[2]
    strides = past.stride()
    end = (
        past.storage_offset() + (batch - 1) * strides[0] + (heads - 1) * strides[1] + (total - 1) * strides[2]
    )
    room = past.untyped_storage().nbytes() // past.element_size()
    fits = strides[3] == 1 and strides[2] == width and strides[1] >= total * width and end + width <= room
    if not fits or tuple(new.shape[:2]) != (batch, heads) or new.shape[3] != width:
        return None
    return past.as_strided((batch, heads, total, width), strides, past.storage_offset())


def cache_write(past: torch.Tensor, new: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``new`` written into the buffer ``past`` is a view of, at positions ``index ..``
    along the length axis; the view of the buffer ``past``'s length plus ``new``'s long.

    ``index``: a one-element integer tensor (on any device; moved to the buffer's). Where
    ``past`` has no room behind it this is ``torch.cat`` (the index is then the past's length).
    """
    out = longer_view(past, new, dim)
    if out is None:
        return torch.cat([past, new], dim)
    where = index.to(past.device, non_blocking=True).reshape(1)
    if new.shape[2] > 1:
        where = where + torch.arange(new.shape[2], device=past.device)
    out.index_copy_(2, where, new)
    return out


def make_indexed(module: Any, appends: Any, *, device: torch.device) -> int:
    """Rewrite the lowered graph's calls of ``appends`` (``static_append(past, new, dim)``)
    into :func:`cache_write` at the module's ``cache_index`` (a one-element int64 tensor on
    ``device``); how many."""
    graph = module.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is appends]
    if not nodes:
        return 0
    # a buffer outside the state dict: the module's parameters and their names stay the model's
    index_tensor = torch.zeros(1, dtype=torch.int64, device=device)
    module.register_buffer(INDEX_ATTRIBUTE, index_tensor, persistent=False)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        index = graph.get_attr(INDEX_ATTRIBUTE)
    for node in nodes:
        node.target, node.args = cache_write, (*node.args, index)
    module.recompile()
    return len(nodes)


class _Inputs:
    """One slot's static inputs at one batch: the tensors every decode step hands the module."""

    def __init__(self, args: list[torch.Tensor], fed: dict[str, torch.Tensor]) -> None:
        self.args = args
        self.fed = fed
        self.graph: Any = None  # the captured CUDA graph (False: the capture failed)
        self.outputs: Any = None  # its outputs (static tensors)


class StaticSteps:
    """Runs a decoder's steps on a module rewritten by :func:`make_indexed` (see the module doc).

    Args:
        module: the lowered module (``pl.to_torch``, ``chunks=1``, no ``cuda_graphs``).
        inputs: its input names in order.
        devices: the device each fed input (and each cache) is read on.
        capture: capture decode steps as CUDA graphs (every device one GPU).
    """

    def __init__(
        self,
        module: Any,
        inputs: Sequence[str],
        devices: Mapping[str, torch.device],
        *,
        capture: bool,
    ) -> None:
        self.module = module
        self.inputs = list(inputs)
        self.devices = dict(devices)
        self.capture = capture
        self._index: torch.Tensor = getattr(module, INDEX_ATTRIBUTE)
        #: decode steps replayed from a CUDA graph, graphs captured, steps run with static shapes
        self.replays = self.captures = self.static_steps = 0

    def call(
        self,
        buffers: Mapping[str, torch.Tensor],
        static_inputs: dict[int, Any],
        batch: int,
        past: int,
        arrays: Mapping[str, np.ndarray],
    ) -> Any:
        """One step on a slot's cache ``buffers``: the prompt (or any step of several tokens)
        eagerly on views of the cache as long as the past; a decode step on the slot's static
        inputs (``static_inputs``: kept with the slot, by batch; replayed when captured)."""
        self._index.fill_(past)
        new_tokens = arrays["input_ids"].shape[1]
        max_length = next(iter(buffers.values())).shape[2]
        if new_tokens != 1 or past + 1 > max_length:
            args = [
                buffers[name][:batch, :, :past] if name in buffers else torch.from_numpy(arrays[name])
                for name in self.inputs
            ]
            with torch.no_grad():
                return self.module(*args)
        if batch not in static_inputs:
            static_inputs[batch] = self._inputs(buffers, batch)
        static = static_inputs[batch]
        for name, tensor in static.fed.items():
            value = arrays[name]
            if name == "attention_mask":  # over the whole buffer: 0 where nothing is written yet
                full = np.zeros((batch, max_length), np.int64)
                full[:, : past + 1] = value
                value = full
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(value)), non_blocking=False)
        self.static_steps += 1
        if self.capture and static.graph is None:
            static.graph, static.outputs = self._captured(static.args)
        if not static.graph:  # not captured (capture=False, or the capture failed)
            with torch.no_grad():
                return self.module(*static.args)
        static.graph.replay()
        self.replays += 1
        return static.outputs

    def _inputs(self, buffers: Mapping[str, torch.Tensor], batch: int) -> _Inputs:
        max_length = next(iter(buffers.values())).shape[2]
        args: list[torch.Tensor] = []
        fed: dict[str, torch.Tensor] = {}
        for name in self.inputs:
            if name in buffers:
                args.append(buffers[name][:batch, :, : max_length - 1])
                continue
            width = max_length if name == "attention_mask" else 1
            fed[name] = torch.zeros(batch, width, dtype=torch.int64, device=self.devices[name])
            args.append(fed[name])
        return _Inputs(args, fed)

    def _captured(self, args: list[torch.Tensor]) -> tuple[Any, Any]:
        """(graph, its outputs) of a decode step on ``args``; (False, None) where the capture
        fails (an op that synchronises with the host): the step then runs eagerly."""
        device = self._index.device
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(_WARMUP):  # writes the keys and values the step writes
                    self.module(*args)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                outputs = self.module(*args)
        except Exception as err:  # noqa: BLE001 (the step still runs, eagerly)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            log.warning("cuda_graphs: capturing a decode step on %s failed (%s): eager steps", device, first)
            return False, None
        self.captures += 1
        log.debug("captured a decode step on %s", device)
        return graph, outputs
