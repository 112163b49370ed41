"""Tests for ``placement.passes.activations``: which blobs are activations."""

from __future__ import annotations

import placement as pl
from placement.passes.activations import activation_values, describe_non_activation
from tests.passes.helpers import GraphBuilder, chain


def test_chain_activations_in_producer_order() -> None:
    model = chain(6)
    assert pl.get_activation_blobs(model) == [f"h{i}" for i in range(6)]


def test_excludes_params_constants_dead_outputs_and_inputs() -> None:
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    const = b.op("Neg", [w], "neg_w")  # data independent
    const2 = b.op("Tanh", [const], "tanh_w")  # still data independent
    a = b.op("Add", [x, const2], "add")
    b.op("Relu", [a], "dead")  # consumed by nobody, not an output
    y = b.op("Mul", [a, w], "mul")
    b.output(y)
    model = b.build()
    assert pl.get_activation_blobs(model) == ["add", "mul"]


def test_graph_output_counts_even_if_unconsumed_and_multi_output_ops() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 3))
    s0, s1, s2 = b.op(
        "Split",
        [x],
        "split",
        outputs=["s0", "s1", "s2"],
        shapes=[(2, 3), (1, 3), (1, 3)],
        attributes={"axis": 0, "num_outputs": 3},
    )
    y = b.op("Relu", [s0], "relu")
    b.output(y, s2)  # s1 is dead
    model = b.build()
    assert pl.get_activation_blobs(model) == ["s0", "s2", "relu"]


def test_copy_outputs_excluded_but_dependence_flows_through() -> None:
    model = chain(4, devices=[0, 0, 1, 1])
    pl.inject_cross_device_copies(model)
    acts = pl.get_activation_blobs(model)
    assert acts == ["h0", "h1", "h2", "h3"]
    assert "h1_cuda_1" in model.blobs and "h1_cuda_1" not in acts


def test_no_duplicates_and_graph_input_initializer_is_not_an_input() -> None:
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    b.inputs.append(w)  # an overridable initializer: still a parameter
    y = b.op("Add", [w, w], "ww")
    z = b.op("Add", [x, y], "xz")
    b.output(z, z)
    model = b.build()
    assert pl.get_activation_blobs(model) == ["xz"]


def test_activation_values_matches_names_and_describe() -> None:
    model = chain(3)
    values = activation_values(model.graph)
    assert [v.name for v in values] == pl.get_activation_blobs(model)
    assert "parameter" in describe_non_activation(model.graph, model.value("w0"))
    assert "graph input" in describe_non_activation(model.graph, model.value("x"))


def test_real_model_activations(exported) -> None:
    model, _, _ = exported("mlp")
    acts = pl.get_activation_blobs(model)
    assert len(acts) == len(set(acts)) == 5
    assert acts[-1] == model.outputs[0]
    assert not set(acts) & set(model.parameters)
