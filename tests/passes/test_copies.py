"""Tests for ``placement.passes.copies``: exact rewrites on tiny golden graphs, repair, idempotence."""

from __future__ import annotations

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import placement as pl
from placement.graph.nodes import COPY_KEY, DEVICE_KEY
from placement.passes import InjectCrossDeviceCopiesPass
from tests.conftest import MODEL_NAMES
from tests.passes.helpers import (
    GraphBuilder,
    assert_same_outputs,
    chain,
    check_copies,
    copy_ops,
    feeds_for,
    run_ort,
    snapshot,
)


def inject_twice(model: pl.Model, **kwargs) -> pl.passes.CopyResult:
    """Inject, check every invariant, and check that a second run changes nothing."""
    result = pl.inject_cross_device_copies(model, **kwargs)
    check_copies(model)
    before = snapshot(model)
    again = pl.inject_cross_device_copies(model, **kwargs)
    assert not again.modified, f"second injection changed the model: {again}"
    assert snapshot(model) == before
    return result


def op_order(model: pl.Model) -> list[str]:
    return [op.name for op in model.ops]


def reads(model: pl.Model, op_name: str) -> tuple[str, ...]:
    return model.op(op_name).inputs


def fanout_model() -> pl.Model:
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0)
    p = b.op("Neg", [a], "p", device=1)
    q = b.op("Relu", [a], "q", device=1)
    r = b.op("Sigmoid", [a], "r", device=2)
    s = b.op("Abs", [a], "s", device=0)
    y = b.op("Sum", [p, q, r, s], "y", device=0)
    b.output(y)
    return b.build()


def test_blob_read_on_several_devices_gets_one_copy_per_device() -> None:
    model = fanout_model()
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    result = inject_twice(model)
    assert copy_ops(model) == [
        ("a", "a_cuda_1", "cuda:1", "dynamic"),
        ("a", "a_cuda_2", "cuda:2", "dynamic"),
        ("p", "p_cuda_0", "cuda:0", "dynamic"),
        ("q", "q_cuda_0", "cuda:0", "dynamic"),
        ("r", "r_cuda_0", "cuda:0", "dynamic"),
    ]
    assert reads(model, "p") == reads(model, "q") == ("a_cuda_1",)
    assert reads(model, "r") == ("a_cuda_2",) and reads(model, "s") == ("a",)
    assert reads(model, "y") == ("p_cuda_0", "q_cuda_0", "r_cuda_0", "s")
    # each copy sits just before its first reader
    assert op_order(model) == [
        "a",
        "copy_a_cuda_1",
        "p",
        "q",
        "copy_a_cuda_2",
        "r",
        "s",
        "copy_p_cuda_0",
        "copy_q_cuda_0",
        "copy_r_cuda_0",
        "y",
    ]
    assert (result.added, result.copies, result.removed) == (5, 5, 0)
    assert_same_outputs(run_ort(model, feeds), expected)


def test_parameter_read_on_another_device_gets_a_static_copy() -> None:
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    a = b.op("Add", [x, w], "a", device=0)
    c = b.op("Mul", [a, w], "c", device=1)
    d = b.op("Sub", [c, w], "d", device=1)
    b.output(d)
    model = b.build()
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    inject_twice(model)
    assert copy_ops(model) == [("a", "a_cuda_1", "cuda:1", "dynamic"), ("w", "w_cuda_1", "cuda:1", "static")]
    assert reads(model, "c") == ("a_cuda_1", "w_cuda_1") and reads(model, "d") == ("c", "w_cuda_1")
    assert model.op("copy_w_cuda_1").is_static_copy and not model.op("copy_a_cuda_1").is_static_copy
    assert model.parameters["w"].device == pl.Device("cuda", 0)  # home: its first reader
    assert_same_outputs(run_ort(model, feeds), expected)


def test_parameter_home_is_its_first_reader() -> None:
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    a = b.op("Tanh", [x], "a", device=0)
    c = b.op("Mul", [a, w], "c", device=1)  # first reader of w: w lives on cuda:1
    d = b.op("Sub", [c, w], "d", device=0)
    b.output(d)
    model = b.build()
    inject_twice(model)
    assert ("w", "w_cuda_0", "cuda:0", "static") in copy_ops(model)
    assert reads(model, "c") == ("a_cuda_1", "w")


def test_graph_input_and_output_on_other_devices() -> None:
    model = chain(4, devices=[1, 1, 1, 1])
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    result = inject_twice(model, input_device="cpu", output_device=0)
    assert model.inputs == ["x"] and model.outputs == ["h3"]
    assert copy_ops(model) == [
        ("x", "x_cuda_1", "cuda:1", "dynamic"),
        ("h3_cuda_1", "h3", "cuda:0", "dynamic"),
    ]
    assert model.op("op3").outputs == ("h3_cuda_1",)
    assert reads(model, "op0") == ("x_cuda_1", "w0")
    assert str(model.input_device) == "cpu" and str(model.output_device) == "cuda:0"
    assert (result.input_device, result.output_device) == (pl.Device("cpu"), pl.Device("cuda", 0))
    assert op_order(model)[-1] == "copy_h3_cuda_0"  # an output-only copy goes last
    assert_same_outputs(run_ort(model, feeds), expected)


def test_default_io_devices_are_first_reader_and_last_producer() -> None:
    model = chain(4, devices=[2, 2, 1, 1])
    result = inject_twice(model)
    assert (str(result.input_device), str(result.output_device)) == ("cuda:2", "cuda:1")
    assert copy_ops(model) == [("h1", "h1_cuda_1", "cuda:1", "dynamic")]


def test_output_also_read_inside_on_several_devices() -> None:
    b = GraphBuilder()
    x = b.input("x")
    y = b.op("Tanh", [x], "y", device=1)
    z0 = b.op("Neg", [y], "z0", device=0)
    z1 = b.op("Relu", [y], "z1", device=1)
    z2 = b.op("Abs", [y], "z2", device=2)
    b.output(y, z0, z1, z2)
    model = b.build()
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    inject_twice(model, input_device=1, output_device=0)
    assert model.outputs == ["y", "z0", "z1", "z2"]
    assert model.op("y").outputs == ("y_cuda_1",)
    # the copy to the output device is shared with the reader there
    assert reads(model, "z0") == ("y",) and reads(model, "z1") == ("y_cuda_1",)
    assert reads(model, "z2") == ("y_cuda_2",)
    assert sorted(copy_ops(model)) == [
        ("y_cuda_1", "y", "cuda:0", "dynamic"),
        ("y_cuda_1", "y_cuda_2", "cuda:2", "dynamic"),
        ("z1_cuda_1", "z1", "cuda:0", "dynamic"),
        ("z2_cuda_2", "z2", "cuda:0", "dynamic"),
    ]
    assert_same_outputs(run_ort(model, feeds), expected)


def test_copy_names_are_made_unique() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0)
    taken = b.op("Neg", [a], "a_cuda_1", device=0)  # a blob already called a_cuda_1
    c = b.op("Add", [a, taken], "c", device=1)
    b.output(c)
    model = b.build()
    inject_twice(model)
    assert [(s, d) for s, d, _, _ in copy_ops(model)] == [
        ("a", "a_cuda_1_1"),
        ("a_cuda_1", "a_cuda_1_cuda_1"),
    ]
    assert len(set(model.blobs)) == len(model.blobs)
    assert len({op.name for op in model.ops}) == len(model.ops)


def test_same_device_model_gets_no_copies_but_records_io_devices() -> None:
    model = chain(3)
    result = pl.inject_cross_device_copies(model)
    assert result.modified and result.copies == 0 and copy_ops(model) == []
    assert str(model.input_device) == str(model.output_device) == "cuda:0"
    assert not pl.inject_cross_device_copies(model).modified


# --- repair: copies from earlier injections after ops moved ------------------------------


def test_repair_after_moving_ops() -> None:
    model = chain(6, devices=[0, 0, 0, 1, 1, 1])
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    inject_twice(model, output_device=0)
    assert [c[1] for c in copy_ops(model)] == ["h2_cuda_1", "h5"]
    # move the boundary: op3 back to cuda:0, op5 to cuda:2
    model.set_device("op3", 0)
    model.set_device("op5", 2)
    result = inject_twice(model, output_device=0)
    assert copy_ops(model) == [
        ("h3", "h3_cuda_1", "cuda:1", "dynamic"),
        ("h4", "h4_cuda_2", "cuda:2", "dynamic"),
        ("h5_cuda_2", "h5", "cuda:0", "dynamic"),
    ]
    assert model.op("op5").outputs == ("h5_cuda_2",)  # renamed after the device it lives on
    assert result.removed == 1 and result.added == 2
    assert_same_outputs(run_ort(model, feeds), expected)


def test_repair_output_produced_on_output_device_again() -> None:
    model = chain(4, devices=[0, 0, 1, 1])
    inject_twice(model, output_device=0)
    assert model.op("op3").outputs == ("h3_cuda_1",)
    for name in ("op2", "op3"):
        model.set_device(name, 0)
    inject_twice(model, output_device=0)
    assert copy_ops(model) == []
    assert model.op("op3").outputs == ("h3",) and model.outputs == ["h3"]


def test_repair_changed_output_device_keeps_needed_copy() -> None:
    b = GraphBuilder()
    x = b.input("x")
    y = b.op("Tanh", [x], "y", device=1)
    z = b.op("Neg", [y], "z", device=0)
    b.output(y, z)
    model = b.build()
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    inject_twice(model, output_device=0)
    assert sorted(copy_ops(model)) == [("y_cuda_1", "y", "cuda:0", "dynamic")]
    inject_twice(model, output_device=1)
    # y is gathered on cuda:1 now; the copy to cuda:0 stays for z under a copy's name
    assert model.outputs == ["y", "z"]
    assert model.op("y").outputs == ("y",) and model.op("z").outputs == ("z_cuda_0",)
    assert copy_ops(model) == [("y", "y_cuda_0", "cuda:0", "dynamic"), ("z_cuda_0", "z", "cuda:1", "dynamic")]
    assert_same_outputs(run_ort(model, feeds), expected)


def test_repair_removes_duplicates_chains_and_redundant_copies() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0)
    c1 = b.op("Identity", [a], "dup1", device=1)
    c2 = b.op("Identity", [a], "dup2", device=1)  # a second copy of a to cuda:1
    c3 = b.op("Identity", [c1], "chain", device=2)  # a copy of a copy
    c4 = b.op("Identity", [a], "same", device=0)  # a copy to its own device
    p = b.op("Add", [c1, c2], "p", device=1)
    q = b.op("Neg", [c3], "q", device=2)
    r = b.op("Abs", [c4], "r", device=0)
    y = b.op("Sum", [p, q, r], "y", device=0)
    b.output(y)
    model = b.build()
    for name in ("dup1", "dup2", "chain", "same"):
        model.op(name).node.metadata_props[COPY_KEY] = "dynamic"
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    result = inject_twice(model)
    assert [(s, d) for s, _, d, _ in copy_ops(model)] == [
        ("a", "cuda:1"),
        ("a", "cuda:2"),
        ("p", "cuda:0"),
        ("q", "cuda:0"),
    ]
    assert reads(model, "p") == ("dup1", "dup1") and reads(model, "q") == ("chain",)
    assert reads(model, "r") == ("a",)
    assert result.removed == 2
    assert_same_outputs(run_ort(model, feeds), expected)


def test_repair_moves_a_copy_before_a_reader_that_moved() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0)
    p = b.op("Neg", [a], "p", device=0)
    q = b.op("Relu", [p], "q", device=1)
    r = b.op("Abs", [a], "r", device=1)
    y = b.op("Add", [q, r], "y", device=1)
    b.output(y)
    model = b.build()
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    inject_twice(model)
    assert op_order(model) == ["a", "p", "copy_p_cuda_1", "q", "copy_a_cuda_1", "r", "y"]
    model.set_device("p", 1)  # p now reads a on cuda:1, before the existing copy of a
    result = inject_twice(model)
    assert result.moved == 1 and result.removed == 1
    assert op_order(model) == ["a", "copy_a_cuda_1", "p", "q", "r", "y"]
    assert_same_outputs(run_ort(model, feeds), expected)


def test_ops_out_of_topological_order_are_an_error() -> None:
    model = chain(4, devices=[0, 0, 1, 1])
    pl.inject_cross_device_copies(model)
    copy = model.op("copy_h1_cuda_1").node
    model.graph.remove(copy)
    model.graph.append(copy)  # now after its readers
    before = snapshot(model)
    with pytest.raises(pl.VerificationError, match="op2.*h1_cuda_1.*before it is produced"):
        pl.inject_cross_device_copies(model)
    assert snapshot(model) == before


def test_static_marks_are_fixed() -> None:
    model = chain(2, devices=[0, 1])
    inject_twice(model)
    node = model.op("copy_h0_cuda_1").node
    node.metadata_props[COPY_KEY] = "static"
    assert pl.inject_cross_device_copies(model).modified
    assert node.metadata_props[COPY_KEY] == "dynamic"


# --- validation before mutation ------------------------------------------------------------


def test_bad_device_annotation_is_an_error_and_model_unchanged() -> None:
    model = chain(3, devices=[0, 1, 0])
    model.op("op1").node.metadata_props[DEVICE_KEY] = "tpu:7"
    before = snapshot(model)
    with pytest.raises(pl.DeviceError, match="op1.*tpu:7"):
        pl.inject_cross_device_copies(model)
    assert snapshot(model) == before


def test_malformed_copy_is_an_error_and_model_unchanged() -> None:
    model = chain(3, devices=[0, 1, 0])
    model.op("op2").node.metadata_props[COPY_KEY] = "dynamic"  # an Add marked as a copy
    before = snapshot(model)
    with pytest.raises(pl.VerificationError, match="op2"):
        pl.inject_cross_device_copies(model)
    assert snapshot(model) == before


def test_bad_io_device_arguments() -> None:
    with pytest.raises(pl.DeviceError):
        pl.inject_cross_device_copies(chain(2), input_device="tpu")
    with pytest.raises(pl.DeviceError):
        InjectCrossDeviceCopiesPass(output_device=-2)


def test_graph_input_passed_through_to_output_is_left_alone() -> None:
    b = GraphBuilder()
    x = b.input("x")
    y = b.op("Tanh", [x], "y", device=1)
    b.output(x, y)
    model = b.build()
    inject_twice(model, input_device=1, output_device=1)
    assert model.outputs == ["x", "y"] and copy_ops(model) == []


def test_optional_empty_inputs_and_ir_model_argument() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0)
    y = b.op("Clip", [a, None, None], "y", device=1)
    b.output(y)
    model = b.build()
    result = InjectCrossDeviceCopiesPass()(model.ir_model)
    assert result.modified and isinstance(result.model, ir.Model)
    check_copies(model)
    assert reads(model, "y") == ("a_cuda_1", "", "")


# --- every model of the zoo ----------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_zoo_second_half_on_device_1_runs_in_one_ort_session(name: str, exported, tmp_path) -> None:
    model, net, args = exported(name)
    feeds = {value.name: arg.numpy() for value, arg in zip(model.graph.inputs, args)}
    expected = run_ort(model, feeds)
    acts = pl.get_activation_blobs(model)
    shifted = pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    assert shifted.total > 0
    inject_twice(model, output_device=0)  # outputs come back to cuda:0: exercises the renaming
    assert {str(d) for d in model.devices} == {"cuda:0", "cuda:1"}
    assert pl.summary(model).total_copies == sum(op.is_copy for op in model.ops) > 0
    path = tmp_path / f"{name}.onnx"
    model.save(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    assert_same_outputs(outputs, expected)
    with torch.no_grad():
        reference = net(*args)
    reference = reference if isinstance(reference, (tuple, list)) else (reference,)
    assert_same_outputs(outputs, [t.numpy() for t in reference])
    loaded = pl.load(path)
    check_copies(loaded)
    assert not pl.inject_cross_device_copies(loaded, output_device=0).modified


def test_blob_listed_twice_as_output_stays_listed_twice() -> None:
    b = GraphBuilder()
    x = b.input("x")
    y = b.op("Tanh", [x], "y", device=1)
    b.output(y, y)
    model = b.build()
    inject_twice(model, output_device=0)
    assert model.outputs == ["y", "y"]
    assert model.graph.outputs[0] is model.graph.outputs[1]
    assert copy_ops(model) == [("y_cuda_1", "y", "cuda:0", "dynamic")]


def test_copy_reading_a_later_blob_is_an_error() -> None:
    model = chain(4, devices=[0, 0, 1, 1])
    pl.inject_cross_device_copies(model)
    copy = model.op("copy_h1_cuda_1").node
    model.graph.remove(copy)
    model.graph.insert_before(model.op("op0").node, copy)  # before h1's producer
    before = snapshot(model)
    with pytest.raises(pl.VerificationError, match="copy_h1_cuda_1.*h1"):
        pl.inject_cross_device_copies(model)
    assert snapshot(model) == before


def test_copies_for_one_reader_go_before_it_in_first_use_order() -> None:
    # copies are inserted in one call per first reader: the order must be what inserting
    # them one by one gives (input order of the first reader), each just before it
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0)
    c = b.op("Neg", [x], "c", device=0)
    d = b.op("Abs", [x], "d", device=0)
    y = b.op("Sum", [d, a, c], "y", device=1)
    z = b.op("Sum", [c, y], "z", device=2)
    b.output(z)
    model = b.build()
    inject_twice(model, output_device=2)
    names = op_order(model)
    at_y, at_z = names.index("y"), names.index("z")
    assert names[at_y - 3 : at_y] == ["copy_d_cuda_1", "copy_a_cuda_1", "copy_c_cuda_1"]
    assert names[at_z - 2 : at_z] == ["copy_c_cuda_2", "copy_y_cuda_2"]
    assert reads(model, "y") == ("d_cuda_1", "a_cuda_1", "c_cuda_1")


# --- subgraphs reading the enclosing graph ------------------------------------------------------


def _loop_reading_outer_values():
    """x -> Relu -> Loop(body: tanh(h @ W + s)) where ``s = Neg(x)`` and ``W`` (also read by an
    outer MatMul) come from the enclosing graph."""
    import numpy as np
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    body = h.make_graph(
        [
            h.make_node("MatMul", ["h_in", "W"], ["hw"]),
            h.make_node("Add", ["hw", "s"], ["pre"]),
            h.make_node("Tanh", ["pre"], ["h_out"]),
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            h.make_tensor_value_info(n, t, s)
            for n, t, s in (("i", T.INT64, []), ("cond_in", T.BOOL, []), ("h_in", T.FLOAT, [2, 3]))
        ],
        [
            h.make_tensor_value_info(n, t, s)
            for n, t, s in (("cond_out", T.BOOL, []), ("h_out", T.FLOAT, [2, 3]))
        ],
    )
    w = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    graph = h.make_graph(
        [
            h.make_node("Relu", ["x"], ["h0"], name="relu"),
            h.make_node("Neg", ["x"], ["s"], name="neg"),
            h.make_node("MatMul", ["x", "W"], ["xw"], name="outer_matmul"),
            h.make_node("Loop", ["M", "", "h0"], ["hN"], body=body, name="loop"),
            h.make_node("Add", ["hN", "xw"], ["y"], name="add"),
        ],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 3]), h.make_tensor_value_info("M", T.INT64, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(w, "W")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    feeds = {
        "x": np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32),
        "M": np.array(3, np.int64),
    }
    return model, feeds


def test_outer_scope_reads_of_a_body_get_copies_on_its_device():
    import numpy as np

    proto, feeds = _loop_reading_outer_values()
    model = pl.load(proto)
    model.set_device("loop", 1)
    inject_twice(model)
    copies = {op.inputs[0]: (op.outputs[0], str(op.device)) for op in model.ops if op.is_copy}
    # the outer activation and the parameter (its home: the outer MatMul's device) are copied
    assert copies["s"] == ("s_cuda_1", "cuda:1") and copies["W"] == ("W_cuda_1", "cuda:1")
    order = [op.outputs[0] for op in model.ops]
    assert order.index("s_cuda_1") < order.index("hN") and order.index("W_cuda_1") < order.index("hN")
    (loop,) = [node for node in model.graph if node.name == "loop"]
    body = loop.attributes["body"].as_graph()
    read = {v.name for node in body for v in node.inputs if v is not None}
    assert {"s_cuda_1", "W_cuda_1"} <= read and not {"s", "W"} & read
    pl.verify(model)
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    (got,) = pl.Runner(model, device_map="cpu").run([feeds["x"], feeds["M"]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    module = pl.to_torch(model, device_map="cpu")
    lowered = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["M"]))
    np.testing.assert_allclose(lowered.detach().numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_copy_read_only_inside_a_body_is_kept_and_moving_back_removes_it():
    proto, _ = _loop_reading_outer_values()
    model = pl.load(proto)
    model.set_device("loop", 1)
    inject_twice(model)
    model.set_device("loop", 0)  # back with its inputs: the copies go, the body reads the blobs again
    result = inject_twice(model)
    assert result.removed == 5 and not [op for op in model.ops if op.is_copy]  # M, h0, s, W, hN
    (loop,) = [node for node in model.graph if node.name == "loop"]
    read = {v.name for node in loop.attributes["body"].as_graph() for v in node.inputs if v is not None}
    assert {"s", "W"} <= read


def test_verify_sees_a_body_reading_another_devices_blob():
    proto, _ = _loop_reading_outer_values()
    model = pl.load(proto)
    model.set_device("loop", 1)
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    (loop,) = [node for node in model.graph if node.name == "loop"]
    (add,) = [node for node in loop.attributes["body"].as_graph() if node.op_type == "Add"]
    (s,) = [v for node in model.graph for v in node.outputs if v.name == "s"]
    add.replace_input_with(1, s)  # the body reads s (on cuda:0) directly again
    with pytest.raises(
        pl.VerificationError, match="op 'loop' on cuda:1 reads blob 's' from cuda:0 without a copy"
    ):
        pl.verify(model)
