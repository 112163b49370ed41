"""Stage sessions build for any graph one ONNX Runtime session can run.

Weights reach stage sessions through ``add_external_initializers``; ONNX Runtime
drops initializers nothing reads *before* it takes those, so a weight handed over
for a graph that does not read it failed the session. These tests build graphs
the way other exporters write them (``onnx.helper``: weights made by ``Constant``
ops, dead weights, weights shared by several ops, weights inside ``If`` / ``Loop``
bodies), place them at random and compare :func:`placement.run` with one plain
ONNX Runtime session of the unplaced file.
"""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

import placement as pl
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort.sessions import stage_session
from placement.runtime.stages import partition
from tests.passes.helpers import assert_same_outputs, run_placed

BATCH = 2
#: ``PLACEMENT_PROPERTY_EXAMPLES=500`` runs a deeper search locally.
EXAMPLES = int(os.environ.get("PLACEMENT_PROPERTY_EXAMPLES", "12"))


def plain_ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The unplaced file in one plain ONNX Runtime session."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def constant_chain(n: int) -> onnx.ModelProto:
    """``x @ w0 @ w1 @ w2`` with each ``n x n`` weight made by a ``Constant`` op (as Paddle exports)."""
    rng = np.random.default_rng(0)
    nodes = [
        oh.make_node(
            "Constant", [], [f"w{i}"], value=numpy_helper.from_array(rng.standard_normal((n, n), np.float32))
        )
        for i in range(3)
    ]
    prev = "x"
    for i in range(3):
        nodes.append(oh.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        prev = f"h{i}"
    graph = oh.make_graph(
        nodes,
        "chain",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, n])],
        [oh.make_tensor_value_info("h2", TensorProto.FLOAT, [BATCH, n])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("n", [4, 64])
def test_constant_weights_with_the_last_matmul_on_another_device(n: int) -> None:
    # The stage of cuda:0 holds the Constant of w2, which only cuda:1's stage reads (through a
    # load-time clone): 64x64 weights are handed to ONNX Runtime outside the protobuf, and a
    # weight the stage does not read made ONNX Runtime refuse the session.
    proto = constant_chain(n)
    model = pl.load(proto)
    model.set_device("mm2", 1)
    feeds = {"x": np.random.default_rng(1).standard_normal((BATCH, n)).astype(np.float32)}
    stages = partition(model)
    assert [str(s.device) for s in stages] == ["cuda:0", "cuda:1"]
    first = stages[0]
    assert "w2" not in first.model.graph.initializers  # the stage does not carry what it never reads
    assert all(node.op_type != "Constant" or node.outputs[0].uses() for node in first.model.graph)
    stage_session(first, PhysicalDevice("cpu"))
    assert_same_outputs(run_placed(model, feeds), plain_ort(proto, feeds))


def test_a_stage_carrying_a_weight_only_another_stage_reads_drops_it() -> None:
    # w (64x64 initializer) -> Transpose on cuda:0, read by a MatMul on cuda:1: cuda:0's stage
    # keeps no dead Transpose and so no copy of w.
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64), np.float32), "w")
    nodes = [
        oh.make_node("Transpose", ["w"], ["wT"], name="t"),
        oh.make_node("Relu", ["x"], ["r"], name="relu"),
        oh.make_node("MatMul", ["r", "wT"], ["y"], name="mm"),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, 64])],
        initializer=[w],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)
    model = pl.load(proto)
    model.set_device("mm", 1)
    first, second = partition(model)
    assert first.ops == ("t", "relu") and first.parameters == ()
    assert [n.op_type for n in first.model.graph] == ["Relu"] and not first.model.graph.initializers
    assert second.parameters == ("w",)
    feeds = {"x": rng.standard_normal((BATCH, 64)).astype(np.float32)}
    assert_same_outputs(run_placed(model, feeds), plain_ort(proto, feeds))


class _Wild:
    """A random graph in the style of files from other exporters (see :func:`wild_graph`)."""

    def __init__(self, rng: random.Random, d: int) -> None:
        self.rng = rng
        self.np_rng = np.random.default_rng(rng.randrange(2**31))
        self.d = d
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.matrices: list[str] = []  # main-graph weights a MatMul may read (shared by several ops)
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        return (self.np_rng.standard_normal(shape) / np.sqrt(self.d)).astype(np.float32)

    def weight(self, shape: tuple[int, ...], *, into: list[onnx.NodeProto] | None = None) -> str:
        """A new weight: an initializer or a ``Constant`` op (in ``into``, default the main graph)."""
        name = self.name("w")
        data = numpy_helper.from_array(self.array(shape), name)
        if into is None and self.rng.random() < 0.5:
            self.initializers.append(data)
        else:
            node = oh.make_node("Constant", [], [name], value=data, name=self.name("const"))
            (self.nodes if into is None else into).append(node)
        return name

    def matrix(self) -> str:
        """A ``d x d`` weight: a new one, a shared one, or a transposed one (a load-time value)."""
        roll = self.rng.random()
        if self.matrices and roll < 0.35:
            return self.rng.choice(self.matrices)
        name = self.weight((self.d, self.d))
        self.matrices.append(name)
        if roll > 0.8:
            out = self.name("wt")
            self.nodes.append(oh.make_node("Transpose", [name], [out], name=self.name("transpose")))
            return out
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name("h")
        self.nodes.append(oh.make_node(op_type, inputs, [out], name=self.name(op_type.lower()), **attrs))
        return out

    def if_op(self, h: str) -> str:
        """``If(sum(h) > 0)``: one branch multiplies by a weight of its own (or a main-graph one)."""
        cond = self.op("Greater", [self.op("ReduceSum", [h], keepdims=0), self.weight(())])
        then_nodes: list[onnx.NodeProto] = []
        then_inits: list[onnx.TensorProto] = []
        if self.rng.random() < 0.5:
            inner = self.name("wif")
            then_inits.append(numpy_helper.from_array(self.array((self.d, self.d)), inner))
        elif self.rng.random() < 0.5:
            inner = self.weight((self.d, self.d), into=then_nodes)
        else:
            inner = self.matrix()
        then_out, else_out = self.name("then"), self.name("else")
        then_nodes.append(oh.make_node("MatMul", [h, inner], [then_out]))
        else_bias = self.weight((self.d,))
        info = [oh.make_tensor_value_info(then_out, TensorProto.FLOAT, [BATCH, self.d])]
        then_graph = oh.make_graph(then_nodes, self.name("then_graph"), [], info, initializer=then_inits)
        else_graph = oh.make_graph(
            [oh.make_node("Add", [h, else_bias], [else_out])],
            self.name("else_graph"),
            [],
            [oh.make_tensor_value_info(else_out, TensorProto.FLOAT, [BATCH, self.d])],
        )
        out = self.name("h")
        self.nodes.append(
            oh.make_node(
                "If", [cond], [out], name=self.name("if"), then_branch=then_graph, else_branch=else_graph
            )
        )
        return out

    def loop_op(self, h: str) -> str:
        """Two iterations of ``h = tanh(h @ w)`` with ``w`` a body initializer or an outer weight."""
        trips = self.name("trips")
        self.initializers.append(numpy_helper.from_array(np.array(2, np.int64), trips))
        inner_inits: list[onnx.TensorProto] = []
        if self.rng.random() < 0.5:
            w = self.name("wloop")
            inner_inits.append(numpy_helper.from_array(self.array((self.d, self.d)), w))
        else:
            w = self.matrix()
        i, cond_in, carried = self.name("i"), self.name("c"), self.name("carried")
        cond_out, mm, new = self.name("cout"), self.name("mm"), self.name("new")
        body = oh.make_graph(
            [
                oh.make_node("Identity", [cond_in], [cond_out]),
                oh.make_node("MatMul", [carried, w], [mm]),
                oh.make_node("Tanh", [mm], [new]),
            ],
            self.name("body"),
            [
                oh.make_tensor_value_info(i, TensorProto.INT64, []),
                oh.make_tensor_value_info(cond_in, TensorProto.BOOL, []),
                oh.make_tensor_value_info(carried, TensorProto.FLOAT, [BATCH, self.d]),
            ],
            [
                oh.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                oh.make_tensor_value_info(new, TensorProto.FLOAT, [BATCH, self.d]),
            ],
            initializer=inner_inits,
        )
        out = self.name("h")
        self.nodes.append(oh.make_node("Loop", [trips, "", h], [out], name=self.name("loop"), body=body))
        return out


def wild_graph(seed: int) -> onnx.ModelProto:
    """A random ``onnx.helper`` model over ``x: [2, d]`` (``d`` 4 or 32, so weights are small
    or large): MatMuls with new, shared, ``Constant``-made or transposed weights, biases,
    elementwise ops, joins of earlier values, ``If`` and ``Loop`` ops with weights of
    their own or from the main graph, and unread initializers and ``Constant`` ops. Some
    write the batch of the graph's inputs and outputs as ``-1``."""
    rng = random.Random(seed)
    g = _Wild(rng, rng.choice([4, 32]))
    values = ["x"]
    for _ in range(rng.randint(2, 9)):
        h = rng.choice(values[-3:])
        kind = rng.choice(["matmul", "matmul", "bias", "unary", "join", "if", "loop"])
        if kind == "matmul":
            h = g.op("MatMul", [h, g.matrix()])
        elif kind == "bias":
            h = g.op("Add", [h, g.weight((g.d,))])
        elif kind == "unary":
            h = g.op(rng.choice(["Tanh", "Relu", "Neg"]), [h])
        elif kind == "join":
            h = g.op("Add", [h, rng.choice(values)])
        elif kind == "if":
            h = g.if_op(h)
        else:
            h = g.loop_op(h)
        values.append(h)
    for _ in range(rng.randint(0, 2)):  # weights nothing reads, large or small
        shape = rng.choice([(g.d, g.d), (32, 32), (g.d,)])
        name = g.name("unused")
        if rng.random() < 0.5:
            g.initializers.append(numpy_helper.from_array(g.array(shape), name))
        else:
            g.nodes.append(
                oh.make_node("Constant", [], [name], value=numpy_helper.from_array(g.array(shape), name))
            )
    outputs = list(dict.fromkeys([values[-1], *rng.sample(values[1:], k=min(len(values) - 1, 1))]))
    batch = -1 if rng.random() < 0.3 else BATCH  # "any batch" as some exporters write it (off the spec)
    graph = oh.make_graph(
        g.nodes,
        "wild",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [batch, g.d])],
        [oh.make_tensor_value_info(name, TensorProto.FLOAT, [batch, g.d]) for name in outputs],
        initializer=g.initializers,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    placement_seed=st.integers(0, 2**32 - 1),
    devices=st.sampled_from([2, 3]),
    inject=st.booleans(),
)
def test_random_wild_graphs_placed_at_random_match_one_session(
    seed: int, placement_seed: int, devices: int, inject: bool
) -> None:
    proto = wild_graph(seed)
    onnx.checker.check_model(proto)
    shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(seed % 1000).standard_normal([BATCH if d < 0 else d for d in shape])
    feeds = {"x": x.astype(np.float32)}
    expected = plain_ort(proto, feeds)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "model 'wild' is off the ONNX spec", UserWarning)
        model = pl.load(proto)
    rng = random.Random(placement_seed)
    for op in model.ops:
        model.set_device(op.name, rng.randrange(devices))
    if inject:
        pl.inject_cross_device_copies(model)
    assert_same_outputs(run_placed(model, feeds), expected)
