"""Control flow with subgraphs: ``If``, ``Loop`` and ``Scan``.

An ``If`` whose condition is known when lowering (shapes, constants) is
inlined: its taken branch's ops are lowered in place. Otherwise each subgraph
(a ``Loop`` or ``Scan`` body, both ``If`` branches) is lowered by the same
machinery into its own ``torch.fx.GraphModule``
(:meth:`~placement.lowering.bodies.Lowering.subgraphs`), wrapped in a
:class:`Subgraph`, and the op becomes one ``call_module`` of an :class:`If`,
:class:`Loop` or :class:`Scan` module holding them, registered on the lowered
module (so a body's own initializers are parameters and buffers on the op's
device). Values of the enclosing graph a subgraph reads (outer-scope
references) are passed to it explicitly, after its formal inputs; parameters
among them stay the enclosing module's one ``nn.Parameter``.

The op modules run plain Python control flow over the subgraph modules
(:func:`if_`, :func:`loop`, :func:`scan` give the ONNX semantics): an ``If``
reads its condition and calls one branch, which lets the branches return
tensors of different shapes (``torch.cond`` needs equal ones); a ``Loop`` or
``Scan`` calls its body once per iteration and stacks the scan outputs with
``torch.stack``. Nothing is written in place, so gradients flow through every
iteration by autograd. Because the trip count and the branch depend on tensor
values, the ``call_module`` node of an ``If`` or ``Loop`` (and of a ``Scan``
whose body holds one, or a random op) is marked
:data:`~placement.lowering.meta.UNTRACEABLE_META`: pipelined stages
holding it are never recorded as TorchScript traces. A ``Scan`` otherwise
runs as many iterations as its inputs' scan axis is long, which a trace keyed
by input shapes records correctly.

Values are tensors: ``Loop`` bodies carrying sequences (``SequenceInsert`` and
the like) stay unsupported, as the sequence ops have no rule.

Example:
    >>> import torch
    >>> body = lambda i, cond, total: (cond, total + i, total * 2)
    >>> final, doubled = loop(torch.tensor(3), None, torch.tensor(1), body=body)
    >>> final.item(), doubled.tolist()
    (4, [2, 2, 4])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import onnx_ir as ir
import torch

from placement.analysis import NONDETERMINISTIC_OPS
from placement.errors import LoweringError
from placement.graph.nodes import node_device
from placement.lowering.meta import UNTRACEABLE_META
from placement.lowering.ops._registry import op, torch_dtype

__all__ = ["If", "Loop", "Scan", "Subgraph", "if_", "loop", "scan"]

Body = Callable[..., Sequence[torch.Tensor]]


class Subgraph(torch.nn.Module):
    """One lowered subgraph: ``forward(*formal_inputs, *captured)`` returns a tuple of its outputs.

    Attributes:
        code: the subgraph's ``torch.fx.GraphModule``.
        num_inputs: its formal inputs (the captured values follow them).
        outputs: per output, ``(static shape or None, torch dtype or None)`` from the
            graph's declared types: the shape of an empty scan output.
    """

    def __init__(
        self,
        code: torch.nn.Module,
        num_inputs: int,
        outputs: Sequence[tuple[tuple[int, ...] | None, torch.dtype | None]],
    ) -> None:
        super().__init__()
        self.code = code
        self.num_inputs = num_inputs
        self.outputs = list(outputs)

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        return tuple(self.code(*args))


def _flag(value: Any) -> bool:
    """A boolean condition given as a Python value or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return bool(value.reshape(-1)[0])
    return bool(value)


def _count(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0])
    return int(value)


def _empty(
    spec: tuple[tuple[int, ...] | None, torch.dtype | None], device: torch.device | str
) -> torch.Tensor:
    """A scan output of zero iterations: ``[0, *element shape]`` when the shape is declared."""
    shape, dtype = spec
    return torch.empty((0, *(shape or ())), dtype=dtype or torch.float32, device=device)


def if_(cond: Any, *captured: torch.Tensor, then_branch: Body, else_branch: Body) -> tuple[torch.Tensor, ...]:
    """ONNX ``If``: the outputs of ``then_branch(*captured)`` when ``cond`` holds, else of ``else_branch``.

    Example:
        >>> x = torch.tensor([1.0, 2.0])
        >>> if_(torch.tensor(False), x, then_branch=lambda v: (v + 1,), else_branch=lambda v: (v * 0,))
        (tensor([0., 0.]),)
    """
    return tuple((then_branch if _flag(cond) else else_branch)(*captured))


def loop(
    trip_count: Any, cond: Any, *args: torch.Tensor, body: Body, num_carried: int | None = None
) -> tuple[torch.Tensor, ...]:
    """ONNX ``Loop`` (opset 11+): run ``body`` while ``i < trip_count`` and the condition holds.

    ``args`` are the initial loop-carried values followed by the captured values
    the body reads (``num_carried`` says how many are carried; default: all). The
    body gets ``(i, cond, *carried, *captured)`` and returns ``(cond, *carried,
    *scan_outputs)``. ``trip_count`` or ``cond`` may be ``None`` (omitted). The loop
    stops when the body's condition output is false even without a ``cond`` input,
    as ONNX Runtime does (the spec's pseudo-code says it is then ignored; following
    ONNX Runtime keeps the library's two runtimes equal).
    Returns the final carried values, then each scan output stacked on a new
    axis 0 (with zero iterations: empty, shaped from ``body.outputs`` when it has them).

    Example:
        >>> body = lambda i, cond, x: (x.sum() < 10, x * 2, x)
        >>> final, history = loop(None, torch.tensor(True), torch.ones(2), body=body)
        >>> final.tolist(), history.shape
        ([16.0, 16.0], torch.Size([4, 2]))
    """
    carried_count = len(args) if num_carried is None else num_carried
    carried, captured = list(args[:carried_count]), args[carried_count:]
    limit = None if trip_count is None else _count(trip_count)
    device = next(
        (t.device for t in (trip_count, cond, *args) if isinstance(t, torch.Tensor)), torch.device("cpu")
    )
    running = True if cond is None else _flag(cond)
    scans: list[list[torch.Tensor]] | None = None
    i = 0
    while running and (limit is None or i < limit):
        step = torch.tensor(i, dtype=torch.int64, device=device)
        out = body(step, torch.tensor(running, device=device), *carried, *captured)
        carried = list(out[1 : 1 + carried_count])
        if scans is None:
            scans = [[] for _ in out[1 + carried_count :]]
        for collected, value in zip(scans, out[1 + carried_count :]):
            collected.append(value)
        running = _flag(out[0])
        i += 1
    if scans is None:  # zero iterations
        specs = getattr(body, "outputs", [])[1 + carried_count :]
        return (*carried, *(_empty(spec, device) for spec in specs))
    return (*carried, *(torch.stack(values) for values in scans))


def scan(
    *args: torch.Tensor,
    body: Body,
    num_scan_inputs: int,
    num_states: int | None = None,
    scan_input_axes: Sequence[int] | None = None,
    scan_input_directions: Sequence[int] | None = None,
    scan_output_axes: Sequence[int] | None = None,
    scan_output_directions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """ONNX ``Scan`` (opset 9+): run ``body`` once per slice of the scan inputs.

    ``args`` are the initial states, then the ``num_scan_inputs`` scan inputs, then
    the captured values the body reads (``num_states`` says how many states there
    are; default: all but the scan inputs). The body gets ``(*states, *slices,
    *captured)`` and returns ``(*states, *scan_output_slices)``. Axes may be
    negative; direction ``1`` scans an input backwards or prepends an output's
    slices. Returns the final states, then each scan output stacked on its axis.

    Example:
        >>> body = lambda total, x: (total + x, total + x)
        >>> final, running = scan(torch.zeros(2), torch.ones(3, 2), body=body, num_scan_inputs=1)
        >>> final.tolist(), running[:, 0].tolist()
        ([3.0, 3.0], [1.0, 2.0, 3.0])
    """
    states_count = len(args) - num_scan_inputs if num_states is None else num_states
    states = list(args[:states_count])
    inputs = args[states_count : states_count + num_scan_inputs]
    captured = args[states_count + num_scan_inputs :]
    in_axes = [a + x.dim() if a < 0 else a for a, x in zip(scan_input_axes or [0] * len(inputs), inputs)]
    in_dirs = list(scan_input_directions or [0] * len(inputs))
    lengths = {x.shape[a] for x, a in zip(inputs, in_axes)}
    if len(lengths) > 1:
        raise ValueError(
            f"Scan: the scan inputs have different lengths along their scan axes: {sorted(lengths)}"
        )
    steps = lengths.pop() if lengths else 0
    scans: list[list[torch.Tensor]] | None = None
    for t in range(steps):
        slices = [x.select(a, steps - 1 - t if d else t) for x, a, d in zip(inputs, in_axes, in_dirs)]
        out = body(*states, *slices, *captured)
        states = list(out[:states_count])
        if scans is None:
            scans = [[] for _ in out[states_count:]]
        for collected, value in zip(scans, out[states_count:]):
            collected.append(value)
    if scans is None:  # zero iterations
        device = next((t.device for t in args if isinstance(t, torch.Tensor)), torch.device("cpu"))
        specs = getattr(body, "outputs", [])[states_count:]
        return (*states, *(_empty(spec, device) for spec in specs))
    out_axes = list(scan_output_axes or [0] * len(scans))
    out_dirs = list(scan_output_directions or [0] * len(scans))
    results = []
    for values, axis, direction in zip(scans, out_axes, out_dirs):
        if direction:
            values = values[::-1]
        rank = values[0].dim() + 1
        results.append(torch.stack(values, dim=axis + rank if axis < 0 else axis))
    return (*states, *results)


class If(torch.nn.Module):
    """An ``If`` whose condition is computed at run time: ``forward(cond, *captured)`` runs one branch."""

    def __init__(self, then_branch: Subgraph, else_branch: Subgraph) -> None:
        super().__init__()
        self.then_branch = then_branch
        self.else_branch = else_branch

    def forward(self, cond: Any, *captured: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return if_(cond, *captured, then_branch=self.then_branch, else_branch=self.else_branch)


class Loop(torch.nn.Module):
    """An ONNX ``Loop``: ``forward(trip_count, cond, *carried, *captured)``, see :func:`loop`."""

    def __init__(self, body: Subgraph) -> None:
        super().__init__()
        self.body = body

    def forward(self, trip_count: Any, cond: Any, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return loop(trip_count, cond, *args, body=self.body, num_carried=self.body.num_inputs - 2)


class Scan(torch.nn.Module):
    """An ONNX ``Scan``: ``forward(*states, *scan_inputs, *captured)``, see :func:`scan`."""

    def __init__(
        self,
        body: Subgraph,
        *,
        num_scan_inputs: int,
        scan_input_axes: Sequence[int] | None = None,
        scan_input_directions: Sequence[int] | None = None,
        scan_output_axes: Sequence[int] | None = None,
        scan_output_directions: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.body = body
        self.num_scan_inputs = num_scan_inputs
        self.scan_input_axes = list(scan_input_axes) if scan_input_axes else None
        self.scan_input_directions = list(scan_input_directions) if scan_input_directions else None
        self.scan_output_axes = list(scan_output_axes) if scan_output_axes else None
        self.scan_output_directions = list(scan_output_directions) if scan_output_directions else None

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return scan(
            *args,
            body=self.body,
            num_scan_inputs=self.num_scan_inputs,
            num_states=self.body.num_inputs - self.num_scan_inputs,
            scan_input_axes=self.scan_input_axes,
            scan_input_directions=self.scan_input_directions,
            scan_output_axes=self.scan_output_axes,
            scan_output_directions=self.scan_output_directions,
        )


# --- lowering ---------------------------------------------------------------------------------


def _specs(graph: ir.Graph) -> list[tuple[tuple[int, ...] | None, torch.dtype | None]]:
    specs = []
    for value in graph.outputs:
        shape = value.shape
        static = (
            tuple(int(d) for d in shape)
            if shape is not None and all(isinstance(d, int) for d in shape)
            else None
        )
        try:
            dtype = torch_dtype(int(value.dtype)) if value.dtype is not None else None
        except LoweringError:
            dtype = None
        specs.append((static, dtype))
    return specs


def _dynamic(graphs: Sequence[ir.Graph]) -> str | None:
    """Why calls of these subgraphs must not be traced (control flow or random ops inside), or None."""
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.op_type in ("If", "Loop"):
                return f"{node.op_type} {node.name!r} inside"
            if node.op_type in NONDETERMINISTIC_OPS:
                return f"random op {node.name!r} ({node.op_type}) inside"
    return None


def _call(
    lowering: Any, node: ir.Node, module: torch.nn.Module, args: list[Any], untraceable: str | None
) -> None:
    """Register ``module`` for ``node``, call it, and define each output as an item of its result."""
    label = node.name or node.op_type
    path = lowering.add_module(label, module)
    for attribute, child in module.named_children():  # then_branch / else_branch / body
        if isinstance(child, Subgraph):
            for key, inner in getattr(child.code, "initializer_paths", {}).items():
                lowering.paths[f"{node.name}/{attribute}/{key}"] = f"{path}.{attribute}.code.{inner}"
    call = lowering.emit("call_module", path, tuple(args), {}, label)
    if untraceable is not None:
        call.meta[UNTRACEABLE_META] = f"{node.op_type} {node.name!r}: {untraceable}"
    device = lowering.current_device
    for i, out in enumerate(node.outputs):
        if out.name:
            item = lowering.emit("call_function", operator.getitem, (call, i), {}, out.name)
            lowering.define(out.name, item, device)


def _lower_if(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    then_graph = node.attributes["then_branch"].as_graph()
    else_graph = node.attributes["else_branch"].as_graph()
    condition = lowering.constant(ins[0] if ins else None)
    if condition is not None:  # known when lowering: inline the taken branch
        branch = then_graph if bool(condition.reshape(-1)[0]) else else_graph
        device = node_device(node) if lowering.device_override is None else lowering.device_override
        lowering.inline(branch, device, list(node.outputs))
        return True
    if not ins or ins[0] is None:
        raise LoweringError(f"op {node.name!r} (If) has no condition")
    (then_code, else_code), captured = lowering.subgraphs(node, [then_graph, else_graph], phys)
    module = If(Subgraph(then_code, 0, _specs(then_graph)), Subgraph(else_code, 0, _specs(else_graph)))
    _call(lowering, node, module, [lowering.on(ins[0], phys), *captured], "its condition is read at run time")
    return True


def _operand(lowering: Any, val: Any, phys: str, kind: type) -> Any:
    """An optional scalar input: None, a Python literal when known when lowering, else its fx node."""
    if val is None:
        return None
    const = lowering.constant(val)
    if const is not None:
        return kind(const.reshape(-1)[0].item())
    return lowering.on(val, phys)


def _lower_loop(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    body = node.attributes["body"].as_graph()
    if len(body.inputs) != len(node.inputs) or len(body.outputs) < len(node.inputs) - 1:
        raise LoweringError(
            f"op {node.name!r} (Loop): the body takes {len(body.inputs)} inputs and returns "
            f"{len(body.outputs)} outputs for {len(node.inputs)} op inputs"
        )
    (code,), captured = lowering.subgraphs(node, [body], phys)
    carried = [lowering.on(val, phys) for val in ins[2:]]
    if any(val is None for val in ins[2:]):
        raise LoweringError(f"op {node.name!r} (Loop): a loop-carried input is missing")
    module = Loop(Subgraph(code, len(body.inputs), _specs(body)))
    trip = _operand(lowering, ins[0] if ins else None, phys, int)
    cond = _operand(lowering, ins[1] if len(ins) > 1 else None, phys, bool)
    _call(lowering, node, module, [trip, cond, *carried, *captured], "its trip count is decided at run time")
    return True


def _lower_scan(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    body = node.attributes["body"].as_graph()
    attrs = {name: attr.value for name, attr in node.attributes.items() if name != "body"}
    count = int(attrs["num_scan_inputs"])
    if len(body.inputs) != len(node.inputs):
        raise LoweringError(
            f"op {node.name!r} (Scan): the body takes {len(body.inputs)} inputs "
            f"for {len(node.inputs)} op inputs"
        )
    if any(val is None for val in ins):
        raise LoweringError(f"op {node.name!r} (Scan): an input is missing")
    (code,), captured = lowering.subgraphs(node, [body], phys)
    module = Scan(
        Subgraph(code, len(body.inputs), _specs(body)),
        num_scan_inputs=count,
        **{k: [int(v) for v in attrs[k]] for k in _SCAN_LISTS if k in attrs},
    )
    args = [lowering.on(val, phys) for val in ins]
    _call(lowering, node, module, [*args, *captured], _dynamic([body]))
    return True


_SCAN_LISTS = ("scan_input_axes", "scan_input_directions", "scan_output_axes", "scan_output_directions")


def _scan_rule(
    *args: torch.Tensor,
    body: Body,
    num_scan_inputs: int,
    scan_input_axes: Sequence[int] | None = None,
    scan_input_directions: Sequence[int] | None = None,
    scan_output_axes: Sequence[int] | None = None,
    scan_output_directions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`scan` with exactly the ONNX attributes (the rule's signature)."""
    return scan(
        *args,
        body=body,
        num_scan_inputs=num_scan_inputs,
        scan_input_axes=scan_input_axes,
        scan_input_directions=scan_input_directions,
        scan_output_axes=scan_output_axes,
        scan_output_directions=scan_output_directions,
    )


def _if_rule(
    cond: Any, *captured: torch.Tensor, then_branch: Body, else_branch: Body
) -> tuple[torch.Tensor, ...]:
    """:func:`if_` (the rule's signature: the ONNX attributes)."""
    return if_(cond, *captured, then_branch=then_branch, else_branch=else_branch)


def _loop_rule(trip_count: Any, cond: Any, *args: torch.Tensor, body: Body) -> tuple[torch.Tensor, ...]:
    """:func:`loop` (the rule's signature: the ONNX attributes)."""
    return loop(trip_count, cond, *args, body=body)


op("If", _if_rule, foldable=False, emit=_lower_if)
op("Loop", _loop_rule, foldable=False, emit=_lower_loop)
op("Scan", _scan_rule, foldable=False, emit=_lower_scan)
