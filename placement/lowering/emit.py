"""The fx graph being built: attribute paths, parameters and constants, values on devices, copies.

:class:`Emitter` holds the state of one lowering (the ``torch.fx.Graph``, the root module
whose attributes the parameters and buffers become, every blob's :class:`~.values.Val`)
and emits the nodes that are not ops: ``get_attr`` of a parameter (registered on first
use, on its home device) or of a constant buffer (one per physical device that reads
it), and ``.to(device)`` where a value crosses physical devices. Every node it creates
records its op and logical device in ``node.meta`` (:mod:`placement.lowering.meta`).
:class:`~.walker.Walker` lowers the ops on top of it.

Example:
    >>> from placement.graph.device import Device
    >>> from placement.lowering.values import Val
    >>> import placement as pl, torch
    >>> model = pl.from_torch(torch.nn.ReLU(), (torch.randn(2),))
    >>> emitter = Emitter(model, {Device("cuda", 0): "cpu"})
    >>> emitter._on(Val("scale", const=torch.tensor([2.0])), "cpu").op
    'get_attr'
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import onnx_ir as ir
import torch
import torch.fx as fx

from placement.errors import LoweringError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import stream_window
from placement.graph.torch_import import exporter_constants
from placement.lowering.meta import DEVICE_META, OP_META, UNTRACEABLE_META
from placement.lowering.ops import Rule
from placement.lowering.values import NOT_LITERAL, RESERVED, Val, identifier, literal

__all__ = ["Emitter", "Streamer", "STREAMER_NAME"]

#: The attribute path of a lowered module's weight streamer (made unique if taken).
STREAMER_NAME = "weight_streamer"


class Streamer(Protocol):
    """What the translation needs of a weight streamer: a module that takes one more streamed
    weight (its physical device and byte size) and returns its index. The torch runtime's
    :class:`~placement.runtime.torch.streaming.WeightStreamer` is one; :meth:`Emitter.new_streamer`
    makes it, so the translation never imports the runtime."""

    def add(self, phys: str, nbytes: int) -> int: ...


log = logging.getLogger(__name__)


class Emitter:
    """The state of one lowering and the nodes that are not ops (see the module docstring)."""

    def __init__(self, model: Model, dmap: dict[Device, Any]) -> None:
        # dmap: logical device -> physical device (anything whose str() is a torch device)
        self.model = model
        self.dmap = dmap
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.values: dict[str, Val] = {}
        self.paths: dict[str, str] = {}  # onnx initializer / constant name -> attribute path
        self.taken_paths: set[str] = set()
        self.prefixes: set[str] = set()
        self.cache: dict[tuple[str, str], fx.Node] = {}  # (blob, physical) -> node there
        self.pending_params: dict[str, torch.Tensor] = {}  # registered on first use
        self.device_override: Device | None = None  # the device of an inlined subgraph's ops
        self.deferred: dict[int, Any] = {}  # consumer node id -> continuation of a fused producer
        self.meta: dict[str, torch.Tensor] = {}  # blob -> meta tensor (static shape and dtype)
        self.fused: set[str] = set()  # blobs computed inside a fused call, never materialized
        self.const_homes: dict[str, str] = {}  # constant blob -> its first buffer path
        self.transient: set[str] = set()  # buffer paths left out of the state_dict
        self.made = exporter_constants(model)  # initializers the exporter made: never state
        self.default_device = next(iter(model.devices), Device("cuda", 0))
        self.current_device: Device | None = None  # logical device of the op being lowered
        self.current_op: str | None = None  # recorded on each fx node (its stage, when pipelining)
        self.streamer: Any = None  # made at the first streamed copy
        self.streamer_path = ""
        self.streamed_sources: list[str] = []  # per streamed copy, its parameter's name

    def _phys(self, device: Device) -> str:
        return str(self.dmap[device])

    def _attr_path(self, name: str) -> str:
        """A free attribute path for ``name`` (see *Names* in :mod:`placement.runtime.torch.lower`)."""
        parts = name.split(".")
        usable = all(p and p not in RESERVED for p in parts)
        path = name if usable else ""
        clash = (
            not path
            or path in self.taken_paths
            or path in self.prefixes
            or any(".".join(parts[:i]) in self.taken_paths for i in range(1, len(parts)))
        )
        if clash:
            base = identifier(name, "tensor")
            if base in RESERVED:
                base += "_"
            path, k = base, 1
            while path in self.taken_paths or path in self.prefixes:
                path, k = f"{base}_{k}", k + 1
        self.taken_paths.add(path)
        split = path.split(".")
        self.prefixes.update(".".join(split[:i]) for i in range(1, len(split)))
        return path

    def _owner(self, path: str) -> tuple[torch.nn.Module, str]:
        """The module that holds attribute ``path`` (made on the way where missing) and its leaf name."""
        *prefix, leaf = path.split(".")
        owner = self.root
        for part in prefix:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner, leaf

    def _register(self, path: str, tensor: torch.Tensor, *, parameter: bool) -> None:
        owner, leaf = self._owner(path)
        if parameter:
            grad = tensor.is_floating_point() or tensor.is_complex()  # integers: frozen (int8 weights)
            owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=grad))
        else:
            owner.register_buffer(leaf, tensor)

    def _param_node(self, val: Val) -> fx.Node:
        """The get_attr node of a parameter (registered on first use, on its home device)."""
        assert val.device is not None
        key = (val.name, "param")
        node = self.cache.get(key)
        if node is None:
            path = self._attr_path(val.name)
            data = self.pending_params.pop(val.name)
            self._register(path, data.to(self._phys(val.device)), parameter=True)
            self.paths[val.name] = path
            val.param = path
            node = self.graph.get_attr(path)
            self.cache[key] = node
            self.cache[(val.name, self._phys(val.device))] = node
        return node

    def _const_node(self, val: Val, phys: str) -> fx.Node:
        """A buffer holding constant ``val`` on physical device ``phys``."""
        key = (val.name, phys)
        node = self.cache.get(key)
        if node is None:
            assert val.const is not None
            first = val.name not in self.const_homes
            path = self._attr_path(val.name if first else f"{val.name}__{phys.replace(':', '_')}")
            self._register(path, val.const.to(phys), parameter=False)
            if first:
                self.const_homes[val.name] = path
            if first and val.name in self.model.graph.initializers:
                self.paths[val.name] = path
            if not first or val.name not in self.model.graph.initializers or val.name in self.made:
                # folded, per-device or exporter-made constants are rebuilt by lowering, not state
                self.transient.add(path)
            node = self.graph.get_attr(path)
            self.cache[key] = node
        return node

    # -- reading values ----------------------------------------------------------------

    def _value(self, value: ir.Value | None, op: ir.Node) -> Val | None:
        if value is None or not value.name or value.name in self.fused:
            return None
        val = self.values.get(value.name)
        if val is None:
            raise LoweringError(
                f"op {op.name!r} ({op.op_type}) reads blob {value.name!r} before it is produced "
                "(the graph is not in topological order)"
            )
        return val

    def _on(self, val: Val, phys: str) -> fx.Node:
        """The fx node of a non-constant value on physical device ``phys``."""
        if val.is_const:
            return self._const_node(val, phys)
        assert val.device is not None
        home = self._phys(val.device)
        source = self._param_node(val) if val.node is None else val.node
        if home == phys:
            return source
        key = (val.name, phys)
        node = self.cache.get(key)
        if node is None:
            log.debug("no explicit copy: moving blob %r from %s to %s", val.name, home, phys)
            node = self._emit_to(source, home, phys, f"{val.name}_to_{phys}")
            self.cache[key] = node
        return node

    def _emit_to(self, source: fx.Node, src_phys: str, dst_phys: str, name: str) -> fx.Node:
        blocking = src_phys.startswith("cuda") and dst_phys == "cpu"
        kwargs = {} if blocking else {"non_blocking": True}
        return self._create("call_method", "to", (source, dst_phys), kwargs, name)

    def _create(
        self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str
    ) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs, name=identifier(name))
        if self.current_device is not None:  # lets a split by device find each node's device
            node.meta[DEVICE_META] = str(self.current_device)
        if self.current_op is not None:
            node.meta[OP_META] = self.current_op
        return node

    def _argument(self, val: Val | None, index: int, rule: Rule, phys: str) -> Any:
        if val is None:
            return None
        if val.is_const:
            inlined = literal(val, index, rule)
            if inlined is not NOT_LITERAL:
                return inlined
        return self._on(val, phys)

    def _emit_streamed(self, source: fx.Node, src: Val, phys: str, out: str) -> fx.Node:
        """A streamed copy: ``self.weight_streamer(param, index=k)`` (see :mod:`.streaming`)."""
        if self.streamer is None:
            self.streamer = self.new_streamer(stream_window(self.model.ir_model))
            self.streamer_path = self.add_module(STREAMER_NAME, self.streamer)
        data = self.model.graph.initializers[src.name].const_value
        index = self.streamer.add(phys, int(data.nbytes) if data is not None else 0)
        self.streamed_sources.append(src.name)
        call = self._create("call_module", self.streamer_path, (source,), {"index": index}, out)
        # a trace would freeze a prefetched weight as a constant and drop the prefetching
        call.meta[UNTRACEABLE_META] = f"copy {out!r}: a streamed weight, copied and prefetched every run"
        return call

    def new_streamer(self, window: int | None) -> torch.nn.Module:
        """The module that streamed copies call (a :class:`Streamer`): the runtime that runs the
        lowered module provides it by overriding this method."""
        raise LoweringError(
            "the model streams weights from the host: lower it with pl.to_torch, whose runtime streams them"
        )

    def add_module(self, name: str, module: torch.nn.Module) -> str:
        """Register ``module`` under a free attribute path made from ``name``; return the path."""
        path = self._attr_path(identifier(name, "control"))
        owner, leaf = self._owner(path)
        owner.add_module(leaf, module)
        return path
