"""The torch lowering of control flow with subgraphs: ``If`` (run-time condition), ``Loop``, ``Scan``.

Hand-built ``onnx.helper`` models are lowered with ``pl.to_torch`` and compared with
ONNX Runtime and ``onnx.reference.ReferenceEvaluator`` (onnx 1.23's evaluator
concatenates a ``Loop``'s scan outputs instead of stacking them, fails on a ``Loop``
without a ``cond`` input and has no ``Scan`` direction 1, so it checks only the
cases and outputs it gets right): outer-scope references,
bodies with their own initializers (parameters of the lowered module), both branches
of an ``If``, every ``Loop`` input form, ``Scan`` axes and directions, gradients by
finite differences, and clear errors for what stays unsupported.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

import placement as pl
from placement.errors import LoweringError
from placement.lowering.ops import control

F, I64, B = T.FLOAT, T.INT64, T.BOOL


def _vi(name: str, dtype: int, shape: list | None) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=9)
    onnx.checker.check_model(model)
    return model


def _compare(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, device: int | None = None, reference: int = 99
) -> list:
    """Lowered outputs equal ONNX Runtime's and (the first ``reference`` of them) the reference
    evaluator's; returns the lowered outputs."""
    placed = pl.load(model)
    if device is not None:
        for op in placed.ops:
            if op.op_type in ("If", "Loop", "Scan"):
                placed.set_device(op.name, device)
        pl.inject_cross_device_copies(placed)
    module = pl.to_torch(placed, device_map="cpu")
    got = module(*[torch.from_numpy(feeds[name]) for name in module.input_names])
    got = [t.detach().numpy() for t in (got if isinstance(got, tuple) else (got,))]
    ort_out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    for g, o in zip(got, ort_out):
        assert g.shape == o.shape and g.dtype == o.dtype
        np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-6)
    ref_out = _reference(model, feeds) if reference else None
    for g, r in list(zip(got, ref_out or []))[:reference]:
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    return got


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list | None:
    """The reference evaluator's outputs, or None where the installed onnx's evaluator cannot run
    the model (onnx 1.17's does not see outer-scope names inside a ``Scan`` body)."""
    try:
        return ReferenceEvaluator(model).run(None, feeds)
    except RuntimeError as err:
        if "Unable to find input" not in str(err):
            raise
        return None


# --- If ---------------------------------------------------------------------------------------


def _if_model() -> onnx.ModelProto:
    """y = If(sum(x) > 0): then x * w (w a branch initializer) + a (outer), else a - x; then Relu."""
    then = h.make_graph(
        [h.make_node("Mul", ["x", "w"], ["xw"]), h.make_node("Add", ["xw", "a"], ["t_out"])],
        "then",
        [],
        [_vi("t_out", F, [3])],
        [h.make_tensor("w", F, [3], [2.0, -1.0, 0.5])],
    )
    other = h.make_graph([h.make_node("Sub", ["a", "x"], ["e_out"])], "else", [], [_vi("e_out", F, [3])])
    nodes = [
        h.make_node("Exp", ["x"], ["a"]),
        h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        h.make_node("Greater", ["s", "zero"], ["c"]),
        h.make_node("If", ["c"], ["r"], then_branch=then, else_branch=other),
        h.make_node("Relu", ["r"], ["y"]),
    ]
    return _model(nodes, [_vi("x", F, [3])], [_vi("y", F, [3])], [h.make_tensor("zero", F, [], [0.0])])


@pytest.mark.parametrize("x", [[1.0, 2.0, -0.5], [-1.0, -2.0, 0.5]], ids=["then", "else"])
def test_if_run_time_condition_takes_each_branch(x: list[float]) -> None:
    _compare(_if_model(), {"x": np.array(x, np.float32)})


def test_if_on_another_device_and_its_branch_parameter() -> None:
    model = _if_model()
    _compare(model, {"x": np.array([1.0, 2.0, 3.0], np.float32)}, device=1)
    module = pl.to_torch(pl.load(model), device_map="cpu")
    names = [name for name, _ in module.named_parameters()]
    assert any(name.endswith(".w") for name in names), names  # the then-branch initializer
    assert any(isinstance(m, control.If) for m in module.modules())


def test_if_known_condition_is_still_inlined() -> None:
    then = h.make_graph([h.make_node("Neg", ["x"], ["o"])], "then", [], [_vi("o", F, [2])])
    other = h.make_graph([h.make_node("Abs", ["x"], ["p"])], "else", [], [_vi("p", F, [2])])
    model = _model(
        [
            h.make_node("Shape", ["x"], ["shape"]),
            h.make_node("Equal", ["shape", "two"], ["c1"]),
            h.make_node("Squeeze", ["c1"], ["c"]),
            h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
        ],
        [_vi("x", F, [2])],
        [_vi("y", F, [2])],
        [h.make_tensor("two", I64, [1], [2])],
    )
    module = pl.to_torch(pl.load(model), device_map="cpu")
    assert "If" not in module.code and "neg" in module.code
    _compare(model, {"x": np.array([1.0, -2.0], np.float32)})


# --- Loop -------------------------------------------------------------------------------------


def _loop_body(with_cond: bool = False) -> onnx.GraphProto:
    """(i, cond, h) -> (cond', tanh(h @ W + b * i) with W outer and b its own, h as scan output)."""
    nodes = [
        h.make_node("MatMul", ["h_in", "W"], ["hw"]),
        h.make_node("Cast", ["i"], ["i_f"], to=F),
        h.make_node("Mul", ["b", "i_f"], ["bi"]),
        h.make_node("Add", ["hw", "bi"], ["pre"]),
        h.make_node("Tanh", ["pre"], ["h_out"]),
        h.make_node("Identity", ["h_out"], ["h_scan"]),
    ]
    if with_cond:  # stop once the state's sum drops below the threshold or after 5 steps (outer values)
        nodes += [
            h.make_node("ReduceSum", ["h_out"], ["total"], keepdims=0),
            h.make_node("Greater", ["total", "threshold"], ["above"]),
            h.make_node("Less", ["i", "cap"], ["early"]),
            h.make_node("And", ["above", "early"], ["cond_out"]),
        ]
    else:
        nodes.append(h.make_node("Identity", ["cond_in"], ["cond_out"]))
    return h.make_graph(
        nodes,
        "body",
        [_vi("i", I64, []), _vi("cond_in", B, []), _vi("h_in", F, [2, 3])],
        [_vi("cond_out", B, []), _vi("h_out", F, [2, 3]), _vi("h_scan", F, [2, 3])],
        [h.make_tensor("b", F, [3], [0.1, -0.2, 0.3])],
    )


def _loop_model(trip: bool, cond: bool, with_cond: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inputs = [_vi("x", F, [2, 3])]
    if trip:
        inputs.append(_vi("M", I64, []))
    if cond:
        inputs.append(_vi("c0", B, []))
    nodes = [
        h.make_node("Relu", ["x"], ["h0"]),
        h.make_node(
            "Loop",
            ["M" if trip else "", "c0" if cond else "", "h0"],
            ["hN", "hs"],
            body=_loop_body(with_cond),
        ),
        h.make_node("Sigmoid", ["hN"], ["y"]),
    ]
    inits = [
        h.make_tensor("W", F, [3, 3], rng.standard_normal(9).astype(np.float32)),
        h.make_tensor("threshold", F, [], [-1.0]),
        h.make_tensor("cap", I64, [], [4]),
    ]
    return _model(nodes, inputs, [_vi("y", F, [2, 3]), _vi("hs", F, [None, 2, 3])], inits)


def _x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)


@pytest.mark.parametrize("trips", [0, 1, 4])
def test_loop_trip_count(trips: int) -> None:
    feeds = {"x": _x(), "M": np.array(trips, np.int64)}
    got = _compare(_loop_model(trip=True, cond=False), feeds, reference=0)
    assert got[1].shape == (trips, 2, 3)  # scan outputs stacked on a new axis 0, empty without trips


@pytest.mark.parametrize("start", [True, False])
def test_loop_trip_count_and_condition(start: bool) -> None:
    feeds = {"x": _x(), "M": np.array(6, np.int64), "c0": np.array(start)}
    _compare(_loop_model(trip=True, cond=True, with_cond=True), feeds, reference=1 if start else 0)


def test_loop_while_condition_only() -> None:
    got = _compare(
        _loop_model(trip=False, cond=True, with_cond=True), {"x": _x() + 1, "c0": np.array(True)}, reference=1
    )
    assert 0 < got[1].shape[0]


def test_loop_without_cond_input_still_stops_on_the_body_condition() -> None:
    """As ONNX Runtime does (the spec's pseudo-code would ignore the body's condition here)."""
    feeds = {"x": _x(), "M": np.array(7, np.int64)}  # the body's condition turns false after step 4
    got = _compare(_loop_model(trip=True, cond=False, with_cond=True), feeds, reference=0)
    assert got[1].shape[0] == 5


def test_loop_on_device_1_reads_outer_parameter() -> None:
    model = _loop_model(trip=True, cond=False)
    _compare(model, {"x": _x(), "M": np.array(3, np.int64)}, device=1, reference=0)
    module = pl.to_torch(pl.load(model), device_map="cpu")
    params = dict(module.named_parameters())
    assert "W" in params and any(name.endswith(".b") for name in params)  # outer and body parameters


def test_trained_body_parameters_go_back_into_the_model() -> None:
    """``update_parameters`` writes a ``Loop`` body's own initializer back as well as the outer
    one, under its subgraph key, so the placed model serves what the lowering trained."""
    model = pl.load(_loop_model(trip=True, cond=False))
    loop = next(op.name for op in model.ops if op.op_type == "Loop")
    model.set_device(loop, 1)
    pl.inject_cross_device_copies(model)
    module = pl.to_torch(model, device_map="cpu")
    key = f"{loop}/body/b"
    assert key in module.initializer_paths and "W" in module.initializer_paths
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(1.5)
    assert set(model.update_parameters(module)) >= {key, "W"}
    body = next(op for op in model.ops if op.op_type == "Loop").node.attributes["body"].as_graph()
    np.testing.assert_allclose(body.initializers["b"].const_value.numpy(), [0.15, -0.3, 0.45], rtol=1e-6)
    feeds = {"x": _x(), "M": np.array(3, np.int64)}
    with torch.no_grad():
        want = module(*[torch.from_numpy(feeds[name]) for name in module.input_names])
    for got, expected in zip(pl.run(model, feeds, device_map="cpu"), want):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_loop_gradients_match_finite_differences() -> None:
    """Through three iterations, to the input and to the outer parameter the body reads."""
    module = pl.to_torch(pl.load(_loop_model(trip=True, cond=False)), device_map="cpu").double()
    trips = torch.tensor(3)
    x = torch.from_numpy(_x()).double().requires_grad_(True)
    w = dict(module.named_parameters())["W"].detach().clone().requires_grad_(True)

    def outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.func.functional_call(module, {"W": w}, (x, trips))

    assert torch.autograd.gradcheck(outputs, (x, w), eps=1e-6, atol=1e-5)


# --- Scan -------------------------------------------------------------------------------------


def _scan_model(in_axis: int = 0, in_dir: int = 0, out_axis: int = 0, out_dir: int = 0) -> onnx.ModelProto:
    """Two states (a running sum and a running product-ish value), two scan inputs, one outer value."""
    body = h.make_graph(
        [
            h.make_node("Add", ["s_in", "u"], ["s_out"]),
            h.make_node("Mul", ["u", "v"], ["uv"]),
            h.make_node("Add", ["p_in", "uv"], ["p_mid"]),
            h.make_node("Mul", ["p_mid", "scale"], ["p_out"]),
            h.make_node("Sub", ["s_out", "p_out"], ["o1"]),
        ],
        "body",
        [_vi("s_in", F, [3]), _vi("p_in", F, [3]), _vi("u", F, [3]), _vi("v", F, [3])],
        [_vi("s_out", F, [3]), _vi("p_out", F, [3]), _vi("o1", F, [3])],
    )
    shape = [4, 3] if in_axis in (0, -2) else [3, 4]
    attrs = {"num_scan_inputs": 2, "scan_input_axes": [in_axis, 0], "scan_input_directions": [in_dir, 0]}
    attrs.update(scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    nodes = [
        h.make_node("Exp", ["x"], ["scale"]),
        h.make_node("Scan", ["s0", "p0", "u_all", "v_all"], ["sN", "pN", "os"], body=body, **attrs),
    ]
    out_shape = [4, 3] if out_axis in (0, -2) else [3, 4]
    return _model(
        nodes,
        [
            _vi("x", F, [3]),
            _vi("s0", F, [3]),
            _vi("p0", F, [3]),
            _vi("u_all", F, shape),
            _vi("v_all", F, [4, 3]),
        ],
        [_vi("sN", F, [3]), _vi("pN", F, [3]), _vi("os", F, out_shape)],
    )


def _scan_feeds(in_axis: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    u = rng.standard_normal((4, 3)).astype(np.float32)
    return {
        "x": rng.standard_normal(3).astype(np.float32) * 0.1,
        "s0": rng.standard_normal(3).astype(np.float32),
        "p0": rng.standard_normal(3).astype(np.float32),
        "u_all": u if in_axis in (0, -2) else np.ascontiguousarray(u.T),
        "v_all": rng.standard_normal((4, 3)).astype(np.float32),
    }


@pytest.mark.parametrize(
    ("in_axis", "in_dir", "out_axis", "out_dir"),
    [(0, 0, 0, 0), (1, 1, 1, 0), (-1, 0, -1, 1), (0, 1, 0, 1)],
)
def test_scan_axes_and_directions(in_axis: int, in_dir: int, out_axis: int, out_dir: int) -> None:
    model = _scan_model(in_axis, in_dir, out_axis, out_dir)
    _compare(model, _scan_feeds(in_axis), device=1, reference=0 if in_dir or out_dir else 3)


def test_scan_gradients_match_finite_differences() -> None:
    module = pl.to_torch(pl.load(_scan_model(1, 1, 1, 1)), device_map="cpu").double()
    feeds = _scan_feeds(1)
    args = tuple(torch.from_numpy(feeds[n]).double().requires_grad_(True) for n in module.input_names)
    assert torch.autograd.gradcheck(lambda *a: module(*a), args, eps=1e-6, atol=1e-5)


def test_scan_functional_form_zero_steps_uses_declared_shapes() -> None:
    body = control.Subgraph(
        torch.nn.Identity(), 2, [((3,), torch.float32), ((2, 3), torch.float64)]
    )  # never called: zero steps
    state, out = control.scan(torch.ones(3), torch.ones(0, 3), body=body, num_scan_inputs=1)
    assert state.tolist() == [1.0, 1.0, 1.0] and out.shape == (0, 2, 3) and out.dtype == torch.float64


# --- what stays unsupported -------------------------------------------------------------------


def test_unsupported_op_inside_a_body_is_named_before_running() -> None:
    body = h.make_graph(
        [
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
            h.make_node("SequenceInsert", ["seq_in", "x"], ["seq_out"]),
        ],
        "body",
        [_vi("i", I64, []), _vi("cond_in", B, []), h.make_tensor_sequence_value_info("seq_in", F, [2])],
        [_vi("cond_out", B, []), h.make_tensor_sequence_value_info("seq_out", F, [2])],
    )
    model = _model(
        [
            h.make_node("SequenceEmpty", [], ["empty"], dtype=F),
            h.make_node("Loop", ["M", "", "empty"], ["seq"], body=body),
            h.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0),
        ],
        [_vi("x", F, [2]), _vi("M", I64, [])],
        [_vi("y", F, [None])],
    )
    with pytest.raises(LoweringError, match="SequenceInsert"):
        pl.to_torch(pl.load(model), device_map="cpu")


def test_a_random_op_inside_an_inlined_branch_keeps_its_stage_untraced() -> None:
    """An ``If`` whose condition is known when lowering is inlined, its branch's ops under the
    If's name: a random op in that branch still keeps the pipeline from tracing its stage (a
    trace would not be checked against a random op's fresh values), and only that stage."""
    then_branch = h.make_graph(
        [h.make_node("RandomUniformLike", ["x"], ["r"], seed=1.0), h.make_node("Add", ["x", "r"], ["t"])],
        "then",
        [],
        [_vi("t", F, ["N", 3])],
    )
    orelse = h.make_graph([h.make_node("Identity", ["x"], ["e"])], "else", [], [_vi("e", F, ["N", 3])])
    model = pl.load(
        _model(
            [
                h.make_node("If", ["c"], ["y"], name="branch", then_branch=then_branch, else_branch=orelse),
                h.make_node("Relu", ["y"], ["z"], name="relu"),
            ],
            [_vi("x", F, ["N", 3])],
            [_vi("z", F, ["N", 3])],
            [h.make_tensor("c", B, [], [True])],
        )
    )
    from placement.runtime.torch.stage_split import nondeterministic_ops

    assert nondeterministic_ops(model) == {"branch"}
    model.set_device("relu", 1)
    pl.inject_cross_device_copies(model)
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    with torch.no_grad():
        for _ in range(4):
            assert piped(torch.ones(4, 3)).shape == (4, 3)
    reasons = [s.call.disabled or "" for s in piped._pl_stages]
    assert reasons[0] == "nondeterministic op(s) branch" and piped._pl_stages[0].call.traced == 0
    # the stage reading the random values is traced: its input stands for them, its code is plain
    assert reasons[1] == "" and piped._pl_stages[1].call.traced == 1
