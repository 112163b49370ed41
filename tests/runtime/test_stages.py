"""Tests for ``placement.runtime.stages``: golden cuts, invariants on random DAGs, zoo models."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement as pl
from placement.graph.saving import to_proto
from placement.runtime.stages import partition, split_stages, stage_graph
from tests.graph.builders import mlp_graph

FLOAT = ir.DataType.FLOAT


def _devices(stages):
    return [(str(s.device), list(s.ops)) for s in stages]


def test_single_device_is_one_stage():
    model = mlp_graph(3)
    stages = partition(model)
    assert len(stages) == 1
    (stage,) = stages
    assert stage.inputs == ("x",)
    assert stage.outputs == ("relu2_out",)
    assert set(stage.parameters) == {"fc0.weight", "fc1.weight", "fc2.weight"}
    onnx.checker.check_model(stage.to_proto(), full_check=True)


def test_sandwich_gives_three_stages():
    model = mlp_graph(3)
    model.set_device("fc1", 1)
    model.set_device("relu1", 1)
    stages = partition(model)
    assert _devices(stages) == [
        ("cuda:0", ["fc0", "relu0"]),
        ("cuda:1", ["fc1", "relu1"]),
        ("cuda:0", ["fc2", "relu2"]),
    ]
    assert [s.depends_on for s in stages] == [(), (0,), (1,)]
    assert stages[1].inputs == ("relu0_out",) and stages[1].outputs == ("relu1_out",)
    assert stages[1].parameters == ("fc1.weight",)
    assert sorted(stage_graph(stages).edges) == [(0, 1), (1, 2)]


def test_greedy_cut_of_an_interleaved_graph():
    # a(0) -> b(1) -> c(0): c cannot join a's stage (a -> b -> c would be a cycle); side and late
    # have no such path and join the current cuda:0 stage; b2(1) reads c so it cannot join b's.
    model = _branchy()
    stages = partition(model)
    assert _devices(stages) == [
        ("cuda:0", ["a"]),
        ("cuda:1", ["b"]),
        ("cuda:0", ["c", "side", "late"]),
        ("cuda:1", ["b2"]),
        ("cuda:0", ["late2"]),
    ]
    assert [s.depends_on for s in stages] == [(), (0,), (0, 1), (2,), (2, 3)]
    assert stages[2].outputs == ("c_out", "side_out", "late_out")
    _check_invariants(model, stages)


def test_copies_become_transfers_and_static_copies_parameters():
    model = mlp_graph(2)
    model.set_device("relu0", 1)
    model.set_device("fc1", 1)
    model.set_device("relu1", 1)
    # a hand-made static copy of fc1.weight to cuda:1 and a dynamic copy of fc0_out
    graph = model.graph
    w = graph.initializers["fc1.weight"]
    fc0_out = model.value("fc0_out")
    wcopy = ir.Node("", "Identity", [w], name="copy_w", num_outputs=1)
    wcopy.outputs[0].name = "fc1.weight_cuda_1"
    wcopy.metadata_props.update({"placement.device": "cuda:1", "placement.copy": "static"})
    acopy = ir.Node("", "Identity", [fc0_out], name="copy_a", num_outputs=1)
    acopy.outputs[0].name = "fc0_out_cuda_1"
    acopy.metadata_props.update({"placement.device": "cuda:1", "placement.copy": "dynamic"})
    graph.insert_before(model.op("relu0").node, [wcopy, acopy])
    model.op("relu0").node.replace_input_with(0, acopy.outputs[0])
    model.op("fc1").node.replace_input_with(1, wcopy.outputs[0])
    p = split_stages(model)
    assert [t.target for t in p.transfers] == ["fc0_out_cuda_1"]
    assert p.static_copies == {"fc1.weight_cuda_1": "fc1.weight"}
    assert _devices(p.stages) == [("cuda:0", ["fc0"]), ("cuda:1", ["relu0", "fc1", "relu1"])]
    assert p.stages[1].inputs == ("fc0_out_cuda_1",)
    assert p.stages[1].parameters == ("fc1.weight_cuda_1",)
    stage_init = p.stages[1].model.graph.initializers["fc1.weight_cuda_1"]
    np.testing.assert_array_equal(stage_init.const_value.numpy(), w.const_value.numpy())
    for stage in p.stages:
        onnx.checker.check_model(stage.to_proto(), full_check=True)


def test_load_time_values_are_rematerialised_not_transferred():
    # w (parameter) -> transpose (cuda:0) -> matmul(x, w^T) (cuda:1): the transposed weight is the
    # same on every run, so cuda:1's stage computes it at load time instead of receiving it.
    x = ir.Value(name="x", type=ir.TensorType(FLOAT), shape=ir.Shape([2, 3]))
    w = ir.Value(
        name="w",
        type=ir.TensorType(FLOAT),
        shape=ir.Shape([4, 3]),
        const_value=ir.tensor(np.arange(12, dtype=np.float32).reshape(4, 3), name="w"),
    )
    transpose = ir.Node("", "Transpose", [w], [ir.AttrInt64s("perm", [1, 0])], name="t", num_outputs=1)
    transpose.outputs[0].name = "wT"
    relu = ir.Node("", "Relu", [x], name="relu", num_outputs=1)
    relu.outputs[0].name = "r"
    matmul = ir.Node("", "MatMul", [relu.outputs[0], transpose.outputs[0]], name="mm", num_outputs=1)
    matmul.outputs[0].name = "y"
    for node, device in ((transpose, "cuda:0"), (relu, "cuda:0"), (matmul, "cuda:1")):
        node.metadata_props["placement.device"] = device
    graph = ir.Graph(
        [x], matmul.outputs, nodes=[transpose, relu, matmul], initializers=[w], opset_imports={"": 20}
    )
    model = pl.Model(ir.Model(graph, ir_version=10))
    pl.inject_cross_device_copies(model)
    p = split_stages(model)
    assert [t.target for t in p.transfers] == ["r_cuda_1"]  # wT_cuda_1 is not moved per run
    first, second = p.stages
    assert first.ops == ("t", "relu") and first.outputs == ("r",)
    assert second.ops == ("mm",) and second.inputs == ("r_cuda_1",)
    assert set(second.load_time_ops) == {"t", "copy_wT_cuda_1"} and second.parameters == ("w",)
    session = ort.InferenceSession(second.to_proto().SerializeToString(), providers=["CPUExecutionProvider"])
    r = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(session.run(None, {"r_cuda_1": r})[0], r @ w.const_value.numpy().T)


def test_a_parameter_only_value_that_is_also_a_graph_output_is_produced_not_rematerialised():
    # p -> square (cuda:1) -> graph output (copied to cpu) and -> neg (cuda:2): since the value
    # is a graph output its stage produces it, so what reads it on cuda:2 receives a transfer.
    from tests.passes.helpers import GraphBuilder, run_ort, run_placed

    b = GraphBuilder()
    x = b.input("x")
    p = b.param("p")
    sq = b.op("Mul", [p, p], "square", device=1)
    neg = b.op("Neg", [sq], "neg", device=2)
    y = b.op("Add", [neg, x], "add", device="cpu")
    b.output(y, sq)
    model = b.build()
    pl.inject_cross_device_copies(model, output_device="cpu")
    p_ = split_stages(model)
    assert {t.target for t in p_.transfers} >= {"square_cuda_2"}
    assert [s.ops for s in p_.stages] == [("square",), ("neg",), ("add",)]
    feeds = {"x": np.ones((2, 3), np.float32)}
    for got, want in zip(run_placed(model, feeds), run_ort(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_fingerprint_tracks_device_ops_and_boundaries():
    model = mlp_graph(3)
    model.set_device("fc2", 1)
    model.set_device("relu2", 1)
    before = [s.fingerprint for s in partition(model)]
    assert before == [s.fingerprint for s in partition(model)]  # deterministic
    model.set_device("relu2", 2)
    after = [s.fingerprint for s in partition(model)]
    assert after[0] == before[0]  # untouched stage: same fingerprint
    assert after[1] != before[1]
    assert len(after) == 3


def test_partition_does_not_modify_the_model():
    model = mlp_graph(3)
    model.set_device("fc1", 1)
    proto = to_proto(model).SerializeToString()
    partition(model)
    assert to_proto(model).SerializeToString() == proto


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_zoo_halves_give_two_stages(exported, name):
    model, _, _ = exported(name)
    ops = model.ops
    for op in ops[len(ops) // 2 :]:
        model.set_device(op.name, 1)
    stages = partition(model)
    assert [str(s.device) for s in stages] == ["cuda:0", "cuda:1"]
    assert sum(len(s.ops) for s in stages) == len(ops)
    for stage in stages:
        onnx.checker.check_model(stage.to_proto())


# --- random DAGs --------------------------------------------------------------------------


def _random_dag(n_ops: int, seed: int, n_devices: int) -> pl.Model:
    """A random DAG of Add/Mul/Relu/Neg over x and two parameters, random devices."""
    rng = np.random.default_rng(seed)
    x = ir.Value(name="x", type=ir.TensorType(FLOAT), shape=ir.Shape([3]))
    params = []
    for i in range(2):
        params.append(
            ir.Value(
                name=f"p{i}",
                type=ir.TensorType(FLOAT),
                shape=ir.Shape([3]),
                const_value=ir.tensor(rng.standard_normal(3).astype(np.float32), name=f"p{i}"),
            )
        )
    values = [x]
    nodes = []
    consumed: set[str] = set()
    for i in range(n_ops):
        kind = rng.choice(["Add", "Mul", "Relu", "Neg"])
        if kind in ("Add", "Mul"):
            pool = values + params
            a, b = (pool[int(j)] for j in rng.choice(len(pool), size=2))
            inputs = [a, b]
        else:
            inputs = [values[int(rng.integers(len(values)))]]
        node = ir.Node("", str(kind), inputs, name=f"op{i}", num_outputs=1)
        out = node.outputs[0]
        out.name, out.type, out.shape = f"v{i}", ir.TensorType(FLOAT), ir.Shape([3])
        node.metadata_props["placement.device"] = f"cuda:{int(rng.integers(n_devices))}"
        consumed.update(v.name for v in inputs)
        nodes.append(node)
        values.append(out)
    outputs = [v for v in values[1:] if v.name not in consumed] or [values[-1]]
    graph = ir.Graph([x], outputs, nodes=nodes, initializers=params, opset_imports={"": 20})
    return pl.Model(ir.Model(graph, ir_version=10))


def _check_invariants(model: pl.Model, stages) -> None:
    # every non-copy op in exactly one stage, stages on one device each, graph order inside
    ops = [op for op in model.ops if not op.is_copy]
    flat = [name for s in stages for name in s.ops]
    assert sorted(flat) == sorted(op.name for op in ops)
    position = {op.name: i for i, op in enumerate(model.ops)}
    for s in stages:
        assert all(model.op(name).device == s.device for name in s.ops)
        assert [position[n] for n in s.ops] == sorted(position[n] for n in s.ops)
    # the stage graph is acyclic and the stage order is topological
    g = stage_graph(stages)
    assert nx.is_directed_acyclic_graph(g)
    assert all(a < b for a, b in g.edges)
    # pairwise maximal: merging any two stages of one device would close a cycle
    for a, b in itertools.combinations(stages, 2):
        if a.device == b.device:
            merged = nx.contracted_nodes(g, a.index, b.index, self_loops=False)
            assert not nx.is_directed_acyclic_graph(merged), (a, b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_ops=st.integers(1, 25), seed=st.integers(0, 10_000), n_devices=st.integers(1, 4))
def test_random_dag_invariants(n_ops, seed, n_devices):
    model = _random_dag(n_ops, seed, n_devices)
    stages = partition(model)
    _check_invariants(model, stages)
    for stage in stages:
        onnx.checker.check_model(stage.to_proto())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_ops=st.integers(1, 12), seed=st.integers(0, 10_000), n_devices=st.integers(2, 4))
def test_random_dag_stages_compose_to_the_model(n_ops, seed, n_devices):
    model = _random_dag(n_ops, seed, n_devices)
    x = np.random.default_rng(seed).standard_normal(3).astype(np.float32)
    whole = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    expected = whole.run(None, {"x": x})
    values = {"x": x}
    for stage in partition(model):
        if not stage.outputs:  # only load-time ops: nothing to run
            continue
        session = ort.InferenceSession(
            stage.to_proto().SerializeToString(), providers=["CPUExecutionProvider"]
        )
        outs = session.run(list(stage.outputs), {n: values[n] for n in stage.inputs})
        values.update(zip(stage.outputs, outs))
    for name, want in zip(model.outputs, expected):
        np.testing.assert_allclose(values[name], want, rtol=1e-6)


def _branchy() -> pl.Model:
    """a(0) -> b(1) -> c(0); side(0) reads x; late(0) reads a; b2(1) reads c; late2(0) reads b2."""
    x = ir.Value(name="x", type=ir.TensorType(FLOAT), shape=ir.Shape([3]))

    def op(name, kind, inputs, device):
        node = ir.Node("", kind, inputs, name=name, num_outputs=1)
        out = node.outputs[0]
        out.name, out.type, out.shape = f"{name}_out", ir.TensorType(FLOAT), ir.Shape([3])
        node.metadata_props["placement.device"] = device
        return node

    a = op("a", "Relu", [x], "cuda:0")
    b = op("b", "Neg", a.outputs, "cuda:1")
    c = op("c", "Add", [b.outputs[0], a.outputs[0]], "cuda:0")
    side = op("side", "Neg", [x], "cuda:0")
    late = op("late", "Relu", a.outputs, "cuda:0")
    b2 = op("b2", "Neg", c.outputs, "cuda:1")
    late2 = op("late2", "Add", [b2.outputs[0], late.outputs[0]], "cuda:0")
    nodes = [a, b, c, side, late, b2, late2]
    graph = ir.Graph([x], [side.outputs[0], late2.outputs[0]], nodes=nodes, opset_imports={"": 20})
    return pl.Model(ir.Model(graph, ir_version=10))
