"""RNN, GRU and LSTM lowering rules (placement.lowering.ops.recurrent).

Each op is checked against ONNX Runtime over random attribute combinations
(activations with alpha/beta, clip, sequence lengths, peepholes, input_forget,
linear_before_reset, all directions), against ONNX's reference implementation
(``onnx.reference``: default activations, both layouts; ONNX Runtime where the installed
onnx's reference lacks a configuration), with the fused-kernel
fast path on and off; gradients with ``gradcheck``; through ``pl.to_torch`` with
omitted outputs; pipelined with traced stages; and the errors for what the
rules refuse.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import placement as pl
from placement.analysis.costs import op_flops
from placement.lowering.ops import RULES, recurrent

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
ACTIVATIONS_PER_DIRECTION = {"RNN": 1, "GRU": 2, "LSTM": 3}
OUTPUTS = {"RNN": 2, "GRU": 2, "LSTM": 3}
INPUTS = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
ACTIVATIONS = list(recurrent._ACTIVATION_ARGS)
NAMES = {
    "relu": "Relu",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "affine": "Affine",
    "leakyrelu": "LeakyRelu",
    "thresholdedrelu": "ThresholdedRelu",
    "scaledtanh": "ScaledTanh",
    "hardsigmoid": "HardSigmoid",
    "elu": "Elu",
    "softsign": "Softsign",
    "softplus": "Softplus",
}


@pytest.fixture(params=[True, False], ids=["fused", "loop"])
def fused(request: Any, monkeypatch: Any) -> bool:
    """Run each test with the fused-kernel fast path allowed and with the reference loop only."""
    monkeypatch.setattr(recurrent, "USE_FUSED_KERNELS", request.param)
    return request.param


def _onnx(op_type: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any], outputs: list[str]) -> Any:
    names = INPUTS[: 8 if op_type == "LSTM" else 6]
    inputs = [n if n in arrays else "" for n in names]
    while inputs and not inputs[-1]:
        inputs.pop()
    node = helper.make_node(op_type, inputs, outputs, **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(
            n, TensorProto.INT32 if n == "sequence_lens" else TensorProto.FLOAT, arrays[n].shape
        )
        for n in inputs
        if n
    ]
    graph_outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * (4 if n == "Y" else 3))
        for n in outputs
        if n
    ]
    graph = helper.make_graph([node], "recurrent", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def _feeds(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(arrays)


def _ours(op_type: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any], **kw: Any) -> list[np.ndarray]:
    names = INPUTS[: 8 if op_type == "LSTM" else 6]
    args = [torch.from_numpy(arrays[n]) if n in arrays else None for n in names]
    out = RULES[op_type].fn(*args, **attrs, num_outputs=OUTPUTS[op_type], **kw)
    return [o.detach().numpy() for o in out]


def _close(got: list[np.ndarray], want: list[Any], what: str) -> None:
    for g, w, name in zip(got, want, ["Y", "Y_h", "Y_c"]):
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))  # unbounded activations grow large
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * scale, err_msg=f"{what}: {name}")


def _arrays(
    rng: np.random.Generator,
    op_type: str,
    *,
    steps: int,
    batch: int,
    dirs: int,
    bias: bool,
    lens: bool,
    h0: bool,
    c0: bool,
    peep: bool,
    size: int = 3,
    inputs: int = 2,
    dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
    g = GATES[op_type]
    arrays = {
        "X": rng.standard_normal((steps, batch, inputs)),
        "W": rng.standard_normal((dirs, g * size, inputs)),
        "R": rng.standard_normal((dirs, g * size, size)),
    }
    if bias:
        arrays["B"] = rng.standard_normal((dirs, 2 * g * size))
    if h0:
        arrays["initial_h"] = rng.standard_normal((dirs, batch, size))
    if op_type == "LSTM" and c0:
        arrays["initial_c"] = rng.standard_normal((dirs, batch, size))
    if op_type == "LSTM" and peep:
        arrays["P"] = rng.standard_normal((dirs, 3 * size))
    arrays = {k: v.astype(dtype) for k, v in arrays.items()}
    if lens:
        arrays["sequence_lens"] = rng.integers(1, steps + 1, size=batch).astype(np.int32)
    return arrays


@st.composite
def instances(draw: Any) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
    op_type = draw(st.sampled_from(["RNN", "GRU", "LSTM"]))
    direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    flags = {k: draw(st.booleans()) for k in ("bias", "lens", "h0", "c0", "peep")}
    arrays = _arrays(
        rng, op_type, steps=draw(st.integers(1, 4)), batch=draw(st.integers(1, 3)), dirs=dirs, **flags
    )
    attrs: dict[str, Any] = {"direction": direction, "hidden_size": 3}
    if draw(st.booleans()):
        count = ACTIVATIONS_PER_DIRECTION[op_type] * dirs
        attrs["activations"] = [
            NAMES[a] for a in draw(st.lists(st.sampled_from(ACTIVATIONS), min_size=count, max_size=count))
        ]
        floats = st.floats(0.25, 1.5, width=32)
        if draw(st.booleans()):
            attrs["activation_alpha"] = draw(st.lists(floats, min_size=1, max_size=4))
        if draw(st.booleans()):
            attrs["activation_beta"] = draw(st.lists(floats, min_size=1, max_size=4))
    if draw(st.booleans()):
        attrs["clip"] = draw(st.floats(0.25, 2.0, width=32))
    if op_type == "LSTM" and draw(st.booleans()):
        attrs["input_forget"] = 1
    if op_type == "GRU" and draw(st.booleans()):
        attrs["linear_before_reset"] = 1
    return op_type, arrays, attrs


@settings(max_examples=60, deadline=None)
@given(case=instances(), fused=st.booleans())
def test_matches_onnx_runtime_over_attribute_combinations(case: Any, fused: bool) -> None:
    op_type, arrays, attrs = case
    outputs = ["Y", "Y_h", "Y_c"][: OUTPUTS[op_type]]
    session = ort.InferenceSession(
        _onnx(op_type, arrays, attrs, outputs).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    want = session.run(None, _feeds(arrays))
    # Unbounded gate activations (Relu, Affine) can overflow; where ORT's float32 does, the
    # order of operations decides between inf, nan and a large number: no semantics to compare.
    assume(all(np.isfinite(w).all() for w in want))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recurrent, "USE_FUSED_KERNELS", fused)
        got = _ours(op_type, arrays, attrs)
    _close(got, want, f"{op_type} {attrs}")


@pytest.mark.parametrize("op_type", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
def test_matches_the_onnx_reference_implementation(
    op_type: str, direction: str, layout: int, fused: bool
) -> None:
    rng = np.random.default_rng(7)
    dirs = 2 if direction == "bidirectional" else 1
    for bias, h0, peep, linear in [(False, False, False, 0), (True, True, True, 1), (True, False, True, 0)]:
        arrays = _arrays(
            rng, op_type, steps=4, batch=2, dirs=dirs, bias=bias, lens=False, h0=h0, c0=h0, peep=peep
        )
        if layout:
            arrays["X"] = np.ascontiguousarray(arrays["X"].transpose(1, 0, 2))
            for key in ("initial_h", "initial_c"):
                if key in arrays:
                    arrays[key] = np.ascontiguousarray(arrays[key].transpose(1, 0, 2))
        attrs: dict[str, Any] = {"direction": direction, "hidden_size": 3, "layout": layout}
        if op_type == "GRU":
            attrs["linear_before_reset"] = linear
        want = _reference(op_type, arrays, attrs)
        _close(_ours(op_type, arrays, attrs), want, f"{op_type} {attrs} bias={bias} h0={h0}")


def _reference(op_type: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> list[Any]:
    """ONNX's reference implementation's outputs where the installed one computes this
    configuration; else ONNX Runtime's, run time-major (ONNX Runtime has no layout 1) and
    transposed back. onnx 1.17's reference has no bidirectional, layout 1 or LSTM ``Y_c`` (it
    raises) and ignores ``direction="reverse"`` (its outputs differ from ONNX Runtime's)."""
    outputs = ["Y", "Y_h", "Y_c"][: OUTPUTS[op_type]]
    time_major = dict(arrays)
    if attrs["layout"]:
        for key in ("X", "initial_h", "initial_c"):
            if key in arrays:
                time_major[key] = np.ascontiguousarray(arrays[key].transpose(1, 0, 2))
    model = _onnx(op_type, time_major, {**attrs, "layout": 0}, outputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    by_ort = session.run(None, _feeds(time_major))
    if attrs["layout"]:
        by_ort = [by_ort[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in by_ort[1:]]
    try:
        want = ReferenceEvaluator(_onnx(op_type, arrays, attrs, outputs)).run(None, _feeds(arrays))
    except (NotImplementedError, RuntimeError, ValueError):
        return by_ort
    agree = all(w.shape == o.shape and np.allclose(w, o, rtol=1e-4, atol=1e-5) for w, o in zip(want, by_ort))
    return want if agree else by_ort


@settings(max_examples=25, deadline=None)
@given(case=instances())
def test_batch_major_layout_is_the_transposed_time_major_result(case: Any) -> None:
    # ONNX Runtime's CPU kernels reject layout=1, so layout 1 with every attribute is
    # checked against layout 0 (itself checked against ONNX Runtime above).
    op_type, arrays, attrs = case
    time_major = _ours(op_type, arrays, attrs)
    batch_major = dict(arrays)
    for key in ("X", "initial_h", "initial_c"):
        if key in arrays:
            batch_major[key] = np.ascontiguousarray(arrays[key].transpose(1, 0, 2))
    got = _ours(op_type, batch_major, {**attrs, "layout": 1})
    want = [time_major[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in time_major[1:]]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):  # the same arithmetic up to the last bit of a matmul's summation order
        np.testing.assert_allclose(
            g, w, rtol=1e-6, atol=1e-6 * max(1.0, float(np.nanmax(np.abs(w), initial=0)))
        )


def test_sequence_lengths_zero_the_tail_and_keep_the_last_valid_state() -> None:
    rng = np.random.default_rng(3)
    arrays = _arrays(
        rng, "LSTM", steps=5, batch=3, dirs=2, bias=True, lens=False, h0=True, c0=True, peep=True
    )
    arrays["sequence_lens"] = np.array([5, 2, 1], np.int32)
    y, y_h, y_c = _ours("LSTM", arrays, {"direction": "bidirectional"})
    assert (y[2:, :, 1] == 0).all() and (y[1:, :, 2] == 0).all() and (y[:2, :, 1] != 0).all()
    np.testing.assert_array_equal(y_h[0, 1], y[1, 0, 1])  # forward: the state at step len-1
    np.testing.assert_array_equal(y_h[1, 1], y[0, 1, 1])  # reverse: the state back at step 0
    # Each sequence alone, cut to its length, gives the same outputs.
    for b, length in enumerate([5, 2, 1]):
        alone = {
            k: (v[:length, b : b + 1] if k == "X" else v[:, b : b + 1] if k.startswith("initial") else v)
            for k, v in arrays.items()
            if k != "sequence_lens"
        }
        ya, ya_h, ya_c = _ours("LSTM", alone, {"direction": "bidirectional"})
        np.testing.assert_allclose(y[:length, :, b : b + 1], ya, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y_h[:, b : b + 1], ya_h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y_c[:, b : b + 1], ya_c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op_type", ["RNN", "GRU", "LSTM"])
def test_fast_path_is_taken_exactly_when_torch_has_the_semantics(op_type: str) -> None:
    x = torch.zeros(2, 1, 2)
    base = recurrent._attrs(
        dict(
            activations=None,
            activation_alpha=None,
            activation_beta=None,
            clip=None,
            direction="forward",
            layout=0,
        )
    )
    plain = {**base, "linear_before_reset": 1}
    assert recurrent._fused_kernel(op_type, x, None, None, plain) is not None
    refused = [
        {**plain, "clip": 1.0},
        {**plain, "activations": ["Softsign"] * ACTIVATIONS_PER_DIRECTION[op_type]},
    ]
    assert all(recurrent._fused_kernel(op_type, x, None, None, attrs) is None for attrs in refused)
    assert recurrent._fused_kernel(op_type, x, None, torch.tensor([2]), plain) is None
    assert recurrent._fused_kernel(op_type, x.half(), None, None, plain) is None
    if op_type == "GRU":
        assert recurrent._fused_kernel(op_type, x, None, None, base) is None  # linear_before_reset=0
    if op_type == "LSTM":
        assert recurrent._fused_kernel(op_type, x, torch.zeros(1, 6), None, plain) is None
        assert recurrent._fused_kernel(op_type, x, None, None, {**plain, "input_forget": 1}) is None


@pytest.mark.parametrize("op_type", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("variant", ["plain", "everything"])
def test_gradients_match_finite_differences(op_type: str, variant: str, fused: bool) -> None:
    rng = np.random.default_rng(11)
    everything = variant == "everything"
    arrays = _arrays(
        rng,
        op_type,
        steps=3,
        batch=2,
        dirs=2,
        bias=True,
        lens=everything,
        h0=True,
        c0=True,
        peep=everything,
        size=2,
        dtype=np.float64,
    )
    attrs: dict[str, Any] = {"direction": "bidirectional", "linear_before_reset": int(not everything)}
    if op_type != "GRU":
        attrs.pop("linear_before_reset")
    if everything:
        attrs["activations"] = (["Softsign", "Elu", "Softplus"][: ACTIVATIONS_PER_DIRECTION[op_type]]) * 2
        attrs["activation_alpha"] = [0.8]
    names = INPUTS[: 8 if op_type == "LSTM" else 6]
    leaves = [
        torch.from_numpy(arrays[n]).requires_grad_(n != "sequence_lens") if n in arrays else None
        for n in names
    ]

    def fn(*tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        args = [next(it) if leaf is not None and leaf.requires_grad else leaf for leaf in leaves]
        return RULES[op_type].fn(*args, **attrs, num_outputs=OUTPUTS[op_type])

    differentiable = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
    assert torch.autograd.gradcheck(fn, differentiable, eps=1e-6, atol=1e-5)


def test_lowered_graph_with_omitted_outputs_and_weights_as_parameters() -> None:
    rng = np.random.default_rng(5)
    arrays = _arrays(
        rng, "LSTM", steps=4, batch=3, dirs=1, bias=True, lens=True, h0=False, c0=False, peep=True
    )
    attrs = {"hidden_size": 3, "clip": 1.5}
    for outputs in (["Y"], ["", "Y_h"], ["", "", "Y_c"], ["Y", "", "Y_c"]):
        proto = _onnx("LSTM", arrays, attrs, outputs)
        for name in ("W", "R", "B", "P"):  # weights become initializers, so trainable parameters
            proto.graph.initializer.append(
                helper.make_tensor(name, TensorProto.FLOAT, arrays[name].shape, arrays[name].ravel().tolist())
            )
        keep = [i for i in proto.graph.input if i.name not in ("W", "R", "B", "P")]
        del proto.graph.input[:]
        proto.graph.input.extend(keep)
        feeds = {"X": arrays["X"], "sequence_lens": arrays["sequence_lens"]}
        want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )
        module = pl.to_torch(pl.load(proto), device_map="cpu")
        assert {"W", "R", "B", "P"} <= {name for name, _ in module.named_parameters()}
        out = module(torch.from_numpy(arrays["X"]), torch.from_numpy(arrays["sequence_lens"]))
        out = out if isinstance(out, (list, tuple)) else [out]
        _close([o.detach().numpy() for o in out], want, f"outputs {outputs}")


def _recurrent_chain(op_type: str) -> Any:
    """Tanh on device 0, then the recurrent op on device 1; dynamic sequence and batch."""
    rng = np.random.default_rng(2)
    g, size, inputs = GATES[op_type], 3, 2
    weights = {
        "W": rng.standard_normal((2, g * size, inputs)).astype(np.float32),
        "R": rng.standard_normal((2, g * size, size)).astype(np.float32),
        "B": rng.standard_normal((2, 2 * g * size)).astype(np.float32),
    }
    pre = helper.make_node("Tanh", ["X"], ["pre"], name="pre")
    node = helper.make_node(
        op_type,
        ["pre", "W", "R", "B", "lens"],
        ["Y", "Y_h"],
        name="rec",
        direction="bidirectional",
        hidden_size=size,
    )
    graph = helper.make_graph(
        [pre, node],
        "chain",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", inputs]),
            helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"]),
        ],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", 2, "N", 3]),
            helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [2, "N", 3]),
        ],
        [helper.make_tensor(k, TensorProto.FLOAT, v.shape, v.ravel().tolist()) for k, v in weights.items()],
    )
    model = pl.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8))
    model.set_device("rec", 1)
    pl.inject_cross_device_copies(model)
    return model


@pytest.mark.parametrize("op_type", ["GRU", "LSTM"])
def test_pipelined_traced_stage_replays_for_new_lengths_and_batches(op_type: str) -> None:
    # The recurrent stage's loop runs over a length read from a shape and masks by
    # the lengths' values: a trace recorded for one signature must still be right for
    # other length values, and other signatures get traces of their own.
    model = _recurrent_chain(op_type)
    plain = pl.to_torch(model, device_map="cpu")
    time_major = {"X": 1, "lens": 0, "Y": 2, "Y_h": 1}  # the batch axes
    piped = pl.to_torch(model, device_map="cpu", chunks=2, batch_axes=time_major)
    gen = torch.Generator().manual_seed(0)
    calls = [(5, 4)] * 4 + [(3, 4)] * 3 + [(7, 6)] * 3 + [(5, 4)] * 2  # (steps, batch)
    for steps, batch in calls:
        x = torch.randn(steps, batch, 2, generator=gen)
        lens = torch.randint(1, steps + 1, (batch,), generator=gen, dtype=torch.int32)
        with torch.no_grad():
            want, got = plain(x, lens), piped(x, lens)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    stages = [s.call for s in piped._pl_stages]
    # Every stage ran as traces, one per (steps, micro-batch) signature, none keyed by values.
    assert [(c.traced, c.disabled, c._keyed) for c in stages] == [(3, None, ())] * len(stages)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"activations": ["Gelu", "Tanh", "Tanh"]}, "activations ['Gelu']"),
        ({"activations": ["Tanh", "Tanh"]}, "2 activations"),
        ({"direction": "sideways"}, "direction='sideways'"),
    ],
)
def test_unsupported_attributes_name_the_op(attrs: dict[str, Any], message: str) -> None:
    rng = np.random.default_rng(0)
    arrays = _arrays(
        rng, "LSTM", steps=2, batch=1, dirs=1, bias=False, lens=False, h0=False, c0=False, peep=False
    )
    proto = _onnx("LSTM", arrays, attrs, ["Y"])
    proto.graph.node[0].name = "encoder_lstm"
    with pytest.raises(pl.LoweringError, match=rf"LSTM: .*{message[:12]}.*encoder_lstm"):
        pl.to_torch(pl.load(proto), device_map="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"direction": "bidirectional"}, "GRU: W has 1 direction"),
        ({"hidden_size": 4}, "GRU: hidden_size=4 but R has hidden size 3"),
        ({"activations": ["Sigmoid", "Tanh"] * 2}, "GRU: 4 activations for 1 direction"),
        ({"activations": ["Sigmoid", "Swish"]}, r"GRU: activations \['Swish'\]"),
    ],
)
def test_rules_called_directly_raise_lowering_errors(kwargs: dict[str, Any], message: str) -> None:
    x, w, r = torch.zeros(2, 1, 2), torch.zeros(1, 9, 2), torch.zeros(1, 9, 3)
    with pytest.raises(pl.LoweringError, match=message):
        RULES["GRU"].fn(x, w, r, **kwargs)


def test_flop_cost_counts_both_projections_per_step_and_direction() -> None:
    import onnx_ir as ir

    def value(name: str, dims: list[int]) -> ir.Value:
        return ir.Value(name=name, shape=ir.Shape(dims))

    steps, batch, inputs, size = 7, 3, 5, 4
    node = ir.Node(
        "",
        "LSTM",
        [value("x", [steps, batch, inputs]), value("w", [2, 16, inputs]), value("r", [2, 16, size])],
        num_outputs=1,
    )

    class Shapes:
        def dims(self, v: Any) -> Any:
            return tuple(v.shape) if v is not None and v.shape is not None else None

        def numel(self, v: Any) -> int:
            return int(np.prod(self.dims(v))) if self.dims(v) else 1

        def out_numel(self, n: Any) -> int:
            return 1

    # directions x steps x batch x (X_t W^T and H R^T: 2 x 4H x (I + H), gate arithmetic: 30 per unit)
    assert op_flops(node, Shapes()) == 2 * steps * batch * (2 * 16 * (inputs + size) + 30 * size)
    node.op_type = "GRU"  # fewer gates' arithmetic for the same shapes
    assert op_flops(node, Shapes()) == 2 * steps * batch * (2 * 16 * (inputs + size) + 24 * size)
