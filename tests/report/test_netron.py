"""Netron shows an ONNX node's ``metadata_props`` in its sidebar: each saved op carries its device there."""

from __future__ import annotations

import onnx

import placement as pl
from tests.report.helpers import placed


def test_saved_nodes_carry_their_device_in_node_metadata(tmp_path, exported):
    model = placed(exported("gpt")[0], 2)
    model.save(tmp_path / "placed.onnx")
    proto = onnx.load(tmp_path / "placed.onnx")
    devices = {op.name: str(op.device) for op in model.ops}
    copies = {op.name: op.is_static_copy for op in model.ops if op.is_copy}
    assert len(proto.graph.node) == len(devices)
    for node in proto.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        assert props["placement.device"] == devices[node.name]
        if node.name in copies:
            assert node.op_type == "Identity"
            assert props["placement.copy"] == ("static" if copies[node.name] else "dynamic")
    assert {d for d in devices.values()} == {"cuda:0", "cuda:1"}
    assert pl.load(tmp_path / "placed.onnx").device_state() == model.device_state()
