"""Recurrent models as users bring them: ``nn.LSTM``/``nn.GRU`` exported by the TorchScript exporter.

``torch.onnx.export(..., dynamo=False)`` writes ``nn.LSTM``/``nn.GRU``/``nn.RNN``
as ONNX's own LSTM/GRU/RNN ops (one per layer, gates reordered to ONNX's order,
``Transpose`` around them for ``batch_first``), as older speech and NLP
exporters did. Each model is loaded with ``pl.load``, placed on two logical
devices (by ``pl.auto_place`` and by hand with the recurrent ops on device 1)
and must compute what the torch module computes: ``pl.Runner`` equals one ONNX
Runtime session, ``pl.to_torch`` equals both, and the lowering pipelined over two
micro-batches trains with the unsplit lowering's gradients.
"""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import placement as pl
from placement.planning.profile import profile

TOL = {"rtol": 1e-4, "atol": 1e-5}
RECURRENT = {"LSTM", "GRU", "RNN"}


class Tagger(torch.nn.Module):
    """Projection, a two-layer recurrent encoder, a per-step classifier (batch first)."""

    def __init__(self, kind: str, bidirectional: bool) -> None:
        super().__init__()
        cell = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[kind]
        self.proj = torch.nn.Linear(4, 6)
        self.encoder = cell(6, 5, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = torch.nn.Linear(10 if bidirectional else 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(torch.relu(self.proj(x)))[0])


MODELS = {"lstm": ("lstm", True), "gru": ("gru", False), "rnn": ("rnn", True)}


def _inputs(batch: int = 4, steps: int = 7) -> torch.Tensor:
    return torch.randn(batch, steps, 4, generator=torch.Generator().manual_seed(1))


@functools.cache
def _exported(name: str, dynamic: bool = True) -> tuple[bytes, Tagger]:
    torch.manual_seed(0)
    net = Tagger(*MODELS[name]).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            net,
            (_inputs(),),
            buffer,
            dynamo=False,
            opset_version=14,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch", 1: "steps"}, "logits": {0: "batch", 1: "steps"}}
            if dynamic
            else None,
        )
    return buffer.getvalue(), net


def _load(name: str, dynamic: bool = True) -> tuple[pl.Model, Tagger, bytes]:
    data, net = _exported(name, dynamic)
    return pl.load(onnx.load_from_string(data)), net, data


def _ort(data: bytes, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.numpy()})[0]


def _by_hand(model: pl.Model) -> None:
    """Everything from the first recurrent op on goes to device 1."""
    ops = list(model.ops)
    first = next(i for i, op in enumerate(ops) if op.op_type in RECURRENT)
    for op in ops[first:]:
        model.set_device(op.name, 1)


def _place(model: pl.Model, how: str) -> None:
    if how == "auto":
        pl.auto_place(model, devices=2, cost="flops")
    else:
        _by_hand(model)
    pl.inject_cross_device_copies(model)
    pl.verify(model)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_exporter_writes_onnx_recurrent_ops(name: str) -> None:
    model, _, _ = _load(name)
    kinds = [op.op_type for op in model.ops if op.op_type in RECURRENT]
    assert kinds == [name.upper()] * 2  # one op per layer: the lowering's rules are what run


@pytest.mark.parametrize("how", ["auto", "hand"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_placed_model_equals_ort_and_the_torch_module(name: str, how: str) -> None:
    model, net, data = _load(name)
    _place(model, how)
    devices = {op.device for op in model.ops if op.op_type in RECURRENT}
    assert len({op.device for op in model.ops}) == 2
    if how == "hand":
        assert devices == {pl.Device("cuda", 1)}
    x = _inputs()
    with torch.no_grad():
        expected = net(x).numpy()
    single = _ort(data, x)
    np.testing.assert_allclose(single, expected, **TOL)
    runner = pl.Runner(model, device_map="cpu", fold=False)  # a session per stage
    np.testing.assert_allclose(runner.run([x.numpy()])[0], single, **TOL)
    module = pl.to_torch(model, device_map="cpu")
    with torch.no_grad():
        lowered = module(x)
    np.testing.assert_allclose(lowered.numpy(), single, **TOL)
    shorter = _inputs(batch=3, steps=4)  # dynamic batch and sequence length
    with torch.no_grad():
        np.testing.assert_allclose(module(shorter).numpy(), net(shorter).numpy(), **TOL)


def test_flop_balanced_plan_puts_one_recurrent_layer_on_each_device() -> None:
    # The profiler counts each LSTM layer's analytic FLOPs (directions x steps x batch x
    # (2 x 4H x (I + H) + gate arithmetic)): nearly all of the model's, so balancing by
    # them cuts between the layers (static shapes: FLOPs need them).
    model, _, _ = _load("lstm", dynamic=False)
    flops = {name: op.flops for name, op in profile(model, time=False).ops.items()}
    layers = [op.name for op in model.ops if op.op_type == "LSTM"]
    for layer, inputs in zip(layers, (6, 10)):
        assert flops[layer] == 2 * 7 * 4 * (2 * 20 * (inputs + 5) + 30 * 5)
    assert sum(flops[layer] for layer in layers) > 0.9 * sum(flops.values())
    pl.auto_place(model, devices=2, cost="flops")
    devices = [op.device for op in model.ops if op.op_type == "LSTM"]
    assert len(set(devices)) == 2, devices


@pytest.mark.parametrize("how", ["auto", "hand"])
@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_pipelined_lowering_trains_like_the_unsplit_lowering(name: str, how: str) -> None:
    model, net, _ = _load(name)
    unsplit = pl.to_torch(model.copy(), device_map="cpu")
    _place(model, how)
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    x = _inputs()
    target = torch.randn(4, 7, 3, generator=torch.Generator().manual_seed(3))
    grads: list[dict[str, torch.Tensor]] = []
    for module in (unsplit, piped):
        for _ in range(3):  # warm-up calls, then the pipelined stages run as traces
            module.zero_grad()
            loss = torch.nn.functional.mse_loss(module(x), target)
            loss.backward()
        grads.append({key: p.grad.clone() for key, p in module.named_parameters() if p.grad is not None})
    want, got = grads
    recurrent_weights = {key for key in want if want[key].dim() == 3}  # W, R: (directions, gates, ...)
    assert recurrent_weights and want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    # ... and the unsplit lowering's gradients are the torch module's, gates reordered.
    net.zero_grad()
    torch.nn.functional.mse_loss(net(x), target).backward()
    total = sum(float(p.grad.abs().sum()) for p in net.parameters())
    lowered = sum(float(g.abs().sum()) for g in want.values())
    assert lowered == pytest.approx(total, rel=1e-4)


@pytest.mark.parametrize("named", [True, False])
def test_time_major_gru_pipelines_on_axis_1(named: bool) -> None:
    # A time-major model (batch on axis 1, after the steps): found from the GRU, or named.
    torch.manual_seed(0)
    net = torch.nn.GRU(3, 4).eval()
    x = torch.randn(6, 4, 3)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (x,),
            buffer,
            dynamo=False,
            opset_version=14,
            input_names=["x"],
            output_names=["y", "h"],
            dynamic_axes={"x": {0: "steps", 1: "batch"}, "y": {0: "steps", 1: "batch"}, "h": {1: "batch"}},
        )
    model = pl.load(onnx.load_from_string(buffer.getvalue()))
    _by_hand(model)
    pl.inject_cross_device_copies(model)
    axes = {"x": 1, "y": 1, "h": 1} if named else None
    piped = pl.to_torch(model, device_map="cpu", chunks=2, batch_axes=axes)
    assert piped.batch_axes.symbol == "batch" and piped.batch_axes.inputs == {"x": 1}
    with torch.no_grad():
        want_y, want_h = net(x)
        for _ in range(3):
            got_y, got_h = piped(x)
            torch.testing.assert_close(got_y, want_y, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got_h, want_h, rtol=1e-4, atol=1e-5)
