"""Subgraphs of an op (``Loop``/``Scan`` bodies, ``If`` branches) lowered into modules of their own.

:meth:`Lowering.subgraphs` lowers each subgraph with a :class:`BodyLowering` (the same
machinery, all ops on the enclosing op's device) into its own ``GraphModule``, whose
forward takes the subgraph's formal inputs and then the enclosing graph's values it
reads (:func:`captured_names`); :mod:`placement.lowering.ops.control` wraps
them in the ``If``/``Loop``/``Scan`` modules. :class:`Lowering` is the class every
lowering instantiates.

Example:
    >>> import onnx_ir as ir
    >>> x = ir.Value(name="x")
    >>> body = ir.Graph([], [x], nodes=[])
    >>> captured_names([body])
    ['x']
"""

from __future__ import annotations

import onnx_ir as ir
import torch
import torch.fx as fx

from placement.errors import LoweringError
from placement.graph.device import Device
from placement.graph.nodes import subgraphs_of
from placement.lowering.ops import get_rule
from placement.lowering.values import Val, identifier, to_torch_tensor
from placement.lowering.walker import Walker

__all__ = ["BodyLowering", "Lowering", "captured_names", "graph_module"]


class Lowering(Walker):
    """A :class:`~.walker.Walker` that also lowers op subgraphs (the rules' ``lowering.subgraphs``)."""

    def subgraphs(
        self, node: ir.Node, graphs: list[ir.Graph], phys: str
    ) -> tuple[list[fx.GraphModule], list[fx.Node]]:
        """Lower an op's subgraphs (a ``Loop``/``Scan`` body, both ``If`` branches) on its device.

        Each graph becomes its own ``GraphModule`` built by the same machinery,
        whose forward takes the graph's formal inputs followed by the values of
        the enclosing graph that the subgraphs read (their *captured* values, one
        list shared by all of ``graphs``) and returns a tuple of the graph's
        outputs. Captured values known when lowering are folded into the
        subgraph instead. Its initializers become its own parameters and buffers
        on ``phys``. Returns the modules and the fx nodes (on ``phys``) of the
        captured values, to pass after the formal inputs.
        """
        names = captured_names(graphs)
        runtime: list[str] = []
        for name in names:
            val = self.values.get(name)
            if val is None or name in self.fused:
                raise LoweringError(
                    f"op {node.name!r} ({node.op_type}): its subgraph reads blob {name!r} of the "
                    "enclosing graph, which is not produced before it"
                )
            if not val.is_const:
                runtime.append(name)
        device = self.current_device or self.default_device
        modules = [BodyLowering(self, graph, device, runtime, node).build() for graph in graphs]
        return modules, [self._on(self.values[name], phys) for name in runtime]


class BodyLowering(Lowering):
    """Lowers one subgraph of an op (see :meth:`Lowering.subgraphs`) into its own ``GraphModule``.

    Every op of the subgraph runs on the enclosing op's logical ``device``. Its
    forward takes the graph's formal inputs, then the ``captured`` values of the
    enclosing graph (already on ``device``), and returns a tuple of its outputs.
    """

    def __init__(
        self, parent: Lowering, body: ir.Graph, device: Device, captured: list[str], owner: ir.Node
    ) -> None:
        super().__init__(parent.model, parent.dmap)
        self.body = body
        self.device_override = device
        self.default_device = device
        self.current_device = device
        self.current_op = parent.current_op
        self.captured = captured
        self.owner = owner
        for name in captured_names([body]):  # folded values of the enclosing graph stay folded here
            val = parent.values.get(name)
            if val is not None and val.is_const:
                self.values[name] = Val(name, const=val.const)

    def build(self) -> fx.GraphModule:
        device = self.default_device
        for value in self.body.inputs:
            placeholder = self.graph.placeholder(identifier(value.name or "", "input"))
            self.values[value.name or ""] = Val(value.name or "", node=placeholder, device=device)
        for name in self.captured:
            placeholder = self.graph.placeholder(identifier(name, "captured"))
            self.values[name] = Val(name, node=placeholder, device=device)
        state = {
            value.name
            for node in self.body
            for i in get_rule(node.op_type, node.domain).buffer_inputs
            if i < len(node.inputs) and (value := node.inputs[i]) is not None
        }
        for name, value in self.body.initializers.items():
            if value.const_value is None:
                raise LoweringError(
                    f"initializer {name!r} of a subgraph of op {self.owner.name!r} has no data"
                )
            data = to_torch_tensor(value.const_value)
            if data.is_floating_point() and data.dim() >= 1 and name not in state:
                self.values[name] = Val(name, device=device)
                self.pending_params[name] = data
            else:
                self.values[name] = Val(name, const=data)
        for node in self.body:
            self._lower(node)
        phys = self._phys(device)
        results = []
        for value in self.body.outputs:
            val = self.values.get(value.name or "")
            if val is None:
                raise LoweringError(
                    f"op {self.owner.name!r} ({self.owner.op_type}): subgraph output {value.name!r} "
                    "is never produced"
                )
            results.append(self._on(val, phys))
        self.graph.output(tuple(results))
        module = graph_module(self.root, self.graph, f"{self.owner.op_type}Body")
        present = {name for name, _ in module.named_buffers()}
        for path in self.transient & present:
            owner, _, leaf = path.rpartition(".")
            module.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
        # its own initializers by name, and those of subgraphs inside it by their keys
        # (see placement.graph.model.subgraph_initializers); the enclosing op prefixes them
        module.initializer_paths = {
            name: path for name, path in self.paths.items() if name in self.body.initializers or "/" in name
        }
        return module


def graph_module(
    root: torch.nn.Module, graph: fx.Graph, name: str, *, cls: type[fx.GraphModule] = fx.GraphModule
) -> fx.GraphModule:
    """The ``GraphModule`` (of class ``cls``) of ``graph``, without dead code (e.g. transposes
    absorbed by fused linears)."""
    module = cls(root, graph, class_name=name)
    if module.graph.eliminate_dead_code():  # needs the owning module to see call_module nodes
        module.recompile()
    module.graph.lint()
    return module


def captured_names(graphs: list[ir.Graph]) -> list[str]:
    """Names of enclosing-graph values that ``graphs`` (or subgraphs in them) read, in first-read order."""
    found: dict[str, None] = {}
    for graph in graphs:
        defined = {v.name for v in graph.inputs} | set(graph.initializers)
        defined |= {out.name for node in graph for out in node.outputs}
        reads: list[str] = []
        for node in graph:
            reads += [v.name for v in node.inputs if v is not None and v.name]
            reads += captured_names([sub for _, sub in subgraphs_of(node)])
        reads += [v.name for v in graph.outputs if v.name]
        for name in reads:
            if name not in defined:
                found.setdefault(name)
    return list(found)
