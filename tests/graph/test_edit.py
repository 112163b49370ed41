"""placement.graph.edit leaves the IR exactly as onnx_ir's public mutators would."""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir
import pytest

from placement.graph import edit
from placement.graph.verify import run_onnx_checker

_FLOAT = ir.TensorType(ir.DataType.FLOAT)


def _graph() -> ir.Graph:
    """x, y -> a = Add(x, y) -> b = Mul(a, a) -> c = Sub(b, x) -> out c."""
    x = ir.Value(name="x", type=_FLOAT, shape=ir.Shape([2]))
    y = ir.Value(name="y", type=_FLOAT, shape=ir.Shape([2]))
    nodes, last = [], None
    for op, inputs in (("Add", ("x", "y")), ("Mul", ("a", "a")), ("Sub", ("b", "x"))):
        by_name = {"x": x, "y": y, **{n.outputs[0].name: n.outputs[0] for n in nodes}}
        last = ir.Node("", op, [by_name[i] for i in inputs], name=op.lower(), num_outputs=1)
        last.outputs[0].name, last.outputs[0].type = "abc"[len(nodes)], _FLOAT
        last.outputs[0].shape = ir.Shape([2])
        nodes.append(last)
    assert last is not None
    return ir.Graph([x, y], last.outputs, nodes=nodes, opset_imports={"": 20}, name="g")


def _state(graph: ir.Graph) -> dict[str, object]:
    """Everything the edits may touch, by name: inputs, uses in order, order, names, links."""
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        values.update({v.name: v for v in node.outputs})
        values.update({v.name: v for v in node.inputs if v is not None})
    return {
        "order": [n.name for n in graph],
        "reversed": [n.name for n in reversed(graph)],
        "len": len(graph),
        "by_index": [graph[i].name for i in range(len(graph))],
        "inputs": {n.name: [v.name if v is not None else None for v in n.inputs] for n in graph},
        "uses": {name: [(u.node.name, u.idx) for u in v.uses()] for name, v in values.items()},
        "use_types": {type(u) for v in values.values() for u in v.uses()},
        "graphs": {n.name: n.graph is graph for n in graph},
        "node_names": set(graph._name_authority._node_names),
        "value_names": set(graph._name_authority._value_names),
    }


def _same(edits: Callable[[ir.Graph, bool], None]) -> ir.Graph:
    """Run ``edits`` through the public methods and through ``edit``; assert equal states."""
    public, fast = _graph(), _graph()
    edits(public, False)
    edits(fast, True)
    assert _state(fast) == _state(public)
    return fast


def _node(graph: ir.Graph, name: str) -> ir.Node:
    return next(n for n in graph if n.name == name)


def test_fast_paths_in_use():
    # fails when onnx_ir's internals change: edit.py then uses the (slower) public methods
    assert edit.FAST, "onnx_ir's private layout changed: update placement/graph/edit.py"


def test_rewire_matches_replace_input_with():
    def edits(graph: ir.Graph, fast: bool) -> None:
        x, y = graph.inputs
        mul, sub = _node(graph, "mul"), _node(graph, "sub")
        a = _node(graph, "add").outputs[0]
        for node, index, value in (
            (mul, 1, x),
            (mul, 0, y),
            (sub, 1, a),
            (mul, 1, x),
            (sub, 1, None),
            (sub, 1, y),
        ):
            if fast:
                edit.rewire(node, index, value)
            else:
                node.replace_input_with(index, value)

    graph = _same(edits)
    graph.sort()
    run_onnx_checker(ir.Model(graph, ir_version=10))


def test_rewire_index_out_of_range():
    graph = _graph()
    mul = _node(graph, "mul")
    with pytest.raises(ValueError, match="out of range"):
        edit.rewire(mul, 2, graph.inputs[0])
    assert [v.name for v in mul.inputs] == ["a", "a"]


def test_insert_before_matches_public_insert_before():
    def edits(graph: ir.Graph, fast: bool) -> None:
        x, _ = graph.inputs
        mul, add = _node(graph, "mul"), _node(graph, "add")
        groups = [(mul, ["c1", "c2"]), (add, ["c0"]), (mul, ["c3"])]
        for before, names in groups:
            new = [ir.Node("", "Identity", [x], name=name) for name in names]
            for node, name in zip(new, names):
                node.outputs[0].name, node.outputs[0].type = f"{name}_out", _FLOAT
            if fast:
                edit.insert_before(graph, before, new)
            else:
                graph.insert_before(before, new)
        unnamed = ir.Node("", "Identity", [x])  # named by the graph: the public path
        (edit.insert_before if fast else lambda g, n, new: g.insert_before(n, new))(graph, add, [unnamed])

    graph = _same(edits)
    assert graph.node("c3").graph is graph
    graph.remove(graph.node("c1"), safe=True)  # the public methods work on what edit built
    graph.insert_after(graph.node("c2"), ir.Node("", "Identity", [graph.inputs[1]], name="late"))
    graph.sort()
    run_onnx_checker(ir.Model(graph, ir_version=10))


def test_insert_before_errors():
    graph, other = _graph(), _graph()
    x = graph.inputs[0]
    with pytest.raises(ValueError):
        edit.insert_before(graph, _node(other, "add"), [ir.Node("", "Identity", [x], name="c")])
    with pytest.raises(ValueError):  # a node of another graph: the public method refuses it too
        edit.insert_before(graph, _node(graph, "add"), [_node(other, "mul")])
    assert [n.name for n in graph] == ["add", "mul", "sub"]


def test_public_fallback_when_internals_differ(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(edit, "FAST", False)
    test_rewire_matches_replace_input_with()
    test_insert_before_matches_public_insert_before()
    test_new_node_matches_the_constructor()
    test_copy_shape_matches_the_constructor()


def _slots(node: ir.Node) -> dict[str, object]:
    """Every slot of ``node`` comparable across two graphs (objects by name or content)."""
    out: dict[str, object] = {}
    for slot in ir.Node.__slots__:
        value = getattr(node, slot)
        if slot in ("_inputs", "_outputs"):
            value = [(v.name, v.producer() is node, v.index()) if v is not None else None for v in value]
        elif slot == "_attributes":
            value = (type(value), list(vars(value)), dict(value), value._owner is node)
        elif slot == "_graph":
            value = value is not None and node in value
        out[slot] = value
    return out


def test_new_node_matches_the_constructor():
    built = {}
    for fast in (False, True):
        graph = _graph()
        x, y = graph.inputs
        out = ir.Value(name="x_copy", type=_FLOAT, shape=ir.Shape([2]))
        props = {"placement.device": "cuda:1"}
        if fast:
            node = edit.new_node("", "Identity", (x, None, x), out, name="copy", metadata_props=props)
        else:
            node = ir.Node("", "Identity", (x, None, x), outputs=(out,), name="copy", metadata_props=props)
        assert node.metadata_props is props and out.producer() is node
        edit.insert_before(graph, _node(graph, "mul"), [node]) if fast else graph.insert_before(
            _node(graph, "mul"), [node]
        )
        built[fast] = (_slots(node), _state(graph))
    assert built[True] == built[False]
    with pytest.raises(ValueError, match="producer"):
        edit.new_node("", "Identity", [None], _graph()[0].outputs[0], name="n", metadata_props=None)


def test_copy_shape_matches_the_constructor():
    for shape in (ir.Shape([1, 8]), ir.Shape(["batch", None, 3], denotations=["N", None, "C"]), ir.Shape([])):
        shape.freeze()
        public, fast = ir.Shape(shape), edit.copy_shape(shape)
        assert edit._state_of(fast) == edit._state_of(public) == {"_dims", "_denotations", "_frozen"}
        assert fast == public and fast._denotations == public._denotations and not fast.frozen
        assert fast._dims == public._dims and fast._dims is not shape._dims
        assert all(a is b for a, b in zip(fast.dims, public.dims))  # the same SymbolicDim objects
        if len(fast):
            fast[0] = 7  # unfrozen, and a copy: the source keeps its dims
            assert shape[0] != 7


def test_rewire_of_a_sharded_node_drops_its_spec_like_the_public_method():
    def edits(graph: ir.Graph, fast: bool) -> None:
        sub = _node(graph, "sub")
        spec = ir.ShardingSpec(value=sub.inputs[1], device=(0, 1))
        sub.device_configurations = (ir.NodeDeviceConfiguration(sharding_specs=(spec,)),)
        (edit.rewire if fast else ir.Node.replace_input_with)(sub, 1, graph.inputs[1])
        assert sub.device_configurations[0].sharding_specs == ()

    _same(edits)
