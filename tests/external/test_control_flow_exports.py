"""Models with control flow as other exporters write them: ``Loop``, ``Scan`` and run-time ``If``, placed.

Two models a user could bring: a ``torch.jit.script``-ed decoder whose ``for`` loop
(trip count from an input) and ``if`` (on that input) the TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``) writes as ``Loop`` and ``If`` with
subgraphs that read the enclosing graph's weights; and an ``onnx.helper`` model
with a ``Scan`` over time between ordinary ops, as tf2onnx writes recurrences.
Each is loaded with ``pl.load``, placed on two logical devices with the control-flow
op on device 1 (by hand and by ``pl.auto_place``), given copies, and must compute
what one ONNX Runtime session computes: through ``pl.Runner``, ``pl.to_torch`` and
``pl.to_torch(chunks=2)`` (with the unsplit lowering's gradients), also for trip
counts and branches other than those seen while the pipelined stages warmed up.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import placement as pl

TOL = {"rtol": 1e-5, "atol": 1e-6}


class Decoder(torch.nn.Module):
    """``n`` recurrent steps, then a branch on ``n``: data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 4)
        self.cell = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for _ in range(int(n)):
            h = torch.tanh(self.cell(h))
        if bool(n > 2):
            h = h * 2.0
        else:
            h = h - 1.0
        return self.out(h)


def _scripted_decoder() -> tuple[onnx.ModelProto, torch.nn.Module]:
    torch.manual_seed(0)
    net = Decoder()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            torch.jit.script(net),
            (torch.randn(4, 3), torch.tensor(3)),
            buf,
            dynamo=False,
            input_names=["x", "n"],
            output_names=["y"],
            opset_version=17,
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        )
    return onnx.load_from_string(buf.getvalue()), net


def _scan_model() -> onnx.ModelProto:
    """x[batch, time, 3] -> MatMul, Relu -> Scan over time (h = tanh(h @ W + x_t), the body reading
    W from the enclosing graph) -> MatMul of the states, plus the last state's sum."""
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).ravel() * 0.5)

    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "rec_w"], ["hw"]),
            helper.make_node("Add", ["hw", "x_t"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_out"]),
            helper.make_node("Identity", ["h_out"], ["h_seq"]),
        ],
        "step",
        [
            helper.make_tensor_value_info("h_in", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("x_t", TensorProto.FLOAT, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("h_seq", TensorProto.FLOAT, ["batch", 4]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "in_w"], ["proj"]),
            helper.make_node("Relu", ["proj"], ["act"]),
            helper.make_node("Shape", ["x"], ["x_shape"], start=0, end=1),
            helper.make_node("Concat", ["x_shape", "four"], ["h0_shape"], axis=0),
            helper.make_node("ConstantOfShape", ["h0_shape"], ["h0"]),
            helper.make_node(
                "Scan",
                ["h0", "act"],
                ["h_last", "hs"],
                body=body,
                num_scan_inputs=1,
                scan_input_axes=[1],
                scan_output_axes=[1],
            ),
            helper.make_node("MatMul", ["hs", "out_w"], ["y"]),
            helper.make_node("ReduceSum", ["h_last", "one"], ["h_last_sum"], keepdims=1),
            helper.make_node("Unsqueeze", ["h_last_sum", "two"], ["h_last_col"]),
            helper.make_node("Add", ["y", "h_last_col"], ["z"]),
        ],
        "scan_rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 5, 2])],
        [
            init("in_w", 3, 4),
            init("rec_w", 4, 4),
            init("out_w", 4, 2),
            helper.make_tensor("four", TensorProto.INT64, [1], [4]),
            helper.make_tensor("one", TensorProto.INT64, [1], [1]),
            helper.make_tensor("two", TensorProto.INT64, [1], [2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    return model


def _on_device_1_from(model: pl.Model, op_type: str) -> None:
    """The first op of ``op_type`` and everything after it on logical device 1."""
    start = next(i for i, op in enumerate(model.ops) if op.op_type == op_type)
    for op in model.ops[start:]:
        model.set_device(op.name, 1)


def _grads(module: torch.nn.Module, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = module(*args)
    (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _check(model: pl.Model, proto: onnx.ModelProto, feeds_list: list[dict[str, np.ndarray]]) -> None:
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    runner = pl.Runner(model, device_map="cpu", fold=False)  # a session per stage
    plain = pl.to_torch(model, device_map="cpu")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    for feeds in feeds_list:
        (want,) = session.run(None, feeds)
        np.testing.assert_allclose(runner.run(feeds)[0], want, **TOL)
        args = [torch.from_numpy(feeds[name]) for name in plain.input_names]
        with torch.no_grad():
            np.testing.assert_allclose(plain(*args).numpy(), want, **TOL)
            np.testing.assert_allclose(piped(*args).numpy(), want, **TOL)
    args = [torch.from_numpy(feeds_list[-1][name]) for name in plain.input_names]
    expected, got = _grads(plain, args), _grads(piped, args)
    assert expected.keys() == got.keys() and expected
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for name, g in got.items() if "cell" in name or "rec_w" in name)


def _decoder_feeds(trips: list[int]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((4, 3)).astype(np.float32), "n": np.array(n, np.int64)} for n in trips]


#: Warm-up with one trip count and branch, then others (a trace would have frozen the first).
TRIPS = [3, 3, 3, 3, 3, 1, 0, 5, 2, 3]


def test_scripted_loop_and_if_placed_by_hand() -> None:
    proto, net = _scripted_decoder()
    assert {"Loop", "If"} <= {node.op_type for node in proto.graph.node}
    model = pl.load(proto)
    _on_device_1_from(model, "Loop")
    feeds = _decoder_feeds(TRIPS)
    _check(model, proto, feeds)
    for f in feeds[:3]:  # the export computes what the scripted module does
        want = net(torch.from_numpy(f["x"]), torch.from_numpy(f["n"])).detach().numpy()
        np.testing.assert_allclose(pl.run(model, f)[0], want, **TOL)


def test_scripted_loop_stage_is_never_traced() -> None:
    proto, _ = _scripted_decoder()
    model = pl.load(proto)
    _on_device_1_from(model, "Loop")
    pl.inject_cross_device_copies(model)
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    plain = pl.to_torch(model, device_map="cpu")
    with torch.no_grad():
        for feeds in _decoder_feeds(TRIPS):
            args = [torch.from_numpy(feeds[name]) for name in plain.input_names]
            # traced vs eager kernels, micro-batches vs the whole batch: equal within float tolerance
            torch.testing.assert_close(piped(*args), plain(*args))
    reasons = [s.call.disabled or "" for s in piped._pl_stages]
    assert any("Loop" in r and "If" in r for r in reasons), reasons
    assert any(s.call.traced for s in piped._pl_stages)  # the stage without control flow still traces


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_scripted_loop_auto_placed(cost: str) -> None:
    proto, _ = _scripted_decoder()
    model = pl.load(proto)
    feeds = _decoder_feeds([3, 1, 4])
    pl.auto_place(model, devices=2, cost=cost, sample_inputs=feeds[0])
    _check(model, proto, feeds)


def test_scan_between_ops() -> None:
    proto = _scan_model()
    model = pl.load(proto)
    _on_device_1_from(model, "Scan")
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((4, 5, 3)).astype(np.float32)} for _ in range(6)]
    _check(model, proto, feeds)


def test_scan_auto_placed() -> None:
    proto = _scan_model()
    model = pl.load(proto)
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((4, 5, 3)).astype(np.float32)} for _ in range(3)]
    pl.auto_place(model, devices=2, cost="flops")
    _check(model, proto, feeds)
