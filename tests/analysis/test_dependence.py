"""One definition of dependence, copy origin and load-time values, shared by every layer.

The planner's bytes per cut, the bytes the ONNX Runtime executor transfers per run and the
bytes the per-device report shows must agree on every cut of the zoo models.
"""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, shape_inference

import placement as pl
from placement.analysis import activation_values, copy_origin, independent_values, load_time_values
from placement.graph.model import value_nbytes
from placement.planning.graph_info import GraphInfo
from placement.runtime.stages import split_stages
from tests.conftest import MODEL_NAMES


def _cuts(n: int, most: int = 12) -> list[int]:
    step = max(1, n // most)
    return sorted({*range(1, n, step), n - 1})


def _planner_bytes(model: pl.Model, cut: int) -> int:
    info = GraphInfo(model)
    part = [0 if pos < cut else 1 for pos in range(len(info))]
    _, into = info.transfers(part, 2)
    return sum(into)


def _runtime_bytes(model: pl.Model) -> int:
    transfers = split_stages(model).transfers
    return sum(int(value_nbytes(model.value(t.source)) or 0) for t in transfers)


def _report_bytes(model: pl.Model) -> int:
    return sum(row.recv_bytes for row in pl.summary(model).rows)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_planner_runtime_and_report_agree_on_cut_bytes(name: str, exported) -> None:
    base, _, _ = exported(name)
    compute = [op.name for op in base.ops if not op.is_copy]
    checked = 0
    for cut in _cuts(len(compute)):
        model = base.copy()
        for op in compute[cut:]:
            model.set_device(op, 1)
        planned = _planner_bytes(model, cut)
        pl.inject_cross_device_copies(model, output_device=1)
        moved = _runtime_bytes(model)
        where = f"{name}, cut before op {cut} ({compute[cut]!r})"
        assert planned == moved, f"{where}: planner {planned} B, runtime {moved} B"
        assert _report_bytes(model) == moved, f"{name}, cut {cut}: report disagrees with runtime"
        checked += 1
    assert checked >= 2


def _random_graph() -> pl.Model:
    """x -> Relu -> Add(RandomNormalLike(x) ...), a constant Transpose weight, and a random op."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 3], [float(i) for i in range(9)])
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], name="transpose_w"),
        helper.make_node("RandomNormal", [], ["noise"], name="noise", shape=[2, 3], dtype=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "wt"], ["h"], name="matmul"),
        helper.make_node("Add", ["h", "noise"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return pl.load(shape_inference.infer_shapes(model))


def test_random_outputs_are_neither_load_time_nor_free_to_move() -> None:
    model = _random_graph()
    graph = model.graph
    fixed = {v.name for v in load_time_values(graph)}
    assert fixed == {"wt"}  # the transposed weight, not the random draw
    assert {v.name for v in independent_values(graph)} == {"wt", "noise"}
    assert [v.name for v in activation_values(graph)] == ["h", "y"]
    # the random draw is made on device 0 and read on device 1: it is transferred and counted
    model.set_device("add", 1)
    planned = _planner_bytes(model, 3)
    pl.inject_cross_device_copies(model, output_device=1)
    assert planned == _runtime_bytes(model) == _report_bytes(model) == 2 * 6 * 4


def test_copy_origin_follows_chains() -> None:
    model = _random_graph()
    model.set_device("matmul", 1)
    model.set_device("add", 2)
    pl.inject_cross_device_copies(model, output_device=2)
    graph = model.graph
    for node in graph:
        if node.metadata_props.get("placement.copy"):
            assert copy_origin(node.outputs[0]).producer() is None or not copy_origin(
                node.outputs[0]
            ).producer().metadata_props.get("placement.copy")
    assert copy_origin(model.value("x")).name == "x"
    assert isinstance(copy_origin(graph.outputs[0]), ir.Value)
