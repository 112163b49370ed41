"""The ONNX -> torch rule table, checked op by op against ONNX's reference evaluator.

Each case is a one-op ONNX model. It runs twice through ``pl.to_torch``: with
every input but the first as a graph input (runtime tensors), and with them as
initializers (constants: folded, or inlined as Python literals into the rule or
its direct torch emission). Both must match ONNX Runtime (or ``onnx.reference.ReferenceEvaluator`` for
ops ORT lacks).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator

import placement as pl
from placement.lowering.ops import DEFAULT_RULE, RULES, get_rule, torch_dtype
from placement.runtime.torch import to_torch

OPSET = 21
RNG = np.random.default_rng(0)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def scalar(value: Any, dtype: Any = np.float32) -> np.ndarray:
    return np.array(value, dtype=dtype)


def _one_op_model(
    op_type: str,
    inputs: list[np.ndarray | None],
    attrs: dict[str, Any],
    n_outputs: int,
    const: bool,
    results: list[np.ndarray] | None = None,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    names, graph_inputs, inits, feeds = [], [], [], {}
    for i, array in enumerate(inputs):
        if array is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if const and i > 0:
            inits.append(onnx.numpy_helper.from_array(array, name))
        else:
            dtype = helper.np_dtype_to_tensor_dtype(array.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, dtype, array.shape))
            feeds[name] = array
    outputs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outputs, name=f"the_{op_type.lower()}", **attrs)
    graph = helper.make_graph(
        [node],
        "one_op",
        graph_inputs,
        [
            helper.make_tensor_value_info(
                o, helper.np_dtype_to_tensor_dtype(np.asarray(r).dtype), np.asarray(r).shape
            )
            if results is not None
            else helper.make_empty_tensor_value_info(o)
            for o, r in zip(outputs, results or outputs)
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    return model, feeds


def _reference(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's outputs, or the ONNX reference evaluator's where ORT lacks the op."""
    try:
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # ORT does not implement it at this opset: use the spec's evaluator
        return ReferenceEvaluator(proto).run(None, feeds)
    return session.run(None, feeds)


def _check(
    op_type: str,
    inputs: list[np.ndarray | None],
    attrs: dict[str, Any] | None = None,
    *,
    n_outputs: int = 1,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    attrs = attrs or {}
    for const in (False, True):
        proto, feeds = _one_op_model(op_type, inputs, attrs, n_outputs, const)
        expected = _reference(proto, feeds)
        proto, feeds = _one_op_model(op_type, inputs, attrs, n_outputs, const, expected)
        module = to_torch(pl.load(proto), device_map="cpu")
        got = module(**{k: torch.from_numpy(v.copy()) for k, v in feeds.items()})
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            g = g.detach().numpy()
            assert g.shape == np.asarray(e).shape, (op_type, const, g.shape, np.asarray(e).shape)
            assert g.dtype == np.asarray(e).dtype, (op_type, const, g.dtype, np.asarray(e).dtype)
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{op_type} const={const}")


X4 = f32(2, 3, 5, 5)
CASES: list[tuple[str, list[Any], dict[str, Any], int]] = [
    # elementwise arithmetic, broadcasting and scalar constants
    ("Add", [f32(2, 3), f32(3)], {}, 1),
    ("Sub", [f32(2, 3), scalar(1.5)], {}, 1),
    ("Sub", [scalar(1.5), f32(2, 3)], {}, 1),
    ("Mul", [f32(2, 1, 3), f32(4, 1)], {}, 1),
    ("Div", [f32(2, 3), f32(2, 3) + 3], {}, 1),
    ("Div", [i64(7, -7, 9), i64(2, 2, -4)], {}, 1),
    ("Pow", [np.abs(f32(2, 3)) + 0.1, scalar(2.0)], {}, 1),
    ("Pow", [np.abs(f32(2, 3)) + 0.1, f32(2, 3)], {}, 1),
    ("Mod", [i64(5, -5, 7), i64(3, 3, -2)], {}, 1),
    ("Mod", [f32(4) * 5, f32(4) + 3], {"fmod": 1}, 1),
    ("Max", [f32(2, 3), f32(3), f32(1, 3)], {}, 1),
    ("Min", [f32(2, 3), f32(3)], {}, 1),
    ("Sum", [f32(2, 3), f32(3), f32(2, 1)], {}, 1),
    ("Mean", [f32(2, 3), f32(3)], {}, 1),
    ("Abs", [f32(3, 4)], {}, 1),
    ("Neg", [f32(3, 4)], {}, 1),
    ("Exp", [f32(3, 4)], {}, 1),
    ("Log", [np.abs(f32(3, 4)) + 0.1], {}, 1),
    ("Sqrt", [np.abs(f32(3, 4))], {}, 1),
    ("Reciprocal", [np.abs(f32(3, 4)) + 0.5], {}, 1),
    ("Floor", [f32(3, 4)], {}, 1),
    ("Ceil", [f32(3, 4)], {}, 1),
    ("Round", [np.array([0.5, 1.5, 2.5, -0.5, 1.2], np.float32)], {}, 1),
    ("Sign", [f32(3, 4)], {}, 1),
    ("Sin", [f32(3, 4)], {}, 1),
    ("Cos", [f32(3, 4)], {}, 1),
    ("Tanh", [f32(3, 4)], {}, 1),
    ("Erf", [f32(3, 4)], {}, 1),
    ("Relu", [f32(3, 4)], {}, 1),
    ("Sigmoid", [f32(3, 4)], {}, 1),
    ("Softplus", [f32(3, 4)], {}, 1),
    ("Softsign", [f32(3, 4)], {}, 1),
    ("LeakyRelu", [f32(3, 4)], {"alpha": 0.2}, 1),
    ("Elu", [f32(3, 4)], {"alpha": 0.5}, 1),
    ("Selu", [f32(3, 4)], {}, 1),
    ("Celu", [f32(3, 4)], {"alpha": 2.0}, 1),
    ("HardSigmoid", [f32(3, 4)], {"alpha": 0.3, "beta": 0.4}, 1),
    ("HardSwish", [f32(3, 4) * 4], {}, 1),
    ("ThresholdedRelu", [f32(3, 4)], {"alpha": 0.5}, 1),
    ("PRelu", [f32(2, 3, 4), f32(3, 1)], {}, 1),
    ("Gelu", [f32(3, 4)], {}, 1),
    ("Gelu", [f32(3, 4)], {"approximate": "tanh"}, 1),
    ("Clip", [f32(3, 4), scalar(-0.5), scalar(0.5)], {}, 1),
    ("Clip", [f32(3, 4), None, scalar(0.2)], {}, 1),
    ("Clip", [f32(3, 4)], {}, 1),
    ("Softmax", [f32(2, 3, 4)], {"axis": 1}, 1),
    ("LogSoftmax", [f32(2, 3, 4)], {}, 1),
    # comparisons and logic
    ("Equal", [i64(1, 2, 3), i64(1, 0, 3)], {}, 1),
    ("Less", [f32(2, 3), f32(3)], {}, 1),
    ("LessOrEqual", [f32(2, 3), scalar(0.0)], {}, 1),
    ("Greater", [f32(2, 3), f32(2, 3)], {}, 1),
    ("GreaterOrEqual", [f32(2, 3), f32(3)], {}, 1),
    ("Not", [np.array([True, False])], {}, 1),
    ("And", [np.array([True, False, True]), np.array([True, True, False])], {}, 1),
    ("Or", [np.array([True, False, False]), np.array([True, True, False])], {}, 1),
    ("Xor", [np.array([True, False, False]), np.array([True, True, False])], {}, 1),
    ("Where", [f32(2, 3) > 0, f32(2, 3), scalar(-np.inf)], {}, 1),
    ("Where", [f32(3) > 0, scalar(-np.inf), f32(2, 3)], {}, 1),  # masked_fill form
    ("Where", [f32(2, 1) > 0, scalar(1.0), f32(3)], {}, 1),  # broadcast: torch.where form
    ("IsNaN", [np.array([1.0, np.nan], np.float32)], {}, 1),
    ("IsInf", [np.array([1.0, np.inf, -np.inf], np.float32)], {"detect_negative": 0}, 1),
    ("Cast", [f32(2, 3) * 10], {"to": onnx.TensorProto.INT64}, 1),
    ("Cast", [i64(1, 0, 3)], {"to": onnx.TensorProto.BOOL}, 1),
    ("CastLike", [i64(1, 0, 3), f32(1)], {}, 1),
    ("Identity", [f32(2, 3)], {}, 1),
    ("Dropout", [f32(2, 3)], {}, 1),
    # linear algebra and normalisation
    ("MatMul", [f32(2, 3, 4), f32(4, 5)], {}, 1),
    ("MatMul", [f32(4), f32(2, 4, 5)], {}, 1),
    ("Gemm", [f32(2, 3), f32(4, 3), f32(4)], {"transB": 1}, 1),
    ("Gemm", [f32(3, 2), f32(3, 4), f32(2, 4)], {"transA": 1, "alpha": 0.5, "beta": 2.0}, 1),
    ("Gemm", [f32(2, 3), f32(3, 4)], {}, 1),
    ("Einsum", [f32(2, 3, 4), f32(2, 4, 5)], {"equation": "bij,bjk->bik"}, 1),
    ("LayerNormalization", [f32(2, 3, 4), f32(4), f32(4)], {"epsilon": 1e-3}, 1),
    ("LayerNormalization", [f32(2, 3, 4), f32(3, 4), f32(3, 4)], {"axis": 1}, 1),
    ("LayerNormalization", [f32(2, 3, 4), f32(4)], {}, 1),
    ("BatchNormalization", [X4, f32(3), f32(3), f32(3), np.abs(f32(3)) + 0.5], {}, 1),
    ("BatchNormalization", [X4, f32(3), f32(3), f32(3), np.abs(f32(3)) + 0.5], {"training_mode": 1}, 1),
    (
        "BatchNormalization",
        [X4, f32(3), f32(3), f32(3), np.abs(f32(3)) + 0.5],
        {"training_mode": 1, "momentum": 0.7, "epsilon": 1e-3},
        3,
    ),
    ("InstanceNormalization", [X4, f32(3), f32(3)], {"epsilon": 1e-3}, 1),
    ("GroupNormalization", [f32(2, 4, 3, 3), f32(4), f32(4)], {"num_groups": 2}, 1),
    ("LpNormalization", [f32(2, 3)], {"axis": 1}, 1),
    ("LRN", [X4], {"size": 3}, 1),
    # convolution and pooling
    ("Conv", [X4, f32(4, 3, 3, 3), f32(4)], {"pads": [1, 1, 1, 1]}, 1),
    ("Conv", [X4, f32(4, 3, 3, 3)], {"strides": [2, 2], "dilations": [1, 2]}, 1),
    ("Conv", [X4, f32(6, 1, 3, 3)], {"group": 3, "auto_pad": "SAME_UPPER"}, 1),
    ("Conv", [X4, f32(4, 3, 2, 2)], {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, 1),
    ("Conv", [X4, f32(4, 3, 3, 3)], {"pads": [0, 1, 2, 1]}, 1),
    ("Conv", [f32(2, 3, 7), f32(4, 3, 3), f32(4)], {"pads": [1, 1]}, 1),
    ("ConvTranspose", [X4, f32(3, 4, 2, 2), f32(4)], {"strides": [2, 2]}, 1),
    (
        "ConvTranspose",
        [X4, f32(3, 2, 3, 3)],
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
        1,
    ),
    ("ConvTranspose", [X4, f32(3, 4, 3, 3), f32(4)], {"strides": [2, 2], "pads": [0, 1, 1, 0]}, 1),
    ("ConvTranspose", [X4, f32(3, 4, 3, 3)], {"strides": [2, 2], "output_shape": [10, 10]}, 1),
    ("ConvTranspose", [X4, f32(3, 4, 3, 3)], {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, 1),
    ("MaxPool", [X4], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1),
    ("MaxPool", [X4], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "ceil_mode": 1, "strides": [2, 2]}, 1),
    ("MaxPool", [X4], {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, 1),
    ("MaxPool", [X4], {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1),
    ("AveragePool", [X4], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 1),
    ("AveragePool", [X4], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}, 1),
    ("AveragePool", [X4], {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, 1),
    ("GlobalAveragePool", [X4], {}, 1),
    ("GlobalMaxPool", [X4], {}, 1),
    # shapes and data movement
    ("Reshape", [f32(2, 3, 4), i64(0, -1)], {}, 1),
    ("Reshape", [f32(2, 3, 4), i64(6, 4)], {"allowzero": 1}, 1),
    ("Flatten", [f32(2, 3, 4)], {"axis": 2}, 1),
    ("Flatten", [f32(2, 3, 4)], {"axis": 0}, 1),
    ("Transpose", [f32(2, 3, 4)], {"perm": [1, 2, 0]}, 1),
    ("Transpose", [f32(2, 3, 4)], {}, 1),
    ("Squeeze", [f32(2, 1, 3, 1), i64(1, -1)], {}, 1),
    ("Squeeze", [f32(2, 1, 3, 1)], {}, 1),
    ("Unsqueeze", [f32(2, 3), i64(0, -1)], {}, 1),
    ("Unsqueeze", [f32(2, 3), i64(1)], {}, 1),
    ("Concat", [f32(2, 3), f32(2, 1), f32(2, 2)], {"axis": -1}, 1),
    ("Concat", [i64(1, 2), i64(3)], {"axis": 0}, 1),
    ("Split", [f32(2, 6), i64(2, 4)], {"axis": 1}, 2),
    ("Split", [f32(7, 2)], {"num_outputs": 3}, 3),
    ("Slice", [f32(5, 6), i64(1, 0), i64(4, 10), i64(0, 1), i64(2, 3)], {}, 1),
    ("Slice", [f32(5, 6), i64(-1), i64(-10_000), i64(1), i64(-2)], {}, 1),
    ("Slice", [f32(5, 6), i64(-3), i64(2**62), i64(-1)], {}, 1),
    ("Slice", [f32(5, 6), i64(1), i64(3)], {}, 1),
    ("Gather", [f32(5, 4), i64(0, 4, -1)], {}, 1),
    ("Gather", [f32(5, 4), np.array(2, np.int64)], {"axis": 1}, 1),
    ("Gather", [f32(3, 5, 4), np.array([[0, 1], [-1, 2]], np.int64)], {"axis": 1}, 1),
    ("Gather", [i64(4, 5, 6), np.array(-1, np.int64)], {}, 1),
    ("GatherElements", [f32(3, 4), np.array([[0, 1], [2, -1], [3, 0]], np.int64)], {"axis": 1}, 1),
    ("GatherND", [f32(3, 4, 2), np.array([[0, 1], [2, 3]], np.int64)], {}, 1),
    ("Expand", [f32(3, 1), i64(2, 1, 4)], {}, 1),
    ("Expand", [f32(2, 3), i64(3, 1, 1)], {}, 1),
    ("Tile", [f32(2, 3), i64(2, 1)], {}, 1),
    ("Pad", [f32(2, 3), i64(1, 0, 0, 2), scalar(1.5)], {}, 1),
    ("Pad", [X4, i64(0, 0, 1, 2, 0, 0, 2, 1)], {"mode": "reflect"}, 1),
    ("Pad", [X4, i64(0, 0, 1, 1, 0, 0, 1, 1)], {"mode": "edge"}, 1),
    ("Pad", [f32(2, 3, 4), i64(1, 1), None, i64(1)], {}, 1),
    ("Pad", [f32(2, 3), i64(0, -1, 0, 1)], {}, 1),
    ("Shape", [f32(2, 3, 4)], {}, 1),
    ("Shape", [f32(2, 3, 4)], {"start": 1, "end": -1}, 1),
    ("Size", [f32(2, 3, 4)], {}, 1),
    ("ConstantOfShape", [i64(2, 3)], {"value": helper.make_tensor("v", onnx.TensorProto.INT64, [1], [7])}, 1),
    ("Range", [scalar(1, np.int64), scalar(10, np.int64), scalar(3, np.int64)], {}, 1),
    ("Range", [scalar(0.5), scalar(2.0), scalar(0.5)], {}, 1),
    ("Trilu", [f32(4, 5)], {}, 1),
    ("Trilu", [f32(2, 4, 5), scalar(-1, np.int64)], {"upper": 0}, 1),
    ("CumSum", [f32(3, 4), scalar(1, np.int64)], {}, 1),
    ("CumSum", [f32(3, 4), scalar(0, np.int64)], {"exclusive": 1, "reverse": 1}, 1),
    ("OneHot", [i64(0, 2, -1), scalar(4, np.int64), np.array([0.0, 1.0], np.float32)], {}, 1),
    ("TopK", [f32(3, 6), i64(2)], {"axis": 1}, 2),
    ("TopK", [f32(3, 6), i64(3)], {"largest": 0}, 2),
    ("ArgMax", [f32(3, 6)], {"axis": 1, "keepdims": 0}, 1),
    ("ArgMin", [np.array([[1, 0, 0, 2]], np.float32)], {"axis": 1, "select_last_index": 1}, 1),
    ("NonZero", [np.array([[1, 0], [0, 3]], np.float32)], {}, 1),
    # reductions (axes as inputs, opset 18+)
    ("ReduceMean", [f32(2, 3, 4), i64(-1)], {}, 1),
    ("ReduceMean", [f32(2, 3, 4)], {"keepdims": 0}, 1),
    ("ReduceSum", [f32(2, 3, 4), i64(0, 2)], {"keepdims": 0}, 1),
    ("ReduceSum", [f32(2, 3, 4), np.zeros(0, np.int64)], {"noop_with_empty_axes": 1}, 1),
    ("ReduceMax", [f32(2, 3, 4), i64(1)], {}, 1),
    ("ReduceMin", [f32(2, 3, 4), i64(1)], {}, 1),
    ("ReduceProd", [f32(2, 3, 4), i64(1, 2)], {}, 1),
    ("ReduceL1", [f32(2, 3, 4), i64(2)], {}, 1),
    ("ReduceL2", [f32(2, 3, 4), i64(2)], {}, 1),
    ("ReduceSumSquare", [f32(2, 3, 4), i64(2)], {}, 1),
    ("ReduceLogSum", [np.abs(f32(2, 3, 4)) + 0.1, i64(2)], {}, 1),
    ("ReduceLogSumExp", [f32(2, 3, 4), i64(2)], {}, 1),
    # resize
    (
        "Resize",
        [X4, None, np.array([1, 1, 2, 2], np.float32)],
        {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
        1,
    ),
    ("Resize", [X4, None, np.array([1, 1, 0.5, 0.5], np.float32)], {"mode": "nearest"}, 1),
    (
        "Resize",
        [X4, None, None, i64(2, 3, 8, 7)],
        {
            "mode": "nearest",
            "coordinate_transformation_mode": "align_corners",
            "nearest_mode": "round_prefer_ceil",
        },
        1,
    ),
    ("Resize", [X4, None, np.array([1, 1, 2, 2], np.float32)], {"mode": "linear"}, 1),
    (
        "Resize",
        [X4, None, None, i64(2, 3, 9, 9)],
        {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
        1,
    ),
    ("Resize", [X4, None, np.array([1, 1, 2, 2], np.float32)], {"mode": "cubic"}, 1),
]


@pytest.mark.parametrize(
    ("op_type", "inputs", "attrs", "n_outputs"),
    CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)],
)
def test_rule_matches_onnx_reference(op_type: str, inputs: list[Any], attrs: dict[str, Any], n_outputs: int):
    rtol = 1e-4 if op_type in ("Resize", "ReduceProd", "LRN", "Einsum") else 1e-5
    _check(op_type, inputs, attrs, n_outputs=n_outputs, rtol=rtol, atol=1e-4 if rtol > 1e-5 else 1e-5)


def test_constant_is_folded_and_used():
    value = helper.make_tensor("v", onnx.TensorProto.FLOAT, [2], [1.0, 2.0])
    const = helper.make_node("Constant", [], ["c"], value=value, name="the_const")
    add = helper.make_node("Add", ["x", "c"], ["y"], name="the_add")
    graph = helper.make_graph(
        [const, add],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    module = to_torch(pl.load(proto), device_map="cpu")
    assert module(torch.ones(2)).tolist() == [2.0, 3.0]
    assert "the_const" not in module.code and "constant" not in module.code


#: Rules for ops of newer opsets than older onnx releases know: op -> the opset that brought it.
_LATER_OPS = {
    "Attention": 23, "RMSNormalization": 23, "RotaryEmbedding": 23, "Swish": 24, "BitCast": 26,
    "CumProd": 26, "SwiGLU": 28, "TensorScatter": 24, "LinearAttention": 27, "CausalConvWithState": 27,
}  # fmt: skip
#: ONNX Runtime's own ops that its files hold in the default domain.
_ORT_DEFAULT_DOMAIN_OPS = {"SimplifiedLayerNormalization"}


def test_every_rule_is_an_onnx_op_with_a_callable():
    for key, rule in RULES.items():
        domain, _, op_type = key.rpartition("::")
        assert rule.op_type == op_type
        # ONNX Runtime's contrib ops, ONNX's preview, training and ML domains, keyed by domain
        assert domain in ("", "com.microsoft", "ai.onnx.preview", "ai.onnx.preview.training", "ai.onnx.ml"), (
            key
        )
        if not domain:  # an op of an opset newer than the installed onnx's has no schema there
            newer = _LATER_OPS.get(op_type, 0) > onnx.defs.onnx_opset_version()
            ort_own = op_type in _ORT_DEFAULT_DOMAIN_OPS  # ONNX Runtime's ops in the default domain
            assert onnx.defs.has(op_type) or newer or ort_own, op_type
            if onnx.defs.has(op_type) and op_type in _LATER_OPS:
                assert onnx.defs.get_schema(op_type, _LATER_OPS[op_type]).since_version == _LATER_OPS[op_type]
        assert get_rule(op_type, domain) is rule
        assert callable(rule.fn)


def test_coverage_of_the_zoo_and_transformer_ops():
    needed = {
        "Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Neg", "Exp", "Log", "Tanh", "Erf",
        "Relu", "Sigmoid", "Gelu", "Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization",
        "GroupNormalization", "InstanceNormalization", "Conv", "ConvTranspose", "MaxPool", "AveragePool",
        "GlobalAveragePool", "Reshape", "Transpose", "Concat", "Split", "Slice", "Squeeze", "Unsqueeze",
        "Flatten", "Gather", "Where", "Equal", "Less", "Greater", "Not", "And", "Cast", "Constant",
        "ConstantOfShape", "Shape", "Expand", "Range", "ReduceMean", "ReduceSum", "ReduceMax", "Trilu",
        "Identity", "Dropout", "Resize", "Pad", "Clip", "Min", "Max", "Abs", "CumSum", "Einsum", "Tile",
    }  # fmt: skip
    assert needed <= set(RULES), sorted(needed - set(RULES))


def test_default_rule_raises_lowering_error():
    assert get_rule("NoSuchOp") is DEFAULT_RULE
    assert get_rule("Relu", "com.microsoft") is DEFAULT_RULE
    with pytest.raises(pl.LoweringError, match="NoSuchOp"):
        DEFAULT_RULE.fn(op_type="NoSuchOp")


def test_direct_emission_is_plain_torch():
    rule = RULES["Transpose"]
    assert rule.direct is not None
    assert rule.direct(("x",), {"perm": (0, 2, 1)}, [None]) == ("call_method", "permute", ("x", 0, 2, 1), {})
    assert RULES["Gather"].direct(("w", "i"), {}, [None, None])[1] is operator.getitem
    assert RULES["Reshape"].direct(("x", [0, -1]), {}, [None, None]) is None  # 0 needs the rule


def test_direct_slice_from_int64_min_is_an_open_start():
    # exporters write "from the start" as INT64_MIN (Hugging Face's shape[:-2]); torch warns
    # when it has to truncate such a bound, so the emitted slice leaves the start open
    kind, fn, (_, index), _ = RULES["Slice"].direct(("x", [-(2**63)], [-2], [0]), {}, [None] * 4)
    assert fn is operator.getitem and index == (slice(None, -2, None),)


def test_torch_dtype():
    assert torch_dtype(onnx.TensorProto.FLOAT16) is torch.float16
    assert torch_dtype(onnx.TensorProto.BFLOAT16) is torch.bfloat16
    with pytest.raises(pl.LoweringError, match="8"):
        torch_dtype(onnx.TensorProto.STRING)


def test_rules_are_differentiable():
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    y = RULES["Conv"].fn(x, w, None, pads=[0, 1, 2, 1])
    y = RULES["MaxPool"].fn(y, kernel_shape=[2, 2], pads=[0, 0, 1, 1])
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_half_precision_layer_norm_and_cast():
    x = torch.randn(2, 4, dtype=torch.float16)
    y = RULES["LayerNormalization"].fn(x, torch.ones(4, dtype=torch.float16), axis=-1)
    assert y.dtype == torch.float16
    assert RULES["Cast"].fn(x, to=onnx.TensorProto.FLOAT).dtype == torch.float32
