"""Tests for ``placement.report.summary``: the per-device summary."""

from __future__ import annotations

import json

import onnx_ir as ir

import placement as pl
from placement.report import DeviceRow, summary
from placement.report.summary import Column
from tests.passes.helpers import GraphBuilder, chain

FLOAT = 4
BLOB = 2 * 3 * FLOAT  # every test blob is float32[2, 3]


def golden() -> pl.Model:
    """x(cpu) -> a(0) -> [b(1) uses w too] -> y back on cuda:0; w is read on 0 and 1."""
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    a = b.op("Add", [x, w], "a", device=0)
    c = b.op("Mul", [a, w], "c", device=1)
    y = b.op("Tanh", [c], "y", device=1)
    b.output(y)
    model = b.build()
    pl.inject_cross_device_copies(model, input_device="cpu", output_device=0)
    return model


def test_rows_count_ops_copies_params_and_traffic() -> None:
    report = summary(golden())
    assert [str(r.device) for r in report.rows] == ["cpu", "cuda:0", "cuda:1"]
    cpu, gpu0, gpu1 = report.rows
    assert (cpu.ops, cpu.copies, cpu.recv_bytes, cpu.sent_bytes) == (0, 0, 0, BLOB)  # x sent to cuda:0
    assert (gpu0.ops, gpu0.copies, gpu0.params, gpu0.param_bytes) == (1, 2, 1, BLOB)  # x and y come in
    assert (gpu0.recv_bytes, gpu0.sent_bytes) == (2 * BLOB, BLOB)
    assert (gpu1.ops, gpu1.copies, gpu1.static_copies, gpu1.static_copy_bytes) == (2, 2, 1, BLOB)
    assert (gpu1.recv_bytes, gpu1.sent_bytes, gpu1.params) == (BLOB, BLOB, 0)
    assert (gpu0.activations, gpu1.activations) == (1, 2)
    assert gpu1.activation_bytes == 2 * BLOB
    assert report.total_copies == 4
    assert str(report.input_device) == "cpu" and str(report.output_device) == "cuda:0"
    assert sum(r.sent_bytes for r in report.rows) == sum(r.recv_bytes for r in report.rows)


def test_model_summary_and_rendering() -> None:
    model = golden()
    report = pl.summary(model)
    text = str(report)
    for word in ("cuda:1", "cpu", "copies in", "recv", "sent", "24 B"):
        assert word in text
    assert report.to_table().row_count == 3
    data = json.loads(json.dumps(report.to_dict()))
    assert data["devices"][2]["static_copies"] == 1 and data["output_device"] == "cuda:0"
    assert report.row("cuda:1").ops == 2 and report.row("cuda:7") == DeviceRow(pl.Device("cuda", 7))


def test_unplaced_model_has_one_row_and_no_copies() -> None:
    report = summary(chain(4))
    assert len(report.rows) == 1 and report.rows[0].ops == 4 and report.total_copies == 0
    assert report.rows[0].params == 2 and report.rows[0].param_bytes == 2 * BLOB


def test_unknown_shapes_count_zero_and_are_flagged() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.op("Tanh", [x], "a", device=0, shapes=[None])
    y = b.op("Relu", [a], "y", device=1)
    b.output(y)
    model = b.build()
    pl.inject_cross_device_copies(model)
    report = summary(model)
    assert report.unknown_sizes == ["a"]
    assert report.row(1).recv_bytes == 0
    assert "unknown size" in str(report)


def test_columns_are_extensible() -> None:
    report = summary(golden())
    report.columns.append(Column("half ops", lambda r: str(r.ops / 2)))
    assert "half ops" in str(report)


def test_summary_accepts_ir_models_and_unused_parameters() -> None:
    model = chain(2)
    unused = ir.Value(name="unused", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    unused.const_value = ir.tensor([[0.0] * 3] * 2, dtype=ir.DataType.FLOAT, name="unused")
    model.graph.initializers.add(unused)
    report = summary(model.ir_model)
    assert report.rows[0].params == 2
