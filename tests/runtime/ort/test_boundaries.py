"""Tests for ``placement.runtime.ort.boundaries``: CPU stage boundaries kept in ONNX Runtime's blocked
layout give exactly the outputs of the usual NCHW boundaries, in every way a runner runs."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import pytest
import torch

import placement as pl
from placement.runtime.ort import boundaries


def _placed(devices: int = 2) -> tuple[pl.Model, torch.nn.Module, tuple[torch.Tensor, ...]]:
    from placement.models import resnet

    net, args = resnet.build("tiny")
    model = pl.from_torch(net, args, dynamic_shapes=({0: torch.export.Dim("batch")},))
    pl.place_evenly(model, devices)
    pl.inject_cross_device_copies(model)
    return model, net, args


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("devices", [2, 4])
def test_blocked_boundaries_give_the_usual_outputs_exactly(devices):
    model, net, (x,) = _placed(devices)
    blocked = pl.Runner(model, device_map="cpu", fold=False)
    usual = pl.Runner(model, device_map="cpu", fold=False, keep_layout=False)
    assert blocked.blocked_boundaries and not usual.blocked_boundaries
    want = usual.run([x])
    _same(blocked.run([x]), want)
    np.testing.assert_allclose(want[0], net(x).detach().numpy(), atol=1e-5, rtol=1e-4)
    # every way a runner runs: micro-batches, a stream, other batch sizes
    _same(pl.Runner(model, device_map="cpu", fold=False, chunks=2).run([x]), want)
    streamed = list(pl.Runner(model, device_map="cpu", fold=False).stream([[x[:1].numpy()], [x[1:].numpy()]]))
    _same([np.concatenate([s[0] for s in streamed])], want)
    _same(blocked.run([x[:1]]), usual.run([x[:1]]))


def test_a_boundary_that_is_also_a_graph_output_stays_plain():
    model, _, (x,) = _placed()
    before = pl.Runner(model, device_map="cpu", fold=False).blocked_boundaries
    assert before  # which cuts stay blocked depends on ONNX Runtime's fusions: one or more
    blob = before[-1]
    graph = model.ir_model.graph
    graph.outputs.append(next(v for node in graph for v in node.outputs if v.name == blob))
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert blob not in runner.blocked_boundaries
    got = runner.run([x])
    want = pl.Runner(model, device_map="cpu", fold=False, keep_layout=False).run([x])
    _same(got, want)
    assert got[-1].ndim == 4


def test_a_failed_blocked_session_leaves_every_usual_session(monkeypatch, caplog):
    model, _, (x,) = _placed()
    want = pl.Runner(model, device_map="cpu", fold=False, keep_layout=False).run([x])

    def broken(*args, **kwargs):
        raise RuntimeError("no session today")

    monkeypatch.setattr(boundaries, "blocked_session", broken)
    with caplog.at_level(logging.WARNING, logger="placement"):
        runner = pl.Runner(model, device_map="cpu", fold=False)
    assert runner.blocked_boundaries == []
    assert "no session today" in caplog.text
    _same(runner.run([x]), want)


def test_re_placement_reuses_blocked_sessions():
    model, _, (x,) = _placed()
    runner = pl.Runner(model, device_map="cpu", fold=False, keep_sessions=True)
    first = list(runner.blocked_boundaries)
    built = runner.stats.sessions_built
    op = model.ops[-1].name
    device = model.device_of(op)
    model.set_device(op, 0 if device.index else 1)
    pl.inject_cross_device_copies(model)
    runner.run([x])
    model.set_device(op, device)
    pl.inject_cross_device_copies(model)
    runner.run([x])
    after = runner.stats.sessions_built
    model.set_device(op, 0 if device.index else 1)
    pl.inject_cross_device_copies(model)
    runner.run([x])
    model.set_device(op, device)
    pl.inject_cross_device_copies(model)
    _same(runner.run([x]), pl.Runner(model, device_map="cpu", fold=False, keep_layout=False).run([x]))
    assert runner.blocked_boundaries == first
    assert runner.stats.sessions_built == after > built  # switching back and forth built nothing new


def test_stage_sessions_are_built_once_to_read_their_optimised_graphs(monkeypatch):
    """A stage that may keep a boundary blocked writes ONNX Runtime's optimised graph as its
    usual session is built; keeping the layout reads it back instead of building the
    session a second time (it used to: three builds per such stage, now two)."""
    import onnxruntime as ort

    model, _, (x,) = _placed()
    built = []
    init = ort.InferenceSession.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", counting)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert len(runner.stages) == 2 and runner.blocked_boundaries
    # each stage once as usual, and once more blocked (both sides of the boundary)
    assert len(built) == runner.stats.sessions_built == 4
    _same(runner.run([x]), pl.Runner(model, device_map="cpu", fold=False, keep_layout=False).run([x]))


def test_models_without_convolutions_build_nothing_extra():
    from placement.models import mlp

    net, args = mlp.build("tiny")
    model = pl.from_torch(net, args)
    pl.place_evenly(model, 2)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert runner.blocked_boundaries == [] and runner.stats.sessions_built == 2


def test_keep_blocked_renames_through_the_stage():
    from onnx import helper

    from placement.runtime.ort.layout import NCHWC_DOMAIN, keep_blocked

    nodes = [
        helper.make_node("ReorderInput", ["x"], ["bx"], domain=NCHWC_DOMAIN),
        helper.make_node("Conv", ["bx", "w"], ["c"], domain=NCHWC_DOMAIN),
        helper.make_node("ReorderOutput", ["c"], ["y"], domain=NCHWC_DOMAIN, channels=8),
        helper.make_node("ReorderOutput", ["c"], ["z"], domain=NCHWC_DOMAIN, channels=8, channels_last=1),
    ]
    info = [helper.make_tensor_value_info(n, 1, [1, 8, 2, 2]) for n in ("x", "y", "z")]
    proto = helper.make_model(helper.make_graph(nodes, "g", [info[0]], info[1:]))
    kept = keep_blocked(proto, ["y"], ["x"])
    assert [(n.op_type, list(n.input), list(n.output)) for n in kept.graph.node] == [
        ("Conv", ["x", "w"], ["y"]),
        ("ReorderOutput", ["y"], ["z"]),  # the channels-last output still converts
    ]
    dims = kept.graph.output[0].type.tensor_type.shape.dim
    assert not dims[1].HasField("dim_value") and dims[0].dim_value == 1
    assert len(proto.graph.node) == 4  # the original is not modified
    assert ir.serde.deserialize_model(kept).graph.node(0).inputs[0].name == "x"
