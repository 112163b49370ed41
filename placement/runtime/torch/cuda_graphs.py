"""CUDA graphs for the lowered module: ``pl.to_torch(model, cuda_graphs=True)``.

A small model's forward on a GPU costs more in kernel launches (one or more per op,
each a few microseconds of CPU) than in the kernels themselves. A CUDA graph records
the launches of one forward once and replays them with one call. The lowered
``GraphModule`` is cut into *segments*, maximal runs of its nodes (in their
topological order) that run on one physical device (``torch.fx.passes.split_module``);
every segment on a GPU is captured with ``torch.cuda.CUDAGraph``, segments on the
CPU run as they are, and the cross-device ``.to(...)`` copies run between them. All
logical devices on one GPU (the common single-GPU case) make one segment: the whole
forward is one graph.

Static shapes: a graph replays the shapes, dtypes and devices it was captured for. A
call with new ones captures a new graph for them (kept beside the others, at most
``max_graphs`` per segment, the least recently used dropped first); a capture that
fails (an op that synchronises with the host, such as one reading a tensor's value
into Python) is logged once and the segment runs eagerly for those shapes from then on.

Inputs are copied into the graph's static input buffers before each replay (the
caller's tensors are never written); outputs are cloned out of the graph's static
buffers before they are returned (every tensor handed to a caller owns its memory).

Autograd: graphs replay forward only. With gradients enabled and a parameter or an
input that requires them (training), the module runs eagerly, so ``loss.backward()``
works unchanged; wrap inference in ``torch.no_grad()`` or ``torch.inference_mode()``
for the graphs.

Example (on a GPU; every line skipped elsewhere):

    >>> import torch, placement as pl  # doctest: +SKIP
    >>> from placement.models import gpt  # doctest: +SKIP
    >>> net, (idx,) = gpt.build("tiny")  # doctest: +SKIP
    >>> model = pl.from_torch(net, (idx,))  # doctest: +SKIP
    >>> module = pl.to_torch(model, device_map="cuda:0", cuda_graphs=True)  # doctest: +SKIP
    >>> with torch.no_grad():  # doctest: +SKIP
    ...     logits = module(idx.cuda())  # captured on the first call, replayed on the next
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from placement.errors import CUDAGraphError
from placement.lowering.meta import DEVICE_META

__all__ = ["CUDAGraphModule", "cuda_graph_module", "segments"]

log = logging.getLogger(__name__)

#: Warm-up calls on a side stream before a capture (lazy initialisations, cuBLAS workspaces).
_WARMUP = 2


def segments(module: fx.GraphModule) -> dict[fx.Node, int]:
    """Each computing node of a lowered module -> its segment: runs of nodes, in graph
    order, on one physical device (from ``node.meta[DEVICE_META]`` through
    ``module.device_map``). Nodes without a device (moves of the graph inputs and
    outputs) join the segment of the node before them, or the first one.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> module = pl.to_torch(pl.from_torch(net, (torch.randn(2, 4),)), device_map="cpu")
        >>> set(segments(module).values())
        {0}
    """
    dmap: Mapping[str, str] = getattr(module, "device_map", {}) or {}
    nodes = [n for n in module.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    physical = [dmap.get(n.meta.get(DEVICE_META, ""), None) for n in nodes]
    first = next((p for p in physical if p is not None), None)
    assigned: dict[fx.Node, int] = {}
    current, index = first, 0
    for node, device in zip(nodes, physical):
        if device is not None and device != current:
            index += 1 if assigned else 0
            current = device
        assigned[node] = index
    return assigned


def _segment_devices(module: fx.GraphModule, assigned: Mapping[fx.Node, int]) -> dict[int, str]:
    dmap: Mapping[str, str] = getattr(module, "device_map", {}) or {}
    devices: dict[int, str] = {}
    for node, seg in assigned.items():
        device = dmap.get(node.meta.get(DEVICE_META, ""))
        if device is not None:
            devices.setdefault(seg, device)
    return devices


@dataclass
class _Captured:
    """One captured graph: its static inputs (tensor positions), outputs, and the graph."""

    graph: Any
    inputs: list[Any]
    outputs: Any


class _GraphedSegment(torch.nn.Module):
    """A segment on a GPU, run by replaying CUDA graphs (one per input signature)."""

    def __init__(self, segment: torch.nn.Module, device: torch.device, max_graphs: int) -> None:
        super().__init__()
        self.segment = segment
        self.device = device
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[Any, ...], _Captured | None] = OrderedDict()
        #: replays so far (for tests and reports)
        self.replays = 0
        #: graphs captured so far (a new input signature each)
        self.captures = 0

    def forward(self, *args: Any) -> Any:
        if torch.is_grad_enabled() and self._needs_grad(args):
            return self.segment(*args)
        key = tuple(
            (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", repr(a))
            for a in args
        )
        if key not in self._graphs:
            self._graphs[key] = self._capture(args)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        captured = self._graphs[key]
        if captured is None:
            return self.segment(*args)
        for static, arg in zip(captured.inputs, args):
            if static is not None:
                static.copy_(arg, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return captured.outputs

    def _needs_grad(self, args: tuple[Any, ...]) -> bool:
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return True
        return any(p.requires_grad for p in self.segment.parameters())

    def _capture(self, args: tuple[Any, ...]) -> _Captured | None:
        """Warm up on a side stream, then capture the segment on static inputs (None: failed)."""
        statics = [
            torch.empty_like(a, device=self.device) if isinstance(a, torch.Tensor) else None for a in args
        ]
        for static, arg in zip(statics, args):
            if static is not None:
                static.copy_(arg)
        call_args = [s if s is not None else a for s, a in zip(statics, args)]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(_WARMUP):
                    self.segment(*call_args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                outputs = self.segment(*call_args)
        except Exception as err:  # noqa: BLE001 (the segment still runs, eagerly)
            log.warning(
                "cuda_graphs: capturing a segment on %s failed for input shapes %s (%s); "
                "it runs eagerly for them",
                self.device,
                [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)],
                str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__,
            )
            return None
        self.captures += 1
        return _Captured(graph, statics, outputs)


class CUDAGraphModule(torch.nn.Module):
    """A lowered module whose GPU segments run as CUDA graphs (see the module docstring).

    Attributes:
        module: the lowered ``GraphModule`` (its parameters, ``code``, names and device map).
        split: the module cut into segments; GPU segments wrapped to replay graphs.
        graphed: the wrapped segments.
    """

    def __init__(self, module: fx.GraphModule, *, max_graphs: int = 8) -> None:
        super().__init__()
        self.module = module
        assigned = segments(module)
        devices = _segment_devices(module, assigned)
        self.split = split_module(module, module, lambda node: assigned[node], keep_original_order=True)
        self.graphed: list[_GraphedSegment] = []
        for name, sub in list(self.split.named_children()):
            if not name.startswith("submod_"):  # split_module names the segments submod_<segment>
                continue
            index = int(name.rsplit("_", 1)[1])
            device = devices.get(index, "cpu")
            if device.startswith("cuda"):
                wrapped = _GraphedSegment(sub, torch.device(device), max_graphs)
                setattr(self.split, name, wrapped)
                self.graphed.append(wrapped)
        for attr in ("input_names", "output_names", "device_map", "initializer_paths"):
            if hasattr(module, attr):
                setattr(self, attr, getattr(module, attr))

    @property
    def code(self) -> str:
        """The lowered module's code."""
        return self.module.code

    @property
    def replays(self) -> int:
        """Graph replays so far, over all segments."""
        return sum(seg.replays for seg in self.graphed)

    @property
    def captures(self) -> int:
        """Graphs captured so far, over all segments."""
        return sum(seg.captures for seg in self.graphed)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        before = self.replays
        out = self.split(*args, **kwargs)
        if self.replays == before:
            return out
        if isinstance(out, torch.Tensor):
            return out.clone()
        return type(out)(o.clone() if isinstance(o, torch.Tensor) else o for o in out)


def cuda_graph_module(module: fx.GraphModule, *, max_graphs: int = 8) -> CUDAGraphModule:
    """Wrap a lowered module so its GPU segments replay CUDA graphs.

    Raises:
        CUDAGraphError: torch has no CUDA, or the device map puts nothing on a GPU.
    """
    dmap: Mapping[str, str] = getattr(module, "device_map", {}) or {}
    if not torch.cuda.is_available():
        raise CUDAGraphError("cuda_graphs=True needs a CUDA GPU, and torch sees none")
    if not any(str(p).startswith("cuda") for p in dmap.values()):
        shown = ", ".join(f"{k} -> {v}" for k, v in dmap.items())
        raise CUDAGraphError(f"cuda_graphs=True needs a device on a GPU; the device map is {shown}")
    return CUDAGraphModule(module, max_graphs=max_graphs)
