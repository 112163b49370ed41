"""Sizes on dynamic shapes: a model exported with a symbolic batch plans, draws and reports at
the sample inputs' sizes or a stated batch, exactly as the same net exported at that batch."""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
import pytest
import torch

import placement as pl
from placement.models import resnet
from placement.planning.dims import planned_dims, stored_dims

BUDGETS = {0: "20KiB", 1: "40KiB"}


@pytest.fixture(scope="module")
def cnn():
    """``(net, x, fixed, dynamic)``: the tiny resnet at batch 8, exported fixed and with a dynamic batch."""
    net, _ = resnet.build("tiny")
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    fixed = pl.from_torch(net, (x,))
    dynamic = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return net, x, fixed, dynamic


def _fresh(cnn) -> pl.Model:
    """A copy of the dynamic-batch export (the planner places in place)."""
    return pl.Model(cnn[3].ir_model.clone())


def _needs(err: pl.InfeasiblePlacementError) -> int:
    return int(re.search(r"\((\d+) bytes\)", str(err)).group(1))


def test_a_too_small_budget_is_refused_on_a_dynamic_batch_as_on_a_fixed_one(cnn):
    _, x, fixed, _ = cnn
    with pytest.raises(pl.InfeasiblePlacementError) as fixed_err:
        pl.auto_place(pl.Model(fixed.ir_model.clone()), max_memory=BUDGETS, cost="flops")
    for options in ({"sample_inputs": {"x": x}}, {"batch": 8}, {"batch": {"batch": 8}}):
        model = _fresh(cnn)
        before = model.device_state()
        with pytest.raises(pl.InfeasiblePlacementError) as dyn_err:
            pl.auto_place(model, max_memory=BUDGETS, cost="flops", **options)
        # the same need, give or take the few bytes of the dynamic export's shape arithmetic
        assert _needs(dyn_err.value) == pytest.approx(_needs(fixed_err.value), rel=0.01), options
        assert model.device_state() == before


def test_plans_count_activations_and_copies_at_the_planned_batch(cnn):
    _, x, fixed, _ = cnn
    at_8 = pl.auto_place(_fresh(cnn), devices=2, cost="flops", sample_inputs={"x": x})
    at_1 = pl.auto_place(_fresh(cnn), devices=2, cost="flops")
    ref = pl.auto_place(pl.Model(fixed.ir_model.clone()), devices=2, cost="flops")
    assert at_8.dims == {"batch": 8} and at_1.dims == {"batch": 1} and ref.dims == {}
    assert "sizes at batch=8" in str(at_8)
    peak_8 = max(d.activation_bytes for d in at_8.devices)
    assert peak_8 == pytest.approx(max(d.activation_bytes for d in ref.devices), rel=0.01)
    assert peak_8 > 4 * max(d.activation_bytes for d in at_1.devices)
    assert at_8.transfer_bytes >= 8 * 4 * 16  # a [8, C, H, W] float activation crosses, not a few bytes


def test_summary_draw_and_report_use_the_planned_sizes(cnn, tmp_path):
    _, x, _, _ = cnn
    model = _fresh(cnn)
    pl.auto_place(model, devices=2, cost="flops", sample_inputs={"x": x})
    pl.inject_cross_device_copies(model)
    path = tmp_path / "placed.onnx"
    model.save(path)
    loaded = pl.load(path)
    assert stored_dims(loaded) == {"batch": 8}  # the saved file keeps the sizes it was planned at

    report = pl.summary(loaded)
    assert report.dims == {"batch": 8}
    recv = sum(r.recv_bytes for r in report.rows)
    assert recv >= 8 * 4 * 16 and all(r.peak_activation_bytes > 0 for r in report.rows)
    assert sum(r.recv_bytes for r in pl.summary(loaded, batch=1).rows) * 8 == pytest.approx(recv, rel=0.01)

    dot = pl.draw(loaded, None).dot
    copy_labels = re.findall(r'label="[^"]*\n?([0-9.]+ (?:B|KiB|MiB))" class=copy', dot)
    assert copy_labels and "0 B" not in copy_labels
    dot_16 = pl.draw(loaded, None, batch=16).dot
    assert dot_16 != dot

    written = pl.write_report(loaded, tmp_path / "r.html")
    assert sum(written.traffic.values()) == recv
    assert "sizes at batch=8" in (tmp_path / "r.html").read_text()


def test_planned_dims_rules_and_bad_batches(cnn):
    model = _fresh(cnn)
    assert planned_dims(model) == {"batch": 1}
    assert planned_dims(model, batch=3) == {"batch": 3}
    assert planned_dims(model, sample_inputs={"x": np.zeros((5, 3, 16, 16))}, batch=3) == {"batch": 5}
    with pytest.raises(pl.PlanError, match="'seq' is not a symbolic dimension.*batch"):
        pl.auto_place(model, devices=2, cost="flops", batch={"seq": 4})
    with pytest.raises(pl.PlanError, match="auto_place: batch must be a positive integer"):
        pl.auto_place(model, devices=2, cost="flops", batch=0)


def test_time_cost_profiles_a_dynamic_batch_without_sample_inputs(cnn):
    model = _fresh(cnn)
    plan = pl.auto_place(model, devices=2, cost="time", repeats=1, batch=4)
    assert plan.cost_kind == "time" and plan.dims == {"batch": 4} and plan.bottleneck > 0


def _unshaped() -> pl.Model:
    """``y = -relu(x)`` whose input ``x`` has a dtype and no shape."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))
    relu = ir.Node("", "Relu", [x], name="relu", num_outputs=1)
    neg = ir.Node("", "Neg", relu.outputs, name="neg", num_outputs=1)
    relu.outputs[0].name, neg.outputs[0].name = "a", "y"
    graph = ir.Graph([x], neg.outputs, nodes=[relu, neg], opset_imports={"": 18})
    return pl.Model(ir.Model(graph, ir_version=10))


def test_an_input_without_a_shape_names_the_function_called():
    with pytest.raises(pl.InputError, match=r"'x' has no known shape.*pass sample_inputs= to auto_place"):
        pl.auto_place(_unshaped(), devices=2, cost="time")
    with pytest.raises(pl.InputError, match="pass sample_inputs= to calibrate"):
        pl.calibrate(_unshaped(), 2)
    with pytest.raises(pl.InputError, match="pass sample_inputs= to profile"):
        pl.profile(_unshaped())
    with pytest.raises(pl.InputError, match="pass sample_inputs= to balance_by_time"):
        pl.balance_by_time(_unshaped(), 2)
    with pytest.raises(pl.InputError, match="pass sample_inputs= to plan_offload"):
        pl.plan_offload(_unshaped(), {0: "1MiB", "cpu": "1GiB"})
